"""What a rank sends back: results pickled with device tensors moved to the host."""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DistributedError", "RankFailure", "dumps_on_host"]


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: its traceback, or why it produced no result."""

    rank: int
    reason: str


class DistributedError(RuntimeError):
    """One or more ranks failed, timed out or died; ``failures`` says which and how."""

    def __init__(self, function: str, world_size: int, failures: list[RankFailure]) -> None:
        self.failures = failures
        lines = [f"{function} failed on {len(failures)} of {world_size} ranks:"]
        for failure in failures:
            lines.append(f"--- rank {failure.rank} ---\n{failure.reason.rstrip()}")
        super().__init__("\n".join(lines))


class _HostPickler(pickle.Pickler):
    # A CUDA tensor pickled as is would come back on the sender's GPU (or through CUDA IPC);
    # the parent compares results with host references, so every tensor travels as a CPU one.
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # type: ignore[no-untyped-call]
        return NotImplemented


def dumps_on_host(value: Any) -> bytes:
    """Pickle ``value`` with every tensor in it moved to the CPU."""
    buffer = io.BytesIO()
    _HostPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()
