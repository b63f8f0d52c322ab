"""The rejected-update counter every metric with value checks carries."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from sidestream.metric import Metric
from sidestream.state import MetricAccumulator

__all__ = ["ScreenedMetric"]

T = TypeVar("T")


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
        """How many updates were dropped for bad values (CUDA only; CPU raises instead)."""
        return self._rejected.value
