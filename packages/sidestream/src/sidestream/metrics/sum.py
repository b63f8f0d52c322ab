"""Sum of all values seen."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import as_tensor, check_floating, check_floating_dtype
from sidestream.metrics._nan_strategy import NanStrategy
from sidestream.metrics._screened import NanScreenedMetric
from sidestream.state import MetricAccumulator

__all__ = ["SumMetric"]


class SumMetric(NanScreenedMetric):
    """The sum of every value passed to ``update``, over all ranks after ``sync``.

    Args:
        dtype: The floating-point accumulation dtype; float64 by default so long runs do not
            lose precision (an integer one would truncate the values: ``TypeError``).
        nan_strategy: ``"disable"`` (NaN propagates), ``"error"``, ``"ignore"`` or a fill
            value; see ``sidestream.metrics.NanPolicy``.

    Example:
        >>> metric = SumMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]))
        >>> metric.compute()
        tensor(3., dtype=torch.float64)
    """

    def __init__(
        self, dtype: torch.dtype = torch.float64, nan_strategy: NanStrategy = "disable"
    ) -> None:
        check_floating_dtype("dtype", dtype)
        self._total = MetricAccumulator(0.0, dtype=dtype)
        super().__init__(nan_strategy, dtype=dtype)

    def update(self, values: Tensor | float) -> None:
        """Add ``values`` (any shape, floating point) to the sum."""
        tensor = as_tensor("values", values, self.device, floating=True)
        check_floating("values", tensor)
        tensor = self._nan.apply(tensor, self._rejected, self._nan_count, self._total.dtype).values
        self._total.accumulate(tensor.sum(dtype=self._total.dtype))

    def compute(self) -> Tensor:
        """The sum (0 over no data)."""
        return self._total.value.clone()
