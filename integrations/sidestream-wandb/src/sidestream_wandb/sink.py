"""The Weights & Biases sink: one W&B run per training job, one history row per report."""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import math
import os
import re
import secrets
import string
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from sidestream.sinks import PermanentSinkError, Report, RunInfo, TrackerSink, is_permanent
from sidestream.sinks.config import install_hint
from sidestream.sinks.support import (
    HistogramEdges,
    check_directory_path,
    check_option_types,
    close_before_backends_exit,
    failed_exit_code,
    flatten_config,
    histogram_counts,
    name_digest,
    redact,
    secrets_in,
    shorten,
    uri_without_password,
    working_directory_hint,
)
from sidestream.sinks.tracker import signature_options
from sidestream_wandb._transaction_log import TransactionLog

__all__ = ["FLUSH_INTERVAL_S", "MIN_WANDB_VERSION", "WandbSink", "step_metric"]

_SECRET_ENV = ("WANDB_API_KEY",)
_INIT_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("project", "entity", "name", "notes", "group", "job_type", "id"), (str,)),
    "dir": (str, os.PathLike),
}
"""``wandb.init``'s options, checked when the sink is made (``project=5`` would only fail when
rank 0 opens the sink, after training started)."""
_MAX_TAG_LENGTH = 64  # W&B rejects longer tags
_MAX_HISTOGRAM_BINS = 512  # wandb.Histogram's limit
#: Each stream's last logged step, in the run's local directory (outside the uploaded files/).
PROGRESS_FILE = "sidestream-steps.json"
#: wandb's setting for how often it writes buffered run data to the run's ``.wandb`` file.
FLUSH_SETTING = "x_transaction_log_flush_interval"
#: The sink's value for it unless the settings give one (wandb's own default is 15 s).
FLUSH_INTERVAL_S = 1.0
#: The oldest wandb the sink works with: the first with ``FLUSH_SETTING``. Older clients write
#: logged rows only when a 32 KiB buffer fills or after ``run.finish()`` returned, so the sink
#: could not tell which rows wandb has (the floor in sidestream-wandb's pyproject.toml).
MIN_WANDB_VERSION = "0.31"
# How long a logged row may take to reach wandb's writer before its next periodic write.
_FLUSH_MARGIN_S = 0.5
# How often a flush looks again whether a stalled service has written the rows.
_GROWTH_POLL_S = 0.05
INSTALL = install_hint("wandb")


