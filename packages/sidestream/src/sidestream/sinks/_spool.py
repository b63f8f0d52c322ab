"""A first-in first-out file of reports, one JSON line each: where a full queue's reports wait."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import time
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from typing import IO, Any

from sidestream.sinks._lost import LostSteps
from sidestream.sinks._spool_format import decode_report, encode_report
from sidestream.sinks.base import Report

__all__ = [
    "DEFAULT_SPOOL_MAX_BYTES",
    "SPOOL_SUFFIX",
    "Spool",
    "SpoolTooLargeError",
    "SpoolWriteError",
    "file_label",
    "leftover_spools",
]

#: Default cap on the bytes one sink's spool file holds (256 MiB).
DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024

# Bytes moved per read when the file is compacted or copied: bounded memory.
_CHUNK = 1 << 20


class _LineIndex:
    """Size, stream and step of each spooled line, oldest first, in compact arrays.

    The spool file is on disk, but this index of it is in memory, one entry per line: a spool
    of small reports (``run.log`` of one value, about 100 bytes a line) holds 2.7 million lines
    at the default 256 MiB cap. A deque of sizes and one of ``(stream, step)`` tuples took
    about 118 bytes of memory a line there (300 MiB, more than the file on disk, for each sink
    of a tracker that was down); these arrays take 20 (an int64 size and step, and the stream's
    number in a table of the streams seen).
    """

    _BLOCK = 4096  # entries per array block: popleft frees memory a block at a time

    def __init__(self) -> None:
        # [sizes, steps, stream numbers] per block, oldest first; the first block's first
        # _head entries were taken already.
        self._blocks: deque[list[Any]] = deque()
        self._head = 0
        self._count = 0
        self._streams: list[str] = []
        self._stream_ids: dict[str, int] = {}

    def __len__(self) -> int:
        return self._count

    def append(self, size: int, stream: str, step: int) -> None:
        """Add the newest line."""
        stream_id = self._stream_ids.get(stream)
        if stream_id is None:
            stream_id = self._stream_ids[stream] = len(self._streams)
            self._streams.append(stream)
        if not self._blocks or len(self._blocks[-1][0]) == self._BLOCK:
            self._blocks.append([array("q"), array("q"), array("I")])
        block = self._blocks[-1]
        try:
            block[1].append(step)
        except (OverflowError, TypeError):
            # A step no int64 holds (a Report made by hand): this block keeps its steps as
            # Python objects, as they were given.
            block[1] = [*block[1], step]
        block[0].append(size)
        block[2].append(stream_id)
        self._count += 1

    def size_at(self, index: int) -> int:
        """The size of the ``index``-th oldest line (0 is the oldest)."""
        if not 0 <= index < self._count:
            raise IndexError(index)
        index += self._head
        sizes: array[int] = self._blocks[index // self._BLOCK][0]
        return sizes[index % self._BLOCK]

    def popleft(self) -> tuple[int, str, int]:
        """Remove the oldest line; return its ``(size, stream, step)``."""
        if not self._count:
            raise IndexError("the spool is empty")
        sizes, steps, streams = self._blocks[0]
        entry = (sizes[self._head], self._streams[streams[self._head]], steps[self._head])
        self._head += 1
        self._count -= 1
        if self._head == len(sizes) and (len(sizes) == self._BLOCK or not self._count):
            self._blocks.popleft()
            self._head = 0
        return entry

    def marks(self) -> Iterator[tuple[str, int]]:
        """``(stream, step)`` of every line, oldest first."""
        head = self._head
        for sizes, steps, streams in self._blocks:
            for index in range(head, len(sizes)):
                yield self._streams[streams[index]], steps[index]
            head = 0

    def clear(self) -> None:
        """Forget every line."""
        self._blocks.clear()
        self._head = self._count = 0


class SpoolWriteError(OSError):
    """A report not spooled although the oldest reports were dropped to make room for it."""

    def __init__(self, error: OSError, dropped: int) -> None:
        super().__init__(error.errno, f"{error.strerror} ({dropped} older report(s) dropped)")
        self.dropped = dropped


class SpoolTooLargeError(ValueError):
    """A report whose spool line alone is larger than the spool's cap: it cannot be spooled."""


