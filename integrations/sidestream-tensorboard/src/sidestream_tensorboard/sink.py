"""The TensorBoard sink: event files in one log directory per training job."""

from __future__ import annotations

import contextlib
import dataclasses
import html
import itertools
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from sidestream._logs import get_logger
from sidestream.sinks import PermanentSinkError, Report, RunInfo, TrackerSink
from sidestream.sinks.config import install_hint
from sidestream.sinks.support import (
    NOT_WRITABLE_ERRNOS,
    HistogramEdges,
    call_within,
    check_directory_path,
    check_option_types,
    flatten_config,
    histogram_counts,
    seconds_left,
    silence_thread_errors,
)
from sidestream.sinks.tracker import signature_options

__all__ = ["TensorBoardSink"]

logger = get_logger("sidestream.sinks")

_HPARAM_TYPES = (bool, int, float, str)
# The characters Python-Markdown (TensorBoard's renderer, with its tables extension) takes a
# backslash escape of: another one (``~``) would show the backslash.
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()#+\-.!|])")
_LINE_BREAKS = re.compile(r"\r\n?|\n")


def _cell(value: Any) -> str:
    """``value`` as the text of a cell of TensorBoard's markdown table, shown as it is.

    TensorBoard renders text summaries as markdown: a ``|`` would end the cell (the rest of
    the value lost), a newline the row (its second line shown as a tag of its own), and
    ``*``, ``_``, ``[..](..)`` or ``&amp;`` would be shown formatted. HTML-escaped, markdown's
    punctuation backslash-escaped, newlines as ``<br>``.
    """
    text = html.escape(str(value), quote=False)
    # "\r" alone ends a line too (Python-Markdown reads it as "\n"): its own row otherwise.
    return _LINE_BREAKS.sub("<br>", _MARKDOWN_PUNCTUATION.sub(r"\\\1", text))


def _hparam(value: Any) -> Any:
    """``value`` as TensorBoard keeps it: an int a float64 cannot hold exactly, or a bool, as a str.

    TensorBoard stores numbers as doubles: ``10**400`` would raise ``OverflowError`` at every
    open, and ``2**53 + 1`` would be shown as another number. torch's ``hparams`` writes a bool
    as the number 1 or 0 (its bool branch comes after the int one): ``"True"``, as MLflow
    shows it.
    """
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int) and abs(value) > 2**53:
        return str(value)
    return value


_WRITER_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "comment": (str,),
    "max_queue": (int,),
    "flush_secs": (int, float),
    "filename_suffix": (str,),
}
"""``SummaryWriter``'s options, checked when the sink is made (a str ``flush_secs`` would only
fail in its writer thread, after training started)."""
INSTALL = install_hint("tensorboard")