class WandbSink(TrackerSink):
    """Logs every report as one W&B history row, against its stream's own step metric.

    ``open`` starts the run with ``wandb.init`` (its own run object, ``reinit="create_new"``,
    so a run the user started with ``wandb.init`` is left alone): the ``RunInfo`` name, its
    flattened hyper-parameters as the config and its tags as ``key:value`` W&B tags. ``write``
    logs scalars as they are and histograms (bin counts) as ``wandb.Histogram``.

    Streams: W&B's own step must only grow, so reports are not logged with ``step=``.
    Instead each stream gets a step metric (``train/step`` for the stream ``train``, ``step``
    for ``Run.log``'s) declared with ``define_metric``, and every row carries it: a
    validation window at step 500 that arrives after training windows up to 520 is kept and
    plotted at 500. Chart against ``<stream>/step``. A report at or below its stream's last
    delivered step is skipped.

    Resume: ``state_dict()`` holds the run id, the last delivered step per stream and the run's
    local directory; after ``load_state_dict`` the next ``open`` passes that id with
    ``resume="allow"``. Online this continues the same run on the server. Offline, W&B writes a
    new ``offline-run-*-<id>`` directory with the same run id; ``wandb sync`` the directories in
    order to join them. Steps delivered after the checkpoint was taken are skipped either way:
    the sink keeps each stream's last logged step in ``sidestream-steps.json`` in the run's
    directory (outside ``files/``, so it is not uploaded), written once ``finish`` returned,
    and reads it back on resume. A sink opened again after its ``close`` continues its run the
    same way (a fork or rewind it made is not made again).

    Delivered: wandb has no call that writes logged rows out and confirms it. Its service
    (wandb 0.31 or later, ``MIN_WANDB_VERSION``, which the sink needs: older clients write rows
    only when the run finishes) writes buffered rows to the run's ``.wandb`` file every
    ``x_transaction_log_flush_interval`` seconds, which the sink sets to
    ``FLUSH_INTERVAL_S`` (1 s) unless ``settings`` give it. The sink reads the file back: a
    row counts as delivered (in ``state_dict``) once its record is in the file whole, never
    before, even after ``finish`` returned (a full disk, a deleted run directory: wandb only
    logs the error); ``flush`` and a checkpoint's ``make_durable`` wait for the rows logged so
    far (given less time, they still count the rows already written). Without a ``.wandb``
    file to read (``x_skip_transaction_log``, a layout this reader does not know) a row counts
    once the interval plus a margin passed since it was logged and wandb's service is alive.

    Args:
        project: W&B project.
        histogram_edges: Bin edges per histogram name (``num_bins + 1`` values); bins without
            edges span ``[i, i + 1)``.
        **init_kwargs: Passed to ``wandb.init`` under W&B's own names (``mode``, ``dir``,
            ``entity``, ``name``, ``id``, ``group``, ``settings``, ...). ``name``, ``config``
            and ``tags`` given here override / extend those from ``RunInfo``.

    Example:
        >>> sink = WandbSink(project="demo", mode="offline", dir="/tmp/wandb-demo")
    """

    name = "wandb"
    durable_on_send = False  # rows count once persist says wandb wrote them (see above)
    skips_values = True  # a histogram it cannot take (skip_value)
    _own_locks = ("_lock", "_unwritten_lock", "_progress_lock")

    def __init__(
        self,
        project: str | None = None,
        *,
        histogram_edges: Mapping[str, Sequence[float]] | None = None,
        **init_kwargs: Any,
    ) -> None:
        super().__init__()
        self._init_kwargs = dict(init_kwargs)
        if project is not None:
            self._init_kwargs["project"] = project
        _refuse_old_wandb()  # built directly, not by sinks_from_config (check_available)
        self.refuse_unknown_options(init_kwargs)
        check_option_types("WandbSink", self._init_kwargs, _INIT_OPTION_TYPES)
        self._histogram_edges = HistogramEdges(histogram_edges, "WandbSink")
        _check_branching(self._init_kwargs)  # before _check_settings: it names the options
        _check_settings(self._init_kwargs)
        _check_environment(self._init_kwargs)
        _check_run_options(self._init_kwargs)
        if self._init_kwargs.get("dir") is not None:
            # wandb falls back to a temporary folder, silently, for a dir it cannot make.
            check_directory_path("dir", self._init_kwargs["dir"])
        self._run: Any = None
        # Made here, not by wandb.init: a checkpoint taken before the sink could open (W&B
        # unreachable) still names the run, so the resumed job continues it, not a second one.
        # Unless wandb is to pick the run itself: WANDB_RUN_ID (a requeued job), resume="auto",
        # or a fork / rewind of another run (which wandb refuses together with an id).
        self._run_id: str | None = self._init_kwargs.pop("id", None) or _initial_run_id(
            self._init_kwargs
        )
        # Whether wandb.init made the run once already (this sink opened before): an open
        # after a close continues it, as a resumed job does, instead of forking or rewinding
        # again (wandb makes a second fork under the same id, or refuses it online).
        self._run_made = False
        self._defined: set[str] = set()  # names given a step metric with define_metric
        self._logged: dict[str, int] = {}  # last step per stream handed to W&B by this sink
        self._previous_dir: str | None = None  # the run directory of the checkpointed job
        # Seconds between wandb's writes of buffered rows to the .wandb file, set at open;
        # None: never opened (nothing logged to wait for).
        self._flush_interval: float | None = None
        self._last_log = 0.0  # time.monotonic() when the last row was handed to wandb
        # (time.monotonic(), .wandb file size before the row, stream, step) of each row logged
        # and not counted as written yet, oldest first: under a steady backlog persist never
        # sees a quiet interval, but a row logged an interval (plus the margin) ago is in the
        # file by then, if the file grew since (a stalled service writes nothing).
        self._unwritten: deque[tuple[float, int | None, str, int]] = deque()
        self._data_file: str | None = None  # the run's .wandb file (absolute), found at open
        self._local_dir = ""  # the open run's directory (absolute), set at open
        self._size_before_last_log: int | None = None
        self._unwritten_lock = threading.Lock()
        self._progress_lock = threading.Lock()
        self._finished = False
        self._disabled = False  # mode="disabled": nothing is kept anywhere
        self._service_pid: int | None = None  # wandb-core, found at open
        # The rows wandb has written to the .wandb file, read back from it.
        self._log: TransactionLog | None = None
        self._handed: dict[str, int] = {}  # last step per stream given to run.log since open
        self._where: dict[str, str] = {}  # project, entity and dir of the open run
        self._progress: dict[str, int] = {}  # the steps last written to the progress file

    @classmethod
    def check_available(cls) -> None:
        """Raise ``ImportError`` with the install command if wandb is missing or too old."""
        try:
            import wandb  # noqa: F401
        except ImportError as error:
            raise ImportError(f"WandbSink needs wandb ({error}): {INSTALL}") from None
        _refuse_old_wandb()

    @classmethod
    def option_names(cls) -> set[str] | None:
        """The constructor's options and ``wandb.init``'s (minus ``config``/``tags`` merging)."""
        import wandb

        return signature_options(cls, wandb.init)

    def __repr__(self) -> str:
        return (
            f"WandbSink(project={self._init_kwargs.get('project')!r}, "
            f"mode={self._init_kwargs.get('mode')!r}, run_id={self._run_id!r})"
        )

    @property
    def run_id(self) -> str | None:
        """The W&B run id: given, loaded from a state dict, or made by the sink.

        Given: ``id=`` or ``WANDB_RUN_ID``. ``None`` until ``open`` when wandb picks it
        (``resume="auto"``, ``fork_from``, ``resume_from``).
        """
        return self._run_id

    @property
    def identity(self) -> str | None:
        """The run id."""
        return self._run_id

    @identity.setter
    def identity(self, value: str | None) -> None:
        if value is not None:  # a state saved before ids were made here may have none
            self._run_id = value

    @property
    def run_dir(self) -> str | None:
        """The local directory of the open run (where an offline run's ``.wandb`` file is)."""
        return None if self._run is None else self._local_dir

    def describe_error(self, error: BaseException) -> str:
        """``error`` as text with the API key removed."""
        return redact(f"{type(error).__name__}: {error}", secrets_in(_SECRET_ENV))

    def _failure(self, what: str, error: BaseException) -> RuntimeError:
        # Unchained and redacted; the kind (permanent or not) survives in the class.
        kind = PermanentSinkError if is_permanent(error) or _is_usage(error) else RuntimeError
        hint = working_directory_hint(error)
        return kind(f"WandbSink: {what} failed: {self.describe_error(error)}{hint}")

    def open(self, run: RunInfo) -> None:
        """Start the run, or continue the one from ``load_state_dict`` / ``id=``.

        Raises:
            PermanentSinkError: If wandb is not installed or rejects the arguments.
            RuntimeError: If ``wandb.init`` failed (message redacted of the API key).
        """
        try:
            import wandb
        except ImportError as error:
            message = f"WandbSink: wandb is not installed ({error}); {INSTALL}"
            raise PermanentSinkError(message) from None

        kwargs = dict(self._init_kwargs)
        if run.name is not None:
            kwargs.setdefault("name", run.name)
        config = flatten_config(run.config)
        config.update(flatten_config(kwargs.pop("config", None) or {}))
        # wandb writes a NaN into the config as null (infinities it keeps): the text keeps it,
        # as MLflow's params and TensorBoard's hparams show it.
        config = {
            key: "nan" if isinstance(value, float) and math.isnan(value) else value
            for key, value in config.items()
        }
        # Only "" makes a bare tag (RunInfo's documented way): a value 0 or False is a value.
        tags = [
            shorten(f"{k}:{v}" if str(v) else str(k), _MAX_TAG_LENGTH) for k, v in run.tags.items()
        ]
        tags += list(kwargs.pop("tags", None) or [])
        if self._run_id is not None:
            kwargs["id"] = self._run_id
            if self.resumed or self._run_made:
                # The checkpointed job, or this sink's earlier open, made the fork or rewind:
                # continue that run, not branch again (with resume="allow", wandb refuses
                # fork_from and resume_from anyway).
                kwargs.pop("fork_from", None)
                kwargs.pop("resume_from", None)
            if kwargs.get("fork_from") is None and kwargs.get("resume_from") is None:
                kwargs.setdefault("resume", "allow")
        kwargs.setdefault("reinit", "create_new")
        settings, self._flush_interval = _with_flush_interval(kwargs.get("settings"))
        kwargs["settings"] = settings
        failure: RuntimeError | None = None
        try:
            self._run = wandb.init(config=config, tags=tags or None, **kwargs)
        except Exception as error:
            failure = self._failure("wandb.init", error)
        if failure is not None:
            raise failure  # outside the handler: the original is not chained as its context
        self._run_id = str(self._run.id)
        self._run_made = True  # before anything below can fail: a retried open continues it
        self._service_pid = _service_process()
        # Absolute, as both paths are taken now: the script may change its working directory.
        self._local_dir = os.path.abspath(str(self._run.dir).removesuffix("/files"))
        self._data_file = _data_file_of(self._run)
        with self._unwritten_lock:  # rows of an earlier run of this sink were in its own file
            self._unwritten.clear()
            self._handed.clear()
            # A file of a layout this reader does not know (another wandb): rows count by time.
            self._log = (
                None
                if self._data_file is None or not TransactionLog.readable(self._data_file)
                else TransactionLog(self._data_file)
            )
        with self._progress_lock:
            self._progress = {}
        # Where the run is, as wandb resolved it (WANDB_PROJECT, a relative dir), for a replay.
        self._where = {
            key: value
            for key, value in (
                ("project", getattr(self._run, "project", None)),
                ("entity", getattr(self._run, "entity", None)),
                ("mode", getattr(getattr(self._run, "settings", None), "mode", None)),
                ("dir", os.path.dirname(os.path.dirname(self._local_dir))),
                ("base_url", _own_server(wandb, self._run)),
            )
            if isinstance(value, str) and value
        }
        # wandb.init registered the teardown of its service at exit: a Run closed at exit
        # must still find it there.
        close_before_backends_exit()
        self._last_log, self._size_before_last_log = 0.0, None
        self._finished = False
        # mode="disabled": wandb keeps nothing, so there is no write to wait for or record.
        self._disabled = getattr(getattr(self._run, "settings", None), "mode", None) == "disabled"
        self._warn_if_not_in_given_dir()
        self._defined.clear()
        if self.resumed:
            # Steps logged after the checkpoint was taken: in the progress files of the earlier
            # jobs of this run (the checkpointed one, and any other directory of this run id
            # beside this one: a checkpoint taken before the sink opened names no directory),
            # and online also in the run's summary.
            earlier = _earlier_run_dirs(self.run_dir, self._run_id)
            for directory in {self._previous_dir, *earlier}:
                progress = _read_progress(directory)
                self.found_in_backend(progress)
                # And the rows in its .wandb file: a job whose wandb service stalled, then
                # wrote them after its close gave up, never brought the progress file up to
                # date (a replay of its kept spool wrote them all again).
                streams = {*progress, *self.last_steps()}
                self.found_in_backend(_rows_in_files(directory, streams))
            self.found_in_backend(self._steps_in_summary())
        self._logged = self.last_steps()

    def _steps_in_summary(self) -> dict[str, int]:
        found: dict[str, int] = {}
        summary = getattr(self._run, "summary", None)
        for stream in self.last_steps():
            try:
                value = summary.get(step_metric(stream)) if summary is not None else None
            except Exception:  # an offline or older client: nothing to learn
                value = None
            if isinstance(value, int | float) and not isinstance(value, bool):
                found[stream] = int(value)
        return found

    def send(self, reports: Sequence[Report]) -> None:
        """Log each report as one history row, with its stream's step metric.

        Raises:
            RuntimeError: If the sink is not open or ``run.log`` failed (redacted message).
        """
        if self._run is None:
            raise RuntimeError("WandbSink.write: call open() first")
        import wandb

        for report in reports:
            key = step_metric(report.stream)
            row: dict[str, Any] = {self._column(n): v for n, v in report.values.items()}
            for name, counts in report.histograms.items():
                histogram = self._histogram(wandb, name, counts)
                if histogram is not None:
                    row[self._column(name)] = histogram
            failure: RuntimeError | None = None
            try:
                self._define(key, row)
                row[key] = report.step
                # W&B's wall time of the row: the report's, as MLflow and TensorBoard keep it,
                # not when the row reached wandb (after wandb.init, a backlog, or a resume).
                row["_timestamp"] = report.time
                size_before = self._data_size()
                self._run.log(row, commit=True)
            except ConnectionError as error:
                # run.log only talks to wandb's local service process: a broken connection
                # means that process is gone, and this run object can take no more rows.
                failure = PermanentSinkError(
                    f"WandbSink: log at {key}={report.step} failed: wandb's service process "
                    f"is gone ({self.describe_error(error)}), so this run takes no more rows; "
                    "resume the job from its last checkpoint (it holds the rows not written "
                    "yet, and the steps after it are logged again)"
                )
            except Exception as error:
                failure = self._failure(f"log at {key}={report.step}", error)
            if failure is not None:
                raise failure  # outside the handler: the original is not chained as context
            self._last_log = time.monotonic()
            self._size_before_last_log = size_before
            # Handed before sent: a flush from another thread that counts the row as sent
            # then waits for it in the file too.
            with self._unwritten_lock:
                self._handed[report.stream] = report.step
                if self._log is None and self._counts_by_time():
                    self._unwritten.append(
                        (self._last_log, size_before, report.stream, report.step)
                    )
            self.mark_sent(report)
            self._logged[report.stream] = report.step
        self._count_written()

    def _count_written(self) -> None:
        """Count the rows in the ``.wandb`` file as delivered (without one: by time)."""
        if self._disabled:
            return
        written = self._rows_in_file() if self._log is not None else self._rows_by_time()
        if written:
            self.count_delivered(written)
            # Under the lock: send and a checkpoint's flush both count, and an older set of
            # steps written last would stand.
            with self._progress_lock:
                steps = self.last_steps()
                if self._local_dir and steps != self._progress:
                    # What counts as delivered is in the .wandb file: a job that crashes from
                    # here on resumes past it (the rows logged since may be lost). Not noted
                    # as written when the write failed (a full disk): the next count tries again.
                    recorded = self._write_progress(self._local_dir, steps)
                    self._progress = steps if recorded else {}

    def _rows_in_file(self) -> dict[str, int]:
        """Each stream's last step whose row is in the ``.wandb`` file whole."""
        assert self._log is not None
        with self._unwritten_lock:
            streams = list(self._handed)
            try:
                found = self._log.last_steps()
            except OSError as error:
                self.warn_once(
                    "unreadable",
                    f"WandbSink: cannot read the run's .wandb file ({error}); the rows logged "
                    "since do not count as delivered (a checkpoint keeps them, close spools "
                    "them)",
                )
                return {}
            if self._log.damaged:
                self.warn_once(
                    "damaged",
                    f"WandbSink: {self._log.path} has a damaged record (a failed write: a full "
                    "disk?); the rows after it do not count as delivered (a checkpoint keeps "
                    "them, close spools them)",
                )
        return {
            stream: found[step_metric(stream)] for stream in streams if step_metric(stream) in found
        }

    def _counts_by_time(self) -> bool:
        """Whether rows count by time (``_rows_by_time``), which takes them off ``_unwritten``.

        Not for ``mode="disabled"`` (nothing is kept), nor without a periodic write (an
        interval of 0): only a persist at finish counts those rows, and a row held for
        ``_rows_by_time`` would stay for good, one per row for the whole job.
        """
        return not self._disabled and self._flush_interval is not None and self._flush_interval > 0

    def _rows_by_time(self) -> dict[str, int]:
        """Rows logged at least one periodic write (plus the margin) ago, the file grown since.

        For a run without a ``.wandb`` file to read (``x_skip_transaction_log``).
        """
        if self._flush_interval is None or self._flush_interval <= 0:
            return {}  # never opened, or no periodic write: only persist at finish can say
        if not self._service_alive():
            return {}  # it may have died before its periodic write: the rows stay unconfirmed
        written: dict[str, int] = {}
        cutoff = time.monotonic() - self._flush_interval - _FLUSH_MARGIN_S
        size = self._data_size()
        with self._unwritten_lock:
            while self._unwritten and self._unwritten[0][0] <= cutoff:
                if not _grown(size, self._unwritten[0][1]):
                    break  # nothing written since it was logged: a stalled service or disk
                _, _, stream, step = self._unwritten.popleft()
                written[stream] = step  # steps of a stream are logged in increasing order
        return written

    def flush(self, timeout: float | None = None) -> bool:
        """``persist``; if it cannot wait long enough, the rows already written still count."""
        done = super().flush(timeout)
        self._count_written()  # also drains the rows a whole persist counted already
        return done

    def persist(self, timeout: float | None) -> bool:
        """Wait until every row logged so far is in the run's ``.wandb`` file.

        wandb writes buffered rows there every ``x_transaction_log_flush_interval`` seconds;
        the sink reads them back. A stalled service (a blocked disk, a stopped process) gets
        one more interval, then the rows stay unconfirmed (a checkpoint keeps them) instead of
        the caller waiting on. False if ``timeout`` is shorter, if the service died or stalled,
        if the interval is 0 (wandb then writes rows only when a buffer fills or at
        ``finish``), or if ``finish`` returned without writing them all (a full disk).
        """
        if self._flush_interval is None or self._disabled:
            return True  # never opened, or nothing kept
        if self._log is None:
            return self._persist_by_time(timeout)
        with self._unwritten_lock:
            logged = dict(self._handed)  # later rows are the next flush's
        if self._all_in_file(logged):
            return True
        if self._flush_interval <= 0 and not self._finished:
            return False
        period = max(self._flush_interval, 0.0) + _FLUSH_MARGIN_S
        start = time.monotonic()
        if self._finished:
            # finish wrote them: its last block may reach the file a moment after it returned.
            waited_enough = start + period
        else:
            # The rows' periodic write, and one more for a service slow to write them; at least
            # one from now (a service stalled for a while may be writing again).
            waited_enough = max(self._last_log + 2 * period, start + period)
        deadline = waited_enough if timeout is None else min(waited_enough, start + timeout)
        while time.monotonic() < deadline and (self._finished or self._service_alive()):
            time.sleep(_GROWTH_POLL_S)
            if self._all_in_file(logged):
                return True
        if time.monotonic() < waited_enough:
            return False  # given less time than that: not a sign of trouble yet
        if self._finished:
            self.warn_once(
                "lost",
                f"WandbSink: wandb's finish returned, but {self._log.path} lacks rows logged "
                "before it, or is gone (wandb's debug-internal.log says why: a full disk?); "
                "they do not count as delivered",
            )
        else:
            age = time.monotonic() - self._last_log
            self.warn_once(
                "stalled",
                f"WandbSink: rows logged {age:.1f} s ago are not in {self._log.path}: "
                "wandb's service seems stalled or gone; those rows do not count as delivered "
                "yet",
            )
        return False

    def _all_in_file(self, logged: Mapping[str, int]) -> bool:
        """Whether the ``.wandb`` file holds each stream's row at ``logged[stream]``."""
        written = self._rows_in_file()
        return all(written.get(stream, step - 1) >= step for stream, step in logged.items())

    def _persist_by_time(self, timeout: float | None) -> bool:
        """``persist`` without a ``.wandb`` file to read: rows count by time and file growth.

        That is the interval plus a margin after the last ``run.log``, and the file grown
        since then, which a stalled service gets one more interval for.
        """
        if self._finished:
            return True
        if self._flush_interval is None or self._flush_interval <= 0:
            return False
        # The rows logged by now; later ones are the next flush's.
        period = self._flush_interval + _FLUSH_MARGIN_S
        last_log, size_before = self._last_log, self._size_before_last_log
        start = time.monotonic()
        wait = last_log + period - start
        if wait > 0:
            if timeout is not None and wait > timeout:
                return False
            time.sleep(wait)
        deadline = time.monotonic() + period
        if timeout is not None:
            deadline = min(deadline, start + timeout)
        while self._service_alive():
            if _grown(self._data_size(), size_before):
                return True
            if time.monotonic() >= deadline:
                self.warn_once(
                    "stalled",
                    f"WandbSink: the run's .wandb file did not grow within {period:.1f} s of "
                    "the last row's periodic write: wandb's service seems stalled; those rows "
                    "do not count as delivered yet",
                )
                return False
            time.sleep(_GROWTH_POLL_S)
        return False

    def _data_size(self) -> int | None:
        """The size of the run's ``.wandb`` file; None without one to look at (no check)."""
        if self._data_file is None:
            return None
        try:
            return os.stat(self._data_file).st_size
        except OSError:
            return -1  # gone since open: nothing counts as written

    def _service_alive(self) -> bool:
        """Whether wandb's service process (if this process started it) is still running.

        Rows count by time since they were logged; that holds only while the service that
        writes them lives. Unknown (not found at open, or not Linux) counts as alive.
        """
        return self._service_pid is None or _process_running(self._service_pid)

    def _write_progress(self, run_dir: str, last_steps: Mapping[str, int]) -> bool:
        """Record each stream's last step in the ``.wandb`` file next to the run (for resume).

        Written with the steps that count as delivered (wandb's periodic write has put them in
        the file, see ``_count_written``) and once ``finish`` has returned, never with steps
        only handed to ``run.log``: wandb keeps those in memory until its next write, so a
        crashed job loses them, and a resumed job that skipped them would never log them.

        Also written into the checkpointed job's run directory when this job resumed from it:
        a job that crashes before its own first checkpoint is resumed from that same
        checkpoint, which names only that directory, so the steps this job delivered are
        found there too. Called with ``_progress_lock`` held.

        Returns:
            Whether every directory's file was written (a full disk fails it, warned once).
        """
        directories = [run_dir]
        previous = self._previous_dir
        if previous is not None and previous != run_dir and Path(previous).is_dir():
            directories.append(previous)
        text = json.dumps(dict(last_steps))
        written = True
        for directory in directories:
            path = Path(directory) / PROGRESS_FILE
            temporary = path.with_suffix(".tmp")
            try:
                temporary.write_text(text)
                os.replace(temporary, path)
            except OSError as error:
                written = False
                # A full disk makes the file and fails its write: an empty
                # sidestream-steps.tmp was left in the run's directory.
                with contextlib.suppress(OSError):
                    temporary.unlink()
                self.warn_once("progress", f"WandbSink: cannot write {path}: {error}")
        return written

    def extra_state(self) -> dict[str, Any]:
        """The run's local directory (where the progress file is)."""
        return {"run_dir": self.run_dir or self._previous_dir}

    def replay_options(self) -> dict[str, Any]:
        """Where the run is (project, entity, mode, group, job type, dir, server), for a replay.

        A replay given only ``--sink wandb`` then continues the job's run in its project on its
        server, not a run of the same id in wandb's default project on W&B's cloud. The server
        is kept as ``settings={"base_url": ...}`` when it is not wandb's default (a password
        in it hidden as ``***``): once the run opened as wandb resolved it (from the settings,
        ``WANDB_BASE_URL`` or ``wandb login --host``), before that (a server down for the whole
        job) from ``settings`` or ``WANDB_BASE_URL``.
        """
        options: dict[str, Any] = {
            key: self._init_kwargs[key]
            for key in ("project", "entity", "mode", "group", "job_type")
            if isinstance(self._init_kwargs.get(key), str)
        }
        if self._init_kwargs.get("dir") is not None:
            options["dir"] = os.path.abspath(os.fspath(self._init_kwargs["dir"]))
        where = dict(self._where)  # once opened: as wandb resolved them
        # Before open (the server may have been down for the whole job): as given.
        base_url = where.pop("base_url", None) or _given_server(self._init_kwargs)
        options.update(where)
        if base_url is not None:
            options["settings"] = {"base_url": uri_without_password(base_url)}
        return options

    def load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        """Remember the saved run directory."""
        run_dir = state_dict.get("run_dir")
        self._previous_dir = run_dir if isinstance(run_dir, str) else None

    def _define(self, key: str, row: Mapping[str, Any]) -> None:
        """Plot the row's names against the stream's step metric (declared once per name).

        Each name is declared by itself, not with a ``<stream>/*`` glob: a glob also takes the
        names of a nested stream (``val/*`` matches ``val/ood/loss``, which wandb then
        charted, and filled, with ``val/step``), and misses a value named as its stream
        (``train`` of a one-metric collector with prefix ``train``). Names are declared
        escaped (``_metric_name``): wandb reads a ``.`` in a declared name as a level of
        nesting.
        """
        if key not in self._defined:
            self._run.define_metric(_metric_name(key))
            self._defined.add(key)
        for name in row.keys() - self._defined:
            self._run.define_metric(_metric_name(name), step_metric=_metric_name(key))
            self._defined.add(name)

    def _column(self, name: str) -> str:
        """The W&B column of a value: its name, unless W&B or a stream's step owns that name.

        W&B keeps top-level names starting with ``_`` for itself (``_step``, ``_runtime``,
        ``_timestamp``), and each stream's step is written under ``step`` or
        ``<stream>/step``: a value of such a name would overwrite one or be overwritten. A
        ``*`` cannot be declared with ``define_metric``. Such a value gets a column of its own,
        with a digest of the name (``*`` as ``_``), like MLflow's sink does for names MLflow
        refuses; warned once per name.
        """
        is_step = name == "step" or name.endswith("/step")
        is_pattern = "*" in name
        if not is_step and not is_pattern and not (name.startswith("_") and "/" not in name):
            return name
        column = f"{name.lstrip('_').replace('*', '_') or 'value'}-{name_digest(name)}"
        if is_pattern:
            why = "W&B's define_metric reads '*' as a pattern, and refuses it inside a name"
        elif is_step:
            why = "W&B columns named 'step' or '<stream>/step' hold the streams' steps"
        else:
            why = "W&B keeps names starting with '_' for itself"
        self.warn_once(f"column:{name}", f"WandbSink: {name!r} is logged as {column!r}: {why}")
        return column

    def _warn_if_not_in_given_dir(self) -> None:
        """Warn if wandb keeps the open run outside the ``dir`` it was given.

        wandb falls back to a temporary folder, silently, for a dir it cannot write (and
        always when disabled, which is no mistake).
        """
        given_dir = self._init_kwargs.get("dir")
        given_as = "dir"
        if given_dir is None:
            # wandb.init reads WANDB_DIR for a dir not given, and falls back from it as
            # silently: a run looked for in WANDB_DIR would seem lost.
            given_dir = _environment_dir(self._init_kwargs)
            given_as = "the environment variable WANDB_DIR"
        if given_dir is None or self._disabled:
            return
        wanted = os.path.realpath(os.path.expanduser(os.fspath(given_dir)))
        if os.path.commonpath([wanted, os.path.realpath(self._local_dir)]) != wanted:
            self.warn_once(
                "dir",
                f"WandbSink: wandb could not write in {given_as}={os.fspath(given_dir)!r} "
                f"and keeps the run in {self._local_dir} instead (a read-only folder?)",
            )

    def _histogram(self, wandb: Any, name: str, counts: Any) -> Any:
        """``counts`` as a ``wandb.Histogram``, or ``None`` if skipped (and warned).

        Raises:
            PermanentSinkError: If torch cannot hand the counts to numpy (numpy missing, or
                one this torch build cannot use): every later histogram fails the same way.
        """
        on_cpu = counts.detach().reshape(-1).double().cpu()
        try:
            flat = on_cpu.numpy()
        except RuntimeError as error:
            # torch's "Numpy is not available": a RuntimeError, which is_permanent takes for
            # transient, so the pipeline retried the same report forever.
            raise PermanentSinkError(
                f"WandbSink: histogram {name!r} needs numpy, which torch cannot use "
                f"({error}): pip install numpy, or {INSTALL}"
            ) from None
        if counts.dim() != 1 or not 1 <= flat.size <= _MAX_HISTOGRAM_BINS:
            self.skip_value(
                name,
                f"WandbSink: histogram {name!r} skipped: expected 1-D bin counts with 1 to "
                f"{_MAX_HISTOGRAM_BINS} bins, got shape {tuple(counts.shape)}",
            )
            return None
        try:
            weights = histogram_counts(flat.tolist())
            edges = self._histogram_edges.edges(name, flat.size, self.warn_once)
        except ValueError as error:
            self.skip_value(name, f"WandbSink: histogram {name!r} skipped: {error}")
            return None
        return wandb.Histogram(np_histogram=(weights, edges))

    def close(self, timeout: float | None = None) -> bool:
        """``run.finish()``; whether it finished within ``timeout`` s with every row written.

        False too if ``finish`` returned but rows are missing from the ``.wandb`` file (a full
        disk, a deleted run directory): they stay unconfirmed, and the pipeline keeps them.
        """
        if self._run is None:
            return True
        self._histogram_edges.warn_unmatched(self.warn_once)
        active, self._run = self._run, None
        deadline = None if timeout is None else time.monotonic() + timeout
        code = failed_exit_code()  # closed at exit after an uncaught exception: failed
        finish = active.finish if code is None else functools.partial(active.finish, code)
        finished = self.within(finish, timeout, "finish")
        if not finished:
            self._count_written()  # what wandb wrote before it failed still counts
            return False
        self._finished = True
        # Every row is in the file now, unless wandb failed to write it.
        written = self.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._log is None and not self._disabled:
            # Every row is written: a resume may skip them all.
            with self._progress_lock:
                self._write_progress(self._local_dir, self._logged)
        return self.closed_with_every_value(written)


