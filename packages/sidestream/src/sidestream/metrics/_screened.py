"""The rejected-update counter every metric with value checks carries, and ``nan_strategy``."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from sidestream.metric import Metric
from sidestream.metrics._nan_strategy import NanPolicy, NanStrategy
from sidestream.state import MetricAccumulator

__all__ = ["NanScreenedMetric", "ScreenedMetric"]

T = TypeVar("T", covariant=True)  # as Metric's: only what compute() returns


class ScreenedMetric(Metric[T]):
    """A metric whose value checks drop bad batches on CUDA and count them.

    On CPU a bad batch raises before the state changes; on CUDA a check would be a host sync,
    so the batch is dropped on the device and counted in ``rejected_updates``, an int64 SUM
    state that is reduced with ``sync`` and saved by ``state_dict`` like the rest.
    """

    def __init__(self) -> None:
        self._rejected = MetricAccumulator(0, dtype=torch.int64)

    @property
    def rejected_updates(self) -> Tensor:
        """Updates dropped for bad values on the device path (CUDA, or compiled); CPU raises."""
        return self._rejected.value


class NanScreenedMetric(Metric[Tensor]):
    """An aggregation with a ``nan_strategy`` (``NanPolicy``): the policy and its counters.

    Unlike ``ScreenedMetric`` the rejected-update counter exists only when something can drop
    a batch: a metric without checks carries no extra state to sync.

    Args:
        nan_strategy: ``"disable"``, ``"error"``, ``"ignore"`` or a fill value.
        counts_rejected: Keep the rejected-update counter even when the policy drops nothing
            (the metric has other checks that do).
        dtype: The metric's dtype (its result's), which a fill value must fit (see ``NanPolicy``).
    """

    def __init__(
        self,
        nan_strategy: NanStrategy,
        *,
        counts_rejected: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._nan = NanPolicy(nan_strategy, dtype)
        self._nan_count = self._nan.counter()
        checks = counts_rejected or self._nan.checks
        self._rejected = MetricAccumulator(0, dtype=torch.int64) if checks else None

    def _state_key_hint(self, names: set[str]) -> str:
        if names <= {"nan_count", "rejected", "configuration"}:
            return (
                "'nan_count' and 'rejected' exist or not by nan_strategy (now "
                f"{self._nan._strategy!r}): load into a metric made with the nan_strategy "
                "it was saved with"
            )
        return ""

    @property
    def rejected_updates(self) -> Tensor:
        """Batches dropped for bad values on CUDA (CPU raises instead); 0 without checks."""
        if self._rejected is None:
            # A fill on the metric's device, not a copy: no sync, and the collector can stack it.
            return torch.zeros((), dtype=torch.int64, device=self.device)
        return self._rejected.value

    @property
    def nan_count(self) -> Tensor | None:
        """NaN elements ignored or filled (``nan_strategy`` "ignore" or a number), else None."""
        return None if self._nan_count is None else self._nan_count.value
