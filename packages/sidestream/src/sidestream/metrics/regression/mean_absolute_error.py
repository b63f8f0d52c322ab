"""Mean absolute error."""

from __future__ import annotations

from torch import Tensor

from sidestream.metrics.regression._paired import MultiOutput, PairedRegressionMetric

__all__ = ["MeanAbsoluteErrorMetric"]


class MeanAbsoluteErrorMetric(PairedRegressionMetric):
    """``mean(|preds - target|)`` from a float64 sum of absolute errors and a count.

    Args:
        num_outputs: 1, or ``D`` for ``(N, D)`` inputs.
        multioutput: ``uniform_average`` or ``raw_values`` (with ``D > 1``).

    Example:
        >>> metric = MeanAbsoluteErrorMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 4.0]))
        >>> metric.compute()
        tensor(1.2500, dtype=torch.float64)
    """

    def __init__(self, num_outputs: int = 1, multioutput: MultiOutput = "uniform_average") -> None:
        super().__init__(num_outputs, multioutput)
        self._absolute_error = self._sum_state()

    def update(self, preds: Tensor | float, target: Tensor | float) -> None:
        """Add predictions and targets of the same shape (``(N, D)`` with ``D`` outputs).

        Raises:
            TypeError: If ``preds`` is not floating point.
            ValueError: On a shape mismatch, or (CPU) a non-finite value; CUDA drops such a
                batch and counts it in ``rejected_updates``.
        """
        preds_64, target_64, _ = self._pairs(preds, target)
        self._absolute_error.accumulate((preds_64 - target_64).abs().sum(0))

    def compute(self) -> Tensor:
        """The mean absolute error; NaN over no data."""
        return self._finish(self._absolute_error.value / self._count.value)
