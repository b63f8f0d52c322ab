"""Helpers to test code on several local processes joined by a process group."""

from sidestream.testing._collectives import COLLECTIVES, count_collectives
from sidestream.testing._device import on_rank_device, rank_device
from sidestream.testing._ops import OpRecorder
from sidestream.testing._pool import DistributedPool, RankPool, run_distributed
from sidestream.testing._results import DistributedError, RankFailure
from sidestream.testing._torchrun import TorchrunPool

__all__ = [
    "COLLECTIVES",
    "DistributedError",
    "DistributedPool",
    "OpRecorder",
    "RankFailure",
    "RankPool",
    "TorchrunPool",
    "count_collectives",
    "on_rank_device",
    "rank_device",
    "run_distributed",
]
