"""Coalesced cross-rank reduction of metric state.

Every accumulator reduced inside one ``coalesced_sync()`` block is staged into flat buffers and
reduced together when the block ends, so the number of collectives of a sync depends on the kinds
of state, never on how many metrics there are. Per group and device a sync issues:

- **one** ``all_gather`` of a single byte buffer holding every state when the gathered size
  (packed bytes x group size) is at most ``GATHER_LIMIT_BYTES``; each rank then reduces the
  gathered rows itself, in each state's own dtype (exact for integers);
- otherwise **at most three** ``all_reduce``: one float64 SUM buffer (floats widened exactly;
  integer and bool counts split into two 32-bit halves, so sums stay exact in float64), one
  float64 MAX buffer (MIN states ride in it negated) and, only when there are integer MAX/MIN
  states, one int64 MAX buffer (MIN states bit-inverted). Collections without MAX/MIN states
  use one collective, typical ones two.

The first sync of a given state structure (names, shapes, dtypes, ops) over a group exchanges a
fixed-size fingerprint first (one extra, blocking all_reduce of two int64). When ranks disagree,
every rank raises ``RankMismatchError`` naming the states that differ and on which ranks, instead
of hanging in collectives of different sizes. Verified structures are cached, so later syncs pay
nothing; structures must therefore change on every rank together. ``coalesced_sync(
check_only=True)`` runs only this check, so code that must not block later (the collector) can
pay it up front.

``SyncProgram.record`` lays a sync out once (buffers and views included) so that it can be
started again with a handful of tensor calls; the collector replays one per staging slot.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sidestream._distributed import Group, group_rank, group_size, resolve_group
from sidestream.state import MetricAccumulator, ReduceOp

__all__ = [
    "GATHER_LIMIT_BYTES",
    "RankMismatchError",
    "SyncBatch",
    "SyncProgram",
    "coalesced_sync",
    "reduce_accumulator",
    "state_name",
]

GATHER_LIMIT_BYTES = 1 << 20
"""Largest gathered size (packed bytes x group size) synced with one all_gather."""

_ALIGN = 8  # every staged state starts at a multiple of the widest element size
_LOW_BITS = 0xFFFFFFFF
_MAX_CACHED_STRUCTURES = 4096


class RankMismatchError(RuntimeError):
    """Ranks of one group tried to sync different metric state (keys, shapes, dtypes or ops)."""


@dataclass
class _Entry:
    name: str
    accumulator: MetricAccumulator
    receive: Callable[[Tensor], None]


@dataclass
class _GroupEntries:
    group: dist.ProcessGroup | None
    size: int
    entries: list[_Entry] = field(default_factory=list)


@dataclass
class _Segment:
    """Every state of one (dtype, op) class, laid out back to back in a staging buffer."""

    dtype: torch.dtype
    op: ReduceOp
    entries: list[_Entry]
    numel: int

    @property
    def integral(self) -> bool:
        return not (self.dtype.is_floating_point or self.dtype.is_complex)

    def flat_local(self) -> Tensor:
        return torch.cat([e.accumulator.local.reshape(-1) for e in self.entries])

    def slices(self, flat: Tensor) -> list[tuple[_Entry, Tensor]]:
        """Each state with its slice of ``flat`` (one element per element of the segment)."""
        out = []
        offset = 0
        for entry in self.entries:
            local = entry.accumulator.local
            out.append((entry, flat[offset : offset + local.numel()].view(local.shape)))
            offset += local.numel()
        return out


def _segments(entries: list[_Entry]) -> list[_Segment]:
    """Group states by (dtype, op) in first-appearance order: the same on every rank."""
    classes: dict[tuple[torch.dtype, ReduceOp], _Segment] = {}
    for entry in entries:
        local = entry.accumulator.local
        key = (local.dtype, entry.accumulator.op)
        segment = classes.get(key)
        if segment is None:
            segment = classes[key] = _Segment(local.dtype, entry.accumulator.op, [], 0)
        segment.entries.append(entry)
        segment.numel += local.numel()
    return list(classes.values())


_Handout = tuple[Callable[[Tensor], None], Tensor]


class _GatherPlan:
    """One all_gather of every state packed into a byte buffer; each rank reduces the rows.

    The buffers and every view into them are made once: running the plan stages with one
    batched copy (each state's view into the send buffer), issues the collective and hands out
    precomputed result views, which the finisher fills with one reduction per segment.
    """

    def __init__(
        self, segments: list[_Segment], group: dist.ProcessGroup | None, size: int
    ) -> None:
        device = segments[0].entries[0].accumulator.local.device
        packed = sum(_padded_bytes(segment) for segment in segments)
        self._group = group
        self._send = torch.zeros(packed, dtype=torch.uint8, device=device)  # padding stays 0
        self._gathered = torch.empty(size * packed, dtype=torch.uint8, device=device)
        rows = self._gathered.view(size, packed)
        self._sources: list[MetricAccumulator] = []
        self._staging: list[Tensor] = []
        self._handouts: list[_Handout] = []
        self._reductions: list[tuple[Tensor, Tensor, ReduceOp]] = []
        start = 0
        for segment in segments:
            nbytes = segment.numel * segment.dtype.itemsize
            for entry, view in segment.slices(
                self._send[start : start + nbytes].view(segment.dtype)
            ):
                self._sources.append(entry.accumulator)
                self._staging.append(view)
            result = torch.empty(segment.numel, dtype=segment.dtype, device=device)
            self._handouts += [(entry.receive, view) for entry, view in segment.slices(result)]
            per_rank = rows[:, start : start + nbytes].view(segment.dtype)
            self._reductions.append((result, per_rank, segment.op))
            start += _padded_bytes(segment)

    def run(self, batch: SyncBatch) -> None:
        torch._foreach_copy_(self._staging, [source.local for source in self._sources])
        batch._start(_all_gather_single(self._gathered, self._send, self._group, batch.async_op))
        for receive, result in self._handouts:
            receive(result)
        batch._finishers.append(self._reduce)

    def _reduce(self) -> None:
        for result, per_rank, op in self._reductions:
            result.copy_(_reduce_rows(per_rank, op))


class _ReducePlan:
    """At most three all_reduce: float64 SUM, float64 MAX (MIN negated), int64 MAX (MIN inverted).

    Buffers and views are made once; running the plan converts each segment into its buffer,
    issues the collectives and hands out the results (views into a buffer where the state's
    dtype and op need no conversion back, else tensors the finisher fills).
    """

    def __init__(self, segments: list[_Segment], group: dist.ProcessGroup | None) -> None:
        device = segments[0].entries[0].accumulator.local.device
        layout: dict[str, list[tuple[_Segment, int]]] = {"sum": [], "max": [], "int_max": []}
        sizes = dict.fromkeys(layout, 0)
        for segment in segments:
            kind, width = _buffer_kind(segment)
            layout[kind].append((segment, sizes[kind]))
            sizes[kind] += width * segment.numel
        self._group = group
        self._buffers: list[tuple[Tensor, dist.ReduceOp.RedOpType]] = []
        self._stages: list[tuple[_Segment, Tensor]] = []
        self._handouts: list[_Handout] = []
        self._unpack: list[tuple[_Segment, Tensor, Tensor]] = []
        for kind, placed in layout.items():
            if not placed:
                continue
            wide = torch.int64 if kind == "int_max" else torch.float64
            buffer = torch.empty(sizes[kind], dtype=wide, device=device)
            for segment, start in placed:
                width = 2 if kind == "sum" and segment.integral else 1
                view = buffer[start : start + width * segment.numel]
                self._stages.append((segment, view))
                if segment.dtype == wide and segment.op is not ReduceOp.MIN:
                    result = view  # reduced in place: no unpacking
                else:
                    result = torch.empty(segment.numel, dtype=segment.dtype, device=device)
                    self._unpack.append((segment, view, result))
                self._handouts += [(entry.receive, part) for entry, part in segment.slices(result)]
            op = dist.ReduceOp.SUM if kind == "sum" else dist.ReduceOp.MAX
            self._buffers.append((buffer, op))

    def run(self, batch: SyncBatch) -> None:
        for segment, view in self._stages:
            _stage(segment, view)
        for buffer, op in self._buffers:
            batch._start(dist.all_reduce(buffer, op=op, group=self._group, async_op=batch.async_op))
        for receive, result in self._handouts:
            receive(result)
        if self._unpack:
            batch._finishers.append(self._unstage)

    def _unstage(self) -> None:
        for segment, view, result in self._unpack:
            _unstage(segment, view, result)


class _Scope:
    __slots__ = ("_name", "_token")

    def __init__(self, name: str) -> None:
        self._name = name

    def __enter__(self) -> None:
        self._token = _scope.set((*_scope.get(), self._name))

    def __exit__(self, *exc: object) -> None:
        _scope.reset(self._token)


_scope: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "sidestream_state_scope", default=()
)


def state_name(name: str) -> contextlib.AbstractContextManager[None]:
    """Name the accumulators reduced inside the ``with`` block (nested names join with ``.``).

    Only used to say which state differs when ranks disagree; ``Metric.sync`` names each
    accumulator by its dotted attribute path.
    """
    return _Scope(name)


@dataclass
class SyncBatch:
    """The accumulators collected by one ``coalesced_sync`` block, reduced together at its end."""

    async_op: bool = False
    check_only: bool = False
    works: list[dist.Work] = field(default_factory=list)
    _groups: dict[int, _GroupEntries] = field(default_factory=dict)
    _copies: list[_Entry] = field(default_factory=list)
    _resolved: dict[int, tuple[Any, dist.ProcessGroup | None, int]] = field(default_factory=dict)
    _finishers: list[Callable[[], None]] = field(default_factory=list)

    def add(
        self,
        accumulator: MetricAccumulator,
        group: Group,
        receive: Callable[[Tensor], None],
    ) -> None:
        """Schedule ``accumulator``'s reduction over ``group``; ``receive`` gets the result.

        The tensor handed to ``receive`` holds the reduced state once the batch is flushed (with
        ``async_op``, once ``wait`` returned; on CUDA, once the current stream passed ``wait``).
        """
        resolved = self._resolved.get(id(group))
        if resolved is None or resolved[0] is not group:
            process_group = resolve_group(group)
            resolved = self._resolved[id(group)] = (group, process_group, group_size(process_group))
        _, process_group, size = resolved
        if size == 1:
            # Nothing to reduce with: the local state is already the global one.
            self._copies.append(_Entry("", accumulator, receive))
            return
        slot = self._groups.get(id(process_group))
        if slot is None:
            slot = self._groups[id(process_group)] = _GroupEntries(process_group, size)
        scope = _scope.get()
        name = ".".join(scope) if scope else f"#{len(slot.entries)}"
        slot.entries.append(_Entry(name, accumulator, receive))

    def flush(self) -> None:
        """Issue the collectives of every group and hand each accumulator its result.

        Groups and states are processed in the order they were added: every rank adds its
        accumulators in the same order, so every rank issues the same sequence of collectives.
        Without ``async_op`` the results are ready on return.
        """
        self._prepare()._run(self)
        if not self.async_op:
            self._finish()

    def wait(self) -> None:
        """Wait for the collectives started by an ``async_op`` flush and finish the results.

        On CUDA this makes the current stream wait and queues the unpacking on it; the host does
        not block.
        """
        works, self.works = self.works, []
        for work in works:
            work.wait()
        self._finish()

    def _prepare(self, check: bool = True) -> SyncProgram:
        """Check each group's structure (once per structure) and lay out its collectives."""
        groups, self._groups = self._groups, {}
        copies, self._copies = self._copies, []
        plans: list[_GatherPlan | _ReducePlan] = []
        for slot in groups.values():
            if check:
                _check_structure(slot)
            by_device: dict[torch.device, list[_Entry]] = {}
            for entry in slot.entries:
                if entry.accumulator.local.numel() == 0:
                    copies.append(entry)
                else:
                    by_device.setdefault(entry.accumulator.local.device, []).append(entry)
            if self.check_only:
                continue
            for entries in by_device.values():
                segments = _segments(entries)
                packed = sum(_padded_bytes(s) for s in segments)
                if packed * slot.size <= GATHER_LIMIT_BYTES:
                    plans.append(_GatherPlan(segments, slot.group, slot.size))
                else:
                    plans.append(_ReducePlan(segments, slot.group))
        return SyncProgram([] if self.check_only else copies, plans)

    def _finish(self) -> None:
        finishers, self._finishers = self._finishers, []
        for finish in finishers:
            finish()

    def _start(self, work: dist.Work | None) -> None:
        if work is not None:
            self.works.append(work)


class SyncProgram:
    """A recorded sync that can be started again and again with the same prepared collectives.

    ``record`` runs a sync once without issuing its collectives and keeps what it would do:
    the packing layout, the buffers and every view into them. ``start`` then issues the same
    collectives as that sync, skipping the walk over the metric, the structure check and the
    packing: small states are staged with one batched copy and reduced with one all_gather.

    Each start reuses the same buffers, so the tensors it hands out are overwritten by the next
    start: read (or copy) a start's results before starting the program again. The recorded
    accumulators must keep their shapes, dtypes and devices.

    Example:
        >>> program = SyncProgram.record(lambda: metric.sync())
        >>> program.start().wait()  # like metric.sync(), for the state of this moment
    """

    def __init__(self, copies: list[_Entry], plans: list[_GatherPlan | _ReducePlan]) -> None:
        self._copies = copies
        self._plans = plans

    @classmethod
    def record(cls, sync: Callable[[], None], *, check: bool = True) -> SyncProgram:
        """Record the accumulator reductions ``sync`` asks for (for example ``metric.sync``).

        Issues no reduction. Like the first sync of a structure, recording a structure not yet
        verified on this group runs the blocking rank check (every rank must record then).

        Args:
            sync: Calls the syncs to record.
            check: ``False`` skips the rank check, for code that records on one rank alone a
                copy of a structure it already checked (the collector's extra slots).

        Raises:
            RankMismatchError: If ranks of a group hold different metric state.
        """
        batch = SyncBatch()
        token = _current.set(batch)
        try:
            sync()
        finally:
            _current.reset(token)
        return batch._prepare(check)

    def start(self, async_op: bool = False) -> SyncBatch:
        """Stage the current state and issue the collectives; returns the batch to ``wait`` on.

        Without ``async_op`` the results are ready on return (``wait`` then does nothing).
        """
        batch = SyncBatch(async_op=async_op)
        self._run(batch)
        if not async_op:
            batch._finish()
        return batch

    def _run(self, batch: SyncBatch) -> None:
        for entry in self._copies:
            entry.receive(entry.accumulator.local.clone())
        for plan in self._plans:
            plan.run(batch)


def _padded_bytes(segment: _Segment) -> int:
    nbytes = segment.numel * segment.dtype.itemsize
    return -(-nbytes // _ALIGN) * _ALIGN


def _buffer_kind(segment: _Segment) -> tuple[str, int]:
    """Which all_reduce buffer a segment rides in, and how many slots per element it takes."""
    if segment.op is ReduceOp.SUM:
        return "sum", 2 if segment.integral else 1  # integers as two exact 32-bit halves
    return ("int_max" if segment.integral else "max"), 1


def _stage(segment: _Segment, view: Tensor) -> None:
    local = segment.flat_local()
    n = segment.numel
    if segment.integral:
        wide = local.to(torch.int64)
        if segment.op is ReduceOp.SUM:
            view[:n].copy_(wide >> 32)
            view[n:].copy_(wide & _LOW_BITS)
        elif segment.op is ReduceOp.MIN:
            torch.bitwise_not(wide, out=view)  # MIN as MAX, overflow-free
        else:
            view.copy_(wide)
    elif segment.op is ReduceOp.MIN:
        torch.neg(local.to(view.dtype), out=view)
    else:
        view.copy_(local)


def _unstage(segment: _Segment, view: Tensor, result: Tensor) -> None:
    n = segment.numel
    if segment.integral and segment.op is ReduceOp.SUM:
        result.copy_((view[:n].to(torch.int64) << 32) + view[n:].to(torch.int64))
    elif segment.integral and segment.op is ReduceOp.MIN:
        result.copy_(torch.bitwise_not(view))
    elif segment.op is ReduceOp.MIN:
        result.copy_(view.neg())
    else:
        result.copy_(view)


def _reduce_rows(per_rank: Tensor, op: ReduceOp) -> Tensor:
    """Reduce the gathered ``(ranks, elements)`` rows of one state in an exact dtype."""
    if per_rank.dtype == torch.bool:
        if op is ReduceOp.MIN:
            return per_rank.all(dim=0)
        return per_rank.any(dim=0)  # a sum of flags is nonzero exactly when any flag is set
    if op is ReduceOp.SUM:
        wide = torch.float64 if per_rank.is_floating_point() else torch.int64
        return per_rank.sum(dim=0, dtype=wide)
    return per_rank.amax(dim=0) if op is ReduceOp.MAX else per_rank.amin(dim=0)


def _all_gather_single(
    output: Tensor, staged: Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> dist.Work | None:
    gather: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work: dist.Work | None = gather(output, staged, group=group, async_op=async_op)
    return work


_verified: set[tuple[int, int, tuple[tuple[str, tuple[int, ...], str, str], ...]]] = set()


def _describe(slot: _GroupEntries) -> tuple[tuple[str, tuple[int, ...], str, str], ...]:
    return tuple(
        (
            entry.name,
            tuple(entry.accumulator.local.shape),
            str(entry.accumulator.local.dtype).removeprefix("torch."),
            entry.accumulator.op.name,
        )
        for entry in slot.entries
    )


def _check_structure(slot: _GroupEntries) -> None:
    """Check once per structure that every rank of the group syncs the same states.

    A fixed-size fingerprint (its hash and the bitwise complement, reduced with MAX) tells
    every rank whether all hashes are equal; only on a mismatch are the descriptions exchanged,
    so the error can name the difference on every rank.
    """
    structure = _describe(slot)
    key = (id(slot.group), slot.size, structure)
    if key in _verified:
        return
    digest = hashlib.blake2b(repr(structure).encode(), digest_size=8).digest()
    fingerprint = int.from_bytes(digest, "little", signed=True)
    device = slot.entries[0].accumulator.local.device
    check = torch.tensor([fingerprint, ~fingerprint], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=slot.group)
    largest, smallest_inverted = check.tolist()  # one host sync per new structure
    if largest == ~smallest_inverted:
        if len(_verified) >= _MAX_CACHED_STRUCTURES:
            _verified.clear()
        _verified.add(key)
        return
    everyone: list[Any] = [None] * slot.size
    dist.all_gather_object(everyone, structure, group=slot.group)
    raise RankMismatchError(_mismatch_message(everyone, group_rank(slot.group)))


def _mismatch_message(structures: list[Any], own_rank: int) -> str:
    reference = structures[0]
    by_name_reference = {item[0]: item for item in reference}
    problems = []
    for rank, structure in enumerate(structures[1:], start=1):
        by_name = {item[0]: item for item in structure}
        for name in by_name_reference.keys() - by_name.keys():
            problems.append(f"state {name!r} exists on rank 0 but not on rank {rank}")
        for name in by_name.keys() - by_name_reference.keys():
            problems.append(f"state {name!r} exists on rank {rank} but not on rank 0")
        for name in by_name_reference.keys() & by_name.keys():
            for label, index in (("shape", 1), ("dtype", 2), ("op", 3)):
                ours, theirs = by_name_reference[name][index], by_name[name][index]
                if ours != theirs:
                    problems.append(
                        f"state {name!r} has {label} {theirs} on rank {rank} but {ours} on rank 0"
                    )
        if not problems and structure != reference:
            problems.append(f"rank {rank} syncs the same states in a different order than rank 0")
    return (
        f"sync: ranks of the group hold different metric state (seen from rank {own_rank}); "
        "every rank must sync the same metrics with the same shapes, dtypes and ops: "
        + "; ".join(sorted(set(problems)))
    )


_current: contextvars.ContextVar[SyncBatch | None] = contextvars.ContextVar(
    "sidestream_sync_batch", default=None
)


@contextlib.contextmanager
def coalesced_sync(async_op: bool = False, *, check_only: bool = False) -> Iterator[SyncBatch]:
    """Batch every accumulator reduction inside the block into as few collectives as possible.

    Nested blocks join the outermost one. On normal exit the batch is flushed; on an exception it
    is dropped, so no rank issues collectives the others may never match.

    Args:
        async_op: Start the collectives without waiting; call ``batch.wait()`` after the block
            before reading the results (the collector does this off the training thread).
        check_only: Reduce nothing; only check, once per state structure, that every rank of
            each group syncs the same states (a blocking collective, see the module docstring).
            A later real sync of the same structure then skips the check, so it can run
            without any host sync (for example at ``bind`` time, before the training loop).
    """
    outer = _current.get()
    if outer is not None:
        yield outer
        return
    batch = SyncBatch(async_op=async_op, check_only=check_only)
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
    running = _current.get()
    if running is not None:
        running.add(accumulator, group, receive)
        return
    with coalesced_sync() as batch:
        batch.add(accumulator, group, receive)
