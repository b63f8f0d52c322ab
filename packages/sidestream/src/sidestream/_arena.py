"""The state arena: every state of a metric tree as views into one flat buffer per dtype."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from sidestream._reduce_op import ReduceOp
from sidestream._samples import SampleStore
from sidestream.state import Freshness, MetricAccumulator, copy_keeping_views
from sidestream.sync import StatePart, tensor_over_storage

__all__ = ["Arena", "ArenaSegment"]

_OP_ORDER = {ReduceOp.SUM: 0, ReduceOp.MAX: 1, ReduceOp.MIN: 2}
_BLOCK_ALIGN = 16
"""A block's size is a multiple of this: of every dtype's size (complex128's is the largest)."""


class ArenaSegment:
    """The states of one (device, dtype, op) class: a contiguous range of one arena buffer.

    What the sync reduces (it has a ``local`` and an ``op``), with ``synced`` receiving the
    result and ``parts`` naming the states inside for the structure check.
    """

    def __init__(
        self,
        local: Tensor,
        synced: Tensor,
        op: ReduceOp,
        parts: tuple[StatePart, ...],
    ) -> None:
        self.local = local
        self.synced = synced
        self.op = op
        self.parts = parts


class Arena:
    """One contiguous buffer per (device, dtype) holding every state of a metric tree.

    Building it copies each state in and re-points the state at views: ``local`` into the
    local buffer, ``initial`` into a twin buffer of initial values, ``synced`` into a third.
    Within a buffer the states are ordered by op, so each op is one contiguous segment and the
    sync sends whole segments, never state by state.

    The dtype buffers of one device share one block of memory (back to back in a byte buffer,
    each a tensor of its own, not a view of the bytes), so ``reset`` is one copy of the
    initial bytes per device and staging a copy is one copy between two arenas of the same
    layout, whatever the number of dtypes: on CUDA each copy is a runtime call that costs the
    training thread several microseconds.

    An arena dies (``alive`` false) when a state of its tree is re-declared or moved into another
    arena; metrics then build a new one.

    Args:
        root: The metric whose tree this is.
        states: ``(dotted name, state)`` pairs of the tree, in declaration order.
        flags: The freshness flags of the tree's metrics.
        device: Move every state there first (``None``: leave each where it is).
        stores: The tree's growing per-sample stores: moved, reset and staged with the states
            (they are not part of the buffers).
        settings: Parts of no state that the structure check compares too (each metric's
            class and compute settings): they ride with the first segment.
    """

    def __init__(
        self,
        root: Any,
        states: Sequence[tuple[str, MetricAccumulator]],
        flags: Sequence[Freshness],
        device: torch.device | None = None,
        stores: Sequence[SampleStore] = (),
        settings: Sequence[StatePart] = (),
    ) -> None:
        self.alive = True
        self.stores = list(stores)
        if device is not None:
            for store in self.stores:
                store.to(device)
        self.root = root
        self.flags = list(flags)
        self._cleared_at = -1  # Freshness.raised when mark(False) last cleared every flag
        self.states = list(states)
        #: One byte buffer per device for each kind of value; the dtype buffers live in them.
        self.locals: list[Tensor] = []
        self.initials: list[Tensor] = []
        self.synceds: list[Tensor] = []
        self.segments: list[ArenaSegment] = []
        classes: dict[torch.device, dict[torch.dtype, list[tuple[str, MetricAccumulator]]]] = {}
        for name, state in states:
            where = device or state.device
            classes.setdefault(where, {}).setdefault(state.local.dtype, []).append((name, state))
        self.device = next(iter(classes)) if classes else (device or torch.device("cpu"))
        for where, by_dtype in classes.items():
            # Widest dtype first: each buffer then starts aligned to its own dtype with no gap
            # before it, so copies of neighbouring segments can merge (see sync.py).
            by_width = sorted(by_dtype.items(), key=lambda item: -item[0].itemsize)
            offsets: list[int] = []
            size = 0
            for dtype, members in by_width:
                members.sort(key=lambda item: _OP_ORDER[item[1].op])  # stable: declaration order
                offsets.append(size)
                size += sum(state.local.numel() for _, state in members) * dtype.itemsize
            # A whole number of elements of every dtype in it: torch refuses a storage whose
            # size is not (aot_eager's functionalized updates, torch.save of a state).
            size = -(-size // _BLOCK_ALIGN) * _BLOCK_ALIGN
            # Normal tensors even under torch.inference_mode() (a metric built in an evaluation
            # function): inference ones, and tensors set onto their storage, could not be
            # updated in place outside it (see state.normal_tensor).
            with torch.inference_mode(False):
                blocks = [torch.empty(size, dtype=torch.uint8, device=where) for _ in range(3)]
                self.locals.append(blocks[0])
                self.initials.append(blocks[1])
                self.synceds.append(blocks[2])
                for (dtype, members), offset in zip(by_width, offsets, strict=True):
                    self._lay_out(blocks, offset, dtype, members)
        if settings and self.segments:
            first = self.segments[0]
            first.parts = first.parts + tuple(settings)

    def _lay_out(
        self,
        blocks: list[Tensor],
        offset: int,
        dtype: torch.dtype,
        members: list[tuple[str, MetricAccumulator]],
    ) -> None:
        """Place one dtype's states (sorted by op) at byte ``offset`` of the device's blocks."""
        total = sum(state.local.numel() for _, state in members)
        # Tensors of their own over the blocks, not views of the bytes: a state's view into
        # one has it as ``_base``, which compiled updates slice (``MetricAccumulator._bind``).
        local, initial, synced = (
            tensor_over_storage(block, offset, dtype, total) for block in blocks
        )
        start = 0
        bounds: list[tuple[ReduceOp, int, int, list[StatePart]]] = []
        for name, state in members:
            n, shape = state.local.numel(), state.local.shape
            part = slice(start, start + n)
            local[part].copy_(state.local.reshape(-1))
            initial[part].copy_(state.initial.reshape(-1))
            # The synchronized values too: a metric current before (to, a copy, a pickle)
            # stays current with them.
            synced[part].copy_(state._synced.reshape(-1))
            previous = state._arena
            if isinstance(previous, Arena) and previous is not self:
                previous.alive = False
            state._arena = self
            state._bind(
                local[part].view(shape), initial[part].view(shape), synced[part].view(shape)
            )
            if not bounds or bounds[-1][0] is not state.op:
                bounds.append((state.op, start, start, []))
            op, first, _, parts = bounds[-1]
            parts.append((name, tuple(shape), state._configuration))
            bounds[-1] = (op, first, start + n, parts)
            start += n
        for op, first, stop, parts in bounds:
            if stop > first:
                self.segments.append(
                    ArenaSegment(local[first:stop], synced[first:stop], op, tuple(parts))
                )

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with a metric whose own __getstate__ keeps it: the states come back with
        # views of their own (MetricAccumulator.__setstate__), so this copy holds nothing of
        # theirs and must be built again.
        return {**self.__dict__, "alive": False, "_cleared_at": -1}

    def __deepcopy__(self, memo: dict[int, Any]) -> Arena:
        copied: Arena = copy_keeping_views(self, memo)  # deepcopy keeps the views: alive
        return copied

    def reset(self) -> None:
        """Every state back to its initial value (one copy per device) and every flag stale."""
        for local, initial in zip(self.locals, self.initials, strict=True):
            local.copy_(initial)
        for store in self.stores:
            store.clear()
        self.mark(False)

    def copy_from(self, other: Arena) -> None:
        """Copy ``other``'s local state (same layout) into this arena.

        The flags are left alone: the caller (the collector's staging) syncs right after.
        """
        for block, source in zip(self.locals, other.locals, strict=True):
            block.copy_(source)
        for mine, theirs in zip(self.stores, other.stores, strict=True):
            mine.copy_from(theirs)

    def mark(self, current: bool) -> None:
        """Set every freshness flag of the tree (``Freshness.mark`` of each).

        It runs on the training thread every window (the reset after staging), where the live
        flags are already clear (updates cleared them, and the windows sync staged copies): the
        loop, a cache miss per metric after a training step, is skipped when no flag of the
        process was set since it last cleared them all (``Freshness.raised``). Inlined, as a
        call per flag would cost more.
        """
        if not current and self._cleared_at == Freshness.raised:
            return
        seen = Freshness.raised
        for flag in self.flags:
            flag.current = current
            flag.pending = False
        if current:
            Freshness.announce()
        else:
            self._cleared_at = seen

    def same_layout(self, other: Arena) -> bool:
        """Whether ``other`` holds the same states in the same buffers' layout."""
        return len(self.stores) == len(other.stores) and [
            (n, s.local.shape, s.local.dtype, s.op) for n, s in self.states
        ] == [(n, s.local.shape, s.local.dtype, s.op) for n, s in other.states]