def _own_server(wandb: Any, run: Any) -> str | None:
    """The run's W&B server as wandb resolved it, or ``None`` for wandb's default one."""
    base_url = getattr(getattr(run, "settings", None), "base_url", None)
    return _unless_default(base_url, getattr(wandb, "Settings", None))


def _given_server(init_kwargs: Mapping[str, Any]) -> str | None:
    """The server the sink's ``settings`` or ``WANDB_BASE_URL`` name, before ``wandb.init``."""
    settings = init_kwargs.get("settings")
    if isinstance(settings, Mapping):
        given = settings.get("base_url")
    elif "base_url" in getattr(settings, "model_fields_set", ()):
        given = getattr(settings, "base_url", None)
    else:
        given = None
    return _unless_default(given or os.environ.get("WANDB_BASE_URL"), _settings_type())


def _unless_default(base_url: object, settings_type: Any) -> str | None:
    """``base_url`` unless it is empty or wandb's default server."""
    default = getattr(settings_type, "model_fields", {}).get("base_url")
    if not isinstance(base_url, str) or not base_url:
        return None
    if base_url.rstrip("/") == str(getattr(default, "default", "")).rstrip("/"):
        return None
    return base_url


def _with_flush_interval(settings: Any) -> tuple[Any, float]:
    """``settings`` with wandb's periodic write every ``FLUSH_INTERVAL_S`` unless they set it.

    Returns:
        The settings to pass to ``wandb.init`` and the interval in effect.
    """
    if settings is None:
        return {FLUSH_SETTING: FLUSH_INTERVAL_S}, FLUSH_INTERVAL_S
    if isinstance(settings, Mapping):
        chosen = dict(settings)
        chosen.setdefault(FLUSH_SETTING, FLUSH_INTERVAL_S)
        return chosen, float(chosen[FLUSH_SETTING])
    if FLUSH_SETTING not in getattr(settings, "model_fields_set", set()):
        settings = settings.model_copy()
        setattr(settings, FLUSH_SETTING, FLUSH_INTERVAL_S)
    return settings, float(getattr(settings, FLUSH_SETTING))


