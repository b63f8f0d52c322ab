"""Sum of all values seen."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import as_tensor, check_floating
from sidestream.metric import Metric
from sidestream.metrics._nan_strategy import NanPolicy, NanStrategy
from sidestream.state import MetricAccumulator

__all__ = ["SumMetric"]


class SumMetric(Metric[Tensor]):
    """The sum of every value passed to ``update``, over all ranks after ``sync``.

    Args:
        dtype: The accumulation dtype; float64 by default so long runs do not lose precision.
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
        self._total = MetricAccumulator(0.0, dtype=dtype)
        self._nan = NanPolicy(nan_strategy)
        self._nan_count = self._nan.counter()
        self._rejected = MetricAccumulator(0, dtype=torch.int64) if self._nan.checks else None

    def update(self, values: Tensor | float) -> None:
        """Add ``values`` (any shape, floating point) to the sum."""
        tensor = as_tensor("values", values, self.device)
        check_floating("values", tensor)
        tensor = self._nan.apply(tensor, self._rejected, self._nan_count).values
        self._total.accumulate(tensor.sum(dtype=self._total.local.dtype))

    def compute(self) -> Tensor:
        """The sum (0 over no data)."""
        return self._total.value.clone()

    @property
    def nan_count(self) -> Tensor | None:
        """NaN elements ignored or filled (``nan_strategy`` "ignore" or a number), else None."""
        return None if self._nan_count is None else self._nan_count.value

    @property
    def rejected_updates(self) -> Tensor:
        """Batches dropped for NaN on CUDA (``nan_strategy="error"``); always 0 otherwise."""
        if self._rejected is None:
            # A fill on the metric's device, not a copy: no sync, and the collector can stack it.
            return torch.zeros((), dtype=torch.int64, device=self.device)
        return self._rejected.value
