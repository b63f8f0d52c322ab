"""One window's private copy of the metric, and its pinned host buffers on CUDA."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from sidestream._distributed import Group
from sidestream.metric import Metric
from sidestream.metrics.compose import ComposeMetric
from sidestream.state import MetricAccumulator, load_all
from sidestream.sync import SyncBatch, SyncProgram, coalesced_sync

__all__ = ["Slot", "clone_metric"]


class Slot:
    """A staging copy of the metric that one window owns from staging until it is published.

    The training thread copies the live accumulators into ``metric`` (so later updates never
    race the reduction), the reduction and ``compute`` run on it, and the dispatcher hands the
    slot back once the window's numbers are on the host. A slot is reused only after that, so
    no window ever writes a buffer another window still reads, which is also what lets each
    slot keep one recorded ``SyncProgram`` (with its own buffers) for all its windows.

    Args:
        metric: A copy of the collector's metric (see ``clone_metric``), on the same device.
        live: The collector's metric, which ``stage`` copies from.
        group: The process group / 1-D device mesh the windows are reduced over.
        check: Run the blocking check that every rank holds this structure (the first slot,
            made on every rank at ``bind``). Slots made later, on one rank alone when its
            dispatcher falls behind, must not issue collectives.
    """

    def __init__(
        self, metric: Metric[Any], live: Metric[Any], group: Group, *, check: bool
    ) -> None:
        self.metric = metric
        self._group = group
        # Found once: walking the metric tree per window costs the training thread.
        self._staged = [accumulator for _, accumulator in metric.named_accumulators()]
        self._live = [accumulator for _, accumulator in live.named_accumulators()]
        if len(self._staged) != len(self._live):
            raise RuntimeError("the collector's metric changed its state while being copied")
        # The library's own sync methods only reduce the accumulators, always the same ones in
        # the same order, so their sync is recorded once and replayed every window. A metric
        # with its own sync keeps calling it.
        self._program = None
        if _replayable(metric):
            self._program = SyncProgram.record(self._sync, check=check)
        elif check:
            with coalesced_sync(check_only=True):
                self._sync()
        self.host: list[Tensor] = []
        #: CUDA: recorded on the side stream after the last window that used this slot.
        self.done: torch.cuda.Event | None = None

    def stage(self) -> None:
        """Copy every local accumulator of the live metric into this slot's, in one batched copy."""
        load_all(self._staged, [accumulator.local for accumulator in self._live])

    def start_sync(self) -> SyncBatch:
        """Start the reduction of the staged state (``async_op``); ``wait`` on the batch."""
        if self._program is not None:
            return self._program.start(async_op=True)
        with coalesced_sync(async_op=True) as batch:
            self._sync()
        return batch

    def _sync(self) -> None:
        self.metric.sync(self._group)

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
    # Tensor.__deepcopy__ is slow Python; cloning the state tensors up front makes a new slot
    # (made on the training thread when the dispatcher falls behind) about 5x cheaper.
    for _, accumulator in metric.named_accumulators():
        for tensor in (accumulator.local, accumulator.initial, accumulator.synced):
            if tensor is not None and id(tensor) not in memo:
                memo[id(tensor)] = tensor.clone()
    return copy.deepcopy(metric, memo)


def _sync_groups(obj: Any, seen: set[int]) -> Iterator[Any]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Metric):
        if obj.sync_group is not None:
            yield obj.sync_group
        for value in vars(obj).values():
            yield from _sync_groups(value, seen)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _sync_groups(value, seen)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _sync_groups(value, seen)


def _replayable(metric: Metric[Any]) -> bool:
    """Whether ``metric.sync`` is the library's: it reduces each accumulator once, in order."""
    sync = type(metric).sync
    if sync is ComposeMetric.sync:
        assert isinstance(metric, ComposeMetric)
        return all(_replayable(child) for _, child in metric.items())
    return sync is Metric.sync and all(
        type(accumulator).sync is MetricAccumulator.sync
        for _, accumulator in metric.named_accumulators()
    )
