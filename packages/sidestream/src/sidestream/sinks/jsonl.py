"""Reports as JSON lines in an append-only file: the embedded default sink."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from sidestream._logs import get_logger
from sidestream._validation import check_int
from sidestream.sinks.base import Report, RunInfo
from sidestream.sinks.status import PermanentSinkError
from sidestream.sinks.support import (
    NOT_WRITABLE_ERRNOS,
    call_within,
    check_directory_path,
    check_name_lengths,
)
from sidestream.sinks.tracker import TrackerSink

__all__ = ["JsonlSink", "read_jsonl", "read_lines"]

logger = get_logger("sidestream.sinks")

# Non-finite floats as JSON strings, spelt the way float() reads them back.
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
_CHUNK = 65536

READ_PROGRESS_FIRST_S = 5.0
"""How long a resume reads the file for each stream's last step before it says how far it is."""

READ_PROGRESS_EVERY_S = 15.0
"""How often, after the first, a resume still reading the file says how far it is."""

_LINES_PER_CLOCK_READ = 4096  # lines read between two looks at the clock (cheap per line)

_FSYNC_GRACE_S = 1.0
"""Added to a checkpoint's timeout for ``make_durable``: a healthy disk's ``fsync`` ends well
within it, so a checkpoint with no time left still makes the file durable."""