class Spool:
    """Reports kept on disk, one JSON line each, read back in the order they were written.

    Not thread-safe: the sink runner holds its lock around every call. The file is created on
    first use (readable by its owner only) and deleted by ``discard``; ``keep`` leaves a file
    on disk for a person to read or replay (``sidestream.sinks.replay_spool``).

    At most ``max_bytes`` of reports are held: appending past it drops the oldest reports
    first (counted in ``dropped``). The dead prefix of reports already read is cut off once it
    is larger than the live part, and before a line would take the file past twice the cap, so
    the file on disk stays within twice the cap.

    Args:
        directory: Where to create the spool file (the system temp dir by default).
        label: Part of the file name, to tell sinks apart.
        max_bytes: Most bytes of reports held; the oldest are dropped beyond it.
    """

    def __init__(
        self,
        directory: str | None = None,
        label: str = "sink",
        max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes: expected >= 1, got {max_bytes}")
        # Absolute now: resolved at the first spill instead, a relative one followed a later
        # os.chdir (a hand-made SinkRunner's spool_dir; a run's is made absolute already).
        self._directory = None if directory is None else os.path.abspath(directory)
        self._label = label
        self._max_bytes = max_bytes
        self._file: IO[bytes] | None = None
        self._path: str | None = None
        self._read_offset = 0
        self._end = 0
        # Byte length, stream and step of each spooled line, oldest first: compact, since a
        # spool of small reports holds millions of lines (see _LineIndex).
        self._lines = _LineIndex()
        self.dropped = 0
        #: The steps of the reports this spool dropped or could not keep, for the messages.
        self.lost = LostSteps()
        #: When ``keep`` last wrote something (``time.monotonic()``): a caller that waits for
        #: it on another thread gives up on a disk that stopped answering, not on a slow one.
        self.kept_progress = 0.0

    def __len__(self) -> int:
        return len(self._lines)

    @property
    def nbytes(self) -> int:
        """Bytes of the reports spooled now."""
        return self._end - self._read_offset

    @property
    def max_bytes(self) -> int:
        """The most bytes of reports held (the cap)."""
        return self._max_bytes

    @property
    def location(self) -> str:
        """The spool file once created, else the folder it is to be made in (for messages)."""
        return self._path or self.directory

    @property
    def directory(self) -> str:
        """The folder spool files are made in (the system temp dir by default)."""
        return self._directory or tempfile.gettempdir()

    def leftovers(self) -> list[str]:
        """Spool files of this spool's label in its directory whose process has ended."""
        return leftover_spools(self._directory, self._label)

    @property
    def path(self) -> str | None:
        """The spool file, once created."""
        return self._path

    def _new_file(self) -> tuple[IO[bytes], str]:
        if self._directory is not None:
            os.makedirs(self._directory, mode=0o700, exist_ok=True)
        # mkstemp creates the file with mode 0600: reports may hold what the job logs.
        # The process id (and its start time, where the system gives it) in the name tells a
        # later job whose file it finds (leftover_spools).
        handle, path = tempfile.mkstemp(
            prefix=f"sidestream-{file_label(self._label)}@{_process_mark(os.getpid())}-",
            suffix=_SUFFIX,
            dir=self._directory,
        )
        return os.fdopen(handle, "w+b"), path

    def _open(self) -> IO[bytes]:
        if self._file is None:
            self._file, self._path = self._new_file()
        elif self._file.closed:
            # The reopen after a failed write failed too (too many open files, say): the
            # spooled lines are still in the file. Open it again now, cut back to its last
            # whole line, instead of failing every later call on the closed one for good.
            assert self._path is not None
            self._file = open(self._path, "r+b")  # noqa: SIM115 - kept open, closed by close()
            self._file.truncate(self._end)
        return self._file

    def append(self, report: Report) -> int:
        """Add ``report`` at the end; return how many old reports were dropped to make room.

        Raises:
            SpoolTooLargeError: If the report alone is larger than ``max_bytes`` (the spool is
                left as it was).
            OSError: If the file cannot be created or written (the spool is left as it was).
            SpoolWriteError: If it could not be written even after the oldest reports were
                dropped to make room (``dropped`` of them).
        """
        line = encode_report(report)
        if len(line) > self._max_bytes:
            # Larger than the whole cap: it can never be kept, and the spool is not full.
            raise SpoolTooLargeError(
                f"the report is {len(line)} bytes as a spool line, more than spool_max_bytes "
                f"({self._max_bytes}) allows"
            )
        # The oldest reports that make room, dropped only once the new one is written: a
        # failed write leaves the spool as it was.
        dropped, freed = 0, 0
        while dropped < len(self._lines) and self.nbytes - freed + len(line) > self._max_bytes:
            freed += self._lines.size_at(dropped)
            dropped += 1
        # The dead prefix is cut once larger than the live part (and than a chunk, or the cap
        # when that is smaller), and whenever this line would take the file past twice the
        # cap: the live part (at most the cap) and the line (at most the cap) then fit.
        if self._read_offset > max(self.nbytes, min(_CHUNK, self._max_bytes)) or (
            self._read_offset and self._end + len(line) > 2 * self._max_bytes
        ):
            self._compact(self._open())
        try:
            self._write_at_end(line)
        except OSError:
            if not dropped:
                raise
            # Out of space: make the room for real (the oldest reports go, counted, and the
            # file is compacted) and try once more.
            self._drop_oldest(dropped)
            try:
                self._compact(self._open())
                self._write_at_end(line)
            except OSError as error:
                raise SpoolWriteError(error, dropped) from error
        else:
            self._drop_oldest(dropped)
        self._end += len(line)
        self._lines.append(len(line), report.stream, report.step)
        return dropped

    def _drop_oldest(self, count: int) -> None:
        for _ in range(count):
            size, stream, step = self._lines.popleft()
            self._read_offset += size
            self.lost.add(stream, step)
        self.dropped += count

    def _write_at_end(self, line: bytes) -> None:
        """Write ``line`` after the last one; on failure the file is as it was (``OSError``)."""
        file = self._open()
        try:
            file.seek(self._end)
            file.write(line)
            file.flush()
        except OSError:
            self._reopen_at_end()
            raise

    def _reopen_at_end(self) -> None:
        """After a failed write: the file cut back to its last whole line, with a new buffer.

        The buffered file keeps the bytes it could not write and tries them again on every
        later seek, read or flush, so one full disk would make the spool unusable for good;
        closing it drops them. A full disk may also have taken part of the line: it is cut.

        The file is reopened through a duplicate of its descriptor, not by its path: the
        spool's folder may have been deleted while the file was open (a temp-dir cleaner, an
        ``rm -rf``). By path the reopen failed, the spooled lines went with the closed
        descriptor, and every later spill failed too, for the rest of the job.
        """
        assert self._file is not None and self._path is not None
        try:
            duplicate: int | None = os.dup(self._file.fileno())
        except (OSError, ValueError):  # out of descriptors, or closed already: by path
            duplicate = None
        with contextlib.suppress(OSError):
            self._file.close()  # its flush fails again; the bytes it held are dropped
        if duplicate is None:
            self._file = open(self._path, "r+b")  # noqa: SIM115 - kept open, closed by close()
        else:
            self._file = os.fdopen(duplicate, "r+b")
        with contextlib.suppress(OSError):
            self._file.truncate(self._end)

    def pop_oldest(self) -> Report:
        """Remove and return the oldest report.

        The report is removed even when it cannot be read back.

        Raises:
            IndexError: If the spool is empty.
            ValueError: If its line is damaged.
            OSError: If its line cannot be read (the later lines stay spooled).
        """
        if self._file is None or not self._lines:
            raise IndexError("the spool is empty")
        size, stream, step = self._lines.popleft()
        start = self._read_offset
        self._read_offset += size
        try:
            file = self._open()
            file.seek(start)
            line = file.read(size)
        except OSError:
            self.lost.add(stream, step)
            # Only this line is lost: the next read seeks to its own line. A buffer the
            # failed read left in an unknown state is dropped with the file object.
            if self._lines:
                with contextlib.suppress(OSError):
                    self._reopen_at_end()
            raise
        finally:
            if not self._lines:
                self._reset_file()
        try:
            if len(line) != size:
                raise ValueError(
                    f"spool {self._path}: a line was cut short ({len(line)} of {size} B)"
                )
            return decode_report(line)
        except ValueError:
            self.lost.add(stream, step)
            raise

    def _reset_file(self) -> None:
        # Everything read back: start the file over instead of growing it forever.
        assert self._file is not None
        self._end = self._read_offset = 0
        with contextlib.suppress(OSError):
            self._open().truncate(0)

    def _compact(self, file: IO[bytes]) -> None:
        """Move the live lines to the start of the file, in chunks (bounded memory)."""
        source, target = self._read_offset, 0
        while source < self._end:
            file.seek(source)
            chunk = file.read(min(_CHUNK, self._end - source))
            if not chunk:
                break
            file.seek(target)
            file.write(chunk)
            source += len(chunk)
            target += len(chunk)
            self._progress()
        file.truncate(target)
        file.flush()
        self._end, self._read_offset = target, 0

    def live_bytes(self) -> bytes:
        """The spooled reports' lines as they are in the file, oldest first (a copy).

        Raises:
            OSError: If the file cannot be read.
        """
        if self._file is None or not self._lines:
            return b""
        file = self._open()
        file.seek(self._read_offset)
        data = file.read(self._end - self._read_offset)
        if len(data) != self._end - self._read_offset:
            raise OSError(f"spool {self._path}: read {len(data)} of {self.nbytes} bytes")
        return data

    def keep(
        self, reports: list[Report], newer: Sequence[Report] = ()
    ) -> tuple[list[str], int, Exception | None]:
        """Leave ``reports`` (older), what is spooled and ``newer`` on disk; empty the spool.

        Both go to one new file when the disk has room for it. When it has not (the spool may
        be most of a full disk, and the new file needs its size again), the spool file itself is
        kept, its delivered prefix cut off in place, and ``reports`` go to a file of their own,
        as many of the oldest as fit (whole lines: a line the disk cut short is cut off); only
        what fits in neither is lost.

        Returns:
            The paths of the files left (one JSON report per line, oldest first; a file of
            ``reports`` comes before the spool file it was written with), the number of
            reports lost, and the first error met (``None`` when one file held everything).
        """
        try:
            return [self._write_with_spooled(reports, newer)], 0, None
        except Exception as error:  # never raises: close reports what it could not keep
            first_error = error
        paths: list[str] = []
        lost = 0
        if reports:
            path, kept = self._write_oldest(reports)
            if path is not None:
                paths.append(path)
            lost += len(reports) - kept
            self.lost.add_reports(reports[kept:])
        if self._lines:
            spooled = len(self._lines)
            try:
                paths.append(self._keep_file())
            except Exception:
                lost += spooled
                for mark in self._lines.marks():
                    self.lost.add(*mark)
        if newer:
            path, kept = self._write_oldest(list(newer))
            if path is not None:
                paths.append(path)
            lost += len(newer) - kept
            self.lost.add_reports(newer[kept:])
        self.discard()
        return paths, lost, first_error

    def _write_with_spooled(self, reports: list[Report], newer: Sequence[Report] = ()) -> str:
        """``reports``, every spooled line, then ``newer``, to one new file (all or none).

        Empties the spool.
        """
        self._progress()
        out, path = self._new_file()
        try:
            with out:
                for report in reports:
                    out.write(encode_report(report))
                self._progress()
                if self._file is not None:
                    spooled = self._open()
                    source = self._read_offset
                    while source < self._end:
                        spooled.seek(source)
                        chunk = spooled.read(min(_CHUNK, self._end - source))
                        if not chunk:
                            break
                        out.write(chunk)
                        source += len(chunk)
                        self._progress()
                for report in newer:
                    out.write(encode_report(report))
                out.flush()
                self._progress(syncing=out.tell())
                os.fsync(out.fileno())
        except BaseException:
            # Left whole or not at all: keep() then keeps the spool file itself and the oldest
            # of ``reports`` that fit in a file of their own.
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        self.discard()
        return path

    def _write_oldest(self, reports: list[Report]) -> tuple[str | None, int]:
        """Write as many of ``reports`` as fit, oldest first, to a new file: its path and count.

        Line by line and unbuffered, so a full disk (or a file size limit) leaves the whole
        lines written before it; a part of a line is cut off. No file when none fit.
        """
        try:
            out, path = self._new_file()
        except Exception:
            return None, 0
        kept = end = 0
        with out:
            handle = out.fileno()
            try:
                for report in reports:
                    line = encode_report(report)
                    view = memoryview(line)
                    while view:
                        view = view[os.write(handle, view) :]
                    end += len(line)
                    kept += 1
                    self._progress()
            except Exception:
                with contextlib.suppress(OSError):
                    os.ftruncate(handle, end)
            try:
                self._progress(syncing=end)
                os.fsync(handle)
            except OSError:
                kept = 0  # nothing is known to be on disk
        if kept == 0:
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None, 0
        return path, kept

    def _progress(self, syncing: int = 0) -> None:
        """Note progress; ``syncing``: bytes an ``fsync`` about to start may have to write."""
        self.kept_progress = time.monotonic() + syncing / _SLOW_DISK_BYTES_PER_S

    def _keep_file(self) -> str:
        """Leave the spool file itself on disk, its read prefix cut off (no extra space)."""
        assert self._file is not None and self._path is not None
        if not os.path.exists(self._path):  # moved or deleted: a path that names nothing
            raise FileNotFoundError(self._path)
        self._progress()
        file = self._open()
        if self._read_offset:
            self._compact(file)  # overwrites and truncates: needs no new blocks
        self._progress(syncing=self._end)
        os.fsync(file.fileno())
        path = self._path
        file.close()
        self._file = self._path = None  # discard must not delete it now
        return path

    def discard(self, *, lost: bool = False) -> None:
        """Close and delete the spool file; never raises.

        Args:
            lost: The spooled reports are lost (not delivered, not kept): note their steps.
        """
        if lost:
            for mark in self._lines.marks():
                self.lost.add(*mark)
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            self._path = None
        self._lines.clear()
        self._read_offset = self._end = 0


_SLOW_DISK_BYTES_PER_S = 10 * 1024 * 1024
"""The slowest disk a kept spool's ``fsync`` is waited for (``kept_progress``): 27 s for a full
256 MiB spool, longer than which the disk counts as having stopped answering."""

SPOOL_SUFFIX = ".spool.jsonl"
"""How every spool file's name ends."""
_SUFFIX = SPOOL_SUFFIX
# Characters a sink's label keeps in a file name; the others become "_".
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+-]")
# Most characters of a label in a file name: with the prefix, process mark, random part,
# suffix and ".replayed.state.json" the name stays well within 255 bytes.
_LABEL_MAX = 64


