"""The state arena: every state of a metric tree as views into one flat buffer per dtype."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from sidestream._reduce_op import ReduceOp
from sidestream._samples import SampleStore
from sidestream.state import Freshness, MetricAccumulator, copy_keeping_views
from sidestream.sync import StatePart

__all__ = ["Arena", "ArenaSegment"]

_OP_ORDER = {ReduceOp.SUM: 0, ReduceOp.MAX: 1, ReduceOp.MIN: 2}


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
    sync sends whole segments, never state by state. ``reset`` is one batched copy from the
    initial buffers and staging a copy is one batched copy between two arenas of the same layout.

    An arena dies (``alive`` false) when a state of its tree is re-declared or moved into another
    arena; metrics then build a new one.

    Args:
        root: The metric whose tree this is.
        states: ``(dotted name, state)`` pairs of the tree, in declaration order.
        flags: The freshness flags of the tree's metrics.
        device: Move every state there first (``None``: leave each where it is).
        stores: The tree's growing per-sample stores: moved, reset and staged with the states
            (they are not part of the buffers).
    """

    def __init__(
        self,
        root: Any,
        states: Sequence[tuple[str, MetricAccumulator]],
        flags: Sequence[Freshness],
        device: torch.device | None = None,
        stores: Sequence[SampleStore] = (),
    ) -> None:
        self.alive = True
        self.stores = list(stores)
        if device is not None:
            for store in self.stores:
                store.to(device)
        self.root = root
        self.flags = list(flags)
        self.states = list(states)
        self.locals: list[Tensor] = []
        self.initials: list[Tensor] = []
        self.synceds: list[Tensor] = []
        self.segments: list[ArenaSegment] = []
        classes: dict[tuple[torch.device, torch.dtype], list[tuple[str, MetricAccumulator]]] = {}
        for name, state in states:
            key = (device or state.device, state.local.dtype)
            classes.setdefault(key, []).append((name, state))
        self.device = next(iter(classes))[0] if classes else (device or torch.device("cpu"))
        for (where, dtype), members in classes.items():
            members.sort(key=lambda item: _OP_ORDER[item[1].op])  # stable: declaration order
            total = sum(state.local.numel() for _, state in members)
            local = torch.empty(total, dtype=dtype, device=where)
            initial = torch.empty(total, dtype=dtype, device=where)
            synced = torch.empty(total, dtype=dtype, device=where)
            offset = 0
            bounds: list[tuple[ReduceOp, int, int, list[StatePart]]] = []
            for name, state in members:
                n, shape = state.local.numel(), state.local.shape
                part = slice(offset, offset + n)
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
                    bounds.append((state.op, offset, offset, []))
                op, start, _, parts = bounds[-1]
                parts.append((name, tuple(shape), state._configuration))
                bounds[-1] = (op, start, offset + n, parts)
                offset += n
            self.locals.append(local)
            self.initials.append(initial)
            self.synceds.append(synced)
            for op, start, stop, parts in bounds:
                if stop > start:
                    self.segments.append(
                        ArenaSegment(local[start:stop], synced[start:stop], op, tuple(parts))
                    )

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with a metric whose own __getstate__ keeps it: the states come back with
        # views of their own (MetricAccumulator.__setstate__), so this copy holds nothing of
        # theirs and must be built again.
        return {**self.__dict__, "alive": False}

    def __deepcopy__(self, memo: dict[int, Any]) -> Arena:
        copied: Arena = copy_keeping_views(self, memo)  # deepcopy keeps the views: alive
        return copied

    def reset(self) -> None:
        """Every state back to its initial value (one batched copy) and every flag stale."""
        if self.locals:
            torch._foreach_copy_(self.locals, self.initials)
        for store in self.stores:
            store.clear()
        self.mark(False)

    def copy_from(self, other: Arena) -> None:
        """Copy ``other``'s local state (same layout) into this arena.

        The flags are left alone: the caller (the collector's staging) syncs right after.
        """
        if self.locals:
            torch._foreach_copy_(self.locals, other.locals)
        for mine, theirs in zip(self.stores, other.stores, strict=True):
            mine.copy_from(theirs)

    def mark(self, current: bool) -> None:
        """Set every freshness flag of the tree."""
        for flag in self.flags:
            flag.current = current

    def same_layout(self, other: Arena) -> bool:
        """Whether ``other`` holds the same states in the same buffers' layout."""
        return len(self.stores) == len(other.stores) and [
            (n, s.local.shape, s.local.dtype, s.op) for n, s in self.states
        ] == [(n, s.local.shape, s.local.dtype, s.op) for n, s in other.states]
