"""Sum of all values seen."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import as_tensor, check_floating
from sidestream.metric import Metric
from sidestream.state import MetricAccumulator

__all__ = ["SumMetric"]


class SumMetric(Metric[Tensor]):
    """The sum of every value passed to ``update``, over all ranks after ``sync``.

    Args:
        dtype: The accumulation dtype; float64 by default so long runs do not lose precision.

    Example:
        >>> metric = SumMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]))
        >>> metric.compute()
        tensor(3., dtype=torch.float64)
    """

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self._total = MetricAccumulator(0.0, dtype=dtype)

    def update(self, values: Tensor | float) -> None:
        """Add ``values`` (any shape, floating point) to the sum."""
        tensor = as_tensor("values", values, self.device)
        check_floating("values", tensor)
        self._total.accumulate(tensor.sum(dtype=self._total.local.dtype))

    def compute(self) -> Tensor:
        """The sum (0 over no data)."""
        return self._total.value.clone()
