"""One window's private copy of the metric, and its pinned host buffers on CUDA."""

from __future__ import annotations

import collections
import copy
import sys
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from sidestream._arena import Arena
from sidestream._distributed import Group
from sidestream._logs import get_logger
from sidestream.metric import Metric, has_own_sync, own_data
from sidestream.sync import CallFingerprint, RankMismatchError, SyncBatch, SyncHandle, SyncProgram

__all__ = ["Slot", "StartedWindow", "clone_metric"]

logger = get_logger("sidestream.collector")


class StartedWindow(Protocol):
    """What ``Slot.start_from_live`` records on a window (``_window.Window`` has it).

    A protocol, not the class: ``_window`` imports this module.
    """

    started: bool
    batch: SyncHandle | None


class Slot:
    """A staging copy of the metric that one window owns from staging until it is published.

    The training thread copies the live metric's state arena into ``metric``'s (one copy per
    dtype, so later updates never race the reduction), the reduction and ``compute`` run on
    it, and the dispatcher hands the slot back once the window's numbers are on the host. A
    slot is reused only after that, so no window ever writes a buffer another window still
    reads, which is also what lets each slot keep one laid-out sync (with its own buffers) for
    all its windows.

    Args:
        metric: A copy of the collector's metric (see ``clone_metric``), on the same device.
        live: The collector's metric, which ``stage`` copies from.
        group: The process group / 1-D device mesh the windows are reduced over.
        check: Run the blocking check that every rank holds this structure (the first slot,
            made on every rank at ``bind``). Slots made later, on one rank alone when its
            dispatcher falls behind, must not issue collectives.
        direct: Lay out ``start_from_live`` (off CUDA): the reduction reads the live arena
            itself, so a window stages with one copy instead of two.
        stream: The collector's prefix, sent in every window's call fingerprint: windows of
            two collectors that ranks schedule in different orders fail instead of mixing.
    """

    def __init__(
        self,
        metric: Metric[Any],
        live: Metric[Any],
        group: Group,
        *,
        check: bool,
        direct: bool = False,
        stream: str = "",
    ) -> None:
        self.metric = metric
        self._stream = stream
        self._live = live
        self._group = group
        live_arena, arena = live._own_arena(), metric._own_arena()
        if live_arena is None or arena is None or not arena.same_layout(live_arena):
            raise RuntimeError("the collector's metric changed its state while being copied")
        self._live_arena: Arena = live_arena
        #: The live metric's arena this slot stages from (checked unchanged every window).
        self.live_arena = live_arena
        self._arena: Arena = arena
        #: A tree whose metrics all use the library's sync is reduced by one laid-out program
        #: per slot, replayed every window. A metric with its own sync (or sample stores, which
        #: sync by gathering) keeps calling it: the slow path.
        self.replayable = not any(has_own_sync(m) for m in metric._walk_metrics())
        # A metric with its own sync keeps data besides its states (a sample buffer, say) that
        # its sync gathers: staged by a copy too, or this slot's sync would see bind time's.
        self._own_sync_pairs = [
            (source, target)
            for source, target in zip(live._walk_metrics(), metric._walk_metrics(), strict=True)
            if type(source).sync is not Metric.sync
        ]
        if check:
            _warn_of_unstaged(self._own_sync_pairs)
        self._direct: SyncProgram | None = None
        self._marked = False
        if direct and self.replayable:
            self._direct = self._lay_out_direct(check)
        else:
            metric.prepare_sync(group, check=check)
        self.host: list[Tensor] = []
        #: CUDA: recorded on the side stream after the last window that used this slot.
        self.done: torch.cuda.Event | None = None

    def stage(self, step: int) -> None:
        """Copy the live metric's state arena into this slot's: one batched copy.

        Raises:
            RankMismatchError: If the live metric's states changed since ``bind`` (after
                telling the other ranks, whose window at ``step`` then fails too).
        """
        live = self._live._own_arena()
        if live is not self._live_arena:
            changed = CallFingerprint("changed", step, self._stream)
            self.metric.prepare_sync(self._group).every_state.start(changed).verify()
            raise RankMismatchError(_changed_after_bind(self._live))
        self._arena.copy_from(live)
        for source, target in self._own_sync_pairs:
            for attribute, value in own_data(source):
                if _stageable(value):
                    object.__setattr__(target, attribute, _staged_copy(value))

    def _lay_out_direct(self, check: bool) -> SyncProgram:
        """The slot's sync with the live arena's segments as sources and its own as results.

        The entries are named and described exactly as ``Metric.prepare_sync`` describes the
        arena (same structure hash, same structure check), so the payload is byte for byte what
        a staged copy would send.
        """
        batch = SyncBatch()
        pairs = zip(self._live_arena.segments, self._arena.segments, strict=True)
        for source, own in pairs:
            batch.add(source, self._group, own.synced, name=own.parts[0][0], parts=own.parts)
        return batch.program(check=check)

    def start_from_live(self, step: int, window: StartedWindow) -> None:
        """Stage the live state and start ``window``'s reduction (``async_op``).

        With a direct layout the live arena is copied straight into the send buffer (the
        slot's own local state is then never read: ``compute`` reads the synced state, marked
        current here); otherwise ``stage`` then ``start_sync``. Either way the live metric may
        be updated or reset as soon as this returns.

        Sets ``window.started`` just before the first collective is issued and
        ``window.batch`` (the handle) as soon as the start returns, so a caller interrupted
        anywhere in between knows its collectives may be in flight.

        Raises:
            RankMismatchError: If the live metric's states changed since ``bind`` (see
                ``stage``).
        """
        if self._direct is None:
            self.stage(step)
            window.started = True
            window.batch = self.start_sync(step)
            return
        live = self._live_arena
        # The common case without a call: the bound arena is alive and still the live tree's
        # (``_own_arena`` would rebuild a dead one, which is what the check below catches).
        unchanged = live.alive and self._live.__dict__.get("_state_arena") is live
        if not unchanged and self._live._own_arena() is not live:
            # Tells the other ranks, whose window at this step then fails too.
            self._direct.start(CallFingerprint("changed", step, self._stream))
            raise RankMismatchError(_changed_after_bind(self._live))
        # Marked before the start: nothing reads this copy until the window's wait, and after
        # the start nothing may come between the collectives and the window knowing the handle.
        self._mark_once()
        window.started = True
        window.batch = self._direct.start(
            CallFingerprint("window", step, self._stream), async_op=True
        )

    def unstage(self) -> None:
        """Copy the staged state back into the live metric (queued on the current stream).

        For a window whose reduction never started, after staging reset the live state: its
        updates are kept for the window scheduled again. Only what ``stage`` copied comes back.
        """
        self._live_arena.copy_from(self._arena)
        for source, target in self._own_sync_pairs:
            for attribute, value in own_data(target):
                if _stageable(value):
                    object.__setattr__(source, attribute, value)

    def _mark_once(self) -> None:
        """Mark this slot's synced state current (after the first window's start only).

        Nothing updates, resets or loads a staging copy, so its flags stay current once set:
        marking them every window would cost a loop over the tree's metrics.
        """
        if not self._marked:
            self._arena.mark(True)
            self._marked = True

    def start_sync(self, step: int) -> SyncHandle:
        """Start the reduction of the staged state (``async_op``); ``wait`` on the handle."""
        if self.replayable:
            handle = self.metric.start_sync(
                self._group, CallFingerprint("window", step, self._stream), mark=False
            )
            self._mark_once()
            return handle
        # The slow path: the metric's own sync, blocking, under the window's fingerprint.
        self.metric.sync_as(self._group, CallFingerprint("window", step, self._stream))
        return SyncHandle(async_op=False)

    def copy_to_host(self, leaves: tuple[Any, ...]) -> list[Any]:
        """Start device-to-host copies of ``leaves`` into pinned buffers (CUDA, current stream).

        The buffers are allocated on the first window and reused; Python numbers pass through.
        Read the result only after the stream's work is done (the window's ``done`` event).
        """
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        if [(t.shape, t.dtype) for t in tensors] != [(h.shape, h.dtype) for h in self.host]:
            # Normal tensors even when first made under torch.inference_mode() (a collector
            # bound in an evaluation function): the dispatcher thread, which is never in
            # inference mode (it is per thread), copies into them in place.
            with torch.inference_mode(False):
                self.host = [
                    torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                    for t in tensors
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


def _changed_after_bind(live: Metric[Any]) -> str:
    """Why a window found the collector's metric with other states than at bind."""
    home = live.__dict__.get("_state_arena")
    if home is not None and home.alive and home.root is not live:
        # Its states were laid out again as part of a tree that holds it.
        return (
            "schedule_collection: the collector's metric is part of a "
            f"{type(home.root).__name__}, which was synced, reset, moved or checkpointed as a "
            "whole after bind and took the metric's states into its own arena; bind the "
            f"collector to that {type(home.root).__name__}, or keep this metric out of it"
        )
    return (
        "schedule_collection: the collector's metric changed its states after bind; make a "
        "new collector for a new metric structure"
    )


def _warn_of_unstaged(pairs: list[tuple[Metric[Any], Metric[Any]]]) -> None:
    """Name, once per collector, own-sync data that windows do not stage (kept from bind)."""
    for source, _ in pairs:
        kept = [attribute for attribute, value in own_data(source) if not _stageable(value)]
        if kept:
            logger.warning(
                "%s overrides sync; its attributes %s are not tensors, arrays, numbers or "
                "plain containers, so every window's copy keeps their value from bind. Keep "
                "data its sync gathers in tensors or lists",
                type(source).__name__,
                kept,
            )


def _stageable(value: Any) -> bool:
    """Whether a metric's own data is staged per window: tensors, arrays, numbers, containers.

    Other objects (settings, helpers) were copied with the metric at ``bind`` and are left as
    they are.
    """
    if isinstance(value, Tensor | list | tuple | dict | set | collections.deque):
        return True
    if value is None or isinstance(value, bool | int | float | str):
        return True
    numpy = sys.modules.get("numpy")  # not a dependency: an array means numpy is imported
    return numpy is not None and isinstance(value, numpy.ndarray)


def _staged_copy(value: Any) -> Any:
    """A window's copy of a stageable value (numbers, strings and ``None`` are immutable)."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return copy.deepcopy(value)


def clone_metric(metric: Metric[Any]) -> Metric[Any]:
    """A deep copy of ``metric`` with its own state arena (views kept as views).

    Process groups, device meshes and the call counter are shared, not copied; laid-out syncs
    are not copied (the copy lays out its own).
    """
    memo: dict[int, Any] = {}
    for group in _sync_groups(metric, set()):
        memo[id(group)] = group
    for inner in metric._walk_metrics():
        memo[id(inner.call_counter)] = inner.call_counter
        for private in ("_sync_layouts", "_unverified_syncs"):
            value = inner.__dict__.get(private)
            if value is not None:
                memo[id(value)] = {} if private == "_sync_layouts" else []  # none pending
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
