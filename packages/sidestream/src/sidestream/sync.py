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
nothing; structures must therefore change on every rank together.
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


_scope: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "sidestream_state_scope", default=()
)


@contextlib.contextmanager
def state_name(name: str) -> Iterator[None]:
    """Name the accumulators reduced inside the block (nested names join with ``.``).

    Only used to say which state differs when ranks disagree; ``Metric.sync`` names each
    accumulator by its dotted attribute path.
    """
    token = _scope.set((*_scope.get(), name))
    try:
        yield
    finally:
        _scope.reset(token)


@dataclass
class SyncBatch:
    """The accumulators collected by one ``coalesced_sync`` block, reduced together at its end."""

    async_op: bool = False
    works: list[dist.Work] = field(default_factory=list)
    _groups: dict[int, _GroupEntries] = field(default_factory=dict)
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
        process_group = resolve_group(group)
        size = group_size(process_group)
        if size == 1:
            # Nothing to reduce with: the local state is already the global one.
            receive(accumulator.local.clone())
            return
        scope = _scope.get()
        slot = self._groups.setdefault(id(process_group), _GroupEntries(process_group, size))
        name = ".".join(scope) if scope else f"#{len(slot.entries)}"
        slot.entries.append(_Entry(name, accumulator, receive))

    def flush(self) -> None:
        """Issue the collectives of every group and hand each accumulator its result.

        Groups and states are processed in the order they were added: every rank adds its
        accumulators in the same order, so every rank issues the same sequence of collectives.
        Without ``async_op`` the results are ready on return.
        """
        groups, self._groups = self._groups, {}
        for slot in groups.values():
            _check_structure(slot)
            by_device: dict[torch.device, list[_Entry]] = {}
            for entry in slot.entries:
                by_device.setdefault(entry.accumulator.local.device, []).append(entry)
            for entries in by_device.values():
                live = [e for e in entries if e.accumulator.local.numel() > 0]
                for entry in entries:
                    if entry.accumulator.local.numel() == 0:
                        entry.receive(entry.accumulator.local.clone())
                if live:
                    self._reduce(live, slot.group, slot.size)
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

    def _finish(self) -> None:
        finishers, self._finishers = self._finishers, []
        for finish in finishers:
            finish()

    def _start(self, work: dist.Work | None) -> None:
        if work is not None:
            self.works.append(work)

    def _reduce(self, entries: list[_Entry], group: dist.ProcessGroup | None, size: int) -> None:
        packed = sum(_padded_bytes(e.accumulator.local) for e in entries)
        if packed * size <= GATHER_LIMIT_BYTES:
            self._gather(entries, group, size, packed)
        else:
            self._all_reduce(entries, group)

    def _gather(
        self, entries: list[_Entry], group: dist.ProcessGroup | None, size: int, packed: int
    ) -> None:
        device = entries[0].accumulator.local.device
        staged = torch.zeros(packed, dtype=torch.uint8, device=device)
        offsets = []
        offset = 0
        for entry in entries:
            local = entry.accumulator.local
            flat_bytes = local.reshape(-1).view(torch.uint8)
            staged[offset : offset + flat_bytes.numel()].copy_(flat_bytes)
            offsets.append(offset)
            offset += _padded_bytes(local)
        gathered = torch.empty(size * packed, dtype=torch.uint8, device=device)
        self._start(_all_gather_single(gathered, staged, group, self.async_op))
        rows = gathered.view(size, packed)
        outputs = [torch.empty_like(e.accumulator.local) for e in entries]

        def finish() -> None:
            for entry, start, out in zip(entries, offsets, outputs, strict=True):
                local = entry.accumulator.local
                nbytes = local.numel() * local.element_size()
                per_rank = rows[:, start : start + nbytes].view(local.dtype)
                out.copy_(_reduce_rows(per_rank, entry.accumulator.op).view(local.shape))

        self._finishers.append(finish)
        for entry, out in zip(entries, outputs, strict=True):
            entry.receive(out)

    def _all_reduce(self, entries: list[_Entry], group: dist.ProcessGroup | None) -> None:
        device = entries[0].accumulator.local.device
        plans: dict[str, list[tuple[_Entry, int]]] = {"sum": [], "max": [], "int_max": []}
        sizes = {"sum": 0, "max": 0, "int_max": 0}
        for entry in entries:
            kind, width = _buffer_kind(entry.accumulator)
            plans[kind].append((entry, sizes[kind]))
            sizes[kind] += width * entry.accumulator.local.numel()
        buffers = {
            kind: torch.empty(
                sizes[kind],
                dtype=torch.int64 if kind == "int_max" else torch.float64,
                device=device,
            )
            for kind in plans
            if sizes[kind]
        }
        for kind, buffer in buffers.items():
            for entry, start in plans[kind]:
                _stage(entry.accumulator, buffer, start)
            op = dist.ReduceOp.SUM if kind == "sum" else dist.ReduceOp.MAX
            self._start(dist.all_reduce(buffer, op=op, group=group, async_op=self.async_op))
        outputs: list[tuple[_Entry, Tensor, Tensor, int]] = []
        for kind, buffer in buffers.items():
            for entry, start in plans[kind]:
                outputs.append((entry, torch.empty_like(entry.accumulator.local), buffer, start))

        def finish() -> None:
            for entry, out, buffer, start in outputs:
                _unstage(entry.accumulator, buffer, start, out)

        self._finishers.append(finish)
        for entry, out, _, _ in outputs:
            entry.receive(out)


def _padded_bytes(tensor: Tensor) -> int:
    nbytes = tensor.numel() * tensor.element_size()
    return -(-nbytes // _ALIGN) * _ALIGN


def _is_integral(tensor: Tensor) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex())


def _buffer_kind(accumulator: MetricAccumulator) -> tuple[str, int]:
    """Which all_reduce buffer a state rides in, and how many slots per element it takes."""
    integral = _is_integral(accumulator.local)
    if accumulator.op is ReduceOp.SUM:
        return "sum", 2 if integral else 1  # integers as two exact 32-bit halves
    return ("int_max" if integral else "max"), 1


def _stage(accumulator: MetricAccumulator, buffer: Tensor, start: int) -> None:
    local = accumulator.local.reshape(-1)
    n = local.numel()
    if _is_integral(local):
        wide = local.to(torch.int64)
        if accumulator.op is ReduceOp.SUM:
            buffer[start : start + n].copy_(wide >> 32)
            buffer[start + n : start + 2 * n].copy_(wide & _LOW_BITS)
        elif accumulator.op is ReduceOp.MIN:
            torch.bitwise_not(wide, out=buffer[start : start + n])  # MIN as MAX, overflow-free
        else:
            buffer[start : start + n].copy_(wide)
    elif accumulator.op is ReduceOp.MIN:
        torch.neg(local.to(torch.float64), out=buffer[start : start + n])
    else:
        buffer[start : start + n].copy_(local)


def _unstage(accumulator: MetricAccumulator, buffer: Tensor, start: int, out: Tensor) -> None:
    n = out.numel()
    flat = out.view(-1)
    if _is_integral(out):
        if accumulator.op is ReduceOp.SUM:
            high = buffer[start : start + n].to(torch.int64)
            low = buffer[start + n : start + 2 * n].to(torch.int64)
            flat.copy_((high << 32) + low)
        elif accumulator.op is ReduceOp.MIN:
            flat.copy_(torch.bitwise_not(buffer[start : start + n]))
        else:
            flat.copy_(buffer[start : start + n])
    elif accumulator.op is ReduceOp.MIN:
        flat.copy_(buffer[start : start + n].neg())
    else:
        flat.copy_(buffer[start : start + n])


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