class TensorBoardSink(TrackerSink):
    """Writes every report to TensorBoard event files with ``SummaryWriter``.

    ``open`` creates the writer on ``log_dir`` and, for a new run, records the flattened
    hyper-parameters in TensorBoard's HPARAMS tab (values it cannot show become strings) and
    the tags as a text summary. ``write`` adds each value with ``add_scalar`` and each histogram
    (bin counts) with ``add_histogram_raw`` at the report's step and wall time; streams may
    arrive in any step order. Nothing is flushed per step: the writer flushes every
    ``flush_secs`` and on ``flush`` / ``close``, and only flushed steps count as delivered.

    Resume: ``state_dict()`` holds the log directory and the last delivered step per stream;
    after ``load_state_dict`` the next ``open`` appends a new event file to the same directory
    and skips reports at or below each stream's step (or the largest step of that stream
    already in the directory, if later), so TensorBoard never sees a step twice.

    Args:
        log_dir: The run's directory, made absolute when the sink is built (a checkpoint names
            it for a job resumed from another working directory; a URL such as ``s3://...`` is
            kept as it is); ``None`` takes the saved one
            on resume, else SummaryWriter's default (``runs/<date>_<host><comment>``; with
            ``-2``, ``-3``, ... after a name that exists or another sink was given).
        histogram_edges: Bin edges per histogram name (``num_bins + 1`` values); bins without
            edges span ``[i, i + 1)``.
        **writer_kwargs: Passed to ``SummaryWriter`` under its own names (``flush_secs``,
            ``max_queue``, ``filename_suffix``, ``comment``); not ``purge_step``, which would
            make TensorBoard hide steps the sink keeps on resume (``TypeError``). ``comment``
            ends the default directory's name, so it is refused with a ``log_dir``
            (``ValueError``), where it would do nothing.

    Example:
        >>> sink = TensorBoardSink(log_dir="runs/demo")
    """

    name = "tensorboard"
    identity_key = "log_dir"
    skips_values = True  # a histogram it cannot take (skip_value)
    identity_is_path = True
    durable_on_send = False  # the writer buffers events until it flushes
    _own_locks = ("_lock", "_writer_lock")

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        histogram_edges: Mapping[str, Sequence[float]] | None = None,
        **writer_kwargs: Any,
    ) -> None:
        super().__init__()
        if writer_kwargs.get("purge_step") is not None:
            # TensorBoard's reader would hide the earlier files' events at or after that step,
            # among them the steps this sink keeps on disk and does not write again.
            raise TypeError(
                "TensorBoardSink: purge_step is not supported: the sink resumes by itself "
                "(load_state_dict), keeping each step already on disk and skipping it, and "
                "purge_step would make TensorBoard hide those steps"
            )
        writer_kwargs.pop("purge_step", None)  # None: SummaryWriter's default
        self.refuse_unknown_options(writer_kwargs)
        check_option_types("TensorBoardSink", writer_kwargs, _WRITER_OPTION_TYPES)
        _check_writer_ranges(writer_kwargs)
        # A resumed job's saved directory replaces only a default one (see identity).
        self._log_dir_given = log_dir is not None
        self._saved_log_dir: str | None = None  # a checkpoint's directory, compared at open
        if log_dir is None:
            self._log_dir = _default_log_dir(writer_kwargs.get("comment", ""))
        else:
            if not isinstance(log_dir, str | os.PathLike):
                raise TypeError(
                    f"log_dir: expected a directory path (str or os.PathLike), got {log_dir!r}"
                )
            if writer_kwargs.get("comment"):
                # SummaryWriter appends it to its default directory's name only: with a
                # log_dir it was silently dropped.
                raise ValueError(
                    f"comment: it only ends the name of the default directory "
                    f"(runs/<date>_<host><comment>), and log_dir={os.fspath(log_dir)!r} is "
                    f"given; put {writer_kwargs['comment']!r} in log_dir, or leave log_dir out"
                )
            self._log_dir = os.fspath(log_dir)
            check_directory_path("log_dir", self._log_dir)  # "" before it becomes the cwd
            if "://" not in self._log_dir:  # not a URL (s3://...): TensorBoard's own file layer
                # Absolute: a checkpoint names this directory for a job resumed from anywhere.
                self._log_dir = os.path.abspath(self._log_dir)
        self._histogram_edges = HistogramEdges(histogram_edges, "TensorBoardSink")
        self._writer_kwargs = writer_kwargs
        self._writer: Any = None
        self._writer_file: Path | None = None  # the writer's event file, where it is known
        # A checkpoint's flush (another thread) may replace a failed writer too.
        self._writer_lock = threading.Lock()
        self._opened = False
        # A writer whose close did not end in time: its events may never reach the disk.
        self._unclosed = False
        self._earlier_files_warned = False
        # Names of the event files other runs left in the directory before this run wrote:
        # their steps are not this run's (None until first needed, before this run writes).
        self._earlier: frozenset[str] | None = None
        # Each tag's steps in the event files, read when a replayed report's value is held
        # (backend_has_step); reset at open.
        self._steps_on_disk: dict[str, frozenset[int]] | None = None
        # Progress through the report being written: its stream and step, entries sent.
        self._pending: tuple[str, int] | None = None
        self._entries_done = 0

    def __repr__(self) -> str:
        return f"TensorBoardSink(log_dir={self._log_dir!r})"

    @classmethod
    def check_available(cls) -> None:
        """Raise ``ImportError`` with the install command if tensorboard is missing."""
        try:
            import tensorboard  # noqa: F401
        except ImportError as error:
            raise ImportError(f"TensorBoardSink needs tensorboard ({error}): {INSTALL}") from None

    @classmethod
    def option_names(cls) -> set[str] | None:
        """The constructor's options and ``SummaryWriter``'s, but ``purge_step`` (refused)."""
        from torch.utils.tensorboard import SummaryWriter

        options = signature_options(cls, SummaryWriter)
        return None if options is None else options - {"purge_step"}

    @property
    def log_dir(self) -> str:
        """The run's directory: given, loaded from a state dict, or the default one."""
        return self._log_dir

    @property
    def identity(self) -> str | None:
        """The log directory."""
        return self._log_dir

    @identity.setter
    def identity(self, value: str | None) -> None:
        self._saved_log_dir = value
        if value is not None and not self._log_dir_given:  # a given directory wins
            self._log_dir = value

    def open(self, run: RunInfo) -> None:
        """Create the writer; for a new run, record hyper-parameters and tags.

        Raises:
            PermanentSinkError: If tensorboard is not installed, or ``log_dir`` cannot be
                written (not a full disk: that is retried).
        """
        summary_writer = _summary_writer()
        if self._writer is not None:  # an earlier attempt that failed: end its writer
            self._discard_writer()
        earlier = self._earlier_runs_files()  # before this run's first file
        saved = self._saved_log_dir
        if (
            self.resumed
            and saved is not None
            and os.path.realpath(saved) != os.path.realpath(self._log_dir)  # a symlink: same
        ):
            self.warn_once(
                "other-log-dir",
                f"TensorBoardSink: the checkpoint's run is in {saved}, this sink writes "
                f"{self._log_dir} (the log_dir given wins; a relative one is resolved in the "
                "current working directory): TensorBoard shows the two as separate runs; give "
                "the checkpoint's directory as log_dir (or leave log_dir out) to continue it",
            )
        if not self.resumed and not self._earlier_files_warned:
            self._earlier_files_warned = True
            if earlier:
                logger.warning(
                    "TensorBoardSink: %s already holds %d event file(s) of an earlier run; "
                    "TensorBoard shows their points and this run's in the same charts, so its "
                    "steps may repeat earlier ones (give each job its own log_dir, or resume "
                    "from the earlier job's checkpoint)",
                    self._log_dir,
                    len(earlier),
                )
        try:
            self._new_writer(summary_writer)
        except OSError as error:
            if error.errno not in NOT_WRITABLE_ERRNOS:
                raise  # a full disk: retried
            raise PermanentSinkError(
                f"TensorBoardSink: {self._log_dir} cannot be written ({error}); give the sink "
                "a log_dir in a folder this process may write (its reports are kept: resume "
                "from a checkpoint, or replay the spool)"
            ) from error
        self._log_dir = str(self._writer.log_dir)
        self._opened = True
        self._steps_on_disk = None
        if self.resumed:
            # Reports delivered after the checkpoint was taken are already in the directory.
            self.found_values_in_backend(_last_steps_on_disk(self._log_dir, earlier))
            if self._wrote_before(earlier):
                return
            # Nothing of this run reached the directory (it never opened before the checkpoint
            # or the spool was kept): its hyper-parameters and name are written now.
        if run.config:
            flat = flatten_config(run.config, plain_types=_HPARAM_TYPES)
            self._write_hparams({key: _hparam(value) for key, value in flat.items()})
        if run.tags:
            lines = [f"| {_cell(key)} | {_cell(value)} |" for key, value in run.tags.items()]
            self._writer.add_text("tags", "\n".join(["| tag | value |", "|---|---|", *lines]), 0)
        if run.name:
            self._writer.add_text("run_name", run.name, 0)

    def _earlier_runs_files(self) -> frozenset[str]:
        """The event files of other runs in the directory, named before this run first writes.

        Read once, at the first ``open`` or ``state_dict``, and kept in the state, so a resumed
        job, a restarted child process and a replay tell them from this run's files. A state
        without them (an older checkpoint) takes every file for this run's.
        """
        if self._earlier is None:  # set by load_extra_state on resume
            self._earlier = frozenset(
                path.name for path in _event_files(self._log_dir) if not _holds_no_events(path)
            )
        return self._earlier

    def _wrote_before(self, earlier: frozenset[str]) -> bool:
        """Whether an event file of this run (not in ``earlier``) holds an event."""
        return any(
            not _holds_no_events(path)
            for path in _event_files(self._log_dir)
            if path.name not in earlier
        )

    def extra_state(self) -> dict[str, Any]:
        """The names of the earlier runs' event files in the log directory."""
        return {"earlier_files": sorted(self._earlier_runs_files())}

    def load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        """Read back the earlier runs' event files (none in an older checkpoint)."""
        names = state_dict.get("earlier_files", [])
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"state_dict['earlier_files']: expected a list of file names, got {names!r}"
            )
        self._earlier = frozenset(names)

    def _write_hparams(self, hparams: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # Written into this run's own event file (SummaryWriter.add_hparams would open a
        # separate sub-run directory for them).
        summaries = hparams_summary(hparams, {})  # type: ignore[no-untyped-call]
        file_writer = self._writer._get_file_writer()
        for summary in summaries:
            file_writer.add_summary(summary)

    def send(self, reports: Sequence[Report]) -> None:
        """Add each report's scalars and histograms at its step.

        Raises:
            RuntimeError: If the sink is not open. Entries written before a failure are not
                written again when the same report is retried.
            OSError: If the event file cannot be written (a full disk), naming the log
                directory; retried by the pipeline with a new event file.
        """
        if not self._opened:
            raise RuntimeError("TensorBoardSink.write: call open() first")
        # Held throughout: a checkpoint's flush (another thread) must not drop the writer
        # while this one writes to it.
        with self._writer_lock:
            try:
                self._ready_writer()
                for report in reports:
                    # After a new writer: what the old one got to disk is not written again.
                    self._send_one(self._without_held(report))
                    self.mark_sent(report)
            except OSError as error:
                self._discard_writer()  # it keeps failing: the retry makes a new one
                if error.filename is not None or error.errno is None:
                    raise
                # The event writer's error names no file ("No space left on device"): the
                # warning then said neither which directory nor which disk.
                raise OSError(error.errno, error.strerror, self._log_dir) from error
            except Exception:
                self._discard_writer()  # it keeps failing: the retry makes a new one
                raise

    def _ready_writer(self) -> None:
        """After a failed writer: a new one (a new event file), given the unconfirmed reports.

        TensorBoard's event writer stops for good at its first error (a full disk) and raises it
        on every later call, so the sink drops it and makes a new one once the retry comes.
        What the old writer got to disk is read back and not written again; the rest of the
        reports sent since the last confirmed flush are written into the new file. Called
        with ``_writer_lock`` held, by the sink's thread only (``send``, ``close``).
        """
        if self._writer is not None:
            return
        summary_writer = _summary_writer()
        assert self._log_dir is not None
        self._new_writer(summary_writer)
        self.found_values_in_backend(_last_steps_on_disk(self._log_dir, self._earlier_runs_files()))
        self._pending = None
        for report in self.pending_reports():
            self._send_one(self._without_held(report))

    def _new_writer(self, summary_writer: Any) -> None:
        """A ``SummaryWriter`` on the log directory; its event file is noted for a discard."""
        before = set(_event_files(self._log_dir))
        # Its thread re-raises its first write error (a traceback on stderr per writer, maybe
        # before the constructor returns): the sink reports the failure itself, once per streak.
        _SINK_DIRS.add(os.path.realpath(self._log_dir))
        silence_thread_errors(_is_sink_writer_thread)
        try:
            self._writer = summary_writer(log_dir=self._log_dir, **self._writer_kwargs)
        except Exception:
            # A full disk fails the file's first record: the file made for it stays empty.
            for path in _own_new_files(self._log_dir, before):
                _remove_if_empty(path)
            raise
        made = _own_new_files(self._log_dir, before)
        self._writer_file = made[0] if len(made) == 1 else None

    def _discard_writer(self) -> None:
        """Close a failed writer quietly (it re-raises its first error); lock held.

        Its event file goes too if it holds no event: a full disk would otherwise leave an
        empty file per retry, and a later job would take them for an earlier run's.
        """
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
            if self._writer_file is not None:
                _remove_if_empty(self._writer_file)

    def backend_has_step(self, name: str, step: int) -> bool:
        """Whether the event files hold tag ``name`` at ``step`` (read once, when first asked).

        ``False`` if they cannot be read: the value then counts as possibly missing.
        """
        if self._steps_on_disk is None:
            try:
                self._steps_on_disk = _steps_on_disk(self._log_dir, self._earlier_runs_files())
            except Exception:
                return False
        return step in self._steps_on_disk.get(name, frozenset())

    def _without_held(self, report: Report) -> Report:
        """``report`` less the values its tags' event files hold at its step or later."""
        held = set(self.values_in_backend(report))
        if not held:
            return report
        values = {k: v for k, v in report.values.items() if k not in held}
        histograms = {k: v for k, v in report.histograms.items() if k not in held}
        return dataclasses.replace(report, values=values, histograms=histograms)

    def _send_one(self, report: Report) -> None:
        if self._pending != (report.stream, report.step):
            self._pending, self._entries_done = (report.stream, report.step), 0
        entries: list[tuple[str, Any]] = [*report.values.items(), *report.histograms.items()]
        num_values = len(report.values)
        while self._entries_done < len(entries):
            index = self._entries_done
            tag, value = entries[index]
            if index < num_values:
                self._writer.add_scalar(
                    tag, float(value), global_step=report.step, walltime=report.time
                )
            else:
                self._add_histogram(tag, value, report)
            self._entries_done += 1
        self._pending = None

    def _add_histogram(self, tag: str, counts: Any, report: Report) -> None:
        if counts.dim() != 1 or counts.numel() == 0:
            self.skip_value(
                tag,
                f"TensorBoardSink: histogram {tag!r} skipped: expected 1-D bin counts, got "
                f"shape {tuple(counts.shape)}",
            )
            return
        try:
            weights = histogram_counts(counts.detach().double().cpu().tolist())
            edges = self._histogram_edges.edges(tag, len(weights), self.warn_once)
        except ValueError as error:
            self.skip_value(tag, f"TensorBoardSink: histogram {tag!r} skipped: {error}")
            return
        centers = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        occupied = [i for i, weight in enumerate(weights) if weight > 0]
        total = sum(weights)
        # Samples are known only by bin: min / max are the outer edges of the occupied bins and
        # the sums use bin centres.
        self._writer.add_histogram_raw(
            tag,
            min=edges[occupied[0]] if occupied else edges[0],
            max=edges[occupied[-1] + 1] if occupied else edges[0],
            num=total,
            sum=sum(w * c for w, c in zip(weights, centers, strict=True)),
            sum_squares=sum(w * c * c for w, c in zip(weights, centers, strict=True)),
            bucket_limits=edges[1:],
            bucket_counts=weights,
            global_step=report.step,
            walltime=report.time,
        )

    def persist(self, timeout: float | None) -> bool:
        """Write pending events to disk; return whether that ended within ``timeout`` s.

        Thread-safe (the writer's queue takes events from any thread), so a checkpoint may
        call it while the sink's thread writes. A writer that failed is replaced by the next
        ``write`` or ``close`` (the sink's thread), not here: False until then.
        """
        # Bounded: the sink's thread holds the lock through a write, and a write to a hung
        # disk would hold a checkpoint's call with it. One deadline for the lock and the
        # flush: each given the whole timeout, the call took up to twice it.
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._writer_lock.acquire(timeout=-1 if timeout is None else timeout):
            logger.warning("TensorBoardSink: a write did not end within %s s", timeout)
            return False
        try:
            writer = self._writer
        finally:
            self._writer_lock.release()
        if writer is None:
            # Opened: a failed writer not replaced yet. Closed: done, unless that close did
            # not end (a later flush must not count its events as on disk).
            return not self._opened and not self._unclosed
        finished, error = call_within(
            writer.flush, seconds_left(deadline), f"sidestream-{self.name}-flush"
        )
        if error is not None:
            with self._writer_lock:
                if self._writer is writer:  # not replaced meanwhile: the next write replaces it
                    self._discard_writer()
            # Named: the writer's error ("No space left on device") names no file.
            logger.warning(
                "TensorBoardSink: flush of %s failed: %s", self._log_dir, self.describe_error(error)
            )
            return False
        if not finished:
            logger.warning("TensorBoardSink: flush did not end within %s s", timeout)
        return finished

    def close(self, timeout: float | None = None) -> bool:
        """Flush and close the event file; return whether that ended within ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._writer_lock:
            if not self._opened:
                return True
            self._histogram_edges.warn_unmatched(self.warn_once)
            try:
                self._ready_writer()
            except Exception:
                self._discard_writer()
                raise
            writer, self._writer = self._writer, None
            self._opened = False
        if not self.within(writer.close, timeout, "close"):
            self._unclosed = True
            return False
        # The writer is gone: what was sent is on disk now. With what is left of the timeout,
        # not 0: a checkpoint's make_durable in persist on another thread holds the lock
        # flush takes, and flush(0) then said False (close failed, its last reports spooled
        # for a replay to write again) for a flush that would have ended at once.
        return self.closed_with_every_value(self.flush(seconds_left(deadline)))


_MIN_FLUSH_S = 0.01
"""The shortest ``flush_secs`` taken (the writer thread waits that long between flushes)."""

_SINK_DIRS: set[str] = set()
"""Log directories TensorBoard sinks of this process write to."""


def _is_sink_writer_thread(thread: threading.Thread) -> bool:
    """Whether ``thread`` is TensorBoard's writer thread of an event file a sink writes."""
    record_writer = getattr(thread, "_record_writer", None)
    filename = getattr(getattr(record_writer, "_writer", None), "filename", None)
    if type(thread).__name__ != "_AsyncWriterThread" or not isinstance(filename, str | bytes):
        return False
    return os.path.dirname(os.path.realpath(os.fsdecode(filename))) in _SINK_DIRS


def _check_writer_ranges(options: Mapping[str, Any]) -> None:
    """Refuse ``flush_secs`` and ``max_queue`` values that make the writer spin or unbounded.

    TensorBoard's writer thread busy-loops with a ``flush_secs`` that is not > 0, and nearly
    so with a tiny one (1e-6 s: a fifth of a core while idle); with NaN it never flushes on its
    own. A ``max_queue`` below 1 makes its queue unbounded.
    """
    flush_secs = options.get("flush_secs")
    if flush_secs is not None and not (math.isfinite(flush_secs) and flush_secs >= _MIN_FLUSH_S):
        raise ValueError(
            f"flush_secs: expected a finite number of seconds >= {_MIN_FLUSH_S}, got "
            f"{flush_secs!r} (TensorBoard's writer thread spins on shorter ones)"
        )
    max_queue = options.get("max_queue")
    if max_queue is not None and max_queue < 1:
        raise ValueError(f"max_queue: expected an int >= 1, got {max_queue!r}")


def _summary_writer() -> Any:
    """The ``SummaryWriter`` class of ``torch.utils.tensorboard``.

    Raises:
        PermanentSinkError: If tensorboard (which ``torch.utils.tensorboard`` imports) is not
            installed, naming the install command: a sink built by object is not checked for
            it when built, and a bare ``ModuleNotFoundError`` named no extra.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        message = f"TensorBoardSink: tensorboard is not installed ({error}); {INSTALL}"
        raise PermanentSinkError(message) from None
    return SummaryWriter


_LAST_DEFAULT: tuple[str, int] = ("", 0)
"""The latest default name (``_default_log_dir``) and the suffix number it was last given."""
_DEFAULTS_LOCK = threading.Lock()


def _default_log_dir(comment: str) -> str:
    """SummaryWriter's default directory, ``runs/<date>_<host><comment>``, as an absolute path.

    Its name changes once a second only: the sinks of a sweep's trials (or of a notebook cell
    run again) made within one second got one directory, and TensorBoard showed their points
    as one run's, steps repeated (or the second run was refused while the first was open). A
    name this process gave already, or that exists, gets ``-2``, ``-3``, ... after it.
    """
    import socket
    from datetime import datetime

    name = datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname() + comment
    base = os.path.abspath(os.path.join("runs", name))
    global _LAST_DEFAULT
    with _DEFAULTS_LOCK:
        # Only the latest name can be made again (the date in it moves on): nothing grows.
        number = (_LAST_DEFAULT[1] if _LAST_DEFAULT[0] == base else 0) + 1
        path = base if number == 1 else f"{base}-{number}"
        while os.path.lexists(path):
            number += 1
            path = f"{base}-{number}"
        _LAST_DEFAULT = (base, number)
    return path


def _last_steps_on_disk(log_dir: str, earlier: frozenset[str]) -> dict[str, int]:
    """The largest step of each scalar and histogram tag in this run's event files."""
    last: dict[str, int] = {}
    for tag, step in _points_on_disk(log_dir, earlier):
        if step > last.get(tag, -1):
            last[tag] = step
    return last


