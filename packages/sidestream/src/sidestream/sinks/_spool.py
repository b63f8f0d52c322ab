"""A first-in first-out file of reports: where reports wait when a sink's queue is full."""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from typing import IO

from sidestream.sinks.base import Report

__all__ = ["Spool"]


class Spool:
    """Reports kept on disk, read back in the order they were written.

    Not thread-safe: the sink runner holds its lock around every call. The file is created on
    first use and deleted by ``discard``; ``keep`` leaves it on disk for a person to inspect.

    Args:
        directory: Where to create the spool file (the system temp dir by default).
        label: Part of the file name, to tell sinks apart.
    """

    def __init__(self, directory: str | None = None, label: str = "sink") -> None:
        self._directory = directory
        self._label = label
        self._file: IO[bytes] | None = None
        self._path: str | None = None
        self._read_offset = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _open(self) -> IO[bytes]:
        if self._file is None:
            if self._directory is not None:
                os.makedirs(self._directory, exist_ok=True)
            handle, self._path = tempfile.mkstemp(
                prefix=f"sidestream-{self._label}-", suffix=".spool", dir=self._directory
            )
            self._file = os.fdopen(handle, "w+b")
        return self._file

    def append(self, report: Report) -> None:
        """Add ``report`` at the end."""
        file = self._open()
        file.seek(0, os.SEEK_END)
        pickle.dump(report, file, protocol=pickle.HIGHEST_PROTOCOL)
        self._count += 1

    def pop_oldest(self) -> Report:
        """Remove and return the oldest report.

        Raises:
            IndexError: If the spool is empty.
        """
        if self._file is None or self._count == 0:
            raise IndexError("the spool is empty")
        self._file.seek(self._read_offset)
        report: Report = pickle.load(self._file)
        self._read_offset = self._file.tell()
        self._count -= 1
        if self._count == 0:
            # Everything read back: start the file over instead of growing it forever.
            self._file.seek(0)
            self._file.truncate()
            self._read_offset = 0
        return report

    def keep(self, reports: list[Report]) -> str:
        """Put ``reports`` in front of what is spooled, close the file and leave it on disk.

        Returns:
            The path of the file: pickled ``Report`` objects, oldest first.
        """
        remaining = [*reports, *(self.pop_oldest() for _ in range(self._count))]
        file = self._open()
        file.seek(0)
        file.truncate()
        for report in remaining:
            pickle.dump(report, file, protocol=pickle.HIGHEST_PROTOCOL)
        file.close()
        self._file = None
        assert self._path is not None
        path, self._path = self._path, None
        self._count = 0
        self._read_offset = 0
        return path

    def discard(self) -> None:
        """Close and delete the spool file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            self._path = None
        self._count = 0
        self._read_offset = 0
