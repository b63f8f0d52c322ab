"""A sum whose bits do not depend on the number of CPU threads, for ``compute``."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ordered_sum"]

_SUM_CHUNK = 4096
"""Elements summed in one piece: below torch's parallel grain (32768), so one thread's each."""


def ordered_sum(values: Tensor) -> Tensor:
    """``values.sum(-1)``, its bits the same whatever the number of CPU threads.

    On the CPU, torch splits a reduction to a single number over 32768 elements or more into
    one part per thread, so its rounding depends on ``torch.get_num_threads()``: ranks with
    other thread counts (machines of other sizes, another ``OMP_NUM_THREADS``) computed other
    bits from the same reduced state, and a decision every rank takes from the value
    (``if ap > best: dcp.save(...)``) could go either way. Summed in fixed pieces instead
    (padded with zeros), each piece is one thread's, added in one order, and so are the
    pieces' sums. No host sync: the number of pieces comes from the shape. Sums of whole
    numbers (counts below 2**53) are exact in any order and need none of this.
    """
    size = values.shape[-1]
    if size <= _SUM_CHUNK:
        return values.sum(-1)
    padded = torch.nn.functional.pad(values, (0, -size % _SUM_CHUNK))
    pieces = padded.reshape(*padded.shape[:-1], -1, _SUM_CHUNK)
    return pieces.sum(-1).sum(-1)
