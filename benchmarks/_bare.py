"""The bare collective the sync benchmarks compare against: torch.distributed's public call."""

from __future__ import annotations

import torch
import torch.distributed as dist

from sidestream._distributed import PUBLIC_GATHER

__all__ = ["bare_all_gather"]


def bare_all_gather(gathered: torch.Tensor, send: torch.Tensor) -> dist.Work:
    """Start an async all_gather of ``send`` into ``gathered`` as user code would write it.

    The public function (``all_gather_single``, ``all_gather_into_tensor`` before it), with its
    argument checks: sidestream itself calls the process group's method directly.
    """
    work: dist.Work = getattr(dist, PUBLIC_GATHER)(gathered, send, async_op=True)
    return work
