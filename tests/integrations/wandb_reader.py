"""Read the history rows back from a W&B offline run's ``.wandb`` file.

wandb ships no Python reader for this file, so this is an independent one. The layout: a 7-byte
file header (``:W&B``, a uint16 magic, a uint8 version), then a LevelDB-style log in 32 KiB
blocks (counted from the start of the file). Each chunk has a 7-byte header (CRC32 over the
type byte and the data, little-endian uint16 length, uint8 type FULL/FIRST/MIDDLE/LAST); a
block's tail shorter than a chunk header is zero padding. Reassembled payloads are protobuf
``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_HEADER_LEN = 7
CHUNK_HEADER_LEN = 7
BLOCK_LEN = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass(frozen=True)
class HistoryRow:
    """One history record: its step and its items decoded from JSON (``_step`` etc. included)."""

    step: int
    items: dict[str, Any]


def read_payloads(path: Path) -> list[bytes]:
    """Every record payload in ``path``, in order, CRC-checked."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B data file (header {data[:7]!r})")
    payloads: list[bytes] = []
    pending: bytearray | None = None
    offset = FILE_HEADER_LEN
    while offset + CHUNK_HEADER_LEN <= len(data):
        left_in_block = BLOCK_LEN - offset % BLOCK_LEN
        if left_in_block < CHUNK_HEADER_LEN:
            offset += left_in_block  # zero trailer
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, offset)
        start = offset + CHUNK_HEADER_LEN
        if crc == 0 and length == 0 and kind == 0:
            break  # preallocated, never-written space
        chunk = data[start : start + length]
        if len(chunk) != length:
            raise ValueError(f"{path}: truncated record at byte {offset}")
        expected = zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF
        if crc != expected:
            raise ValueError(f"{path}: CRC mismatch at byte {offset}")
        offset = start + length
        if kind == FULL:
            payloads.append(bytes(chunk))
        elif kind == FIRST:
            pending = bytearray(chunk)
        elif kind in (MIDDLE, LAST):
            if pending is None:
                raise ValueError(f"{path}: continuation without a FIRST at byte {offset}")
            pending += chunk
            if kind == LAST:
                payloads.append(bytes(pending))
                pending = None
        else:
            raise ValueError(f"{path}: unknown record type {kind} at byte {offset}")
    return payloads


def read_records(path: Path) -> list[Any]:
    """Every ``wandb_internal_pb2.Record`` in ``path``."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for payload in read_payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def read_history(path: Path) -> list[HistoryRow]:
    """The history rows of the run in ``path`` (records of type ``history``), in order."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items: dict[str, Any] = {}
        for item in record.history.item:
            # A value of a nested dict (a histogram's "values") comes with its key path.
            path = list(item.nested_key) or [item.key]
            node = items
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = json.loads(item.value_json)
        step = record.history.step.num if record.history.HasField("step") else items["_step"]
        rows.append(HistoryRow(step=int(step), items=items))
    return rows


def run_id_of(path: Path) -> str:
    """The run id in the ``run`` record of ``path``."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            return str(record.run.run_id)
    raise ValueError(f"{path}: no run record")


def read_step_metrics(path: Path) -> dict[str, str]:
    """Each name declared with ``define_metric`` in ``path`` and its step metric (``""``: none).

    Glob declarations (``train/*``) are keyed by their pattern.
    """
    declared: dict[str, str] = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "metric":
            metric = record.metric
            declared[metric.name or metric.glob_name] = metric.step_metric
    return declared
