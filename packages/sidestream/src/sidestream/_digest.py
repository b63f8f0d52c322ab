"""A digest of a checkpoint, the same on every rank that was given the same one."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["checkpoint_digest"]


def checkpoint_digest(state_dict: Mapping[str, Any]) -> str:
    """A short digest of a metric checkpoint's keys, dtypes, shapes and bytes.

    The same on every rank that loads the same checkpoint (a global state: ``state_dict`` is
    reduced), on any device.
    """
    digest = hashlib.blake2b(digest_size=8)
    for key in sorted(state_dict):
        value = state_dict[key]
        value = getattr(value, "rows", value)  # a sample store's SavedRows
        digest.update(str(key).encode())
        if isinstance(value, torch.Tensor):
            flat = value.detach().reshape(-1).cpu().contiguous()
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            # The bytes as they are, read without numpy (not a dependency of the core).
            digest.update(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()
