"""Coalesced cross-rank reduction of metric state.

Every accumulator reduced inside one ``coalesced_sync()`` block is packed into flat buffers, one
per (group, device, op, dtype), and each buffer is reduced with a single ``all_reduce``. The
number of collectives of a sync therefore depends on how many kinds of state there are, never on
how many metrics there are.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from sidestream._distributed import Group, group_size, resolve_group
from sidestream.state import MetricAccumulator, ReduceOp

__all__ = ["SyncBatch", "coalesced_sync", "reduce_accumulator"]

_DIST_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


@dataclass
class _Entry:
    accumulator: MetricAccumulator
    receive: Callable[[Tensor], None]


@dataclass
class SyncBatch:
    """The accumulators collected by one ``coalesced_sync`` block, reduced together at its end."""

    _buckets: dict[tuple[int, str, ReduceOp, torch.dtype], list[_Entry]] = field(
        default_factory=dict
    )
    _groups: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)
    async_op: bool = False
    works: list[dist.Work] = field(default_factory=list)

    def add(
        self,
        accumulator: MetricAccumulator,
        group: Group,
        receive: Callable[[Tensor], None],
    ) -> None:
        """Schedule ``accumulator``'s reduction over ``group``; ``receive`` gets the result."""
        process_group = resolve_group(group)
        if group_size(process_group) == 1:
            # Nothing to reduce with: the local state is already the global one.
            receive(accumulator.local.clone())
            return
        group_key = id(process_group)
        self._groups[group_key] = process_group
        local = accumulator.local
        key = (group_key, str(local.device), accumulator.op, local.dtype)
        self._buckets.setdefault(key, []).append(_Entry(accumulator, receive))

    def flush(self) -> None:
        """Issue one all_reduce per bucket and hand each accumulator its slice of the result.

        With ``async_op`` the collectives are only started: the slices handed out are valid
        once ``wait`` returned (on CUDA, once the current stream passed ``wait``).
        """
        buckets, self._buckets = self._buckets, {}
        # Insertion order: every rank adds its accumulators in the same order, so every rank
        # issues the same sequence of collectives.
        for (group_key, _, op, _), entries in buckets.items():
            flat = torch.cat([entry.accumulator.local.reshape(-1) for entry in entries])
            work = dist.all_reduce(
                flat, op=_DIST_OPS[op], group=self._groups[group_key], async_op=self.async_op
            )
            if work is not None:
                self.works.append(work)
            offset = 0
            for entry in entries:
                local = entry.accumulator.local
                entry.receive(flat[offset : offset + local.numel()].view(local.shape))
                offset += local.numel()

    def wait(self) -> None:
        """Wait for the collectives started by an ``async_op`` flush (no-op otherwise)."""
        works, self.works = self.works, []
        for work in works:
            work.wait()


_current: contextvars.ContextVar[SyncBatch | None] = contextvars.ContextVar(
    "sidestream_sync_batch", default=None
)


@contextlib.contextmanager
def coalesced_sync(async_op: bool = False) -> Iterator[SyncBatch]:
    """Batch every accumulator reduction inside the block into as few collectives as possible.

    Nested blocks join the outermost one. On normal exit the batch is flushed; on an exception it
    is dropped, so no rank issues collectives the others may never match.

    Args:
        async_op: Start the collectives without waiting; call ``batch.wait()`` after the block
            before reading the results (the collector does this off the training thread).
    """
    outer = _current.get()
    if outer is not None:
        yield outer
        return
    batch = SyncBatch(async_op=async_op)
    token = _current.set(batch)
    try:
        yield batch
    finally:
        _current.reset(token)
    batch.flush()


def reduce_accumulator(
    accumulator: MetricAccumulator, group: Group, receive: Callable[[Tensor], None]
) -> None:
    """Reduce ``accumulator`` over ``group``, batched with the running coalesced sync if any."""
    with coalesced_sync() as batch:
        batch.add(accumulator, group, receive)
