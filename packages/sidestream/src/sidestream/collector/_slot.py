"""One window's private copy of the metric, and its pinned host buffers on CUDA."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from sidestream.metric import Metric

__all__ = ["Slot", "clone_metric"]


class Slot:
    """A staging copy of the metric that one window owns from staging until it is published.

    The training thread copies the live accumulators into ``metric`` (so later updates never
    race the reduction), the reduction and ``compute`` run on it, and the dispatcher hands the
    slot back once the window's numbers are on the host. A slot is reused only after that, so
    no window ever writes a buffer another window still reads.

    Args:
        metric: A copy of the collector's metric (see ``clone_metric``), on the same device.
        live: The collector's metric, which ``stage`` copies from.
    """

    def __init__(self, metric: Metric[Any], live: Metric[Any]) -> None:
        self.metric = metric
        # Pairs found once: walking the metric tree per window costs the training thread.
        self._pairs = [
            (staged, source)
            for (_, staged), (_, source) in zip(
                metric.named_accumulators(), live.named_accumulators(), strict=True
            )
        ]
        self.host: list[Tensor] = []
        #: CUDA: recorded on the side stream after the last window that used this slot.
        self.done: torch.cuda.Event | None = None

    def stage(self) -> None:
        """Copy every local accumulator of the live metric into this slot's (device copies)."""
        for staged, source in self._pairs:
            staged.load_local(source.local)

    def copy_to_host(self, leaves: tuple[Any, ...]) -> list[Any]:
        """Start device-to-host copies of ``leaves`` into pinned buffers (CUDA, current stream).

        The buffers are allocated on the first window and reused; Python numbers pass through.
        Read the result only after the stream's work is done (the window's ``done`` event).
        """
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        if [(t.shape, t.dtype) for t in tensors] != [(h.shape, h.dtype) for h in self.host]:
            self.host = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True) for t in tensors
            ]
        buffers = iter(self.host)
        out: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                buffer = next(buffers)
                buffer.copy_(leaf.detach(), non_blocking=True)
                out.append(buffer)
            else:
                out.append(leaf)
        return out


def clone_metric(metric: Metric[Any]) -> Metric[Any]:
    """A deep copy of ``metric`` that shares (does not copy) process groups and device meshes."""
    memo: dict[int, Any] = {}
    for group in _sync_groups(metric, set()):
        memo[id(group)] = group
    return copy.deepcopy(metric, memo)


def _sync_groups(obj: Any, seen: set[int]) -> Iterator[Any]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Metric):
        if obj._sync_group is not None:
            yield obj._sync_group
        for value in vars(obj).values():
            yield from _sync_groups(value, seen)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _sync_groups(value, seen)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _sync_groups(value, seen)
