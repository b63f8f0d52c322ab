"""Root mean squared error."""

from __future__ import annotations

from torch import Tensor

from sidestream.metrics.regression.mean_squared_error import MeanSquaredErrorMetric

__all__ = ["RootMeanSquaredErrorMetric"]


class RootMeanSquaredErrorMetric(MeanSquaredErrorMetric):
    """``sqrt(mean((preds - target)^2))``, from the state of ``MeanSquaredErrorMetric``.

    With several outputs the root is taken per output before averaging (scikit-learn's
    ``root_mean_squared_error``).

    Example:
        >>> metric = RootMeanSquaredErrorMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
        >>> metric.compute()
        tensor(1.4142, dtype=torch.float64)
    """

    def compute(self) -> Tensor:
        """The root mean squared error; NaN over no data."""
        return self._finish(self._per_output().sqrt())