def file_label(label: str) -> str:
    """``label`` as it appears in spool file names: safe in one file name, distinct per label.

    A sink's name is free text ("team/tracker", "../x", 300 characters): a "/" would name a
    directory that does not exist and a long name exceeds the file system's limit, so every
    spool write would fail. Characters other than letters, digits and ``_.+-`` become ``_``,
    the label is cut to ``_LABEL_MAX`` characters, and a label changed either way gets a
    short hash of itself, so that two labels do not share a name ("a/b" and "a_b").
    """
    safe = _UNSAFE.sub("_", label)[:_LABEL_MAX]
    if safe == label:
        return label
    digest = hashlib.sha256(label.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{safe}~{digest}"


_NAME = re.compile(
    r"sidestream-(?P<label>.+)@(?P<pid>\d+)(?:\.(?P<start>\d+))?-[^/]*" + re.escape(_SUFFIX)
)


def leftover_spools(directory: str | None, label: str) -> list[str]:
    """Spool files of sink ``label`` in ``directory`` whose process has ended.

    A job that crashed leaves its spool behind, and a close that timed out keeps one on
    purpose; neither was delivered (a replayed file is renamed, so it is not listed). An empty
    file holds nothing (a spool read back to its end starts over empty): it is not listed
    (nor deleted: in a directory shared by machines the process id may be another host's,
    whose job still writes it). Never raises: an unreadable directory lists nothing.
    """
    folder = directory if directory is not None else tempfile.gettempdir()
    found = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        # The raw label too: a file an earlier version named with it ("my sink").
        if match is None or match["label"] not in (file_label(label), label):
            continue
        if not entry.is_file() or _alive(int(match["pid"]), match["start"]):
            continue
        try:
            if entry.stat().st_size:
                found.append(entry.path)
        except OSError:  # gone since the listing
            continue
    return sorted(found)


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (Linux: clock ticks since boot), or ``None`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) is in parentheses and may hold spaces.
    fields = text[text.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else None


def _process_mark(pid: int) -> str:
    """``pid``, or ``pid.start`` where the start time is known (see ``_alive``)."""
    start = _start_time(pid)
    return str(pid) if start is None else f"{pid}.{start}"


def _alive(pid: int, start: str | None = None) -> bool:
    """Whether the process that wrote a spool file named with ``pid`` (and ``start``) runs.

    Process ids are reused: a restarted container often gives the new job's process the very
    id of the crashed one. With the start time in the name, a live process of that id counts
    only if it started then.
    """
    if start is not None:
        now = _start_time(pid)
        if now is not None:
            return now == start
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
