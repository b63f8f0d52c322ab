"""Reports as JSON lines in an append-only file: the embedded default sink."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from sidestream.sinks.base import Report, RunInfo, Sink

__all__ = ["JsonlSink"]


class JsonlSink(Sink):
    """Append one JSON object per report to ``path``.

    Each line is ``{"step": ..., "time": ..., "values": {name: number}}`` (plus
    ``"histograms": {name: [numbers]}`` when a report has any). Non-finite values are written
    as ``NaN`` / ``Infinity``, which Python's ``json`` reads back. Lines are buffered and
    pushed to the file every ``flush_every`` reports and whenever the pipeline flushes (it does
    when the sink has been idle for a moment, and on close), so the disk sees batches.

    The file is only appended to. A job resumed from a checkpoint (``load_state_dict`` before
    ``open``) skips reports at or before the last step in the file (or in the checkpoint, if
    larger), so no step appears twice even when the job logged past its last checkpoint. A
    line cut short by a crash is closed with a newline before appending.

    Args:
        path: The file; parent directories are created.
        flush_every: Push buffered lines to the file after this many reports.
        fsync: Also ``os.fsync`` on every flush (survives a machine crash, costs a disk sync).
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str], flush_every: int = 64, fsync: bool = False):
        if flush_every < 1:
            raise ValueError(f"flush_every: expected >= 1, got {flush_every}")
        self.path = Path(path)
        self._flush_every = flush_every
        self._fsync = fsync
        self._file: IO[str] | None = None
        self._unflushed = 0
        self._last_step: int | None = None
        self._resuming = False

    def open(self, run: RunInfo) -> None:
        """Open ``path`` for appending (``run`` is not recorded in the file)."""
        del run
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tail = _tail(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if tail and not tail.endswith(b"\n"):
            self._file.write("\n")
        if self._resuming:
            written = _last_step(tail)
            if written is not None and (self._last_step is None or written > self._last_step):
                self._last_step = written

    def write(self, report: Report) -> None:
        """Buffer one line; skip steps already written before a resume."""
        if self._file is None:
            raise RuntimeError(f"JsonlSink({self.path}): write before open")
        if self._last_step is not None and report.step <= self._last_step:
            return
        record: dict[str, Any] = {
            "step": report.step,
            "time": report.time,
            "values": dict(report.values),
        }
        if report.histograms:
            record["histograms"] = {k: v.tolist() for k, v in report.histograms.items()}
        self._file.write(json.dumps(record) + "\n")
        self._last_step = report.step
        self._unflushed += 1
        if self._unflushed >= self._flush_every:
            self.flush()

    def flush(self, timeout: float | None = None) -> bool:
        """Push buffered lines to the file."""
        del timeout
        if self._file is not None and self._unflushed:
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
            self._unflushed = 0
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush and close the file."""
        self.flush(timeout)
        if self._file is not None:
            self._file.close()
            self._file = None
        return True

    def state_dict(self) -> dict[str, Any]:
        """The path and the last step written."""
        return {"path": str(self.path), "last_step": self._last_step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume after ``state_dict["last_step"]``."""
        self._last_step = state_dict.get("last_step")
        self._resuming = True


def _tail(path: Path, size: int = 65536) -> bytes:
    """The last ``size`` bytes of ``path`` (empty if it does not exist)."""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - size))
            return file.read()
    except FileNotFoundError:
        return b""


def _last_step(tail: bytes) -> int | None:
    """The step of the last complete JSON line in ``tail``."""
    for line in reversed(tail.splitlines()):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(step, int):
            return step
    return None