def _steps_on_disk(log_dir: str, earlier: frozenset[str]) -> dict[str, frozenset[int]]:
    """Every step of each scalar and histogram tag in this run's event files."""
    steps: dict[str, set[int]] = {}
    for tag, step in _points_on_disk(log_dir, earlier):
        steps.setdefault(tag, set()).add(step)
    return {tag: frozenset(found) for tag, found in steps.items()}


def _event_files(log_dir: str) -> list[Path]:
    return sorted(Path(log_dir).glob("*tfevents*"))


def _own_new_files(log_dir: str, before: set[Path]) -> list[Path]:
    """Event files made since ``before`` by this process.

    TensorBoard names each with the process id: another job's new files are never taken.
    """
    mark = f".{os.getpid()}."
    return [path for path in _event_files(log_dir) if path not in before and mark in path.name]


def _remove_if_empty(path: Path) -> None:
    if _holds_no_events(path):
        with contextlib.suppress(OSError):
            path.unlink()


def _holds_no_events(path: Path) -> bool:
    """Whether the event file at ``path`` is empty or holds only its version record.

    ``False`` where it cannot be read: a file that may hold data is never taken for empty.
    """
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    try:
        if path.stat().st_size == 0:
            return True
        return all(
            event.WhichOneof("what") == "file_version"
            for event in LegacyEventFileLoader(str(path)).Load()
        )
    except Exception:
        return False


def _points_on_disk(log_dir: str, earlier: frozenset[str]) -> Iterator[tuple[str, int]]:
    """``(tag, step)`` of each scalar and histogram in this run's event files of ``log_dir``.

    Files named in ``earlier`` are other runs' and skipped.
    """
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    for path in _event_files(log_dir):
        if path.name in earlier:
            continue
        for event in LegacyEventFileLoader(str(path)).Load():
            # Only what write() adds counts, not the hparams / text summaries of open().
            for value in event.summary.value:
                if value.HasField("simple_value") or value.HasField("histo"):
                    yield value.tag, int(event.step)
