"""Coalesced cross-rank reduction of metric state: the lower layer, below ``sidestream.state``.

This module works on anything with a ``local`` tensor and an ``op`` (a ``ReduceOp``): the states
of a metric, or whole flat buffers of them (the state arena of ``sidestream.metric``). It knows
nothing about metrics.

A ``SyncBatch`` collects entries, each with the tensor its result goes to, and ``start`` issues
the collectives of every group at once; the returned ``SyncHandle`` is the sync in flight. Per
group and device a sync issues:

- **one** ``all_gather`` of a single byte buffer holding every state when the gathered size
  (packed bytes x group size) is at most ``GATHER_LIMIT_BYTES``; each rank then reduces the
  gathered rows itself, in each state's own dtype (exact for integers);
- otherwise **at most three** ``all_reduce``: one float64 SUM buffer (floats widened exactly;
  integer and bool counts split into two 32-bit halves, so sums stay exact in float64), one
  float64 MAX buffer (MIN states ride in it negated, with a NaN flag per element so NaN
  propagates exactly as on the gather path) and, only when there are integer MAX/MIN states, one
  int64 MAX buffer (MIN states bit-inverted).

Every payload carries a **call fingerprint** (which call, its step or sequence number, and a
hash of the state structure) at no extra collective. When ranks pair different calls (one rank
skipped a window, or checkpointed alone) the fingerprints differ, and ``SyncHandle.wait`` (off
CUDA) or ``SyncHandle.verify`` raises ``RankMismatchError`` on every rank instead of returning
numbers mixed from different calls.

Laying a sync out (``SyncBatch.program``, once per metric and group) also exchanges a
fixed-size structure check first (one extra, blocking all_gather of each rank's structure hash),
so ranks holding different states fail with a message naming the difference instead of hanging
in collectives of different sizes. A program is started again and again without it, so later
syncs pay nothing. The check is never skipped from a cache of structures verified before: a rank
that skipped it while another ran it would pair the check with a data collective. The check is
9 bytes a rank, a size no data payload has, so such a pairing fails on the size in gloo at once
instead of hanging.

``SyncProgram`` is a batch laid out once (buffers and views included) that can be started again
and again with a handful of tensor calls; metrics and the collector keep one per group.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from sidestream._distributed import (
    Group,
    all_gather_async,
    all_reduce_async,
    group_rank,
    group_ranks,
    group_size,
    resolve_group,
    retain_work,
)
from sidestream._host_events import host_event
from sidestream._reduce_op import ReduceOp

__all__ = [
    "GATHER_LIMIT_BYTES",
    "FINGERPRINT_BYTES",
    "CallFingerprint",
    "RankMismatchError",
    "Reducible",
    "SyncBatch",
    "SyncHandle",
    "StatePart",
    "SyncProgram",
    "check_calls",
    "check_same_call",
    "check_same_setting",
    "resolve_group",
    "settings_part",
    "stable_hash",
]

GATHER_LIMIT_BYTES = 1 << 20
"""Largest gathered size (packed bytes x group size) synced with one all_gather."""

_ALIGN = 8  # every staged state starts at a multiple of the widest element size
_LOW_BITS = 0xFFFFFFFF
# Appended only: a kind travels as its index here.
_KINDS = (
    "sync",
    "state_dict",
    "window",
    "changed",
    "record",
    "sync at step",
    "sync after a load",
    "state_dict after a load",
)
_AT_STEP = "sync at step"
_AFTER_LOAD = ("sync after a load", "state_dict after a load")
"""The first sync or state_dict after a load: its stream carries the checkpoint's digest, so
ranks that loaded different checkpoints (the first rank's numbers alone are kept) raise."""
_CHUNK_BITS = 16  # all_reduce fingerprints travel as 16-bit chunks: exact in float64 sums
_FINGERPRINT_WORDS = 4  # kind, sequence, structure, stream (int64 each, on the gather path)
_FINGERPRINT_CHUNKS = 1 + 3 * (64 // _CHUNK_BITS)
FINGERPRINT_BYTES = 8 * _FINGERPRINT_WORDS
"""Bytes a call fingerprint adds to each rank's payload on the gather path."""
_KIND_BASE = 0x5E00
"""Added to a kind's index in its word: bytes of another collective (often zeros) then read as
no kind at all, not as a "sync" with a meaningless number. Below 2**16: one all_reduce chunk."""
_KIND_INDEX = {kind: _KIND_BASE + index for index, kind in enumerate(_KINDS)}
_KNOWN_WORDS = frozenset(_KIND_INDEX.values())
_WORD_MASK = (1 << 64) - 1


_SAME_ORDER = (
    "Every rank must call sync, state_dict, load_state_dict and schedule_collection (of every "
    "collector) in the same order, with the same metric structure"
)


class RankMismatchError(RuntimeError):
    """Ranks of one group paired different calls, or hold different metric state."""


class Reducible(Protocol):
    """What ``SyncBatch`` reduces: a local tensor and how to combine it across ranks."""

    @property
    def local(self) -> Tensor:
        """This rank's value."""

    @property
    def op(self) -> ReduceOp:
        """How ranks combine."""


@dataclass(frozen=True)
class CallFingerprint:
    """Which call a sync belongs to; every rank of a group must send the same one.

    Attributes:
        kind: ``"sync"``, ``"state_dict"``, ``"window"``, ``"changed"`` (sent by a rank whose
            metric structure changed since its last sync), ``"record"`` or ``"sync at step"``
            (``Metric.sync(step=...)``: a kind of its own, so it never pairs with a counted
            sync whose number happens to equal the step); ``"sync after a load"`` and
            ``"state_dict after a load"``: the first after a ``load_state_dict``, whose stream
            holds the checkpoint's digest.
        sequence: The window's or sync's step, or the how-many-th call of this kind on the
            metric.
        stream: Which of several same-shaped callers this is: a collector's prefix (its stream
            in a run), so that two collectors' windows at one step are not taken for each
            other; ``""`` for a metric's own calls, except ``"sync at step"``'s: the count of
            the metric's earlier calls (``"after 2 call(s)"``), a skipped load told apart.
    """

    kind: str
    sequence: int
    stream: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind: expected one of {_KINDS}, got {self.kind!r}")

    def words(self, structure: int) -> list[int]:
        """The fingerprint with ``structure`` as four signed int64 words."""
        sequence = self.sequence & _WORD_MASK  # _signed, inlined: this runs every window
        if sequence >= 1 << 63:
            sequence -= 1 << 64
        return [_KIND_INDEX[self.kind], sequence, structure, _stream_word(self.stream)]

    def described(self, structure: int) -> str:
        """This fingerprint in words, naming its stream."""
        text = _describe_call(self.words(structure))
        if not self.stream:
            return text
        if self.kind == _AT_STEP or self.kind in _AFTER_LOAD:
            return f"{text}, {self.stream}"
        return f"{text} of the collector with prefix {self.stream!r}"


@functools.lru_cache(maxsize=256)
def _stream_word(stream: str) -> int:
    """A stream name as a signed int64, the same in every process (0 for none)."""
    return stable_hash(stream) if stream else 0


_ANY_CALL = CallFingerprint("sync", 0)


def check_calls(rows: list[list[int]], rank: int, also: str = "") -> None:
    """Raise ``RankMismatchError`` unless every rank's fingerprint words in ``rows`` are equal.

    Args:
        rows: Each rank's ``CallFingerprint.words``, in rank order (as gathered).
        rank: This process's rank in the group (named in the message).
        also: What else a difference may mean here, for the message.
    """
    if rows.count(rows[0]) == len(rows):  # every rank's row equals rank 0's
        return
    seen = "; ".join(f"rank {r}: {_describe_call(row)}" for r, row in enumerate(rows))
    hint = ""
    if all(row[:3] == rows[0][:3] for row in rows) and rows[0][0] == _KIND_INDEX[_AT_STEP]:
        hint = (
            " Only the count of the metric's earlier collective calls differs (syncs, "
            "state_dicts, and a load_state_dict counts one), or the checkpoint a rank loaded "
            "since the last sync: did a rank skip one, or the checkpoint's load, or load "
            "another checkpoint?"
        )
    elif all(row[:3] == rows[0][:3] for row in rows) and rows[0][0] in {
        _KIND_INDEX[kind] for kind in _AFTER_LOAD
    }:
        hint = (
            " Only the checkpoint hash differs: the ranks loaded different checkpoints (each "
            "load_state_dict hashes what it was given; the group's first rank alone keeps the "
            "saved numbers): load the same checkpoint on every rank."
        )
    elif all(row[:3] == rows[0][:3] for row in rows):
        # Only the stream word differs: same call, step and structure.
        hint = (
            " Only the collector hash differs: it covers the collector's prefix, whether it "
            "is cumulative, how many other bound collectors share its prefix (were they "
            "scheduled in another order?), and how many collective calls its metric made "
            "before bind (a load_state_dict counts one: did a rank skip it?)."
        )
    elif all(row[:2] == rows[0][:2] for row in rows):
        hint = (
            " The same call with another structure: the ranks synced different metrics here "
            "(or different children of one tree)."
        )
    elif any(row[0] == _KIND_INDEX["changed"] for row in rows):
        changed = [r for r, row in enumerate(rows) if row[0] == _KIND_INDEX["changed"]]
        hint = (
            f" The metric of rank(s) {changed} changed its states since its last sync "
            "(add_state, a child added, to() another device) and the others' did not: "
            "change the metric the same way on every rank, at the same point of the loop."
        )
    elif all(row[0] == rows[0][0] for row in rows) and rows[0][0] in _KNOWN_WORDS:
        hint = (
            " The same kind of call at other points: a rank skipped one (or ran one more), or "
            "the ranks passed different steps."
        )
    else:
        # What another rank sent is read as a fingerprint whatever it was: a user's own
        # collective, or one of another size that gloo cut short, reads as a call never made.
        hint = (
            " A call your loop never makes (an unknown kind, a number no loop reached) means "
            "that rank ran another collective at this point (its own error, such as gloo's "
            "'Received data size doesn't match', or its stack, names it)."
        )
    raise RankMismatchError(
        f"sync: ranks of the group paired different calls{also} (seen from rank {rank}): "
        f"{seen}.{hint} {_SAME_ORDER}"
    )


def check_same_call(group: Group, fingerprint: CallFingerprint, device: torch.device) -> SyncHandle:
    """Check that every rank of ``group`` sent ``fingerprint``: one small ``all_gather``.

    For a sync that carries none of the caller's fingerprint (a metric's own ``sync`` under a
    collector's window): ranks at different windows then fail before that sync reduces one
    window's data with another's. Off CUDA the check is done on return; on CUDA it is queued
    like a sync's (``SyncHandle.verify``), so the host does not wait for the device. A group
    of one sends nothing.

    Args:
        group: The group the sync runs over.
        fingerprint: The caller's call; its structure word is 0 (no layout is sent).
        device: Where the metric's state lives (a CUDA device under NCCL).

    Returns:
        The handle, waited on; on CUDA its check may still be pending (``deferred``).

    Raises:
        RankMismatchError: Off CUDA, if ranks sent different fingerprints.
    """
    handle = SyncHandle(async_op=False)
    resolved = resolve_group(group)
    size = group_size(resolved)
    if size <= 1:
        return handle
    device = _collective_device(resolved, device)
    words = torch.empty(_FINGERPRINT_WORDS, dtype=torch.int64, device=device)
    _FingerprintWriter(words).write(fingerprint.words(0))  # no host-to-device copy
    gathered = torch.empty(size * _FINGERPRINT_WORDS, dtype=torch.int64, device=device)
    handle._cuda = device.type == "cuda"
    handle._start(all_gather_async(gathered, words, resolved))
    handle._checks.append(_GatherCheck(gathered.view(size, -1), group_rank(resolved)))
    handle.wait()
    return handle


def _describe_call(words: list[int]) -> str:
    kind, sequence, structure, stream = words
    if not 0 <= kind - _KIND_BASE < len(_KINDS):
        return f"no call of sidestream's (unknown kind {kind})"
    name = _KINDS[kind - _KIND_BASE]
    number = f"{name} {sequence}" if name == "sync at step" else f"{name} #{sequence}"
    # 0: no layout was sent (check_same_call), only the call.
    details = [f"structure {structure & _WORD_MASK:016x}"] if structure else []
    if stream and name == _AT_STEP:  # a hash of the count of earlier calls
        details.append(f"earlier-calls hash {stream & _WORD_MASK:016x}")
    elif stream and name in _AFTER_LOAD:  # with a collector's prefix, if any
        details.append(f"checkpoint hash {stream & _WORD_MASK:016x}")
    elif stream:  # a hash of the collector's prefix: other ranks' names are not known
        details.append(f"collector hash {stream & _WORD_MASK:016x}")
    return f"{number} ({', '.join(details)})" if details else number


StatePart = tuple[str, tuple[int, ...], str]
"""One state inside a synced buffer: its name, its shape, and the configuration its values mean
something only with, in words (a constant's value such as histogram bins, a classification
problem), ``""`` for none. Every rank must hold the same."""

_SETTINGS = "/settings"  # ends a settings part's name; no state name has a "/"


def settings_part(prefix: str, text: str) -> StatePart:
    """A part of no state that the structure check compares: a metric's ``text`` settings.

    Args:
        prefix: The metric's dotted prefix in its tree (``""`` for the root).
        text: What must be equal on every rank (its class, what its ``compute`` reads).
    """
    return (prefix + _SETTINGS, (), text)


@dataclass
class _Entry:
    name: str
    state: Reducible
    out: Tensor
    parts: tuple[StatePart, ...]

    def described(self) -> list[tuple[str, tuple[int, ...], str, str, str]]:
        local = self.state.local
        dtype = str(local.dtype).removeprefix("torch.")
        parts = self.parts or ((self.name, tuple(local.shape), ""),)
        return [(name, shape, dtype, self.state.op.name, value) for name, shape, value in parts]


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

    def locals(self) -> list[Tensor]:
        return [entry.state.local for entry in self.entries]

    def result_tensor(self, device: torch.device) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """A flat result for the segment and the (out, slice) copies that hand it out.

        A segment of one contiguous entry (a whole arena buffer) reduces straight into its out.
        """
        if len(self.entries) == 1:
            out = self.entries[0].out
            if out.dtype == self.dtype and out.is_contiguous():
                return out.view(-1), []
        result = torch.empty(self.numel, dtype=self.dtype, device=device)
        parts = zip(self.entries, self.slices(result), strict=True)
        return result, [(e.out, part) for e, part in parts]

    def slices(self, flat: Tensor) -> list[Tensor]:
        """Each entry's slice of ``flat`` (one element per element of the segment), shaped."""
        out = []
        offset = 0
        for entry in self.entries:
            local = entry.state.local
            out.append(flat[offset : offset + local.numel()].view(local.shape))
            offset += local.numel()
        return out


def _segments(entries: list[_Entry]) -> list[_Segment]:
    """Group states by (dtype, op) in first-appearance order: the same on every rank."""
    classes: dict[tuple[torch.dtype, ReduceOp], _Segment] = {}
    for entry in entries:
        local = entry.state.local
        key = (local.dtype, entry.state.op)
        segment = classes.get(key)
        if segment is None:
            segment = classes[key] = _Segment(local.dtype, entry.state.op, [], 0)
        segment.entries.append(entry)
        segment.numel += local.numel()
    return list(classes.values())


class _Plan(Protocol):
    def run(self, handle: SyncHandle, fingerprint: CallFingerprint) -> None: ...


class _GatherPlan:
    """One all_gather of every state packed into a byte buffer, fingerprint last.

    The buffers and every view into them are made once: running the plan stages with one
    batched copy, writes the fingerprint, issues the collective and leaves to the finisher one
    reduction per segment, straight into the entries' out tensors where their layout allows.
    """

    def __init__(
        self,
        segments: list[_Segment],
        group: dist.ProcessGroup | None,
        size: int,
        structure: int,
    ) -> None:
        device = segments[0].entries[0].state.local.device
        data = sum(_padded_bytes(segment) for segment in segments)
        packed = data + 8 * _FINGERPRINT_WORDS
        self._group = group
        self._rank = group_rank(group)
        self._structure = structure
        self._send = torch.zeros(packed, dtype=torch.uint8, device=device)  # padding stays 0
        self._gathered = torch.empty(size * packed, dtype=torch.uint8, device=device)
        rows = self._gathered.view(size, packed)
        self._fingerprint = _FingerprintWriter(self._send[data:].view(torch.int64))
        self._gathered_fingerprints = rows[:, data:].view(torch.int64)
        # One check object for every start; each start's ``queue`` returns a check holding its
        # own host copy, so on CUDA a start may begin before the previous one is verified.
        self._check = _GatherCheck(self._gathered_fingerprints, self._rank)
        self._sources: list[Tensor] = []
        self._staging: list[Tensor] = []
        self._reductions: list[Callable[[], object]] = []
        self._handouts: list[tuple[Tensor, Tensor]] = []
        start = 0
        for segment in segments:
            nbytes = segment.numel * segment.dtype.itemsize
            send = self._send[start : start + nbytes].view(segment.dtype)
            self._sources += segment.locals()
            self._staging += segment.slices(send)
            result, handouts = segment.result_tensor(device)
            self._handouts += handouts
            per_rank = rows[:, start : start + nbytes].view(segment.dtype)
            self._reductions.append(_row_reducer(per_rank, segment.op, result))
            start += _padded_bytes(segment)

    def run(self, handle: SyncHandle, fingerprint: CallFingerprint) -> None:
        torch._foreach_copy_(self._staging, self._sources)
        self._fingerprint.write(fingerprint.words(self._structure))
        handle._start(all_gather_async(self._gathered, self._send, self._group))
        handle._finishers.append(self._reduce)
        handle._checks.append(self._check)

    def _reduce(self) -> None:
        for reduce in self._reductions:
            reduce()
        if self._handouts:
            torch._foreach_copy_([out for out, _ in self._handouts], [r for _, r in self._handouts])


class _ReducePlan:
    """At most three all_reduce: float64 SUM, float64 MAX (MIN negated), int64 MAX (MIN inverted).

    Float MAX/MIN states carry one NaN flag per element in the MAX buffer, because the backends'
    MAX keeps the non-NaN operand while ``amax`` (the gather path) propagates NaN. The
    fingerprint rides as 16-bit chunks in the first buffer: with their squares in a SUM buffer
    (all equal exactly when n * sum(c^2) == sum(c)^2), negated in a MAX buffer.
    """

    def __init__(
        self,
        segments: list[_Segment],
        group: dist.ProcessGroup | None,
        size: int,
        structure: int,
    ) -> None:
        device = segments[0].entries[0].state.local.device
        layout: dict[str, list[tuple[_Segment, int]]] = {"sum": [], "max": [], "int_max": []}
        sizes = dict.fromkeys(layout, 0)
        for segment in segments:
            kind, width = _buffer_kind(segment)
            layout[kind].append((segment, sizes[kind]))
            sizes[kind] += width * segment.numel
        carrier = next(kind for kind in layout if layout[kind])
        fingerprint_at = sizes[carrier]
        sizes[carrier] += 2 * _FINGERPRINT_CHUNKS
        self._group = group
        self._size = size
        self._structure = structure
        self._buffers: list[tuple[Tensor, dist.ReduceOp.RedOpType]] = []
        self._stages: list[tuple[_Segment, Tensor]] = []
        self._unpack: list[tuple[_Segment, Tensor, Tensor]] = []
        self._handouts: list[tuple[Tensor, Tensor]] = []
        for kind, placed in layout.items():
            if not placed:
                continue
            wide = torch.int64 if kind == "int_max" else torch.float64
            buffer = torch.empty(sizes[kind], dtype=wide, device=device)
            if kind == carrier:
                self._carrier = carrier
                self._fingerprint = buffer[fingerprint_at:]
                self._writer = _FingerprintWriter(
                    torch.empty_like(self._fingerprint), self._fingerprint
                )
            for segment, start in placed:
                width = _buffer_kind(segment)[1]
                view = buffer[start : start + width * segment.numel]
                self._stages.append((segment, view))
                result, handouts = segment.result_tensor(device)
                self._unpack.append((segment, view, result))
                self._handouts += handouts
            op = dist.ReduceOp.SUM if kind == "sum" else dist.ReduceOp.MAX
            self._buffers.append((buffer, op))

    def run(self, handle: SyncHandle, fingerprint: CallFingerprint) -> None:
        for segment, view in self._stages:
            _stage(segment, view)
        chunks = _chunks(fingerprint.words(self._structure))
        second = [c * c for c in chunks] if self._carrier == "sum" else [-c for c in chunks]
        self._writer.write(chunks + second)
        for buffer, op in self._buffers:
            handle._start(
                # Always async, so the handle (and retain_work) holds the work; a blocking
                # start waits for it at once.
                all_reduce_async(buffer, op, self._group)
            )
        handle._finishers.append(self._unstage)
        handle._checks.append(
            _ReduceCheck(self._fingerprint, self._carrier, self._size, fingerprint, self._structure)
        )

    def _unstage(self) -> None:
        for segment, view, result in self._unpack:
            _unstage(segment, view, result)
        if self._handouts:
            torch._foreach_copy_([out for out, _ in self._handouts], [r for _, r in self._handouts])


class _CopyPlan:
    """A group of one rank: the local state is already the global one."""

    def __init__(self, entries: list[_Entry]) -> None:
        self._outs: list[Tensor] = []
        self._sources: list[Tensor] = []
        for entry in entries:
            out, source = entry.out, entry.state.local
            if (
                self._outs
                and _plain_copy(out, source)
                and _plain_copy(self._outs[-1], self._sources[-1])
                and _follows(self._outs[-1], out)
                and _follows(self._sources[-1], source)
            ):
                # Back to back in memory on both sides (a state arena's segments): one copy
                # of their bytes, where each copy is a runtime call on CUDA.
                self._outs[-1] = _bytes_spanning(self._outs[-1], out)
                self._sources[-1] = _bytes_spanning(self._sources[-1], source)
            else:
                self._outs.append(out)
                self._sources.append(source)

    def run(self, handle: SyncHandle, fingerprint: CallFingerprint) -> None:
        if self._outs:
            torch._foreach_copy_(self._outs, self._sources)


def _byte_range(tensor: Tensor) -> tuple[int, int]:
    start = int(tensor.storage_offset()) * tensor.element_size()
    return start, start + tensor.numel() * tensor.element_size()


def _plain_copy(out: Tensor, source: Tensor) -> bool:
    """Whether copying ``source`` into ``out`` moves bytes as they are (no cast, no broadcast)."""
    return out.dtype == source.dtype and out.numel() == source.numel()


def _follows(first: Tensor, second: Tensor) -> bool:
    """Whether ``second``'s bytes start where ``first``'s end, in one storage, both dense."""
    return (
        first.device == second.device
        and first.is_contiguous()
        and second.is_contiguous()
        and first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
        and _byte_range(first)[1] == _byte_range(second)[0]
    )


def _bytes_spanning(first: Tensor, last: Tensor) -> Tensor:
    """A byte tensor over the storage from ``first``'s start to ``last``'s end."""
    start, stop = _byte_range(first)[0], _byte_range(last)[1]
    return tensor_over_storage(first, start, torch.uint8, stop - start)


def tensor_over_storage(owner: Tensor, offset: int, dtype: torch.dtype, numel: int) -> Tensor:
    """A 1-D ``dtype`` tensor of ``numel`` elements over ``owner``'s storage from byte ``offset``.

    A tensor of its own sharing the storage, not a view of ``owner`` (whose dtype it need not
    have): views made of it have it as their ``_base``. ``offset`` must be a multiple of the
    dtype's size.
    """
    made = torch.empty(0, dtype=dtype, device=owner.device)
    return made.set_(owner.untyped_storage(), offset // dtype.itemsize, (numel,), (1,))


class _GatherCheck:
    """Every rank's fingerprint, gathered: each rank tells exactly which ranks differ."""

    def __init__(self, gathered: Tensor, rank: int) -> None:
        self._gathered = gathered
        self._rank = rank

    def queue(self, deferred: bool) -> Callable[[], None]:
        """This start's check: reads a host copy if ``deferred`` (checked after the stream)."""
        # Checked at once (off CUDA), the gathered rows are read in place: the program cannot
        # start again before, so no copy is needed.
        host = _to_host(self._gathered) if deferred else self._gathered
        return functools.partial(_check_rows, host, self._rank)


def _check_rows(host: Tensor, rank: int) -> None:
    check_calls(host.tolist(), rank)


class _ReduceCheck:
    """The reduced fingerprint chunks: equal on every rank exactly when no rank differs."""

    def __init__(
        self,
        reduced: Tensor,
        carrier: str,
        size: int,
        fingerprint: CallFingerprint,
        structure: int,
    ) -> None:
        self._reduced = reduced
        self._carrier = carrier
        self._size = size
        # Described only on a mismatch: formatting it every start would cost the caller.
        self._fingerprint = fingerprint
        self._structure = structure

    def queue(self, deferred: bool) -> Callable[[], None]:
        """This start's check (one object per start, so ``deferred`` needs nothing more)."""
        return functools.partial(self._check, _to_host(self._reduced))

    def _check(self, host: Tensor) -> None:
        values = [int(v) for v in host.tolist()]
        first, second = values[:_FINGERPRINT_CHUNKS], values[_FINGERPRINT_CHUNKS:]
        if self._carrier == "sum":
            agree = all(self._size * s == f * f for f, s in zip(first, second, strict=True))
        else:
            agree = all(f == -s for f, s in zip(first, second, strict=True))
        if agree:
            return
        raise RankMismatchError(
            "sync: ranks of the group paired different calls; this rank is at "
            f"{self._fingerprint.described(self._structure)} and "
            f"at least one other rank is not. {_SAME_ORDER}"
        )


def _chunks(words: list[int]) -> list[int]:
    kind, *wide = words
    out = [kind]
    for word in wide:
        unsigned = word & ((1 << 64) - 1)
        out += [(unsigned >> shift) & 0xFFFF for shift in range(0, 64, _CHUNK_BITS)]
    return out


class _FingerprintWriter:
    """Writes a fingerprint's numbers into a device buffer: one ``fill_`` per changed number.

    A fill takes its number as a kernel argument, so there is no host-to-device copy (a sync on
    CUDA from pageable memory) and no temporary tensor; numbers unchanged since the last call
    (the structure hash, the kind, the high chunks of a step) cost nothing. ``target`` is
    written with one copy when given: the all_reduce path reduces its buffer in place, so the
    numbers are kept in a staging tensor of their own.
    """

    def __init__(self, staging: Tensor, target: Tensor | None = None) -> None:
        self._staging = staging
        self._target = target
        self._cells = list(staging.unbind(0))
        self._last: list[int | None] = [None] * len(self._cells)
        # Off CUDA the numbers are stored through a NumPy view of the payload itself: one
        # assignment instead of a tensor op per number (and no staging copy to the target).
        written = staging if target is None else target
        self._host: Any = None
        if written.device.type == "cpu":
            try:
                self._host = written.numpy()
            except (ImportError, RuntimeError):  # torch without NumPy: one fill_ per number
                self._host = None

    def write(self, values: list[int]) -> None:
        if self._host is not None:
            self._host[:] = values
            return
        for index, value in enumerate(values):
            if value != self._last[index]:
                self._cells[index].fill_(value)
                self._last[index] = value
        if self._target is not None:
            self._target.copy_(self._staging)


def _to_host(tensor: Tensor) -> Tensor:
    """A host copy of ``tensor``: on CUDA queued into pinned memory (read after the stream)."""
    if tensor.device.type != "cuda":
        return tensor.clone()
    # device="cpu": under torch.set_default_device("cuda") a pinned tensor was asked of CUDA
    # ("Only dense CPU tensors can be pinned").
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class SyncHandle:
    """A sync in flight: the collectives it started and what finishes its results.

    ``wait`` makes the results ready; the fingerprint check runs in ``wait`` off CUDA and in
    ``verify`` on CUDA (after the stream reached this point), so a CUDA training thread never
    blocks on it.
    """

    def __init__(self, async_op: bool) -> None:
        self.async_op = async_op
        self.works: list[dist.Work] = []
        self._finishers: list[Callable[[], None]] = []
        self._checks: list[_GatherCheck | _ReduceCheck] = []
        self._queued: list[Callable[[], None]] = []
        self._event: torch.cuda.Event | None = None
        self._cuda = False
        self._when_ready: list[Callable[[], None]] = []

    def wait(self) -> None:
        """Wait for the collectives and finish the results.

        On CUDA the current stream waits (the host does not block), the result unpacking is
        queued on it, and the fingerprint check is left to ``verify``. Elsewhere it checks the
        fingerprints too.

        Raises:
            RankMismatchError: Off CUDA, if ranks paired different calls.
        """
        works, self.works = self.works, []
        for work in works:
            work.wait()
        finishers, self._finishers = self._finishers, []
        for finish in finishers:
            finish()
        checks, self._checks = self._checks, []
        self._queued += [check.queue(deferred=self._cuda) for check in checks]
        if self._cuda and self._queued:
            self._event = host_event()
            self._event.record()
        else:
            self.verify()
        ready, self._when_ready = self._when_ready, []
        for callback in ready:
            callback()

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` at the end of the next ``wait``, once the results are ready.

        Off CUDA that is after this rank's fingerprint check passed: a ``wait`` that raises
        calls nothing.
        """
        self._when_ready.append(callback)

    @property
    def pending(self) -> bool:
        """Whether ``wait`` has collectives to wait for or results to finish."""
        return bool(self.works or self._finishers)

    @property
    def deferred(self) -> bool:
        """Whether the fingerprint check waits for ``verify`` (CUDA, after ``wait``)."""
        return self._event is not None

    def ready(self) -> bool:
        """Whether ``verify`` would return without waiting for the device."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def verify(self) -> None:
        """Check that every rank sent the same fingerprint (blocks until ``wait``'s point on CUDA).

        Raises:
            RankMismatchError: If ranks paired different calls.
        """
        if self._event is not None:
            # query first: once the stream passed the event (the collector checks after the
            # window's done event) nothing waits, and sync-debug mode reports nothing.
            if not self._event.query():  # type: ignore[no-untyped-call]
                self._event.synchronize()
            self._event = None
        queued, self._queued = self._queued, []
        for check in queued:
            check()

    def _start(self, work: dist.Work | None) -> None:
        if work is not None:
            self.works.append(retain_work(work))  # type: ignore[arg-type]


class SyncBatch:
    """States to reduce together: ``add`` each, then ``program`` (or ``start``) the batch.

    Entries are grouped by process group and device in the order they were added; every rank
    adds the same states in the same order, so every rank issues the same collectives.
    """

    def __init__(self) -> None:
        self._groups: dict[int, _GroupEntries] = {}
        self._copies: list[_Entry] = []
        self._resolved: dict[int, tuple[Any, dist.ProcessGroup | None, int]] = {}

    def __len__(self) -> int:
        return len(self._copies) + sum(len(g.entries) for g in self._groups.values())

    def add(
        self,
        state: Reducible,
        group: Group,
        out: Tensor,
        *,
        name: str = "",
        parts: tuple[StatePart, ...] = (),
    ) -> None:
        """Reduce ``state`` over ``group`` into ``out`` (its shape and dtype).

        Args:
            state: The local tensor and op.
            group: A process group, a 1-D device mesh, or ``None`` for the default group.
            out: Receives the reduced state once the sync's handle was waited on.
            name: Names the state in the structure check's error message.
            parts: For a flat buffer of several states: each one's ``StatePart``, so the
                structure check and its message describe the states, not the buffer (and
                compare their configuration).
        """
        resolved = self._resolved.get(id(group))
        if resolved is None or resolved[0] is not group:
            process_group = resolve_group(group)
            resolved = self._resolved[id(group)] = (group, process_group, group_size(process_group))
        _, process_group, size = resolved
        if size == 1:
            self._copies.append(_Entry(name, state, out, parts))
            return
        slot = self._groups.get(id(process_group))
        if slot is None:
            slot = self._groups[id(process_group)] = _GroupEntries(process_group, size)
        slot.entries.append(_Entry(name or f"#{len(slot.entries)}", state, out, parts))

    def program(self, *, check: bool = True) -> SyncProgram:
        """Lay the batch out as a ``SyncProgram`` (buffers and views made once).

        Args:
            check: Run the blocking structure check (every rank must then do the same).
                ``False`` is for code that lays out, on one rank alone, a copy of a structure
                it already checked.

        Raises:
            RankMismatchError: If ranks of a group hold different states.
        """
        copies = list(self._copies)
        plans: list[_Plan] = []
        for slot in self._groups.values():
            structure = _describe(slot)
            if check:
                _check_structure(slot, structure)
            digest = _hash(structure)
            by_device: dict[torch.device, list[_Entry]] = {}
            for entry in slot.entries:
                if entry.state.local.numel() == 0:
                    copies.append(entry)
                else:
                    by_device.setdefault(entry.state.local.device, []).append(entry)
            for entries in by_device.values():
                segments = _segments(entries)
                packed = sum(_padded_bytes(s) for s in segments) + 8 * _FINGERPRINT_WORDS
                # Normal buffers even when laid out under torch.inference_mode() (a first sync
                # in an evaluation function): later starts outside it write them in place,
                # which torch refuses for inference tensors (see state.normal_tensor).
                with torch.inference_mode(False):
                    if packed * slot.size <= GATHER_LIMIT_BYTES:
                        plans.append(_GatherPlan(segments, slot.group, slot.size, digest))
                    else:
                        plans.append(_ReducePlan(segments, slot.group, slot.size, digest))
        with torch.inference_mode(False):  # its spanning tensors too
            return SyncProgram(_CopyPlan(copies), plans)

    def check(self) -> None:
        """Only run the structure check (blocking, a collective), reducing nothing."""
        for slot in self._groups.values():
            _check_structure(slot, _describe(slot))

    def start(
        self, fingerprint: CallFingerprint = _ANY_CALL, *, async_op: bool = False
    ) -> SyncHandle:
        """``program()`` then ``start``: for a batch reduced once."""
        return self.program().start(fingerprint, async_op=async_op)


class SyncProgram:
    """A laid-out sync that can be started again and again with the same prepared collectives.

    Made by ``SyncBatch.program``: it keeps the packing layout, the buffers and every view into
    them, so ``start`` skips planning and packing: small states are staged with one batched copy
    and reduced with one all_gather, and results land in the entries' out tensors.

    Each start reuses the same buffers: wait on one start before starting the program again. The
    entries' tensors must keep their shapes, dtypes and devices.

    Example:
        >>> from sidestream import MetricAccumulator
        >>> state, synced = MetricAccumulator(torch.zeros(1)), torch.empty(1)
        >>> state.accumulate(torch.tensor([2.0]))
        >>> batch = SyncBatch()
        >>> batch.add(state, None, out=synced)
        >>> program = batch.program()
        >>> program.start(CallFingerprint("sync", 1)).wait()
        >>> synced  # one process: the local value
        tensor([2.])
    """

    def __init__(self, copies: _CopyPlan, plans: list[_Plan]) -> None:
        # A copy plan with nothing to copy (every multi-rank program) is not run at all.
        self._copies = copies if copies._outs else None
        self._plans = plans
        # On CUDA the fingerprint check waits for the device: it moves from wait to verify.
        self._cuda = any(_plan_device(plan).type == "cuda" for plan in plans)

    @property
    def collective(self) -> bool:
        """Whether a start issues any collective (false in a single process)."""
        return bool(self._plans)

    def start(
        self, fingerprint: CallFingerprint = _ANY_CALL, *, async_op: bool = False
    ) -> SyncHandle:
        """Stage the current state, send ``fingerprint`` with it and issue the collectives.

        Args:
            fingerprint: Which call this is; every rank of the group must send the same.
            async_op: Return before the collectives finish; call ``wait`` on the handle. Without
                it the results are ready on return (the fingerprint checked off CUDA).

        Raises:
            RankMismatchError: Without ``async_op``, off CUDA, if ranks paired different calls.
        """
        handle = SyncHandle(async_op)
        handle._cuda = self._cuda
        if self._copies is not None:
            self._copies.run(handle, fingerprint)
        for plan in self._plans:
            plan.run(handle, fingerprint)
        if not async_op:
            handle.wait()
        return handle


def _plan_device(plan: _Plan) -> torch.device:
    if isinstance(plan, _GatherPlan):
        return plan._send.device
    assert isinstance(plan, _ReducePlan)
    return plan._fingerprint.device


def _padded_bytes(segment: _Segment) -> int:
    nbytes = segment.numel * segment.dtype.itemsize
    return -(-nbytes // _ALIGN) * _ALIGN


def _buffer_kind(segment: _Segment) -> tuple[str, int]:
    """Which all_reduce buffer a segment rides in, and how many slots per element it takes."""
    if segment.op is ReduceOp.SUM:
        return "sum", 2 if segment.integral else 1  # integers as two exact 32-bit halves
    if segment.integral:
        return "int_max", 1
    return "max", 2  # value and NaN flag


_BLOCK = 1 << 22
"""Elements per block of an all_reduce buffer's staging and unstaging: each shift, mask and
conversion of a state made a temporary of the whole state (a first sync of a 30 MB int64
confusion matrix peaked at 5x its size, a later one at 3x), where a block's are at most 32 MiB.
A state within one block is staged with the ops (CUDA kernel launches) it always took."""


def _blocks(numel: int) -> list[slice | None]:
    """``[0, numel)`` in slices of at most ``_BLOCK`` elements; ``[None]`` when within one.

    ``None`` stands for the whole: no slicing view (a dispatch each) for the usual state.
    """
    if numel <= _BLOCK:
        return [None]
    return [slice(start, min(start + _BLOCK, numel)) for start in range(0, numel, _BLOCK)]


def _part(tensor: Tensor, part: slice | None) -> Tensor:
    return tensor if part is None else tensor[part]


def _stage(segment: _Segment, view: Tensor) -> None:
    locals_ = segment.locals()
    local = (
        locals_[0].reshape(-1) if len(locals_) == 1 else torch.cat([t.reshape(-1) for t in locals_])
    )
    n = segment.numel
    split = view.numel() != n  # an integer sum's halves, or a max's values and NaN flags
    high, low = (view[:n], view[n:]) if split else (view, view)
    for part in _blocks(n):
        values = _part(local, part)
        if segment.integral:
            wide = values.to(torch.int64)
            if segment.op is ReduceOp.SUM:
                _part(high, part).copy_(wide >> 32)
                _part(low, part).copy_(wide & _LOW_BITS)
            elif segment.op is ReduceOp.MIN:
                torch.bitwise_not(wide, out=_part(view, part))  # MIN as MAX, overflow-free
            else:
                _part(view, part).copy_(wide)
        elif segment.op is ReduceOp.SUM:
            _part(view, part).copy_(values)
        else:
            value = values.to(view.dtype)
            if segment.op is ReduceOp.MIN:
                value = value.neg()
            nan = torch.isnan(value)
            _part(high, part).copy_(value.masked_fill(nan, -torch.inf))
            _part(low, part).copy_(nan)


def _unstage(segment: _Segment, view: Tensor, result: Tensor) -> None:
    n = segment.numel
    flat = result.reshape(-1)  # the result tensors are contiguous: a view
    split = view.numel() != n
    high, low = (view[:n], view[n:]) if split else (view, view)
    for part in _blocks(n):
        if segment.integral and segment.op is ReduceOp.SUM:
            _part(flat, part).copy_(
                (_part(high, part).to(torch.int64) << 32) + _part(low, part).to(torch.int64)
            )
        elif segment.integral and segment.op is ReduceOp.MIN:
            _part(flat, part).copy_(torch.bitwise_not(_part(view, part)))
        elif segment.integral or segment.op is ReduceOp.SUM:
            _part(flat, part).copy_(_part(view, part))
        else:
            value = _part(high, part)
            value = value.neg() if segment.op is ReduceOp.MIN else value
            _part(flat, part).copy_(value.masked_fill(_part(low, part) > 0, torch.nan))


def _row_reducer(per_rank: Tensor, op: ReduceOp, out: Tensor) -> Callable[[], object]:
    """The reduction of one state's gathered ``(ranks, elements)`` rows into ``out``, exactly.

    Bound once per plan: where ``out`` has the reduction's dtype (and is contiguous) it is one
    tensor op writing ``out`` in place, with no Python in between; otherwise a reduction and a
    copy.
    """
    direct = out.is_contiguous()
    if per_rank.dtype == torch.bool:
        reduce = torch.all if op is ReduceOp.MIN else torch.any  # any: a sum of flags is nonzero
        if direct and out.dtype == torch.bool:
            return functools.partial(reduce, per_rank, dim=0, out=out)
        return lambda: out.copy_(reduce(per_rank, dim=0))
    if op is ReduceOp.SUM:
        wide = torch.float64 if per_rank.is_floating_point() else torch.int64
        if direct and out.dtype == wide:
            return functools.partial(torch.sum, per_rank, dim=0, dtype=wide, out=out)
        return lambda: out.copy_(per_rank.sum(dim=0, dtype=wide))
    extreme = torch.amax if op is ReduceOp.MAX else torch.amin
    if direct and out.dtype == per_rank.dtype:
        return functools.partial(extreme, per_rank, dim=0, out=out)
    return lambda: out.copy_(extreme(per_rank, dim=0))


def _collective_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """``device``, or the current CUDA device where it is the CPU and ``group`` is NCCL's."""
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return device


_Structure = tuple[tuple[str, tuple[int, ...], str, str, str], ...]


def _describe(slot: _GroupEntries) -> _Structure:
    return tuple(item for entry in slot.entries for item in entry.described())


def stable_hash(text: str) -> int:
    """``text`` as a signed int64, the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _hash(structure: _Structure) -> int:
    return stable_hash(repr(structure))


# An odd number of bytes, while every data payload is a whole number of 8-byte words: a check
# paired with another rank's data collective (that rank syncs a metric laid out before, this one
# a new one) then fails in the backend on the size (gloo: "Received data size doesn't match
# expected size") and the data side on its fingerprint, instead of both hanging in collectives
# of different kinds until the process group's timeout.
_CHECK_BYTES = 9


def _check_structure(slot: _GroupEntries, structure: _Structure) -> None:
    """Check that every rank of the group syncs the same states (blocking, a collective).

    A fixed-size all_gather of each rank's structure hash tells every rank whether all are
    equal; only on a mismatch are the descriptions exchanged, so the error can name the
    difference on every rank.
    """
    device = slot.entries[0].state.local.device
    # And the group's members as this rank sees them: ranks that made their groups in another
    # order (new_group([0, 1]) then new_group([2, 3]) on ranks 0 and 1, the other way round on
    # 2 and 3) get groups whose backends connect ranks of different groups (gloo connected
    # ranks 0 and 3), and would reduce each other's states into wrong numbers, without an error.
    members = group_ranks(slot.group)
    described = (members, structure)
    everyone = _differing(slot.group, slot.size, device, described, stable_hash(repr(described)), 0)
    if everyone is not None:
        seen = [held[0] for held in everyone]
        if any(ranks != seen[0] for ranks in seen):
            raise RankMismatchError(_members_message(seen, group_rank(slot.group)))
        raise RankMismatchError(
            _mismatch_message([held[1] for held in everyone], group_rank(slot.group))
        )


def _members_message(seen: list[tuple[int, ...]], own_rank: int) -> str:
    """What ranks paired in a group they each see with other members are told."""
    held = "; ".join(f"rank {rank}: {list(ranks)}" for rank, ranks in enumerate(seen))
    return (
        f"sync: the ranks that met in this group each see it with other members (seen from "
        f"rank {own_rank}; its global ranks, by rank in the group: {held}): the process groups "
        "were made in different orders on different ranks; every rank must call new_group, "
        "new_subgroups and init_device_mesh in the same order, with the same ranks (a rank "
        "outside a group calls new_group for it too)"
    )


_CHECK_KINDS = ("a structure check (a first sync or bind)", "a setting check (bind, a checkpoint)")


def _differing(
    group: dist.ProcessGroup | None,
    size: int,
    device: torch.device,
    value: Any,
    digest: int,
    kind: int,
) -> list[Any] | None:
    """Every rank's ``value`` if some rank's ``digest`` differs, else ``None`` (a collective).

    The ninth byte says which check this is (an index into ``_CHECK_KINDS``): ranks that
    paired two different checks raise at once, on every rank, instead of reading each other's
    values as their own kind.
    """
    # Built on the host, then sent to the states' device: under a default device of the
    # caller's (torch.set_default_device("cuda"), `with torch.device("meta")`) they were made
    # there, and a CPU metric's sync or state_dict failed (meta: "Cannot copy out of meta
    # tensor"), after the other states of the call were laid out.
    own = torch.zeros(_CHECK_BYTES, dtype=torch.uint8, device="cpu")
    own[:8] = torch.tensor([digest], dtype=torch.int64, device="cpu").view(torch.uint8)
    own[8] = kind
    gathered = torch.empty(size * _CHECK_BYTES, dtype=torch.uint8, device=device)
    work = retain_work(all_gather_async(gathered, own.to(device), group))
    if work is not None:
        work.wait()
    rows = gathered.view(size, _CHECK_BYTES).cpu()  # one host sync per check
    if bool((rows == rows[0]).all()):
        return None
    kinds = rows[:, 8].tolist()
    if len(set(kinds)) > 1:
        paired = "; ".join(
            f"rank {rank}: {_CHECK_KINDS[k] if k < len(_CHECK_KINDS) else k}"
            for rank, k in enumerate(kinds)
        )
        raise RankMismatchError(
            f"ranks of the group paired different calls (seen from rank {group_rank(group)}): "
            f"{paired}; every rank must bind, sync and checkpoint in the same order"
        )
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def check_same_setting(
    group: Group, device: torch.device, what: str, setting: str, hint: str = ""
) -> None:
    """Raise on every rank of ``group`` unless all hold the same ``setting`` (a collective).

    For configuration every rank must share beyond the metric states (a collector's sinks, say),
    checked where the ranks already meet for a blocking check: one small all_gather of a hash,
    and the settings themselves only when they differ. Nothing in a one-rank group.

    Args:
        group: A process group, a 1-D device mesh, or ``None`` for the default group.
        device: Where the backend takes tensors (CPU becomes the current CUDA device under
            NCCL).
        what: Names the setting in the message (``"sinks"``).
        setting: This rank's setting, as text.
        hint: Ends the message (how to fix it).

    Raises:
        RankMismatchError: If some rank holds another setting; the message lists each rank's.
    """
    process_group = resolve_group(group)
    size = group_size(process_group)
    if size == 1:
        return
    device = _collective_device(process_group, device)
    everyone = _differing(process_group, size, device, setting, stable_hash(setting), 1)
    if everyone is None:
        return
    held = "; ".join(f"rank {rank}: {value}" for rank, value in enumerate(everyone))
    raise RankMismatchError(
        f"ranks of the group hold different {what} (seen from rank "
        f"{group_rank(process_group)}); every rank must configure the same {what}: {held}"
        + (f" ({hint})" if hint else "")
    )


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
            if name.endswith(_SETTINGS):  # settings_part: a metric's class and settings
                ours, theirs = by_name_reference[name][4], by_name[name][4]
                if ours != theirs:
                    prefix = name.removesuffix(_SETTINGS).rstrip(".")
                    metric = repr(prefix) if prefix else "the root"
                    problems.append(
                        f"metric {metric} is {theirs!r} on rank {rank} but {ours!r} on rank 0"
                    )
                continue
            for label, index in (("shape", 1), ("dtype", 2), ("op", 3), ("configuration", 4)):
                ours, theirs = by_name_reference[name][index], by_name[name][index]
                if ours != theirs:
                    problems.append(
                        f"state {name!r} has {label} {theirs} on rank {rank} but {ours} on rank 0"
                    )
        if not problems and structure != reference:
            problems.append(f"rank {rank} syncs the same states in a different order than rank 0")
    return (
        f"sync: ranks of the group hold different metric state (seen from rank {own_rank}); "
        "every rank must sync the same metrics with the same shapes, dtypes, ops and "
        "configuration (constants such as bins; settings compute reads, such as an average): "
        + "; ".join(sorted(set(problems)))
        # A rank that skipped dcp.load (which calls every metric's state_dict, a collective)
        # pairs its next sync with another metric's call: it reads as different metrics.
        + ". If every rank built the same metrics, a rank skipped or reordered a call that "
        "meets the other ranks (sync, state_dict, load_state_dict, or dcp.save / dcp.load "
        "of them)"
    )
