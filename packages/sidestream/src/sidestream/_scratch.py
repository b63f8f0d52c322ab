"""Per-thread scratch tensors for the chunk loops of large CPU updates."""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

__all__ = ["scratch"]

_local = threading.local()


def scratch(
    name: str, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size, device: torch.device
) -> Tensor:
    """This thread's reusable tensor called ``name`` (contents undefined), of ``shape``.

    A chunk loop over a large batch would otherwise allocate its temporaries per chunk (or per
    update): above the C allocator's mmap threshold each one comes back as fresh pages the
    kernel zeroes, which costs more than the arithmetic on them. Kept per thread, name, dtype
    and device (grown, never shrunk), so two threads, or two loops that use other names, never
    share one. Valid until the next call with the same name on this thread.
    """
    cache: dict[tuple[str, torch.dtype, torch.device], Tensor] | None
    cache = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = {}
    numel = math.prod(shape)
    key = (name, dtype, device)
    kept = cache.get(key)
    # One made under torch.inference_mode() is an inference tensor, which no in-place op may
    # write outside inference mode (a validation pass, then training): make a new one then.
    if (
        kept is None
        or kept.numel() < numel
        or (kept.is_inference() and not torch.is_inference_mode_enabled())
    ):
        kept = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return kept[:numel].view(shape)
