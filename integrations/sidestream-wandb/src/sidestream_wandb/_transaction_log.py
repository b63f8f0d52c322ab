"""Reads the history rows that wandb has written to a run's ``.wandb`` transaction log.

The file is wandb's own record of the run, the one ``wandb sync`` uploads: a 7-byte header
(``:W&B``, magic ``0xBEE1``, version 0), then blocks of 32 KiB holding records framed as in
LevelDB's log (a header of CRC-32, length and type; a record too long for its block is split
into first, middle and last parts), each record a ``wandb.proto`` ``Record``. A row counts as
delivered once its record is in the file whole, with a correct checksum: what a failed write
(a full disk, a deleted directory) leaves behind does not count.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

__all__ = ["TransactionLog"]

_HEADER = struct.Struct("<4sHB")
_HEADER_VALUE = (b":W&B", 0xBEE1, 0)
_RECORD = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
# The CRC of each record type's byte, with which the record's own CRC starts.
_TYPE_CRC = {kind: zlib.crc32(bytes([kind])) for kind in (_FULL, _FIRST, _MIDDLE, _LAST)}


READ_BYTES = 4 << 20
"""Bytes read at a time (at least one block)."""


class TransactionLog:
    """Follows one ``.wandb`` file: the last step each step metric has in its history rows.

    Step metrics are the columns ``step`` and ``<stream>/step`` (the sink gives no value such a
    name). Reads only what was appended since the last call. Not thread-safe: the caller locks.

    Args:
        path: The run's ``.wandb`` file.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._position = 0  # where the next record header starts (0: the file header first)
        self._parts: list[bytes] = []  # a split record's parts read so far
        self._damaged = False  # a bad checksum or header: nothing after it counts
        self._last_steps: dict[str, int] = {}

    @property
    def path(self) -> str:
        """The file followed."""
        return self._path

    @staticmethod
    def readable(path: str) -> bool:
        """Whether the file has this reader's header (or none yet): False for another layout."""
        try:
            with open(path, "rb") as file:
                header = file.read(_HEADER.size)
        except OSError:
            return True  # nothing to judge by: reading it later says what is wrong
        return len(header) < _HEADER.size or _HEADER.unpack(header) == _HEADER_VALUE

    @property
    def damaged(self) -> bool:
        """Whether a record failed its checksum (nothing after it is read)."""
        return self._damaged

    def last_steps(self) -> dict[str, int]:
        """The last value of each step metric in the rows written whole so far.

        Raises:
            OSError: If the file cannot be read (deleted, say).
        """
        if not self._damaged:
            # In pieces: a resumed sink reads an earlier run's whole file, which may hold GBs.
            # A piece of a block or more always holds a whole record part, so each one read in
            # full moves on.
            size = max(READ_BYTES, _BLOCK)
            with open(self._path, "rb") as file:
                while True:
                    file.seek(self._position)
                    data = file.read(size)
                    before = self._position
                    self._read(data)
                    if len(data) < size or self._position == before or self._damaged:
                        break
        return dict(self._last_steps)

    def _read(self, data: bytes) -> None:
        offset = 0  # into data, which starts at self._position
        if self._position == 0:
            if len(data) < _HEADER.size:
                return
            if _HEADER.unpack_from(data) != _HEADER_VALUE:
                self._damaged = True
                return
            offset = _HEADER.size
        while True:
            position = self._position + offset
            left_in_block = _BLOCK - position % _BLOCK
            if left_in_block < _RECORD.size:  # a block's tail too short for a header: padding
                if len(data) - offset < left_in_block:
                    break
                offset += left_in_block
                continue
            if len(data) - offset < _RECORD.size:
                break
            checksum, length, kind = _RECORD.unpack_from(data, offset)
            if checksum == 0 and length == 0 and kind == 0:
                break  # space not written yet (the writer pads only tails shorter than this)
            end = offset + _RECORD.size + length
            if end > len(data):
                break  # not written whole yet
            payload = data[offset + _RECORD.size : end]
            if kind not in _TYPE_CRC or zlib.crc32(payload, _TYPE_CRC[kind]) != checksum:
                # The last record of what was read may be a torn read of a write in progress
                # (a network file system): read again later. Followed by more, it is damage.
                if end < len(data):
                    self._damaged = True
                break
            offset = end
            if kind == _FULL:
                self._parts = []
                self._take(payload)
            elif kind == _FIRST:
                self._parts = [payload]
            elif self._parts:
                self._parts.append(payload)
                if kind == _LAST:
                    record, self._parts = b"".join(self._parts), []
                    self._take(record)
        self._position += offset

    def _take(self, payload: bytes) -> None:
        from wandb.proto import wandb_internal_pb2

        record: Any = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        try:
            record.ParseFromString(payload)
        except Exception:
            return  # not a record this client knows: not a row of ours
        if record.WhichOneof("record_type") != "history":
            return
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if key != "step" and not key.endswith("/step"):
                continue
            try:
                step = json.loads(item.value_json)
            except ValueError:
                continue
            if type(step) is int and step > self._last_steps.get(key, step - 1):
                self._last_steps[key] = step