class JsonlSink(TrackerSink):
    """Append one JSON object per report to ``path``.

    Each line is standard JSON (``jq`` and ``pandas.read_json(path, lines=True)`` read it)::

        {"step": 120, "stream": "train", "time": 1700000000.0, "values": {"train/loss": 0.43}}

    plus ``"histograms": {name: [numbers]}`` when a report has any (nested lists for one of
    several dimensions). Non-finite values, in histograms too, are written as the strings
    ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (``float()`` reads them back; ``read_jsonl``
    does so). Lines are in delivery order: streams may interleave out of step order (a
    validation window at step 50 after training windows up to 60).

    Delivery: ``write`` returns once its lines are flushed to the file, so a step counts as
    delivered only when the operating system has it (a full disk fails the write, which the
    pipeline retries). When a checkpoint takes the state, the file is ``fsync``-ed first
    (``make_durable``). With ``fsync=True`` every write is. Once an ``fsync`` of lines the sink
    does not write again failed (``EIO``: the kernel dropped pages it could not write, and
    tells one ``fsync`` only), ``make_durable`` fails for the rest of the sink's life, so no
    checkpoint counts those lines as durable.

    The file is appended to. A job resumed from a checkpoint (``load_state_dict`` before
    ``open``) skips reports at or before each stream's last step in the checkpoint or in the
    lines written after it, so no step appears twice even when the job logged past its last
    checkpoint. A line cut short by a crash (or by a failed write) is cut off, with a warning,
    the file truncated back to its last complete line, before appending: every line stays
    valid JSON. A last line that is a whole JSON object but lacks its newline is kept, and
    completed. An existing file whose first line is no JSON object (a checkpoint or a CSV given
    by mistake) is refused with ``ValueError``, when the sink is built or opens: cutting its
    end would destroy it. A file moved away while the run writes it (log rotation) or deleted
    is followed: the next write makes a new file at ``path``, with a warning naming it (and
    where the moved file is, when in the same folder). A file cut shorter (logrotate's
    ``copytruncate``) is appended to where it now ends, with a warning (a line the cut left part
    of is cut off). Another file with lines
    put at ``path`` fails the sink (``PermanentSinkError``), and so do lines another writer
    appends (two sinks or jobs on one path would mix their lines, and cutting a failed write
    back would remove the other's). A checkpoint keeps a checksum of the bytes before its
    offset: a resumed job whose file is no longer the one the offset points into (rotated, cut
    or replaced since) reads every line of it instead, so no step is written twice there.
    A file or folder this process may not write (no permission, a read-only file system)
    fails the sink when it opens (``PermanentSinkError``), not retried until ``close``.
    A checkpoint of another file (its path differs) gives no offset into this one: a warning
    says so and only its steps count. A path that is not a regular file (``/dev/stdout``, a
    pipe) is only appended to (a line a failed write cut there is completed by the next write:
    the retried batch goes on where the failed write stopped, so no line comes twice) and
    never ``fsync``-ed (a pipe holds nothing to sync: ``fsync`` fails there). A named pipe
    with no reader attached is refused at ``open`` (``OSError``, ``ENXIO``, naming it)
    instead of waited for: the pipeline retries the open until a reader attaches. A named
    pipe whose reader exits is opened again by the retried write, so a reader attached later
    gets every report from the first it lacks: the same pipe holds what the old reader left
    unread, and gets the rest of the batch that its exit cut; a pipe made anew gets that
    batch whole. A pipe with no name (``/dev/stdout`` piped into ``head``)
    whose reader exits fails the sink (``PermanentSinkError``): no reader can attach again.

    Args:
        path: The file, made absolute when the sink is built (a checkpoint names it for a job
            resumed from another working directory); parent directories are created.
        flush_every: Most reports written per flush when a backlog is delivered at once.
        fsync: Also ``os.fsync`` after every write (survives a machine crash, costs a disk sync).
    """

    name = "jsonl"
    identity_key = "path"
    identity_is_path = True
    _own_locks = ("_lock", "_file_lock")

    def __repr__(self) -> str:
        return f"JsonlSink(path={str(getattr(self, 'path', ''))!r})"

    def __init__(
        self, path: str | os.PathLike[str], flush_every: int = 64, fsync: bool = False
    ) -> None:
        super().__init__()
        check_int("flush_every", flush_every, 1)
        if not isinstance(fsync, bool):
            # A config's "yes" or "false" would otherwise read as true.
            raise TypeError(f"fsync: expected True or False, got {fsync!r}")
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"path: expected a file path (str or os.PathLike), got {path!r}")
        if not os.fspath(path):  # Path("") is the working directory
            raise ValueError("path: expected a file path, got ''")
        # Absolute: a checkpoint names this file for a job resumed from anywhere.
        self.path = Path(path).absolute()
        check_name_lengths("path", self.path)  # is_dir() raised a bare OSError for one too long
        if self.path.is_dir():
            raise ValueError(f"path: expected a file, got the directory {str(self.path)!r}")
        # A file there already (a job's log, /dev/stdout) is appended to: its folder may be
        # one this process cannot write.
        check_directory_path("path", self.path.parent, written=not self.path.exists())
        self.max_batch = flush_every
        self._fsync = fsync
        # Unbuffered: what write() returned for is in the file, nothing waits in a buffer.
        self._file: IO[bytes] | None = None
        self._cut = False  # a failed write may have left part of a line
        self._regular = True
        self._file_lock = threading.Lock()
        self._offset: int | None = None  # bytes of the file once the last write was flushed
        # Where this sink's lines will start (it appends): a checkpoint taken before open
        # names it, so a resumed job finds every line this one delivered after it.
        # A stream (/dev/stdout, even when the job's log is a file) is only appended to: no
        # offset, no check of what others wrote there.
        self._size_at_start = _whole_lines_size(self.path) if _is_regular(self.path) else 0
        self._tail = b""  # the file's last bytes up to the offset: a checkpoint checks them
        if self._size_at_start:
            with contextlib.suppress(OSError):  # unreadable here: open says why
                _check_json_lines(self.path)  # a file of another kind, refused when built
                self._tail = _bytes_before(self.path, self._size_at_start)
        self._broken_pipe = False  # the pipe's reader went: the next write opens it again
        # A stream's write that failed part-way: its data, and how many bytes of it went out.
        self._unsent: tuple[bytes, int] | None = None
        self._resume_offset: int | None = None
        self._resume_tail: int | None = None
        self._saved_path: str | None = None  # the file a loaded checkpoint was taken of
        # The first fsync of a line this sink will not write again that failed (EIO): Linux
        # reports a write-back error once per file descriptor, and drops the pages it could
        # not write, so a later fsync succeeds although lines before it are gone. From then
        # on make_durable fails: a checkpoint never counts those lines as durable.
        self._sync_error: OSError | None = None

    @property
    def identity(self) -> str | None:
        """The file's path."""
        return str(self.path)

    @identity.setter
    def identity(self, value: str | None) -> None:
        # The path given to the constructor wins; a checkpoint's is kept to compare at open.
        self._saved_path = value

    def replay_options(self) -> dict[str, Any]:
        """The file's absolute path: a replay given only the spool writes the job's file."""
        return {"path": str(self.path)}

    def open(self, run: RunInfo) -> None:
        """Open ``path`` for appending (``run`` is not recorded in the file).

        Raises:
            PermanentSinkError: If the file or its folder may not be written (no permission,
                a read-only file system): retrying cannot help.
            OSError: Another failure (a full disk), retried by the pipeline.
        """
        del run
        try:
            self._open_file()
        except OSError as error:
            if error.errno not in NOT_WRITABLE_ERRNOS:
                raise
            raise PermanentSinkError(
                f"JsonlSink: {self.path} cannot be written ({error}); give the sink a path in "
                "a folder this process may write (its reports are kept: resume from a "
                "checkpoint, or replay the spool)"
            ) from error

    def _open_file(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        regular = self._regular = _is_regular(self.path)
        same_file = self._saved_path is None or _same_path(Path(self._saved_path), self.path)
        if regular and not self.resumed and self.path.is_file() and self.path.stat().st_size:
            logger.warning(
                "JsonlSink: %s already holds lines of an earlier run; this run appends after "
                "them, so its steps may repeat earlier ones (give each job its own path, or "
                "resume from the earlier job's checkpoint)",
                self.path,
            )
        if regular and self.path.is_file():
            _check_json_lines(self.path)
            _mend_last_line(self.path)
        if regular and self.resumed and same_file:
            steps = self._steps_in_file()
            # A line without a stream was written before streams existed, by an older
            # sidestream whose checkpoint's "last_step" counts for every stream: so does the
            # line's step (read as stream "", the steps a collector's stream had delivered
            # after the checkpoint were written again).
            streamless = steps.pop(None, None)
            if streamless is not None:
                self.found_in_backend_for_every_stream(streamless)
            self.found_in_backend(
                {stream: step for stream, step in steps.items() if stream is not None}
            )
        elif self.resumed and not same_file:
            logger.warning(
                "JsonlSink: the checkpoint's file is %s, this sink writes %s; steps up to the "
                "checkpoint's are skipped, the lines already in %s are not looked at",
                self._saved_path,
                self.path,
                self.path,
            )
        self._file = (
            _open_fifo(self.path) if _is_fifo(self.path) else self.path.open("ab", buffering=0)
        )
        if regular:
            self._offset = self._file.seek(0, os.SEEK_END)
            self._tail = _bytes_before(self.path, self._offset)

    def _steps_in_file(self) -> dict[str | None, int]:
        """Each stream's last step in the file, from the checkpoint's offset when it still fits.

        The offset fits the file the checkpoint was taken of. A file rotated away (moved,
        or cut by ``copytruncate``), deleted or replaced since is another one: its lines there
        may hold any stream's steps, so every line is read (a resumed job wrote none twice).
        """
        offset = self._resume_offset
        if offset is None:  # an older checkpoint: the last line only
            return _steps_after(self.path, None)
        size = _regular_file_size(self.path) or 0
        if offset <= size and (
            self._resume_tail is None or _crc(_bytes_before(self.path, offset)) == self._resume_tail
        ):
            return _steps_after(self.path, offset)
        if offset > size:
            logger.warning(
                "JsonlSink: %s holds %d bytes, fewer than the %d it held at the checkpoint "
                "(an older copy put back, or the file cut, rotated or deleted since): every "
                "line in it is read for each stream's last step; steps delivered before the "
                "checkpoint that are not in it are not written again, and those delivered "
                "after it to a rotated-away copy are written again here",
                self.path,
                size,
                offset,
            )
        else:
            logger.warning(
                "JsonlSink: %s is not the file the checkpoint was taken of (its bytes before the "
                "checkpoint's offset %d differ: rotated, cut or replaced since): every line in "
                "it is read for each stream's last step; steps delivered after the checkpoint "
                "to a rotated-away copy are written again here",
                self.path,
                offset,
            )
        return _steps_after(self.path, 0)

    def send(self, reports: Sequence[Report]) -> None:
        """Write one line per report and flush them to the file.

        Raises:
            RuntimeError: If the sink is not open.
            OSError: If the file cannot take the lines (a full disk), naming ``path``; nothing
                counts as delivered then, and the retry writes them again after cutting a cut
                line off (a stream: the retry of the same reports sends the rest of them only).
            PermanentSinkError: If another file with lines now stands at ``path``, another
                writer appended to the file since this sink's last write, or the reader of an
                unnamed pipe exited.
        """
        if self._file is None:
            raise RuntimeError(f"JsonlSink({self.path}): write before open")
        data = "".join(_line(report) for report in reports).encode()
        with self._file_lock:
            if self._broken_pipe:
                self._reopen_pipe()  # ENXIO until a reader attaches: retried
            if not self._regular:
                self._send_to_stream(data)
                return
            data = self._follow_file() + data
            file = self._file
            if self._cut and self._offset is not None:  # a failed write left part of a line
                os.ftruncate(file.fileno(), self._offset)  # back to the last whole line
            self._cut = True
            written = 0
            try:
                while written < len(data):
                    written += file.write(memoryview(data)[written:]) or 0
            except OSError as error:
                self._cut_back(file)  # at once: the disk may stay full until close
                if error.filename is not None or error.errno is None:
                    raise
                # A write's error names no file ("No space left on device"): the warning then
                # said neither which file nor which disk.
                raise OSError(error.errno, error.strerror, str(self.path)) from error
            if self._fsync:
                os.fsync(file.fileno())
            self._cut = False
            if self._offset is not None:
                self._offset = file.tell()
                self._tail = (self._tail + data[-_TAIL:])[-_TAIL:]

    def _send_to_stream(self, data: bytes) -> None:
        """Write ``data`` to a pipe or terminal (lock held), after what a failed write left.

        A stream cannot be cut back: a write that failed part-way (a named pipe's reader that
        exited with part of a batch in the pipe, which stays there for the next reader) is
        remembered, with how many of its bytes went out. The retry of that batch (a runner
        retries a batch whole) sends only the rest of it: the cut line is completed, and no
        line comes twice. Other data first completes the cut line from the failed write's.
        A pipe made anew has none of it: the batch is sent whole (``_reopen_pipe``).
        """
        start = 0
        if self._unsent is not None:
            old, sent = self._unsent
            if data.startswith(old[:sent]):
                start = sent  # the same lines again: what went out is not sent twice
            elif (end := _cut_line_end(old, sent)) is not None:
                self._write_stream(old, sent, end)  # the cut line
        self._write_stream(data, start, len(data))

    def _write_stream(self, data: bytes, start: int, end: int) -> None:
        """Write ``data[start:end]`` to the stream (lock held); remember a part that went out.

        Raises:
            OSError: If the stream takes no more (``_pipe_gone``'s error for a broken pipe).
        """
        file = self._file
        assert file is not None
        written = start
        try:
            while written < end:
                written += file.write(memoryview(data)[written:end]) or 0
        except OSError as error:
            if written:  # data[:written] went out: the retry sends the rest only
                self._unsent = (data, written)
            if isinstance(error, BrokenPipeError):
                raise self._pipe_gone(file) from error
            if error.filename is not None or error.errno is None:
                raise
            # Named, as for a file: "No space left on device" alone (/dev/full, a full
            # disk behind a descriptor) said not where.
            raise OSError(error.errno, error.strerror, str(self.path)) from error
        self._unsent = None

    def _follow_file(self) -> bytes:
        """Follow ``path`` if it was rotated; bytes to write before the lines (lock held).

        The file moved away (logrotate's default) or deleted: a new one is made at ``path``,
        with a warning. A file cut shorter (logrotate's ``copytruncate``): appended to where
        it now ends, with a warning; a line the cut left part of is cut off (or completed, if
        it is whole JSON but for its newline). Another file standing at ``path``, or lines
        appended by another writer: ``PermanentSinkError``.
        """
        file = self._file
        assert file is not None
        if not _still_at(self.path, file):
            self._reopen_regular(file)
            return b""
        size = os.fstat(file.fileno()).st_size
        if self._offset is None or size == self._offset:
            return b""
        if size > self._offset and not self._cut:
            raise PermanentSinkError(
                f"JsonlSink: {self.path} changed while this run wrote it (it holds "
                f"{size} bytes, this sink's lines end at {self._offset}): another "
                "writer appends to it (a second job or sink, or a replay, on the same "
                "path); two writers would mix their lines and cut each other's off. Give "
                "each sink its own path (this sink's reports are kept: resume from a "
                "checkpoint, or replay the spool)"
            )
        if size > self._offset:  # this sink's own cut line: cut back before writing
            return b""
        logger.warning(
            "JsonlSink: %s was cut from %d to %d bytes while this run wrote it (logrotate's "
            "copytruncate, or by hand): its lines before the cut are only where a copy of them "
            "went, and any written between that copy and the cut are lost; this run goes on "
            "appending to %s",
            self.path,
            self._offset,
            size,
            self.path,
        )
        self._cut = False
        with self.path.open("rb") as reader:
            start, whole = _last_fragment(reader, size)
        if start < size and not whole:
            # Cut mid-line: the part of this sink's line left before the cut is no JSON, and
            # is cut off, as a torn line is everywhere else (every line stays whole JSON).
            logger.warning(
                "JsonlSink: %s was cut mid-line: the %d bytes of the line cut short are cut off",
                self.path,
                size - start,
            )
            os.ftruncate(file.fileno(), start)
            size = start
        self._offset = size
        self._tail = _bytes_before(self.path, size)
        # A last line cut just before its newline is whole JSON: kept, and completed.
        return b"\n" if start < size else b""

    def _reopen_regular(self, file: IO[bytes]) -> None:
        """Make a new file at ``path`` for the lines to come (lock held).

        Raises:
            PermanentSinkError: If a file with content (another's) or no regular file now
                stands at ``path``: neither is appended to.
        """
        there = _regular_file_size(self.path)
        if there != 0:
            raise PermanentSinkError(
                f"JsonlSink: {self.path} was replaced while this run wrote it (another "
                f"{'file' if there else 'kind of file'} stands there now, that this sink did "
                "not write); nothing more is written to it, and the lines this run wrote are "
                "not there (its reports are kept: resume from a checkpoint, or replay the spool)"
            )
        status = os.fstat(file.fileno())
        if status.st_nlink:
            moved = _name_of(self.path.parent, status)
            logger.warning(
                "JsonlSink: %s was moved away while this run wrote it (log rotation): its lines "
                "so far are in %s; this run goes on in a new file at %s",
                self.path,
                moved or "the moved file",
                self.path,
            )
        else:
            logger.warning(
                "JsonlSink: %s was deleted while this run wrote it: the %d bytes of lines it "
                "held are gone with it; this run goes on in a new file at %s",
                self.path,
                self._offset or 0,
                self.path,
            )
        if self._cut:
            self._cut_back(file)
        try:  # its lines since the last checkpoint were never synced: a failure must stay known
            os.fsync(file.fileno())
        except OSError as error:
            self._note_sync_error(error)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab", buffering=0)
        file.close()
        self._cut = False
        self._offset = self._file.seek(0, os.SEEK_END)
        self._tail = _bytes_before(self.path, self._offset)

    def _pipe_gone(self, file: IO[bytes]) -> Exception:
        """The error for a pipe whose reader exited (lock held); marks a named one for reopening.

        A named pipe gets a new reader (a ``cat`` started again): the next write opens it
        again, retried until one attaches. An anonymous one (``/dev/stdout`` piped to ``head``)
        never does: retrying would only hold ``close`` for its whole timeout.
        """
        if _is_anonymous_pipe(file):
            return PermanentSinkError(
                f"JsonlSink: the reader of {self.path} exited (a pipe into a program that "
                "stopped reading, such as `head`); no reader can attach to it again, so "
                "nothing more is written there (its reports are kept: resume from a "
                "checkpoint, or replay the spool)"
            )
        self._broken_pipe = True
        return BrokenPipeError(
            errno.EPIPE,
            f"JsonlSink: the reader of the named pipe {self.path} exited; the sink opens it "
            "again once a reader attaches, keeping the reports",
        )

    def _reopen_pipe(self) -> None:
        """Open the named pipe at ``path`` again after its reader exited (lock held).

        Raises:
            OSError: ``ENXIO`` while no reader is attached (or no pipe is at ``path``).
        """
        old = self._file
        assert old is not None
        if not _is_fifo(self.path):
            raise OSError(
                errno.ENXIO,
                f"JsonlSink: {self.path} is no named pipe now (its reader made it again?); "
                "retried until one with a reader is there",
            )
        new = _open_fifo(self.path)
        before, after = os.fstat(old.fileno()), os.fstat(new.fileno())
        if (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino):
            # Another pipe: what its old reader left unread, nobody can read now.
            unread = _unread_bytes(old)
            if unread:
                logger.warning(
                    "JsonlSink: %d bytes of lines written to the named pipe %s were never read "
                    "(its reader exited first, and the pipe was made anew): they are lost",
                    unread,
                    self.path,
                )
            self._unsent = None  # none of it is in this pipe: the batch goes whole
        # The same pipe: unread lines stay in it for the new reader (new holds it open), and
        # the rest of a batch cut by the old reader's exit follows them (_send_to_stream).
        self._file, self._broken_pipe = new, False
        old.close()

    def _cut_back(self, file: IO[bytes]) -> None:
        """Cut a failed write's part of a line off (lock held), if the file allows it."""
        if self._regular and self._offset is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(file.fileno(), self._offset)  # needs no free space
                self._cut = False

    def make_durable(self, timeout: float | None = None) -> bool:
        """``fsync`` the file, so delivered lines survive a machine crash. Thread-safe.

        Returns:
            Whether that ended within ``timeout`` seconds and a grace second (a quick ``fsync``
            counts even with no time left): a write that hangs holds the file (a pipe nobody
            reads, a stalled terminal, a hung disk), and so may the ``fsync`` itself (an NFS
            server that is gone); a checkpoint must not wait for either without end.
        """

        def sync() -> None:
            with self._file_lock:
                self._sync_file()

        limit = None if timeout is None else timeout + _FSYNC_GRACE_S
        finished, error = call_within(sync, limit, "sidestream-jsonl-fsync")
        if error is not None:
            raise error
        return finished

    def _sync_file(self) -> None:
        """``fsync`` the open file, if it is a regular one (lock held).

        Raises:
            OSError: If this ``fsync`` fails, or an earlier one did (``_sync_error``): the
                lines written before it may be lost whatever a later ``fsync`` says.
        """
        if self._sync_error is not None:
            error = self._sync_error
            raise OSError(
                error.errno,
                f"JsonlSink: an earlier fsync of {self.path} failed ({error.strerror}): lines "
                "written before it may be lost, and a later fsync cannot tell (the kernel "
                "reports a write-back error once), so none counts as durable from then on",
            ) from error
        if self._file is not None and self._regular:
            try:
                os.fsync(self._file.fileno())
            except OSError as error:
                self._note_sync_error(error)
                raise

    def _note_sync_error(self, error: OSError) -> None:
        """Remember the first failed ``fsync`` of lines not written again (lock held)."""
        if self._sync_error is None:
            self._sync_error = error

    def close(self, timeout: float | None = None) -> bool:
        """Close the file (every delivered line is already in it)."""
        with self._file_lock:
            file, self._file = self._file, None
            unsent, self._unsent = self._unsent, None  # a later open's stream holds none of it
            if file is not None and unsent is not None:
                _complete_cut_line(file, *unsent)
            if file is not None and self._cut:
                self._cut_back(file)  # every line left in the file stays whole JSON
        if file is not None:
            file.close()
        return True

    def extra_state(self) -> dict[str, Any]:
        """Where the file ended after the last delivered line (to find later lines on resume).

        Before ``open``: where it ended when the sink was made, where its lines will start.
        """
        return {
            "offset": self._offset if self._offset is not None else self._size_at_start,
            "tail_crc32": _crc(self._tail),
        }

    def load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        """Remember the saved end of file, and the checksum of the bytes before it."""
        offset = state_dict.get("offset")
        self._resume_offset = offset if isinstance(offset, int) and offset >= 0 else None
        tail = state_dict.get("tail_crc32")  # absent in older checkpoints: offset trusted
        self._resume_tail = tail if isinstance(tail, int) and tail >= 0 else None


def _cut_line_end(data: bytes, sent: int) -> int | None:
    """Where the line ``data[:sent]`` cut ends in ``data`` (past its newline); ``None`` if uncut."""
    if data[sent - 1 : sent] == b"\n":
        return None
    return data.find(b"\n", sent) + 1 or len(data)


def _complete_cut_line(file: Any, data: bytes, sent: int) -> None:
    """At close, the rest of the line a failed write cut on a stream, if the stream takes it.

    A reader attached since (the same named pipe) would otherwise read a torn line, then the
    end. Without waiting: a pipe nobody reads, or one that is full, must not hold close.
    """
    end = _cut_line_end(data, sent)
    if end is None:
        return  # cut between lines: nothing torn
    rest = memoryview(data)[sent:end]
    try:
        os.set_blocking(file.fileno(), False)
        while rest:
            written = file.write(rest)
            if not written:  # None: the pipe is full
                return
            rest = rest[written:]
    except OSError:
        return  # no reader, or none left: nothing more can be done for that line


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records of a ``JsonlSink`` file, non-finite values (histograms' too) as floats.

    Lines that do not parse (one cut short by a crash, bytes that are not UTF-8) are skipped.
    """
    return (record for record in read_lines(path) if record is not None)


def read_lines(path: str | os.PathLike[str]) -> Iterator[dict[str, Any] | None]:
    """Each non-blank line of a ``JsonlSink`` file as its record, ``None`` where it is none."""
    with Path(path).open("rb") as file:  # each line decoded alone: one bad line is skipped
        for line in file:
            if line.strip():
                yield _parse(line)


def _line(report: Report) -> str:
    record: dict[str, Any] = {
        "step": report.step,
        "stream": report.stream,
        "time": report.time,
        "values": dict(report.values),
    }
    if report.histograms:
        record["histograms"] = {k: v.tolist() for k, v in report.histograms.items()}
    try:
        return json.dumps(record, allow_nan=False) + "\n"
    except ValueError:  # a non-finite value: rare, so only then walk the values
        record["values"] = {k: _finite_or_text(v) for k, v in record["values"].items()}
        if "histograms" in record:
            record["histograms"] = {k: _finite_or_text(v) for k, v in record["histograms"].items()}
        return json.dumps(record, allow_nan=False) + "\n"


def _finite_or_text(value: Any) -> Any:
    """``value`` with non-finite floats as text, inside lists too (a 2-D histogram nests)."""
    if isinstance(value, list):
        return [_finite_or_text(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else _NON_FINITE[value]
    return value


def _text_to_float(value: Any) -> Any:
    """``_finite_or_text`` undone: ``"NaN"`` and the infinities as floats, inside lists too.

    Raises:
        ValueError: For a string that is not one of them.
        OverflowError: For an integer no float holds (no line this sink writes).
    """
    if isinstance(value, list):
        return [_text_to_float(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool):
        float(value)  # OverflowError for one no float holds; kept an int (histogram counts)
        return value
    return float(value) if isinstance(value, str) else value


def _parse(line: str | bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: a line of nested brackets
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    values = record.get("values", {})
    histograms = record.get("histograms", {})
    if not isinstance(values, dict) or not isinstance(histograms, dict):
        return None  # not a line JsonlSink writes
    try:
        record["values"] = {k: _text_to_float(v) for k, v in values.items()}
        if "histograms" in record:
            record["histograms"] = {k: _text_to_float(v) for k, v in histograms.items()}
    except (ValueError, OverflowError, RecursionError):  # a string other than "NaN" /
        # "Infinity" / "-Infinity", a number no float holds, lists nested past the stack
        return None
    return record


def _is_fifo(path: Path) -> bool:
    """Whether ``path`` leads to a pipe (``mkfifo``, or ``/dev/stdout`` piped to a reader)."""
    try:
        return stat.S_ISFIFO(path.stat().st_mode)
    except OSError:
        return False


def _open_fifo(path: Path) -> IO[bytes]:
    """Open the pipe at ``path`` for appending, refusing at once if no process reads it.

    A plain open of a FIFO waits until a reader opens it: the sink's thread hung in ``open``
    for good, saying nothing, and a close ran out its timeout. Opened non-blocking it fails
    with ``ENXIO`` instead; the pipeline retries that like any transient error, so a reader
    started later gets every report. Writes then block as on any pipe (a slow reader holds
    up this sink only).

    Raises:
        OSError: ``ENXIO``, naming ``path`` and saying no reader is attached.
    """
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno != errno.ENXIO:
            raise
        raise OSError(
            errno.ENXIO,
            f"JsonlSink: {path} is a named pipe (FIFO) with no reader attached; start the "
            f"process that reads it (such as `cat {path}`); a Run or collector retries the "
            "open until one is, keeping the reports",
        ) from error
    os.set_blocking(descriptor, True)  # this open's own flag: nobody else's descriptor
    return os.fdopen(descriptor, "ab", buffering=0)


def _is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file of this sink's own: mended, synced and watched.

    A name of a file descriptor (``/dev/stdout``, ``/dev/fd/3``, ``/proc/self/fd/1``, or a link
    to one) is a stream even where it leads to a regular file, such as a job's log: other
    output shares that file, so it is only appended to. Any other path is what it names: a
    regular file anywhere (``/dev/shm/run.jsonl`` too) is one, a pipe or a terminal is not.
    """
    if _names_a_descriptor(path):
        return False
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except FileNotFoundError:
        return True  # created as one by open


_DESCRIPTOR_NAME = re.compile(
    r"/dev/(?:stdin|stdout|stderr|fd/\d+)|/proc/(?:self|thread-self|\d+)(?:/task/\d+)?/fd/\d+"
)
"""The names of a process's file descriptors: ``/dev/stdout``, ``/dev/fd/N``,
``/proc/self/fd/N``. Only these, not all of ``/dev`` and ``/proc``: ``/dev/shm`` holds regular
files (a container's tmpfs), whose checkpoint offset a resumed job needs."""


def _names_a_descriptor(path: Path) -> bool:
    """Whether ``path`` or a link on its way is the name of a file descriptor."""
    current = path
    for _ in range(40):  # the kernel's own limit on links followed
        if _is_descriptor_name(current):
            return True
        try:
            target = Path(os.readlink(current))
        except OSError:  # not a link (or gone): the chain ends here
            return False
        current = target if target.is_absolute() else current.parent / target
    return False


def _is_descriptor_name(path: Path) -> bool:
    """Whether ``path``, its folder's links resolved, is one of ``_DESCRIPTOR_NAME``'s."""
    if _DESCRIPTOR_NAME.fullmatch(str(path)):
        return True
    # A folder on the way may be a link (/dev/fd is one to /proc/self/fd), or hold "..":
    # readlink then follows the folder's links, and the name reached here is not the one
    # that named the descriptor.
    try:
        folder = path.parent.resolve()
    except (OSError, RuntimeError):  # a loop of links: open says why
        return False
    return _DESCRIPTOR_NAME.fullmatch(str(folder / path.name)) is not None


def _same_path(saved: Path, path: Path) -> bool:
    try:
        return saved.resolve() == path.resolve()
    except OSError:
        return str(saved) == str(path)


def _mend_last_line(path: Path) -> None:
    """End ``path`` with a whole line: a last line with no newline is completed or cut off.

    A line cut short by a crash (or a failed write) is no JSON object, and is cut off (with a
    warning), so every line stays valid JSON. A last line that is one whole object (written by
    another tool, or cut just before its newline) is kept and gets its newline.
    """
    with path.open("r+b") as file:
        size = file.seek(0, os.SEEK_END)
        start, whole = _last_fragment(file, size)
        if start == size:
            return
        if whole:
            file.seek(size)
            file.write(b"\n")
        else:
            logger.warning(
                "JsonlSink: %s ended with %d bytes of a line cut short (a crash or a failed "
                "write): cut off, so every line is whole JSON",
                path,
                size - start,
            )
            file.truncate(start)


def _last_fragment(file: IO[bytes], size: int) -> tuple[int, bool]:
    """Where a last line without a newline starts (``size`` if none), and if it is whole JSON."""
    if size == 0:
        return 0, True
    file.seek(size - 1)
    if file.read(1) == b"\n":
        return size, True
    newline = _previous_newline(file, size)
    start = 0 if newline is None else newline + 1
    file.seek(start)
    return start, _is_json_object(file.read(size - start))


def _is_json_object(data: bytes) -> bool:
    """Whether ``data`` is one whole JSON object (any keys: another tool's line counts)."""
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:  # cut JSON, not JSON, or bytes that are not UTF-8
        return False


_FIRST_LINE_LIMIT = 1 << 24
"""The most bytes of a file's first line read to tell whether it holds JSON lines."""


def _check_json_lines(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` is empty or starts like a file of JSON lines.

    The sink appends, and cuts a torn last line off: a file of another kind (a checkpoint, a
    CSV given by mistake) would lose its end. Its first line must be one JSON object, or, with
    no whole line yet, the start of one of this sink's lines (a crash during the first write).
    """
    with path.open("rb") as file:
        first = file.readline(_FIRST_LINE_LIMIT)
    if not first:
        return
    if first.endswith(b"\n"):
        if _is_json_object(first):
            return
    elif first.startswith(_LINE_START) or _LINE_START.startswith(first):
        return  # the sink's first line, cut short
    raise ValueError(
        f"path: {path} holds a file that is not JSON lines (its first line is no JSON "
        "object); JsonlSink appends to files of JSON lines only, and would cut the end of "
        "another file: give a path of its own"
    )


_LINE_START = b'{"step": '
"""How every line ``_line`` writes starts."""


def _still_at(path: Path, file: IO[bytes]) -> bool:
    """Whether ``path`` still names the regular file ``file`` has open (not deleted/replaced)."""
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    opened = os.fstat(file.fileno())
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


_TAIL = 256
"""Bytes before a checkpoint's offset whose checksum it keeps: a resumed job tells by them
whether the file at ``path`` is still the one the offset points into."""


def _crc(data: bytes) -> int:
    return zlib.crc32(data)


def _bytes_before(path: Path, offset: int) -> bytes:
    """The last ``_TAIL`` bytes of ``path`` before ``offset`` (fewer if it is shorter)."""
    try:
        with path.open("rb") as file:
            file.seek(max(0, offset - _TAIL))
            return file.read(min(offset, _TAIL))
    except OSError:
        return b""


def _name_of(folder: Path, status: os.stat_result) -> Path | None:
    """The name in ``folder`` of the file ``status`` describes (a rotated log), if found."""
    try:
        with os.scandir(folder) as entries:
            for count, entry in enumerate(entries):
                if count >= 10_000:
                    return None
                with contextlib.suppress(OSError):
                    found = entry.stat(follow_symlinks=False)
                    if (found.st_dev, found.st_ino) == (status.st_dev, status.st_ino):
                        return Path(entry.path)
    except OSError:
        return None
    return None


def _is_anonymous_pipe(file: IO[bytes]) -> bool:
    """Whether ``file`` is a pipe with no name (``|`` in a shell): no reader can open it anew."""
    try:
        target = os.readlink(f"/proc/self/fd/{file.fileno()}")
    except OSError:  # no /proc: taken for a named one, retried as before
        return False
    return target.startswith("pipe:")


def _unread_bytes(file: IO[bytes]) -> int:
    """Bytes in the pipe ``file`` writes that no reader took (0 where unknown)."""
    try:
        import fcntl
        import termios

        buffer = bytearray(4)
        fcntl.ioctl(file.fileno(), termios.FIONREAD, buffer)
    except (ImportError, OSError):
        return 0
    return int.from_bytes(buffer, sys.byteorder, signed=True)


def _whole_lines_size(path: Path) -> int | None:
    """Where lines appended to ``path`` will start: its size without a torn last line.

    0 if it does not exist, None if it is no regular file. ``open`` cuts a torn last line off
    (``_mend_last_line``), so the lines of this run start where it starts.
    """
    size = _regular_file_size(path)
    if not size:
        return size
    try:
        with path.open("rb") as file:
            start, whole = _last_fragment(file, size)
    except OSError:
        return size
    return size if whole else start


def _regular_file_size(path: Path) -> int | None:
    """The size of ``path``: 0 if it does not exist, None if it is no regular file."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return 0
    except OSError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def _steps_after(path: Path, offset: int | None) -> dict[str | None, int]:
    """The last step per stream in the lines from ``offset`` on (the last line if unknown).

    Lines without a stream (an older sidestream's) under ``None``.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return {}
    steps: dict[str | None, int] = {}
    if offset is not None and offset <= size:
        # A job that ran long past its checkpoint, or a file rotated since (every line read),
        # leaves gigabytes to parse: minutes in which the sink's reports wait and nothing is
        # said, so a long read says how far it is.
        began = time.monotonic()
        say_at = began + READ_PROGRESS_FIRST_S
        said = False
        read = 0
        with path.open("rb") as file:
            file.seek(offset)
            for count, line in enumerate(file, 1):  # one line in memory at a time
                read += len(line)
                _note(steps, _parse(line) if line.endswith(b"\n") else None)
                if count % _LINES_PER_CLOCK_READ == 0 and time.monotonic() >= say_at:
                    say_at = time.monotonic() + READ_PROGRESS_EVERY_S
                    said = True
                    logger.warning(
                        "JsonlSink: resuming, %s is read for each stream's last step: %.1f of "
                        "%.1f MiB read in %.0f s; the sink's reports wait (kept) until it ends",
                        path,
                        read / 2**20,
                        (size - offset) / 2**20,
                        time.monotonic() - began,
                    )
        if said:
            logger.warning(
                "JsonlSink: resuming, read %s (%.1f MiB) in %.0f s; delivering",
                path,
                read / 2**20,
                time.monotonic() - began,
            )
        return steps
    _note(steps, _last_record(path, size))
    return steps


def _note(steps: dict[str | None, int], record: dict[str, Any] | None) -> None:
    if record is None:
        return
    # None: a line without a stream (an older sidestream's), apart from every named one.
    stream = str(record["stream"]) if "stream" in record else None
    if record["step"] > steps.get(stream, record["step"] - 1):
        steps[stream] = record["step"]


def _last_record(path: Path, size: int) -> dict[str, Any] | None:
    """The last complete line that parses, read backwards in fixed chunks."""
    with path.open("rb") as file:
        end = _previous_newline(file, size)  # the newline that ends the last complete line
        while end is not None:
            start = _previous_newline(file, end)
            begin = 0 if start is None else start + 1
            file.seek(begin)
            record = _parse(file.read(end - begin))
            if record is not None:
                return record
            end = start
    return None


def _previous_newline(file: IO[bytes], before: int) -> int | None:
    """Offset of the last newline before byte ``before``, reading ``_CHUNK`` bytes at a time."""
    position = before
    while position > 0:
        start = max(0, position - _CHUNK)
        file.seek(start)
        index = file.read(position - start).rfind(b"\n")
        if index >= 0:
            return start + index
        position = start
    return None