def _service_process() -> int | None:
    """The pid of the ``wandb-core`` child of this process (Linux ``/proc``), or ``None``."""
    me = os.getpid()
    try:
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    for entry in entries:
        stat = _proc_stat(int(entry))
        if stat is not None and stat[2] == me and "wandb-core" in stat[0]:
            return int(entry)
    return None


def _data_file_of(run: Any) -> str | None:
    """The run's ``.wandb`` transaction log as an absolute path, or None if there is none.

    None for ``mode="disabled"``, ``x_skip_transaction_log`` or a file that ``wandb.init``
    did not create: rows then count by time alone.
    """
    try:
        settings = run.settings
        path = settings.sync_file
        skipped = bool(getattr(settings, "x_skip_transaction_log", False))
    except Exception:
        return None
    if skipped or not isinstance(path, str) or not os.path.isfile(path):
        return None
    # Absolute: the training script may change its working directory later.
    return os.path.abspath(path)


def _grown(size: int | None, before: int | None) -> bool:
    """Whether the file grew from ``before`` to ``size`` (either unknown: no check)."""
    return size is None or before is None or size > before


def _process_running(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[1] not in ("Z", "X")  # a zombie is dead, not yet reaped


def _proc_stat(pid: int) -> tuple[str, str, int] | None:
    """``(name, state, parent pid)`` of process ``pid`` from ``/proc``, or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as file:
            text = file.read()
        name = text[text.index("(") + 1 : text.rindex(")")]
        state, parent = text[text.rindex(")") + 2 :].split()[:2]
        return name, state, int(parent)
    except (OSError, ValueError):
        return None


def _initial_run_id(init_kwargs: Mapping[str, Any]) -> str | None:
    """The id to start with: ``WANDB_RUN_ID``, none if wandb is to pick it, else a new one.

    A new one is 8 random lowercase letters and digits, as wandb makes them.
    """
    from_env = os.environ.get("WANDB_RUN_ID")
    if from_env:
        return from_env
    if init_kwargs.get("resume") in ("auto", True) or {"fork_from", "resume_from"} & set(
        init_kwargs
    ):
        return None
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _earlier_run_dirs(run_dir: str | None, run_id: str | None) -> list[str]:
    """The other local directories of run ``run_id`` next to ``run_dir``.

    wandb names them ``run-<date>_<time>-<id>`` (``offline-run-...`` offline); matched whole,
    so run ``1`` does not take ``offline-run-..._...-exp-1`` for one of its own.
    """
    if run_dir is None or run_id is None:
        return []
    here = Path(run_dir)
    name = re.compile(rf"(offline-)?run-\d{{8}}_\d{{6}}-{re.escape(run_id)}")
    try:
        return [
            str(path)
            for path in here.parent.iterdir()
            if path != here and path.is_dir() and name.fullmatch(path.name)
        ]
    except OSError:
        return []


def _rows_in_files(run_dir: str | None, streams: Collection[str]) -> dict[str, int]:
    """Each stream's last step whose row is whole in the ``.wandb`` files of ``run_dir``.

    ``streams`` name the step metrics known to be this sink's; any other ``<name>/step`` is
    taken as stream ``<name>`` (a stream never in a progress file or checkpoint).
    """
    if run_dir is None:
        return {}
    known = {step_metric(stream): stream for stream in streams}
    found: dict[str, int] = {}
    try:
        files = sorted(Path(run_dir).glob("*.wandb"))
    except OSError:
        return {}
    for path in files:
        if not TransactionLog.readable(str(path)):
            continue
        try:
            steps = TransactionLog(str(path)).last_steps()
        except OSError:
            continue
        for metric, step in steps.items():
            stream = known.get(metric, "" if metric == "step" else metric.removesuffix("/step"))
            found[stream] = max(step, found.get(stream, step))
    return found


def _read_progress(run_dir: str | None) -> dict[str, int]:
    if run_dir is None:
        return {}
    try:
        saved = json.loads((Path(run_dir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    return {
        str(stream): step
        for stream, step in saved.items()
        if isinstance(step, int) and not isinstance(step, bool)
    }


def _check_settings(init_kwargs: Mapping[str, Any]) -> None:
    """Refuse, when the sink is built, a ``settings`` key wandb would reject.

    The same for ``mode``, ``fork_from`` and ``resume_from``, which wandb takes as settings.
    ``open`` runs on rank 0 only, once training has started, and a rejected ``wandb.init``
    fails the sink for the whole job; wandb's own ``Settings`` check costs nothing here.
    """
    settings = init_kwargs.get("settings")
    if settings is not None and not isinstance(settings, Mapping):
        settings_type = _settings_type()
        if settings_type is not None and not isinstance(settings, settings_type):
            raise TypeError(
                f"settings: expected a mapping of wandb settings or a wandb.Settings, got "
                f"{settings!r}"
            )
    checked = dict(settings) if isinstance(settings, Mapping) else {}
    # wandb.init options that wandb takes as settings, refused only at open as well.
    from_init = {
        key: init_kwargs[key]
        for key in _INIT_SETTINGS
        # mode=None too is wandb.init's default (WANDB_MODE, else online), not a mode.
        if init_kwargs.get(key) is not None
    }
    checked.update(from_init)
    if not checked:
        return
    try:
        import wandb
    except ImportError:
        return  # reported by check_available / open, with the install command
    try:
        _make_settings(wandb, checked)
    except ValueError as error:  # pydantic's ValidationError: one entry per bad key
        entries: list[dict[str, Any]] = getattr(error, "errors", lambda: [])()
        keys = [".".join(str(part) for part in entry.get("loc", ())) for entry in entries]
        for key in from_init:  # named as the sink's own option, not as a settings key
            if key in keys:
                message = entries[keys.index(key)].get("msg")
                advice = "; pass mode='online', 'offline' or 'disabled'" if key == "mode" else ""
                raise ValueError(
                    f"{key}: wandb does not take {checked[key]!r} ({message}){advice}"
                ) from None
        fields = wandb.Settings.model_fields
        problems = []
        for entry in entries:
            location = tuple(entry.get("loc", ()))
            key = str(location[0]) if location else ""
            if not key:  # a check of the settings together, not of one key
                problems.append(f"these settings together: {entry.get('msg')}")
            elif entry.get("type") == "extra_forbidden" or key not in fields:
                hint = difflib.get_close_matches(key, fields, n=1)
                problems.append(
                    f"the unknown key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                )
            else:  # a known key given a value it does not take (or a bad item of one)
                where = "".join(f"[{part!r}]" for part in location[1:])
                problems.append(f"{key!r}{where} = {checked.get(key)!r}: {entry.get('msg')}")
        detail = "; ".join(problems) or str(error).splitlines()[0]
        raise ValueError(f"settings: wandb.Settings refuses {detail}") from None


def _given_settings(init_kwargs: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``settings`` given as a mapping (``{}`` for none); ``None`` for a ``wandb.Settings``.

    A ``wandb.Settings`` object holds a value for every setting, so it is not known which of
    them it overrides the environment with.
    """
    settings = init_kwargs.get("settings")
    if settings is None:
        return {}
    return settings if isinstance(settings, Mapping) else None


def _environment_dir(init_kwargs: Mapping[str, Any]) -> str | None:
    """``WANDB_DIR`` where ``wandb.init`` uses it: no ``dir`` given (nor ``root_dir``)."""
    settings = _given_settings(init_kwargs)
    if init_kwargs.get("dir") is not None or settings is None or "root_dir" in settings:
        return None
    return os.environ.get("WANDB_DIR") or None


def _make_settings(wandb: Any, settings: Mapping[str, Any]) -> Any:
    """``wandb.Settings(**settings)``, naming a deleted working directory as the cause.

    Its defaults read the working directory (``root_dir``): deleted, the sink's build failed
    with a bare ``FileNotFoundError`` that names no path.
    """
    try:
        return wandb.Settings(**settings)
    except FileNotFoundError as error:
        hint = working_directory_hint(error)
        if not hint:
            raise
        raise FileNotFoundError(f"WandbSink: wandb.Settings failed: {error}{hint}") from None


def _check_environment(init_kwargs: Mapping[str, Any]) -> None:
    """Refuse, when the sink is built, a ``WANDB_MODE`` or ``WANDB_DIR`` wandb cannot use.

    ``wandb.init`` reads them for a ``mode`` or ``dir`` not given, at open: on rank 0's sink
    thread once training has started, where a bad ``WANDB_MODE`` fails the sink for the whole
    job and a ``WANDB_DIR`` wandb cannot write sends the run, silently, to a temporary folder.
    The sink's own options take precedence over them, as in wandb.
    """
    settings = _given_settings(init_kwargs)
    mode = os.environ.get("WANDB_MODE")
    given = init_kwargs.get("mode") is not None  # mode=None: wandb reads WANDB_MODE
    if mode and not given and settings is not None and "mode" not in settings:
        try:
            import wandb
        except ImportError:
            return  # reported by check_available / open, with the install command
        try:
            _make_settings(wandb, {"mode": mode})  # any text: wandb says which it takes
        except ValueError as error:  # pydantic's ValidationError
            entries: list[dict[str, Any]] = getattr(error, "errors", lambda: [])()
            message = entries[0].get("msg") if entries else str(error).splitlines()[0]
            raise ValueError(
                f"mode: None uses the environment variable WANDB_MODE, and wandb does not take "
                f"{mode!r} ({message}); set WANDB_MODE to online, offline or disabled, or pass "
                "mode='online', 'offline' or 'disabled'"
            ) from None
    directory = _environment_dir(init_kwargs)
    if directory is not None:
        check_directory_path("WANDB_DIR", directory)


_RESUME_VALUES = (True, False, "allow", "must", "never", "auto")
_INIT_SETTINGS = ("mode", "fork_from", "resume_from")  # wandb.init options that are settings
# wandb.init options of which it takes one (resume=False is no resume: wandb reads it as None).
_BRANCHING_OPTIONS = ("fork_from", "resume", "resume_from")
_RESERVED_ID_CHARACTERS = ":;,#?/'"  # wandb's own list (wandb_settings.validate_run_id)
_MAX_PROJECT_LENGTH = 128  # wandb's own limit (wandb_settings.validate_project)
_RESERVED_PROJECT_CHARACTERS = "/\\#?%:"  # wandb's own list (wandb_settings.validate_project)


def _refuse_old_wandb() -> None:
    """Raise ``ImportError`` if the installed wandb is older than ``MIN_WANDB_VERSION``.

    pip keeps the floor only when it installs sidestream-wandb's dependencies (not with
    ``--no-deps``, a conda wandb or a later ``pip install wandb==...``); an older client would
    leave the sink unable to say which rows wandb has written. Judged by the setting the sink
    needs, not the version text, so a development build of a newer wandb passes. Nothing to
    say without wandb: ``check_available`` and ``open`` name the install command.
    """
    try:
        import wandb
    except ImportError:
        return
    if FLUSH_SETTING in getattr(getattr(wandb, "Settings", None), "model_fields", {}):
        return
    found = getattr(wandb, "__version__", None) or "a release of unknown version"
    raise ImportError(
        f"WandbSink needs wandb {MIN_WANDB_VERSION} or later, found {found}: older clients "
        "write logged rows only when the run finishes, so the sink cannot say which ones wandb "
        f'has; pip install --upgrade "wandb>={MIN_WANDB_VERSION}"'
    )


def _settings_type() -> type | None:
    try:
        import wandb
    except ImportError:
        return None  # reported by check_available / open, with the install command
    return wandb.Settings


def _check_branching(init_kwargs: Mapping[str, Any]) -> None:
    """Refuse more than one of ``fork_from``, ``resume`` and ``resume_from``.

    wandb takes one way to start from an earlier run and refuses two only in ``wandb.init``
    (``resume`` is no setting the sink's ``_check_settings`` hands wandb): at ``open``, on rank
    0, once training has started.

    Raises:
        ValueError: Naming the options given together.
    """
    given = [
        key
        for key in _BRANCHING_OPTIONS
        if init_kwargs.get(key) is not None and init_kwargs.get(key) is not False
    ]
    if len(given) > 1:
        values = ", ".join(f"{key}={init_kwargs[key]!r}" for key in given)
        raise ValueError(
            f"{', '.join(given)}: wandb takes only one of fork_from, resume and resume_from "
            f"(a fork, a resumed run or a rewound run), got {values}"
        )


def _check_run_options(init_kwargs: Mapping[str, Any]) -> None:
    """Refuse ``tags``, ``config``, ``resume``, ``reinit`` or ``id`` values ``open`` would misread.

    Checked when the sink is built: ``open`` runs on rank 0 only, once training has started,
    and would fail there (or split a str of tags into one tag per letter).
    """
    tags = init_kwargs.get("tags")
    if tags is not None and (
        isinstance(tags, str)
        or not isinstance(tags, Sequence | set | frozenset)
        or not all(isinstance(tag, str) for tag in tags)
    ):
        raise TypeError(f"tags: expected a list of str (W&B tags), got {tags!r}")
    for tag in tags or ():
        if not 1 <= len(tag) <= _MAX_TAG_LENGTH:
            # wandb.init refuses it, on rank 0 only, once training runs: the sink would fail.
            raise ValueError(
                f"tags: each W&B tag must have 1 to {_MAX_TAG_LENGTH} characters, got "
                f"{tag!r} ({len(tag)} characters)"
            )
    config = init_kwargs.get("config")
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(
            f"config: expected a mapping of hyper-parameters (nested dicts allowed), got {config!r}"
        )
    if config is not None:
        flatten_config(config)  # two entries of one flattened name: refused now, not at open
    resume = init_kwargs.get("resume")
    if resume is not None and not any(resume is v or resume == v for v in _RESUME_VALUES):
        raise ValueError(
            f"resume: expected one of {', '.join(map(repr, _RESUME_VALUES))} or None, got "
            f"{resume!r}"
        )
    reinit = init_kwargs.get("reinit", "create_new")
    if reinit != "create_new":
        # Any other value may hand the sink a run the user started (and its close would
        # finish that run), or finish the user's run when the sink opens.
        raise ValueError(
            f"reinit: the sink always starts its own run (reinit='create_new'), so a run the "
            f"user started with wandb.init is left alone; leave reinit out, got {reinit!r}"
        )
    project = init_kwargs.get("project")
    refused = sorted(set(project) & set(_RESERVED_PROJECT_CHARACTERS)) if project else []
    if refused:
        raise ValueError(
            f"project: W&B project names cannot hold {''.join(refused)!r} (reserved: "
            f"{_RESERVED_PROJECT_CHARACTERS!r}), got {project!r}"
        )
    if project is not None and len(project) > _MAX_PROJECT_LENGTH:
        raise ValueError(
            f"project: W&B project names are at most {_MAX_PROJECT_LENGTH} characters, got "
            f"{len(project)}"
        )
    run_id = init_kwargs.get("id")
    if run_id is not None:
        if not run_id.strip() or run_id != run_id.strip():
            raise ValueError(f"id: expected a run id without surrounding spaces, got {run_id!r}")
        reserved = sorted(set(run_id) & set(_RESERVED_ID_CHARACTERS))
        if reserved:
            raise ValueError(
                f"id: W&B run ids cannot hold {''.join(reserved)!r} (reserved: "
                f"{_RESERVED_ID_CHARACTERS!r}), got {run_id!r}"
            )


def _metric_name(name: str) -> str:
    """``name`` as ``define_metric`` takes it: a backslash before each backslash and dot.

    wandb reads an unescaped dot in a declared name as a level of nesting: a stream
    ``val.ood`` declared its step as ``val`` -> ``ood/step``, which no row holds, so wandb
    added ``{"val": {"ood/step": 0}}`` to every row of that stream (over a value named
    ``val`` of another stream), a step of 0 for the stream's values. Escaped, the declared
    names are the rows' own (``val.ood/step``, ``f0.5``).
    """
    return name.replace("\\", "\\\\").replace(".", "\\.")


def step_metric(stream: str) -> str:
    """The W&B step metric of ``stream``: ``"<stream>/step"``, or ``"step"`` for ``""``.

    A ``*`` in the stream becomes ``_`` (with a digest of the stream, so two streams keep two
    step metrics): W&B's ``define_metric`` reads it as a pattern and refuses it inside a name.
    """
    if "*" in stream:
        return f"{stream.replace('*', '_')}-{name_digest(stream)}/step"
    return f"{stream}/step" if stream else "step"


def _is_usage(error: BaseException) -> bool:
    """Whether ``error`` is wandb's ``UsageError`` (a bad argument): retrying cannot help."""
    return any(cls.__name__ == "UsageError" for cls in type(error).__mro__)
