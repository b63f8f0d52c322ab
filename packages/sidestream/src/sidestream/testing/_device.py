"""Which device a rank's tensors belong on, so one test body runs on gloo and on NCCL."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
import torch.distributed as dist

__all__ = ["on_rank_device", "rank_device"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def rank_device() -> torch.device:
    """The device this rank's metrics and inputs belong on.

    ``cuda:<current device>`` when the default process group uses NCCL (each torchrun rank
    binds its own GPU), else the CPU, so a test body written with ``.to(rank_device())`` runs
    unchanged on gloo and on NCCL.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_rank_device(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``function`` with ``rank_device()`` as the default device of new tensors.

    For rank functions that build many tensors (``torch.tensor``, ``torch.zeros``, metric
    constructors): under NCCL they all land on the rank's GPU without a ``device=`` each.
    ``torch.from_numpy`` always gives a CPU tensor; move those with ``.to(rank_device())``.
    """

    @functools.wraps(function)
    def on_device(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with rank_device():
            return function(*args, **kwargs)

    return on_device
