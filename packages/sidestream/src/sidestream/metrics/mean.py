"""Arithmetic mean of all values seen."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import as_tensor, check_floating
from sidestream.metric import Metric
from sidestream.metrics._nan_strategy import NanPolicy, NanStrategy
from sidestream.state import MetricAccumulator

__all__ = ["MeanMetric"]


class MeanMetric(Metric[Tensor]):
    """The mean of every element passed to ``update``, stored as a sum and a count.

    A mean over no data is NaN (0 / 0), on purpose: it is not a zero loss.

    Args:
        dtype: The accumulation dtype of the sum and the count (float64 by default).
        nan_strategy: ``"disable"`` (NaN propagates), ``"error"``, ``"ignore"`` or a fill
            value; see ``sidestream.metrics.NanPolicy``.
    """

    def __init__(
        self, dtype: torch.dtype = torch.float64, nan_strategy: NanStrategy = "disable"
    ) -> None:
        self._total = MetricAccumulator(0.0, dtype=dtype)
        self._count = MetricAccumulator(0.0, dtype=dtype)
        self._nan = NanPolicy(nan_strategy)
        self._nan_count = self._nan.counter()
        self._rejected = MetricAccumulator(0, dtype=torch.int64) if self._nan.checks else None

    def update(self, values: Tensor | float) -> None:
        """Add the elements of ``values`` (any shape, floating point; empty is fine)."""
        tensor = as_tensor("values", values, self.device)
        check_floating("values", tensor)
        tensor, kept, keep = self._nan.apply(tensor, self._rejected, self._nan_count)
        self._total.accumulate(tensor.sum(dtype=self._total.local.dtype))
        dtype = self._count.local.dtype
        if kept is not None:  # nan_strategy="ignore": NaN elements do not count
            self._count.accumulate(kept.sum(dtype=dtype))
            return
        # numel is metadata: a CPU scalar rides into the add as an argument, not a sync (even
        # under a CUDA default device, hence device="cpu").
        count = torch.tensor(float(tensor.numel()), dtype=dtype, device="cpu")
        self._count.accumulate(count if keep is None else keep.to(dtype) * count)

    def compute(self) -> Tensor:
        """Sum / count; NaN over no data."""
        return self._total.value / self._count.value

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
