"""Growing per-sample state: rows kept as they arrive and concatenated over ranks on sync.

The exception to fixed-size accumulators, for metrics that must see every sample (exact
ranking). Memory grows with every update and is only returned by ``reset``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sidestream._distributed import (
    Group,
    all_gather_async,
    group_rank,
    group_size,
    resolve_group,
    retain_work,
)
from sidestream.sync import CallFingerprint, check_calls, stable_hash

__all__ = ["SampleStore", "SavedRows"]

_ANY_SYNC = CallFingerprint("sync", 0)
"""The fingerprint of a gather whose caller has none of its own."""

_OWNED = -1
"""The version of a chunk the store owns (version counters start at 0): nothing to watch."""


def _distinct_elements(tensor: Tensor) -> int:
    """How many elements of its storage ``tensor`` reads: an expanded dimension reads one.

    Not ``numel()``: a slice of a buffer expanded to more elements than the buffer holds
    (``labels[i:j, None].expand(-1, tokens)``) read as all of the buffer, and was watched
    through the buffer's version counter, which filling its next slice moves.
    """
    count = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride != 0:
            count *= size
    return 0 if tensor.numel() == 0 else count


def _raise_modified() -> None:
    raise RuntimeError(
        "a tensor passed to update was modified in place before compute: exact metrics keep "
        "references to their inputs (no copy), so their rows changed; reset the metric, and "
        "pass a copy (tensor.clone()) when you reuse an input buffer"
    )


class SavedRows:
    """A sample store field's rows in a ``state_dict``: every rank's rows, in rank order.

    Not a tensor on purpose: ``torch.distributed.checkpoint`` loads a tensor into the tensor of
    the same name in the state it loads into, which must have the saved shape, while a
    store's row count is only known from the checkpoint. Any other object is saved whole (as
    bytes) and handed back as it was saved, so rows load on any world size. ``torch.load``
    with ``weights_only=True`` accepts it (it is registered as a safe global).

    Attributes:
        rows: The ``(N, *row_shape)`` tensor.
    """

    def __init__(self, rows: Tensor) -> None:
        self.rows = rows

    def __repr__(self) -> str:
        return f"SavedRows(shape={tuple(self.rows.shape)}, dtype={self.rows.dtype})"


torch.serialization.add_safe_globals([SavedRows])


class SampleStore:
    """Named fields of rows (same row count each), appended per update, gathered on sync.

    A metric keeps one in an attribute, set in ``__init__`` (before the state arena is built,
    which records the tree's stores); ``Metric`` then resets, moves, stages (collector),
    gathers on ``sync`` and checkpoints it with the rest of the tree, and the metric takes the
    slow (blocking) sync path. Stored tensors are never changed in place, so a staged copy may
    share them with the live store.

    ``borrow`` keeps the caller's own tensors (no copy, like torchmetrics' list states): a
    copy into fresh memory costs more than the rest of an update (page faults). Their version
    counters are recorded, and ``local`` raises if one was modified in place since, instead of
    returning rows that changed under the metric. Borrowed rows may be of another dtype than
    their field (float32 scores of a float64 field, bool labels of an int8 one) as long as
    their values convert exactly; ``local`` converts them when it concatenates, so the stored
    values are the same as if converted at once.

    Args:
        fields: For each field, a template of shape ``(0, *row_shape)`` giving the row shape
            and dtype.
    """

    def __init__(self, **fields: Tensor) -> None:
        self._templates = {name: t.detach().clone() for name, t in fields.items()}
        self._chunks: dict[str, list[Tensor]] = {name: [] for name in fields}
        # Per chunk, its version counter when borrowed, or _OWNED: plain ints, not a tuple per
        # chunk, so an update allocates no object for the garbage collector to scan.
        self._versions: dict[str, list[int]] = {name: [] for name in fields}
        self._borrowing = False  # some chunk is borrowed
        self._modified = False  # a borrowed chunk was changed in place: raise until clear
        self._gathered: dict[str, Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) holds the rows themselves: borrowed tensors come back as
        # new ones whose version counters no longer tell whether the caller changed them.
        # Merging checks them (raising as compute would) and leaves nothing borrowed.
        if self._borrowing or self._modified:
            self.local()
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A store pickled before versions were kept per chunk has a list of borrowed tensors
        # instead, empty (its pickle merged them first): every chunk is the store's own.
        state.pop("_borrowed", None)
        self.__dict__.update(state)
        if "_versions" not in state:
            self._versions = {name: [_OWNED] * len(c) for name, c in self._chunks.items()}
            self._borrowing = self._modified = False

    @property
    def fields(self) -> tuple[str, ...]:
        """The field names, in declaration order."""
        return tuple(self._templates)

    @property
    def device(self) -> torch.device:
        """Where the rows live."""
        return next(iter(self._templates.values())).device

    def append(self, **rows: Tensor) -> None:
        """Keep one batch of rows per field as given (no copy, no host sync): rows no one writes."""
        for name, chunks in self._chunks.items():
            chunks.append(rows[name])
            self._versions[name].append(_OWNED)

    def borrow(self, **rows: Tensor) -> None:
        """Keep one batch of rows that may be the caller's tensors: no copy, no host sync.

        Each row may have another dtype than its field if its values convert exactly (it is
        converted by ``local``). A field whose rows hold one element each may be given in any
        shape, its elements in order being the rows: no reshaping view per update. Inference
        tensors have no version counter to watch, so those are copied, and so are views of
        part of a larger tensor (see below).
        """
        for name, chunks in self._chunks.items():
            row = rows[name]
            try:
                version = row._version
            except RuntimeError:  # an inference tensor: no version counter
                row, version = row.clone(), _OWNED
            else:
                if row.untyped_storage().nbytes() > _distinct_elements(row) * row.element_size():
                    # Part of a larger tensor (a slice of a preallocated buffer, probs[:, 1]):
                    # a view shares the whole tensor's version counter, so filling the next
                    # slice would read as a change of these rows, and compute would raise
                    # though they never changed. Only memory the rows fill can be watched.
                    row, version = row.clone(), _OWNED
            chunks.append(row)
            self._versions[name].append(version)
        self._borrowing = True

    def local(self) -> dict[str, Tensor]:
        """This rank's rows per field, concatenated (the chunks are merged once).

        Raises:
            RuntimeError: If a borrowed tensor (``borrow``) was modified in place since.
        """
        if self._modified:
            _raise_modified()  # again on every read until clear: no value from changed rows
        borrowed = self._borrowing
        merged_from: list[tuple[list[Tensor], list[int]]] = []
        out: dict[str, Tensor] = {}
        for name, chunks in self._chunks.items():
            template = self._templates[name]
            # Borrowed rows are always merged: the result is the store's own, never a caller's.
            if len(chunks) != 1 or borrowed or chunks[0].dtype != template.dtype:
                merged_from.append((list(chunks), self._versions[name]))
                rows = [template, *(chunk.reshape(-1, *template.shape[1:]) for chunk in chunks)]
                # cat converts other dtypes to the field's (exactly, as .to would).
                chunks[:] = [torch.cat(rows).to(template.dtype)]
                self._versions[name] = [_OWNED]
            out[name] = chunks[0]
        if borrowed:
            self._borrowing = False
            # Checked after the copy, so a change made before or during it is caught.
            for chunks, versions in merged_from:
                for chunk, version in zip(chunks, versions, strict=True):
                    if version != _OWNED and chunk._version != version:
                        self._modified = True
                        _raise_modified()
        return out

    def value(self, synced: bool) -> dict[str, Tensor]:
        """The rows of every rank after ``gather`` when ``synced``, else this rank's."""
        if synced and self._gathered is not None:
            return self._gathered
        return self.local()

    def gather(self, group: Group, fingerprint: CallFingerprint = _ANY_SYNC) -> None:
        """Concatenate every rank's rows in rank order (blocking collectives on ``group``).

        Ranks may hold any number of rows, none included: the row counts are gathered first,
        with ``fingerprint`` and the fields' row layout, then every field padded to the
        largest count.

        Raises:
            RankMismatchError: If ranks paired different calls or lay out rows differently.
        """
        self._gathered = gather_rows(self.local(), resolve_group(group), fingerprint)

    def clear(self) -> None:
        """Drop every row, local and gathered."""
        self._chunks = {name: [] for name in self._templates}
        self._versions = {name: [] for name in self._templates}
        self._borrowing = self._modified = False
        self._gathered = None

    def load(self, rows: dict[str, Tensor | SavedRows]) -> None:
        """Replace the local rows with ``rows`` (one tensor or ``SavedRows`` per field, checked).

        Raises:
            KeyError: If a field is missing.
            ValueError: If a row shape or dtype differs from the field's.
        """
        checked = self.checked_rows(rows)
        self.clear()
        self.append(**checked)

    def checked_rows(self, rows: dict[str, Tensor | SavedRows]) -> dict[str, Tensor]:
        """``rows`` as ``load`` takes them (copies on the store's device), checked; no change.

        Raises:
            The errors of ``check_rows``.
        """
        return self.own_copies(self.check_rows(rows))

    def own_copies(self, checked: dict[str, Tensor]) -> dict[str, Tensor]:
        """``check_rows``' tensors copied to the store's device, as ``append`` keeps them.

        A copy: the rows must not change when the caller reuses its state_dict later.
        """
        return {
            name: tensor.to(self._templates[name].device, copy=True)
            for name, tensor in checked.items()
        }

    def check_rows(self, rows: dict[str, Tensor | SavedRows]) -> dict[str, Tensor]:
        """``rows`` as tensors, checked against the fields (no copy, no change to the store).

        Every rank of a load checks them, not only the one that takes them: a rank that took a
        bad checkpoint alone would go on without the error the others raised.

        Raises:
            KeyError: If a field is missing.
            TypeError: If a field's value is not a tensor (nor ``SavedRows`` of one).
            ValueError: If a row shape or dtype differs from the field's, the fields hold
                different numbers of rows (each row pairs one element of every field), or the
                rows are a meta tensor (no values).
        """
        checked: dict[str, Tensor] = {}
        for name, template in self._templates.items():
            value = rows[name]
            # A bare tensor: a checkpoint from before SavedRows, or one made by hand.
            # Detached: rows that require grad would carry autograd history into the store.
            given = value.rows if isinstance(value, SavedRows) else value
            # device=: torch.as_tensor would move the rows to the caller's default device.
            own = given.device if isinstance(given, Tensor) else torch.device("cpu")
            try:
                tensor = torch.as_tensor(given, device=own).detach()
            except (TypeError, ValueError, RuntimeError) as error:
                # torch's own error ("new(): invalid data type 'str'") names no key. Not the
                # SavedRows' repr: it reads the shape of what it holds.
                raise TypeError(
                    f"state_dict[{name!r}]: expected rows (a tensor, or SavedRows of one), got "
                    f"{'SavedRows of ' if isinstance(value, SavedRows) else ''}{given!r}"
                ) from error
            if tensor.is_meta:
                # Checked here, on every rank: the copy that takes them (on the group's first
                # rank only) raised torch's "Cannot copy out of meta tensor", naming no key.
                raise ValueError(
                    f"state_dict[{name!r}]: a meta tensor holds no values (load the "
                    "checkpoint's tensors, for example with torch.load or dcp.load into this "
                    "metric's state_dict())"
                )
            if tuple(tensor.shape[1:]) != tuple(template.shape[1:]) or tensor.ndim == 0:
                raise ValueError(
                    f"state_dict[{name!r}]: expected rows of shape {tuple(template.shape[1:])}, "
                    f"got a tensor of shape {tuple(tensor.shape)}"
                )
            if tensor.dtype != template.dtype:
                raise ValueError(
                    f"state_dict[{name!r}]: expected dtype {template.dtype}, got {tensor.dtype}"
                )
            checked[name] = tensor
        counts = {name: tensor.shape[0] for name, tensor in checked.items()}
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"state_dict: the fields {sorted(counts)} must hold one row per sample each, "
                f"got {counts} rows (a damaged checkpoint, or fields of different saves)"
            )
        return checked

    def copy_from(self, other: SampleStore) -> None:
        """Take ``other``'s local rows (shared, not copied: stored rows are never mutated)."""
        self._chunks = {name: list(chunks) for name, chunks in other._chunks.items()}
        # The copy reads the same borrowed tensors.
        self._versions = {name: list(versions) for name, versions in other._versions.items()}
        self._borrowing, self._modified = other._borrowing, other._modified
        self._gathered = None

    def to(self, device: torch.device) -> None:
        """Move every row to ``device``."""
        self._templates = {name: t.to(device) for name, t in self._templates.items()}
        for name, chunks in self._chunks.items():
            moved = [chunk.to(device) for chunk in chunks]
            # A row copied to another device no longer reads the caller's tensor; one that
            # stayed (``to`` returned the tensor itself) still does.
            versions = self._versions[name]
            for index, (old, new) in enumerate(zip(chunks, moved, strict=True)):
                if new is not old:
                    # The copy took the rows as they are now: a borrowed tensor changed in
                    # place before the move must still raise (as ``local`` would have), not
                    # be forgotten with its version and counted as if it were the update's.
                    if versions[index] != _OWNED and old._version != versions[index]:
                        self._modified = True
                    versions[index] = _OWNED
            chunks[:] = moved
        self._borrowing = any(v != _OWNED for vs in self._versions.values() for v in vs)
        if self._gathered is not None:
            self._gathered = {name: t.to(device) for name, t in self._gathered.items()}


def gather_rows(
    rows: dict[str, Tensor],
    group: dist.ProcessGroup | None,
    fingerprint: CallFingerprint = _ANY_SYNC,
) -> dict[str, Tensor]:
    """Every rank's ``rows`` concatenated in rank order; ``rows`` itself on a single rank.

    The row counts travel first, with ``fingerprint`` and the rows' layout (field names, dtypes
    and row shapes), so ranks that paired different calls, or hold rows of another shape,
    raise before the rows' gather, which would otherwise mix them or abort the process.

    Raises:
        RankMismatchError: If ranks paired different calls or lay out rows differently.
    """
    world = group_size(group)
    if world == 1:
        return rows
    first = next(iter(rows.values()))
    header = torch.tensor(
        [first.shape[0], *fingerprint.words(_layout(rows))], dtype=torch.int64, device=first.device
    )
    headers = [torch.empty_like(header) for _ in range(world)]
    _gather(headers, header, group)
    table: list[list[int]] = torch.stack(headers).tolist()
    check_calls(
        [row[1:] for row in table],
        group_rank(group),
        also=", or hold sample rows of different shapes",
    )
    sizes = [row[0] for row in table]
    largest = max(sizes)
    out: dict[str, Tensor] = {}
    for name, tensor in rows.items():
        # Into one tensor whose rank blocks are the result itself when every rank holds as
        # many rows: a list of parts, a padded copy and their concatenation were 2.5x the
        # gathered rows at 2 ranks, kept while the last collectives' works are (retain_work).
        send = tensor
        if tensor.shape[0] != largest or not tensor.is_contiguous():
            send = tensor.new_zeros((largest, *tensor.shape[1:]))
            send[: tensor.shape[0]] = tensor
        gathered = tensor.new_empty((world * largest, *tensor.shape[1:]))
        _gather_into(gathered, send, group)
        if min(sizes) == largest:
            out[name] = gathered
        else:
            blocks = [gathered[rank * largest :][:size] for rank, size in enumerate(sizes)]
            out[name] = torch.cat(blocks)
            _release(gathered)
        if send is not tensor:
            _release(send)
    return out


def _release(tensor: Tensor) -> None:
    """Free the memory of a buffer a completed collective used (its work keeps the tensor).

    ``retain_work`` keeps the last collectives' works referenced, and with them their tensors:
    a row gather's buffers would stay allocated for dozens of later collectives.
    """
    tensor.untyped_storage().resize_(0)


def _layout(rows: dict[str, Tensor]) -> int:
    """The rows' field names, dtypes and row shapes as a signed int64, equal in every process."""
    return stable_hash(";".join(f"{n}:{t.dtype}:{tuple(t.shape[1:])}" for n, t in rows.items()))


def _gather_into(output: Tensor, tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    # As _gather: async and retained, then waited for.
    work = retain_work(all_gather_async(output, tensor, group))
    if work is not None:
        work.wait()


def _gather(parts: list[Tensor], tensor: Tensor, group: dist.ProcessGroup | None) -> None:
    # Async and retained, so a gloo worker thread never frees the work (see retain_work).
    work = retain_work(dist.all_gather(parts, tensor, group=group, async_op=True))
    if work is not None:
        work.wait()
