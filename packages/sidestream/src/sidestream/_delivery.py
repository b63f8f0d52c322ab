"""A run's sinks and their pipelines: opened once on rank 0, shared by every stream."""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from numbers import Real
from typing import Any

import torch
import torch.distributed as dist

from sidestream._distributed import check_process_group
from sidestream._exit import closing_at_exit, fork_mark
from sidestream._logs import get_logger
from sidestream._threads import FirstTimes
from sidestream._validation import check_int
from sidestream.sinks._spool import DEFAULT_SPOOL_MAX_BYTES
from sidestream.sinks._spool_format import SpoolFormatError, check_line_format
from sidestream.sinks.base import Report, RunInfo, Sink
from sidestream.sinks.process import ProcessSink
from sidestream.sinks.runner import SinkRunner, state_before_open
from sidestream.sinks.status import PermanentSinkError, SinkStatus
from sidestream.sinks.support import (
    call_within,
    check_directory_path,
    check_retry_waits,
    check_seconds,
    seconds_left,
)
from sidestream.sinks.tracker import TrackerSink, delivered_steps, steps_as_pairs

__all__ = ["Delivery", "DeliveryOptions"]

logger = get_logger("sidestream.sinks")

# Sinks that belong to a live, unclosed run, by id, with weak references to the sink and its
# run: a sink is one tracker run, so two runs (or two collectors with runs of their own) sharing
# it would interleave or drop each other's steps. A run that is gone unclosed frees its sinks; a
# closed one retires them (``_RETIRED``).
_CLAIMED: dict[int, tuple[weakref.ref[Sink], weakref.ref[Delivery]]] = {}
# The sink that writes each file or folder (``Sink.written_place``), process-wide: two live
# runs writing one JSONL file or TensorBoard directory would interleave or repeat its steps.
# A place is taken while its sink is claimed (``_owner``).
_PLACES: dict[tuple[type, str, str], weakref.ref[Sink]] = {}
# Sinks whose run was closed, by id, with a weak reference to the sink: given to a new run (a
# sweep's trial or a notebook cell that reuses the sinks it built once), such a sink continued
# the closed run's tracker run and skipped every step up to the last one it delivered, so the
# new run's first steps (a trial starting again at step 1: all of them) were lost unsaid. Every
# close retires, started or not: only rank 0 starts a run that logs there alone, so a rule on
# starting would refuse the sinks on rank 0 only, and the other ranks would go on to wait in a
# collective for it.
_RETIRED: dict[int, weakref.ref[Sink]] = {}
_CLAIM_LOCK = threading.Lock()


_INTERRUPTED_STOP_S = 1.0
"""How long a start undone by an interrupt (Ctrl-C) waits for the sink threads it started."""

_DURABLE_GRACE_S = 2.0
"""Added to a checkpoint's time left for a sink's ``make_durable`` before it stops waiting.

The built-in sinks bound their own (JSONL's ``fsync``: its timeout and a grace second, which
ends first; a ``ProcessSink``, called without it: its timeout for the pipe and as long again
for the child), so only one that ignores its timeout (a sink of your own whose call hangs) is
cut off: the checkpoint runs on the training thread, which a sink must never hold for good.
"""


class CheckpointTimeout(enum.Enum):
    """``state_dict``'s default timeout: the run's ``checkpoint_timeout`` option."""

    OF_THE_RUN = "the run's checkpoint_timeout"


OF_THE_RUN = CheckpointTimeout.OF_THE_RUN


class DeliveryOptions:
    """The delivery options a run takes (checked once)."""

    def __init__(
        self,
        sink_capacity: int = 1024,
        sink_retry_initial_s: float = 0.1,
        sink_retry_max_s: float = 10.0,
        spool_dir: str | None = None,
        exit_timeout: float = 30.0,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        checkpoint_timeout: float | None = 10.0,
    ) -> None:
        self.checkpoint_timeout = check_timeout("checkpoint_timeout", checkpoint_timeout)
        check_int("sink_capacity", sink_capacity, 1)
        for name, seconds in (
            ("sink_retry_initial_s", sink_retry_initial_s),
            ("sink_retry_max_s", sink_retry_max_s),
            ("exit_timeout", exit_timeout),
        ):
            check_seconds(name, seconds)
        if spool_dir is not None and not isinstance(spool_dir, str | os.PathLike):
            raise TypeError(
                f"spool_dir: expected a path (str or os.PathLike) or None, got {spool_dir!r}"
            )
        if spool_dir is not None:
            # A path under a file is never made: every overflowing report would be dropped.
            check_directory_path("spool_dir", spool_dir)
        check_retry_waits(
            "sink_retry_initial_s", "sink_retry_max_s", sink_retry_initial_s, sink_retry_max_s
        )
        if exit_timeout < 0:
            raise ValueError(f"exit_timeout: expected >= 0, got {exit_timeout}")
        check_int("spool_max_bytes", spool_max_bytes, 1)
        self.spool_max_bytes = spool_max_bytes
        self.sink_capacity = sink_capacity
        self.retry = (sink_retry_initial_s, sink_retry_max_s)
        # Absolute now, as JsonlSink's path: resolved at each spill instead, a relative one
        # followed a later os.chdir, so the kept spool landed under another folder than the
        # one checked here, where a restarted job never looks for leftovers.
        self.spool_dir = None if spool_dir is None else os.path.abspath(spool_dir)
        self.exit_timeout = exit_timeout

    def checkpoint_wait(self, timeout: float | CheckpointTimeout | None) -> float | None:
        """A ``state_dict`` call's ``timeout``, checked (``checkpoint_timeout`` if not given)."""
        if isinstance(timeout, CheckpointTimeout):
            return self.checkpoint_timeout
        return check_timeout("state_dict: timeout", timeout)


class Delivery:
    """The sinks of one run, their runners (rank 0 only) and the resume states.

    Args:
        sinks: The run's sinks; each may belong to one run at a time.
        info: Name, config and tags given to ``sink.open``.
        options: Capacity, retry, spool and exit options.

    Raises:
        TypeError: If an item of ``sinks`` is not a ``Sink``.
        ValueError: If a sink already belongs to another live run, or two sinks of one kind
            write the same place (one JSONL file, one TensorBoard directory).
    """

    def __init__(
        self, sinks: Iterable[Sink], info: RunInfo | None, options: DeliveryOptions
    ) -> None:
        if isinstance(sinks, Sink):
            raise TypeError(f"sinks: expected a list of sinks, got one sink: pass [{sinks!r}]")
        try:
            items = iter(sinks)
        except TypeError:
            # list() alone said "'X' object is not iterable", naming no argument.
            raise TypeError(f"sinks: expected a list of sinks, got {sinks!r}") from None
        sink_list = list(items)
        for index, sink in enumerate(sink_list):
            if not isinstance(sink, Sink):
                raise TypeError(f"sinks[{index}]: expected a sidestream.sinks.Sink, got {sink!r}")
            # On every rank, when the run is built: the runner that reads it is rank 0's.
            check_int(f"sinks[{index}].max_batch", getattr(sink, "max_batch", 1), 1)
        if info is not None and not isinstance(info, RunInfo):
            raise TypeError(f"info: expected a sidestream.sinks.RunInfo, got {info!r}")
        _claim(sink_list, self)
        self.sinks = _keyed(sink_list)
        self.info = info or RunInfo()
        self.options = options
        self.resume_states: dict[str, Any] = {}
        self.unclaimed_states: dict[str, Any] = {}
        self.loaded = False  # load_sink_states was called: the sinks resume a checkpoint's run
        # A checkpoint's undelivered reports per sink (spool lines): delivered first at start.
        self.backlogs: dict[str, str] = {}
        self.unclaimed_backlogs: dict[str, str] = {}
        self.runners: list[SinkRunner] | None = None
        # fork_mark() where the runners' threads started: a fork's calls are refused.
        self.started_in: int | None = None
        # Called once when the sinks start, whoever starts them (a collector's bind or
        # Run.log): the owner registers its close at interpreter exit there.
        self.on_start: Callable[[], None] | None = None
        # Re-entrant: a signal handler's log or close, run on a thread that holds it (starting
        # the sinks in bind or the first log), waited on a plain lock for its own thread, and
        # the job hung. ``_starting`` names the thread inside a start (or its undoing), whose
        # handler's calls are refused (``refuse_inside_start``) instead of let in on runners
        # half started.
        self._lock = threading.RLock()
        self._starting: int | None = None
        self._closed = False
        self._close_result = True  # what the first close returned; later calls repeat it
        self._failed_submits = FirstTimes()
        # The places each sink's state has before it opens: the template a fresh run gives
        # torch.distributed.checkpoint, which loads only those (see _check_places).
        self._fresh_places = {key: _state_places(sink) for key, sink in self.sinks.items()}
        self._place_warned = FirstTimes()
        self._name_streams: dict[str, str] = {}  # value name -> the stream that reported it
        self._name_warned = FirstTimes()  # (name, stream) named in a warning
        # stream -> the names it reported that were checked: a stream reports the same names
        # every window, and only a name new to it can clash (see _check_names).
        self._names_checked: dict[str, set[str]] = {}
        # Each sink's state as of the last checkpoint whose make_durable succeeded: what a
        # checkpoint keeps when a later make_durable fails (see _durable_state).
        self._durable_states: dict[str, Any] = {}
        # Each sink's make_durable that a checkpoint stopped waiting for (set once it ended):
        # a later checkpoint does not start another beside it (see _make_durable).
        self._durable_calls: dict[str, threading.Event] = {}

    @property
    def started(self) -> bool:
        """Whether the sinks were started (their runners exist on rank 0)."""
        return self.runners is not None

    @property
    def closed(self) -> bool:
        """Whether the sinks were closed (or their close began): they take no more reports."""
        return self._closed

    @property
    def is_writer(self) -> bool:
        """Whether this process opens and writes the sinks (global rank 0)."""
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def start(self, where: str) -> list[SinkRunner]:
        """Start one runner per sink on rank 0, once; the runners (none on other ranks).

        All or nothing: if a runner fails to start, those started are stopped and every
        checkpoint backlog is kept for a start made again (see ``_start_runners``).

        Raises:
            RuntimeError: If the environment says the job has several processes but no
                process group is initialized, or the run is closed.
        """
        started = self.runners
        if started is not None and not self._closed:
            return started  # started: the process group was checked then (run.log's hot path)
        check_process_group(where)
        with self._lock:
            self.refuse_inside_start(where)  # a handler's log, run inside this thread's start
            if self._closed:
                raise RuntimeError(f"{where}: the run is closed")
            if self.runners is not None:
                return self.runners
            self._starting = threading.get_ident()
            try:
                runners: list[SinkRunner] = []
                if not self.is_writer:
                    self.backlogs = {}  # only rank 0 delivers: do not hold them for the whole job
                if self.is_writer:
                    runners = [self._runner(key, sink) for key, sink in self.sinks.items()]
                    self._start_runners(runners)
                    self._warn_restart_without_checkpoint()
                self.runners = runners
                self.started_in = fork_mark()
                if self.on_start is not None:
                    self.on_start()
                return runners
            finally:
                self._starting = None

    def _warn_restart_without_checkpoint(self) -> None:
        """Warn when torchrun restarted the job in place and nothing was loaded.

        ``torchrun --max-restarts`` starts every worker again in the same job
        (``TORCHELASTIC_RESTART_COUNT`` counts the restarts). A run that loaded no checkpoint
        then opens new tracker runs beside the earlier attempt's (MLflow, W&B) and writes its
        steps again after theirs (JSONL, TensorBoard): the job shows as two runs, steps
        twice, with only the JSONL and TensorBoard sinks saying why, and their advice (resume
        the earlier job's checkpoint) is none a restart before the first checkpoint can take.
        """
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if self.loaded or not self.sinks or not restarts.isdigit() or int(restarts) == 0:
            return
        logger.warning(
            "torchrun restarted this job's workers (TORCHELASTIC_RESTART_COUNT=%s) and this "
            "run loaded no checkpoint, so its sinks (%s) start anew: a tracker run beside the "
            "one the earlier attempt opened (MLflow, W&B), and the steps it wrote written "
            "again (JSONL, TensorBoard). Checkpoint the run once before the first step (after "
            "bind), so that every restart resumes it (docs/runs.md: Restarts by torchrun)",
            restarts,
            ", ".join(self.sinks),
        )

    def refuse_inside_start(self, where: str) -> None:
        """Raise if this thread is starting the sinks (or undoing a start): a handler's call.

        What a signal handler's ``close`` (or ``log``) finds when it runs between two bytecodes
        of ``bind`` or the first ``log`` while they start the sinks: the start holds ``_lock``
        with runners half started, so the call can neither wait for it (it would wait for its
        own thread: the job hung) nor go on. Raised before anything changed, so the run is
        closed as usual once that call has returned or raised.

        Raises:
            RuntimeError: Naming ``where`` and what to do instead.
        """
        if self._starting is not None and self._starting == threading.get_ident():
            raise RuntimeError(
                f"{where}: called on the thread that is starting this run's sinks (from a "
                "signal handler run inside bind or the first log?), which would wait for "
                "itself; let the handler raise instead (sys.exit), and close the run when "
                "that reaches it: with Run(...) as run:, or run.close() in a finally"
            )

    def _start_runners(self, runners: list[SinkRunner]) -> None:
        """Start ``runners``, then hand each its sink's backlog (lock held), all or nothing.

        Every runner is started before any is handed the checkpoint's undelivered reports, so
        a start that fails (a thread that cannot start) delivered none of them: the runners
        started are stopped without delivering (``SinkRunner.withdraw``) and ``backlogs`` is
        left as it was, for the start made again (a corrected bind) to deliver, once each.
        Their threads end before that start opens the sinks again (they were only opening,
        or closing, the sinks: waited for up to ``exit_timeout``; after an interrupt up to
        ``_INTERRUPTED_STOP_S``). A thread still in a sink's open past that closes the sink once
        the open returns, and ends; the new runner's thread opens that sink only then
        (``SinkRunner.start``), so no two threads use a sink at once.
        """
        handed: list[SinkRunner] = []
        try:
            for runner in runners:
                runner.start()
            for runner in runners:
                # Read before the sinks' states, a checkpoint's backlog may hold reports its
                # sink state counts as delivered (sent, then flushed by the checkpoint): a
                # resumed sink must not take them for a step counter gone back past it.
                steps, default = delivered_steps(self.resume_states.get(runner.key))
                runner.submit_backlog(self.backlogs.get(runner.key, "").encode(), steps, default)
                handed.append(runner)
        except BaseException as error:
            self._withdraw(runners, handed, interrupted=not isinstance(error, Exception))
            raise
        for runner in runners:
            self.backlogs.pop(runner.key, None)

    def _withdraw(
        self, runners: list[SinkRunner], handed: list[SinkRunner], *, interrupted: bool
    ) -> None:
        """Stop ``runners`` without delivering more; ``handed`` ones' leftovers are backlogs.

        A runner in ``handed`` holds its sink's whole backlog (and nothing else yet): what it
        had not delivered becomes that backlog again, so a report is neither lost nor, unless
        a write was in progress when an interrupt gave it no time, delivered twice. Any other
        runner's backlog is still in ``backlogs`` (one interrupted while it was being handed
        over keeps it whole: those reports may reach its sink twice).
        """
        timeout = self.options.exit_timeout
        if interrupted:
            timeout = min(timeout, _INTERRUPTED_STOP_S)
        mine = {id(runner) for runner in handed}
        for runner in runners:
            try:
                left = runner.withdraw(timeout)
            except Exception as error:  # one sink's failure stays its own
                logger.error(
                    "sink %r: stopping it failed: %s: %s", runner.key, type(error).__name__, error
                )
                continue
            if id(runner) in mine:
                if left:
                    self.backlogs[runner.key] = left.decode()
                else:
                    self.backlogs.pop(runner.key, None)

    def unstart(self, *, interrupted: bool) -> None:
        """Undo ``start`` (a bind that failed once it had started the sinks).

        The runners stop without delivering more; what they had not delivered (the
        checkpoint's backlog, nothing else was submitted) is kept for the next ``start``.
        """
        with self._lock:
            self.refuse_inside_start("bind")  # a handler's bind, run inside a start's undoing
            self._starting = threading.get_ident()
            try:
                runners, self.runners = self.runners, None
                if runners:
                    self._withdraw(runners, runners, interrupted=interrupted)
            finally:
                self._starting = None

    def submit(self, report: Report, given: set[str] | None = None) -> None:
        """Hand ``report`` to every runner (rank 0, once started); one failing stays its own.

        ``given``: the keys of runners that have it already (a ``Run.log`` entry whose delivery
        a Ctrl-C cut short), skipped; each runner handed it is added.
        """
        if self._closed:
            # A window that finished after close gave up on it (close warned that it is not
            # reported): the sinks are closing, which is no error of theirs to log.
            logger.debug("step %d of stream %r finished after close", report.step, report.stream)
            return
        if self.runners:
            self._check_names(report)
        # A failed sink's runner keeps its reports too (queue, then its capped spool): a
        # checkpoint holds them and a job resumed from it delivers them.
        runners = [
            runner for runner in self.runners or [] if given is None or runner.key not in given
        ]
        # Each sink its own values: one that changes the mapping or a histogram in place
        # would otherwise change what every other sink writes and keeps. Copied before any is
        # handed out: the first sink's thread may start on its report at once.
        reports = [report, *(_copy_of(report) for _ in runners[1:])]
        for runner, own in zip(runners, reports, strict=False):
            try:
                runner.submit(own)
                if given is not None:
                    given.add(runner.key)
            except Exception as error:
                if given is not None:
                    given.add(runner.key)  # failed for good here: not handed it again
                if self._failed_submits.first(runner.key):
                    logger.error(
                        "sink %r: submit failed: %s: %s; the other sinks are unaffected "
                        "(later failures of this sink are not logged)",
                        runner.key,
                        type(error).__name__,
                        error,
                    )

    def _check_names(self, report: Report) -> None:
        """Warn once per name and stream when a stream reports a name another stream reported.

        Trackers keep values by name alone (a TensorBoard tag, an MLflow key, a W&B column):
        ``run.log(step, {"train/loss": ...})`` next to a ``"train"`` collector's ``loss``, or
        prefixes ``"a"`` (value ``b``) and ``"a/b"``, would put two series into one, with two
        values per step.
        """
        owners = self._name_streams
        checked = self._names_checked.setdefault(report.stream, set())
        for names in (report.values, report.histograms):
            if names.keys() <= checked:
                # Each name was checked when this stream first reported it, and a name's
                # owner never changes: checked again, it finds what it found then. Skipped
                # in one C-level test, not a Python loop per value on every window (2,000
                # names took 0.5 ms of the dispatcher's GIL a window).
                continue
            for name in names:
                if name in checked:
                    continue
                owner = owners.setdefault(name, report.stream)  # atomic: several threads submit
                # Per stream, not per name: a third stream on the name is named too.
                clash = (name, report.stream)
                if owner != report.stream and self._name_warned.first(clash):
                    logger.warning(
                        "%r is reported by two streams of this run, %r and %r: trackers keep "
                        "values by name, so they would show one series with the values of "
                        "both; give one of them another name (a collector's prefix, or the "
                        "name passed to run.log)",
                        name,
                        _stream_text(owner),
                        _stream_text(report.stream),
                    )
            checked.update(names)

    def status(self) -> dict[str, SinkStatus]:
        """Each sink's status by key (``healthy`` before the sinks start, and off rank 0)."""
        started = {runner.key: runner.status for runner in self.runners or ()}
        return {key: started.get(key, SinkStatus("healthy", None)) for key in self.sinks}

    def sink_states(self, timeout: float | None) -> tuple[dict[str, Any], dict[str, str]]:
        """Every sink's state (made durable first) and its undelivered reports.

        The state is as of the sink's last delivered report; the reports are spool lines,
        oldest first (``""`` for none). Waits up to ``timeout`` seconds in all for pending
        reports to be delivered; a sink still behind then gives its state as of its last
        delivered report (warned), and its undelivered reports go into the checkpoint, so a
        job resumed from it delivers them. They are read before the state: a report delivered
        in between is in both, and the resumed sink skips it (it never sends a step its state
        holds).
        """
        if self.runners is None:
            if not self.is_writer:
                return {}, {}
            before = {
                **copy.deepcopy(self.unclaimed_states),
                **{
                    # As the runner takes it: a sink whose state needs its backend open
                    # must not fail the checkpoint.
                    key: copy.deepcopy(self.resume_states[key])
                    if key in self.resume_states
                    else state_before_open(sink, key)
                    for key, sink in self.sinks.items()
                },
            }
            backlogs = {key: self.backlogs.get(key, "") for key in self.sinks}
            return before, {**self.unclaimed_backlogs, **backlogs}
        deadline = None if timeout is None else time.monotonic() + timeout
        states: dict[str, Any] = copy.deepcopy(self.unclaimed_states)
        undelivered: dict[str, str] = dict(self.unclaimed_backlogs)
        for runner in self.runners:
            left = seconds_left(deadline)
            began = time.monotonic()
            behind = not runner.wait_delivered(left)
            if behind:
                logger.warning(
                    "state_dict: sink %r still has %d undelivered report(s) %s; its state is "
                    "as of its last delivered step, and the checkpoint holds those reports "
                    "(a job resumed from it delivers them first)",
                    runner.key,
                    runner.pending,
                    _wait_text(runner, time.monotonic() - began, left, timeout),
                )
            undelivered[runner.key] = runner.undelivered(seconds_left(deadline)).decode()
            # What is left of the overall timeout, not the wait's share again.
            left = seconds_left(deadline)
            states[runner.key] = self._durable_state(runner, left, warn=not behind)
            self._check_places(runner.key, states[runner.key])
        return states, undelivered

    def _check_places(self, key: str, state: Any) -> None:
        """Warn once if a sink's state has other places than before it opened.

        ``torch.distributed.checkpoint`` loads a checkpoint into the state a fresh run gives
        (sinks not open yet) and only into places it has: a key added at ``open`` (or a mapping
        that grows) would be dropped silently, and the resumed sink would repeat its steps.
        """
        fresh = self._fresh_places.get(key)
        if fresh is None or key in self._place_warned:
            return
        now = _places(state)
        if now != fresh and self._place_warned.first(key):
            logger.warning(
                "state_dict: sink %r: its state has places it had not before open (%s) or lacks "
                "some it had (%s): torch.distributed.checkpoint restores only the places of "
                "a fresh run's state, so a checkpoint saved with it would lose them. Keep a "
                "sink's state keys the same before and after open, and hold parts that vary "
                "(per stream, per name) in lists of pairs",
                key,
                sorted(now - fresh),
                sorted(fresh - now),
            )

    def _durable_state(
        self, runner: SinkRunner, timeout: float | None, *, warn: bool = True
    ) -> Any:
        sink = runner.sink
        # Before its open succeeded a sink's own state is not ready (a resumed JSONL sink has
        # no offset yet): the runner's copy, the state it resumes from, is the one to keep.
        ready = runner.opened and runner.status.state != "failed"
        if ready and isinstance(sink, TrackerSink | ProcessSink):
            # Thread-safe by contract: make what was sent durable, then read what counts.
            try:
                # A sink whose state counts a step once sent (JSONL, MLflow) is read before
                # make_durable: its thread may deliver more meanwhile (run.log from another
                # thread, a window that finished late), and a state read after the fsync
                # counted those un-synced steps (and JSONL's offset past them) as durable.
                # What the state holds was sent before make_durable began, so it covers them.
                # One that counts confirmed steps only (W&B, TensorBoard) is read after it.
                send_is_delivery = _send_is_delivery(sink)
                sent_state = sink.state_dict() if send_is_delivery else None
                began = time.monotonic()
                durable = self._make_durable(runner, sink, timeout)
                if not durable and send_is_delivery:
                    # Its state counts a step once send returned, and make_durable is what
                    # makes those steps survive a machine crash (JSONL's fsync): one that did
                    # not finish (a hung disk, an NFS server gone), or failed in a child
                    # process (a ProcessSink says False for the child's EIO), leaves them as
                    # unsafe as an fsync that raised here. The newest state was kept, while the
                    # warning below said the checkpoint holds the rest: it held neither them
                    # nor their reports.
                    limit = "the time given" if timeout is None else f"{timeout:.1f} s"
                    return self._last_durable_state(
                        runner, f"make_durable failed or did not finish within {limit}"
                    )
                if not durable and warn:  # warn: not said already (reports still queued)
                    waited = time.monotonic() - began
                    # The sink may give up before its budget (wandb answers at most 3 s
                    # late): the time it waited, not only what it was given.
                    given = "" if timeout is None else f"; it was given {timeout:.1f} s"
                    # Sent but not yet confirmed by the backend (wandb's file): they travel in
                    # the checkpoint, which wait_delivered's warning (queued ones) does not say.
                    logger.warning(
                        "state_dict: sink %r: its backend has not confirmed every report it "
                        "was sent (it waited %.1f s%s); its state is as of its last confirmed "
                        "step, and the checkpoint holds the rest (a job resumed from it "
                        "delivers them)",
                        runner.key,
                        waited,
                        given,
                    )
                if durable or isinstance(sink, TrackerSink):
                    # A tracker whose steps count once its backend confirms them
                    # (durable_on_send False) holds confirmed steps only, so it is right either
                    # way, and fresher than the runner's copy when part was confirmed by now.
                    state = sent_state if send_is_delivery else sink.state_dict()
                    if durable:
                        self._durable_states[runner.key] = copy.deepcopy(state)
                    return state
            except Exception as error:
                # Nothing sent since the last durable checkpoint is known to be on disk (an
                # fsync that raised EIO: the kernel may have dropped those pages), nor what a
                # state_dict that raised would have counted.
                return self._last_durable_state(
                    runner, f"make_durable or state_dict failed ({error})"
                )
        return runner.sink_state()

    def _make_durable(
        self, runner: SinkRunner, sink: TrackerSink | ProcessSink, timeout: float | None
    ) -> bool:
        """``sink.make_durable(timeout)``, waited for at most ``timeout`` and a grace.

        A sink of one's own may ignore its timeout (a client call that hangs): the checkpoint,
        on the training thread, would wait for it without end. The call runs on a thread that
        is abandoned if it overruns, as ``TrackerSink.within`` does for backend calls, and
        counts as not durable; while it still runs, a later checkpoint starts no second one
        beside it (also not durable).

        Raises:
            Exception: What ``make_durable`` raised (an ``fsync``'s ``EIO``).
        """
        earlier = self._durable_calls.get(runner.key)
        if earlier is not None and not earlier.is_set():
            # The hung one still runs (warned of already): none beside it, whatever this
            # checkpoint's timeout, ``None`` too (it would wait on a second hung call).
            return False
        if timeout is None:
            return bool(sink.make_durable(None))  # no bound asked for
        if isinstance(sink, ProcessSink):
            # It bounds its own: its timeout for the pipe (a write under way on the sink's
            # thread) and as long again for the child, which it stops past that. Cut off at
            # the timeout and a grace, a healthy child's make_durable that waited for a write
            # counted as not durable, with an error blaming the sink.
            return bool(sink.make_durable(timeout))
        outcome: list[bool] = []
        ended = threading.Event()

        def call() -> None:
            try:
                outcome.append(bool(sink.make_durable(timeout)))
            finally:
                ended.set()

        limit = timeout + _DURABLE_GRACE_S
        # Recorded before the wait: a Ctrl-C during it leaves the call running, and a
        # checkpoint in the interrupt's handler must not start a second one beside it.
        self._durable_calls[runner.key] = ended
        finished, error = call_within(call, limit, f"sidestream-{runner.key}-make-durable")
        if not finished:
            logger.warning(
                "state_dict: sink %r: make_durable did not return within %.1f s (the "
                "checkpoint's time left, %.1f s, and %.1f s more): the checkpoint goes on "
                "without it and counts what the sink sent since its last checkpoint as not "
                "durable; a later checkpoint starts none while it runs (a sink's "
                "make_durable must return within its timeout)",
                runner.key,
                limit,
                timeout,
                _DURABLE_GRACE_S,
            )
            return False
        if error is not None:
            raise error
        return outcome[0]

    def _last_durable_state(self, runner: SinkRunner, why: str) -> Any:
        """The sink's state as of the last checkpoint that made it durable, for one that did not.

        The sink's state now counts what it sent since as delivered, so a checkpoint keeping it
        would say steps are safe that a machine crash loses, and the resumed job would never
        send them again. The state of the last checkpoint whose make_durable succeeded (or the
        one the sink started from): a resumed job finds in the backend what survived and skips
        it.
        """
        kept = self._durable_states.get(runner.key, runner.first_state())
        logger.error(
            "state_dict: sink %r: %s: what it delivered since the last checkpoint may not be "
            "on disk, so this checkpoint keeps its state as of then (%s)",
            runner.key,
            why,
            "the last checkpoint that made it durable"
            if runner.key in self._durable_states
            else "its state when the run started",
        )
        return copy.deepcopy(kept)

    def check_sink_states(
        self, states: Mapping[str, Any], undelivered: Mapping[str, Any] | None = None
    ) -> None:
        """Raise now if a sink of this run refuses its saved state in ``states``.

        Each is loaded into a shallow copy of its sink (the sink itself takes it only when it
        starts, on rank 0), so a malformed state fails in the caller, on every rank, before
        anything is restored, instead of on rank 0's sink thread at open while training goes
        on without that sink.

        ``undelivered`` (the checkpoint's undelivered reports) is checked as well.

        Raises:
            ValueError: Naming the sink, with the sink's own message.
            TypeError: If ``states`` or ``undelivered`` is not a mapping of the right types.
        """
        if not isinstance(states, Mapping):
            raise TypeError(f"state_dict['sinks']: expected a mapping, got {states!r}")
        _backlogs(undelivered or {})
        for key, state in self._matched(states).items():
            if key not in self.sinks:
                continue
            trial = copy.copy(self.sinks[key])
            try:
                trial.load_state_dict(copy.deepcopy(steps_as_pairs(state)))
            except (TypeError, ValueError, KeyError, AttributeError) as error:
                raise ValueError(
                    f"load_state_dict: sink {key!r} refuses its saved state: {error}"
                ) from error

    def _matched(self, states: Mapping[str, Any]) -> dict[str, Any]:
        """``states`` under the keys of this run's sinks they belong to (``_saved_keys``)."""
        keys = self._saved_keys(states)
        return {keys[key]: state for key, state in states.items()}

    def _saved_keys(self, states: Mapping[str, Any]) -> dict[str, str]:
        """Each saved sink key, mapped to the key its state belongs under in this run.

        Keys follow the order of the sinks (``jsonl``, ``jsonl-2``), so a job that lists two
        sinks of a kind in another order, or leaves the first out, would give each the other's
        state. A saved state that names a place (a JSONL file, a TensorBoard directory) goes to
        the sink of this run at that place; one whose place no sink here has keeps its key if
        no other state took that sink, else it is carried on as not this run's, under
        ``KEY@PLACE``. States that name no place (MLflow, W&B: their run ids are made when a
        fresh sink is) keep their keys.
        """
        # A sink's written_place() is (class, identity option, real path); a saved state of a
        # key of that sink's name ("jsonl", "jsonl-2") names its place under the same option.
        written = {key: p for key, sink in self.sinks.items() if (p := sink.written_place())}
        places: dict[str, str | None] = dict.fromkeys(states)
        keys: dict[str, str] = {}
        for key, state in states.items():
            for mine, (_, option, path) in written.items():
                name = self.sinks[mine].name
                value = state.get(option) if isinstance(state, Mapping) else None
                if not isinstance(value, str) or not (
                    key == name or key.removeprefix(f"{name}-").isdigit()
                ):
                    continue
                places[key] = os.path.realpath(value)
                if places[key] == path and mine not in keys.values():
                    keys[key] = mine
                    break
        taken = set(keys.values())
        for key in states:
            if key in keys:
                continue
            place = places[key]
            if key in taken and place is not None:
                keys[key] = f"{key}@{place}"  # another job's sink: carried on, never loaded
            else:
                keys[key] = key
        moved = sorted((old, new) for old, new in keys.items() if old != new and new in self.sinks)
        if moved:
            logger.info(
                "load_state_dict: sink states matched by the place they name: %s",
                ", ".join(f"{old} -> {new}" for old, new in moved),
            )
        return keys

    def load_sink_states(
        self, states: Mapping[str, Any], undelivered: Mapping[str, str] | None = None
    ) -> None:
        """Give each sink its saved state, and its undelivered reports, when it starts.

        Raises:
            RuntimeError: If the sinks already started.
        """
        if self.runners is not None:
            raise RuntimeError(
                "load_state_dict: call it before the first bind or log (sinks resume their "
                "run when they open); with torch.distributed.checkpoint: make the run's "
                "collectors, dcp.load({'run': run}, ...), then bind"
            )
        # Copies: the caller's checkpoint dict must not change with what the sinks do.
        # The callers ran check_sink_states first, before restoring anything else.
        keys = self._saved_keys(states)
        loaded = {keys[key]: copy.deepcopy(steps_as_pairs(state)) for key, state in states.items()}
        self.loaded = True
        self.resume_states = {key: state for key, state in loaded.items() if key in self.sinks}
        # A sink this run does not have (left out of the config for this job): its state is
        # carried on into this run's checkpoints, as unclaimed collector states are.
        self.unclaimed_states = {k: v for k, v in loaded.items() if k not in self.sinks}
        backlogs = {keys.get(key, key): text for key, text in _backlogs(undelivered or {}).items()}
        # Only rank 0 delivers them (and checkpoints them): other ranks need not hold them.
        self.backlogs = (
            {key: text for key, text in backlogs.items() if key in self.sinks}
            if self.is_writer
            else {}
        )
        self.unclaimed_backlogs = {k: v for k, v in backlogs.items() if k not in self.sinks}
        if self.unclaimed_states:
            logger.warning(
                "load_state_dict: the checkpoint holds the state of sink(s) %s, which this run "
                "does not have (its sinks: %s); it is kept in this run's checkpoints, so a later "
                "job with that sink resumes it",
                sorted(self.unclaimed_states),
                sorted(self.sinks),
            )

    def close(self, deadline: float | None) -> bool:
        """Close every runner once (delivering what is pending); whether all was delivered.

        A resumed job that closes before its first bind or log starts its sinks first: the
        checkpoint's undelivered reports are delivered now (or kept in a spool file), not
        dropped with the run.
        """
        self.refuse_inside_start("close")  # before anything changed (Run.close checked too)
        self._start_for_backlogs()
        with self._lock:
            if self._closed:
                return self._close_result
            self._closed = True
            runners = self.runners or []
        try:
            complete = self._close_runners(runners, deadline)
        except BaseException:
            # Interrupted (Ctrl-C, a signal handler's SystemExit): each sink's undelivered
            # reports go to a kept spool file now, or the process's exit would lose them with
            # its sink threads; a later close says False.
            self._close_result = False
            self.close_now(runners)
            raise
        _release(self.sinks.values(), self)
        self._close_result = complete
        return complete

    def _start_for_backlogs(self) -> None:
        """At a close before the sinks started: start those with checkpoint reports to deliver.

        Only they open (a sink new to this job would make an empty tracker run), and only on
        the writer: rank 0 by the process group, or by the launcher's ``RANK`` once the group
        is gone (other ranks dropped their backlogs at load). Not registered to close at exit:
        this is that close.
        """
        with self._lock:
            if self.runners is not None or self._closed or not any(self.backlogs.values()):
                return
            if not self.is_writer or os.environ.get("RANK", "0") != "0":
                return
            runners = [
                self._runner(key, sink)
                for key, sink in self.sinks.items()
                if self.backlogs.get(key)
            ]
            # A runner that fails to start leaves every backlog where it was, as at bind.
            self._start_runners(runners)
            self.runners = runners

    def _runner(self, key: str, sink: Sink) -> SinkRunner:
        return SinkRunner(
            sink,
            self.info,
            key=key,
            resume_state=self.resume_states.get(key),
            capacity=self.options.sink_capacity,
            spool_dir=self.options.spool_dir,
            spool_max_bytes=self.options.spool_max_bytes,
            retry_initial_s=self.options.retry[0],
            retry_max_s=self.options.retry[1],
            before_open=self._refuse_live_tracker_run,
        )

    def _refuse_live_tracker_run(self, sink: Sink) -> None:
        """Fail ``sink`` for good if another live run of this process writes its tracker run.

        Called on the sink's thread before it opens, its checkpoint loaded. The places a path
        names are refused when a run is made (``_claim``), but a run id (MLflow, W&B) or a
        default TensorBoard directory becomes the saved one only here: a job restarted in the
        same process that made its new run before closing the old one would write the
        checkpoint's tracker run beside the old run's sinks, which still deliver (MLflow got
        the steps both computed twice; W&B refused the id in use, over and over, until
        close). Failing here, on rank 0's sink thread, keeps the ranks alike: the other
        ranks never open a sink, and this run's reports are kept (spool, checkpoint).

        Raises:
            PermanentSinkError: If a sink of ``sink``'s kind in another unclosed run has
                ``sink``'s identity.
        """
        if not isinstance(sink, TrackerSink):
            return
        identity = sink.identity
        if not isinstance(identity, str):
            return
        is_path = sink.identity_is_path
        mine = os.path.realpath(identity) if is_path else identity
        with _CLAIM_LOCK:
            others = [
                other
                for entry in list(_CLAIMED.values())
                if type(other := entry[0]()) is type(sink) and entry[1]() not in (None, self)
            ]
        for other in others:
            theirs = getattr(other, "identity", None)
            if not isinstance(theirs, str):
                continue
            if (os.path.realpath(theirs) if is_path else theirs) == mine:
                raise PermanentSinkError(
                    f"{type(sink).__name__} resumes {sink.identity_key} {identity!r}, which "
                    "a sink of another run of this process that is not closed yet still "
                    "writes (a restart in the same process that made its new sidestream.Run "
                    "before closing the failed attempt's): both would write that tracker run. "
                    "Close the old run (run.close()) before making the new one; this sink "
                    "delivers nothing, and its reports are kept in a spool file at close"
                )

    def _close_runners(self, runners: list[SinkRunner], deadline: float | None) -> bool:
        # Start every sink's close at once, so one slow sink does not use up the others' time.
        for runner in runners:
            runner.begin_close(seconds_left(deadline))
        # A backlog (a tracker that was down, a slow one behind a full queue) can take the
        # whole timeout, 30 s at exit: without a word the process looks hung after training.
        with CloseProgress(runners, deadline):
            return self._close_each(runners, deadline)

    def _close_each(self, runners: list[SinkRunner], deadline: float | None) -> bool:
        complete = True
        for runner in runners:
            left = seconds_left(deadline)
            try:
                closed = runner.close(left)
            except (
                Exception
            ) as error:  # one sink's failure (its spool on a full disk) stays its own
                logger.error(
                    "sink %r: close failed: %s: %s", runner.key, type(error).__name__, error
                )
                closed = False
            if not closed or runner.status.state == "failed":
                complete = False
            elif isinstance(runner.sink, TrackerSink) and not runner.sink.all_delivered:
                # Written, but the final flush failed: the backend may not have it.
                logger.warning("sink %r: its last flush failed; not all was delivered", runner.key)
                complete = False
        return complete

    def close_now(self, runners: list[SinkRunner] | None = None) -> None:
        """Close every runner at once, keeping what is undelivered (after an interrupted close).

        Every runner gets its turn, even when another Ctrl-C interrupts one (raised once all
        had theirs); a runner whose close ended says what it said before. One sink's failure
        is logged, and the others close.
        """
        with self._lock:
            self._closed = True
            self._close_result = False
            runners = runners if runners is not None else (self.runners or [])
        interrupted: BaseException | None = None
        for runner in runners:
            try:
                runner.close_now()
            except Exception as error:
                logger.error(
                    "sink %r: close failed: %s: %s", runner.key, type(error).__name__, error
                )
            except BaseException as error:  # raised below, once the others had their turn
                interrupted = interrupted or error
        _release(self.sinks.values(), self)
        if interrupted is not None:
            raise interrupted


CLOSE_PROGRESS_FIRST_S = 5.0
"""How long a close waits for its sinks' backlog before it says how far they are."""

CLOSE_PROGRESS_EVERY_S = 15.0
"""How often, after the first, a close still waiting for a backlog says how far it is."""


class CloseProgress:
    """While a close waits for its sinks' backlog, logs how far each sink is.

    A context manager around the close: a watch thread logs one warning (logger
    ``sidestream.sinks``) after ``CLOSE_PROGRESS_FIRST_S`` and one every
    ``CLOSE_PROGRESS_EVERY_S`` after it, while some sink still has reports to deliver: for
    each, how many are left, how many it delivered since the close began, and whether its
    backend fails meanwhile; and how much of the close's timeout is left, after which what is
    left is kept in a spool file. A close that ends sooner says nothing. It only reads the
    runners' counters (no lock), so it changes nothing in the close.

    Args:
        runners: The runners being closed.
        deadline: The close's deadline (``time.monotonic()``), ``None`` for no limit.
    """

    def __init__(self, runners: list[SinkRunner], deadline: float | None) -> None:
        self._runners = runners
        self._deadline = deadline
        # Read when made, not imported: tests shorten them.
        self._first_s = CLOSE_PROGRESS_FIRST_S
        self._every_s = CLOSE_PROGRESS_EVERY_S
        self._began = time.monotonic()
        self._delivered_before = {id(runner): runner.delivered for runner in runners}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> CloseProgress:
        left = seconds_left(self._deadline)
        # A close that ends before the first line would be due needs no watcher (nor the time
        # its thread takes to start, which a close with no time left would spend delivering).
        long_enough = left is None or left > self._first_s
        if long_enough and any(self._busy(runner) for runner in self._runners):
            thread = threading.Thread(
                target=self._watch,
                name="sidestream-close-progress",
                daemon=True,  # only reads counters: never holds the interpreter's exit
            )
            try:
                thread.start()
            except RuntimeError:  # no new threads at this point of the exit (CPython 3.12.0)
                return self
            self._thread = thread
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)  # it only logs; never waited for long

    @staticmethod
    def _busy(runner: SinkRunner) -> bool:
        # A failed sink delivers nothing more: its close keeps its reports at once.
        return runner.pending > 0 and runner.status.state != "failed"

    def _watch(self) -> None:
        wait = self._first_s
        while not self._stop.wait(wait):
            wait = self._every_s
            busy = [runner for runner in self._runners if self._busy(runner)]
            if not busy:
                return
            logger.warning("%s", self.line(busy))

    def line(self, busy: list[SinkRunner]) -> str:
        """The progress line for the runners in ``busy``."""
        waited = time.monotonic() - self._began
        parts = []
        for runner in busy:
            done = runner.delivered - self._delivered_before.get(id(runner), 0)
            part = f"sink {runner.key!r}: {runner.pending:,} report(s) left, {done:,} delivered"
            status = runner.status
            if status.state == "retrying":
                part += f", its backend failing ({status.last_error}), retried with backoff"
            parts.append(part)
        left = seconds_left(self._deadline)
        # At exit the timeout is the run's exit_timeout: named, as the option to change.
        timeout = "exit_timeout" if closing_at_exit() else "the close's timeout"
        if left is None:
            after = f"no timeout ({timeout} is None): it waits until they are delivered"
        else:
            after = (
                f"{left:.0f} s of {timeout} left; what is left then is kept in a spool file "
                "(a warning names it)"
            )
        close = "close at exit" if closing_at_exit() else "close"
        return (
            f"{close}: waiting {waited:.0f} s for the sinks' backlog: {'; '.join(parts)}; {after}"
        )


def _wait_text(runner: SinkRunner, waited: float, left: float | None, timeout: float | None) -> str:
    """Why a checkpoint's sink is behind, for its warning: how long it waited, and of what.

    The sinks wait in turn within one deadline (``timeout`` seconds from the first): a sink
    behind a slow one found it passed and was said to have waited "0.0 s", as if it had been
    given no time by mistake.
    """
    if runner.status.state == "failed":
        return "(it failed for good: see its status)"
    given = "no limit" if timeout is None else f"{timeout:.1f} s"
    if left is not None and left <= 0:
        return (
            f"(not waited for: the checkpoint's time for its sinks, {given}, which they "
            "share in turn, had run out before its turn)"
        )
    return (
        f"after waiting {waited:.1f} s of the checkpoint's time for its sinks, {given}, "
        "which they share in turn"
    )


def _send_is_delivery(sink: Sink) -> bool:
    """Whether ``sink``'s state counts a step once sent, before ``make_durable`` ran.

    A tracker with ``durable_on_send`` (JSONL, MLflow), in this process or in a child one. One
    without (W&B, TensorBoard) counts only what its backend confirmed.
    """
    if isinstance(sink, ProcessSink):
        return sink.send_is_delivery
    return isinstance(sink, TrackerSink) and sink.durable_on_send


def _stream_text(stream: str) -> str:
    return stream or "run.log"


def _state_places(sink: Sink) -> frozenset[str] | None:
    """The places of ``sink``'s state now, or ``None`` if it cannot say before it opens."""
    try:
        return _places(sink.state_dict())
    except Exception:  # a custom sink whose state needs an open backend: not checked
        return None


def _places(state: Mapping[str, Any]) -> frozenset[str]:
    """The dotted paths torch.distributed.checkpoint stores ``state`` under.

    Walked as DCP walks a state (``traverse_state_dict``): into every mapping, into a list only
    when something in it is a tensor, a mapping or such a list; anything else is one place.
    Not DCP's own function: importing ``torch.distributed.checkpoint`` makes a gloo job abort
    at exit now and then (see ``tests/test_import_cost.py``), and a job that saves its
    checkpoint with ``torch.save`` never needs it.
    """
    found: set[str] = set()

    def walk(path: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{path}.{key}", item)
        elif isinstance(value, list) and _holds_places(value):
            for index, item in enumerate(value):
                walk(f"{path}.{index}", item)
        else:
            found.add(path)

    for key, value in state.items():
        walk(str(key), value)
    return frozenset(found)


def _holds_places(items: list[Any]) -> bool:
    """Whether DCP walks into the list ``items`` (it holds a tensor, a mapping or such a list)."""
    return any(
        isinstance(item, torch.Tensor | Mapping) or (isinstance(item, list) and _holds_places(item))
        for item in items
    )


def _owner(sink: Sink) -> Delivery | None:
    """The live run that ``sink`` belongs to, if any (the caller holds the lock)."""
    entry = _CLAIMED.get(id(sink))
    if entry is None:
        return None
    claimed, owner = entry[0](), entry[1]()
    if claimed is not sink or owner is None:
        del _CLAIMED[id(sink)]  # a sink or run that is gone (its id may be reused)
        return None
    return owner


def _claim(sinks: list[Sink], owner: Delivery) -> None:
    """Make ``owner`` the run of each sink and of the file or folder each writes, or raise.

    Refused: a sink object given twice or already in a live run, and two sinks of one kind that
    write one place (``Sink.written_place``), in this run or in another live run of this
    process: they would interleave or repeat its steps.
    """
    with _CLAIM_LOCK:
        seen: set[int] = set()
        places = [sink.written_place() for sink in sinks]  # a realpath each: computed once
        writers: dict[tuple[type, str, str], int] = {}
        for index, (sink, place) in enumerate(zip(sinks, places, strict=True)):
            if id(sink) in seen:
                raise ValueError(
                    f"sinks: {sink!r} is given twice; pass each sink object once (for two "
                    "files or runs of one tracker, make two sinks)"
                )
            if _owner(sink) is not None:
                raise ValueError(
                    f"sinks: {sink!r} already belongs to a run (another collector's, or a "
                    "sidestream.Run); a sink is one tracker run, so share it by creating one "
                    "sidestream.Run(sinks) and making every collector with run.collector(...)"
                )
            if _retired(sink):
                raise ValueError(
                    f"sinks: {sink!r} belonged to a run that is closed; a sink is one tracker "
                    "run and is not opened again (a tracker sink would continue the closed "
                    "run, skipping every step up to the last one it delivered). Make new sinks "
                    "for each run (in a sweep or a notebook cell: build them inside the loop or "
                    "the cell, with the run); for one tracker run over several collectors, make "
                    "one sidestream.Run and take them with run.collector(...); to continue a "
                    "run in a later job, make new sinks and resume with load_state_dict"
                )
            seen.add(id(sink))
            if place is None:
                continue
            kind, key, path = place
            if place in writers:
                raise ValueError(
                    f"sinks[{index}]: {kind.__name__} writes {path!r}, as sinks[{writers[place]}] "
                    f"does (in this process or a child process); give each sink its own {key}"
                )
            holder = _PLACES.get(place)
            if holder is not None and (other := holder()) is not None and _owner(other):
                raise ValueError(
                    f"sinks[{index}]: {kind.__name__} writes {path!r}, as a sink of another run "
                    "of this process does that is not closed yet (a sidestream.Run or a "
                    "collector with sinks); close that run first, or give this sink its own "
                    f"{key}"
                )
            writers[place] = index
        for sink, place in zip(sinks, places, strict=True):
            _CLAIMED[id(sink)] = (weakref.ref(sink), weakref.ref(owner))
            if place is not None:
                _PLACES[place] = weakref.ref(sink)


def _retired(sink: Sink) -> bool:
    """Whether ``sink`` belonged to a run that was closed (the caller holds the lock)."""
    entry = _RETIRED.get(id(sink))
    if entry is None:
        return False
    if entry() is not sink:
        del _RETIRED[id(sink)]  # a sink that is gone (its id may be reused)
        return False
    return True


def _forget_retired(key: int) -> Callable[[weakref.ref[Sink]], None]:
    """A callback that drops ``_RETIRED``'s entry of a sink once it is gone.

    So a sweep of many trials keeps no entry per trial.
    """

    def forget(gone: weakref.ref[Sink]) -> None:
        if _RETIRED.get(key) is gone:  # not a newer sink's entry, made since under its id
            _RETIRED.pop(key, None)

    return forget


def _release(sinks: Iterable[Sink], owner: Delivery) -> None:
    """Free ``owner``'s places and retire its sinks (its close ended; see ``_RETIRED``)."""
    with _CLAIM_LOCK:
        for sink in sinks:
            if _owner(sink) is owner:
                del _CLAIMED[id(sink)]
                _RETIRED[id(sink)] = weakref.ref(sink, _forget_retired(id(sink)))
        for place, held in list(_PLACES.items()):
            if (other := held()) is None or _owner(other) is None:
                del _PLACES[place]


def check_timeout(name: str, timeout: object) -> float | None:
    """``timeout`` as waits take it; raise naming ``name`` unless it is ``None`` or seconds >= 0.

    Infinity is ``None`` (no limit): ``threading``'s waits overflow on it.
    """
    if timeout is None:
        return None
    check_seconds(name, timeout)
    assert isinstance(timeout, Real)
    if timeout < 0:
        raise ValueError(f"{name}: expected a number of seconds >= 0 or None, got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def _keyed(sinks: list[Sink]) -> dict[str, Sink]:
    """Sinks by a stable key: the sink's name, ``name-2`` for a second sink of that name."""
    keyed: dict[str, Sink] = {}
    for sink in sinks:
        key, n = sink.name, 1
        while key in keyed:
            n += 1
            key = f"{sink.name}-{n}"
        keyed[key] = sink
    return keyed


def _backlogs(undelivered: Mapping[str, Any]) -> dict[str, str]:
    """A checkpoint's ``"undelivered"`` part, checked: spool lines per sink key."""
    if not isinstance(undelivered, Mapping):
        raise TypeError(
            f"state_dict['undelivered']: expected a mapping of sink key to text, got "
            f"{type(undelivered).__name__}"
        )
    out = {}
    for key, text in undelivered.items():
        if isinstance(text, bytes):
            text = text.decode()
        if not isinstance(text, str):
            raise TypeError(
                f"state_dict['undelivered'][{key!r}]: expected text (spool lines), got "
                f"{type(text).__name__}"
            )
        # A checkpoint of a newer sidestream: refused when loaded, not each of its reports
        # dropped as damaged once the sink starts. One process wrote them: the first tells.
        try:
            check_line_format(text.lstrip().partition("\n")[0])
        except SpoolFormatError as error:
            raise ValueError(f"state_dict['undelivered'][{key!r}]: {error}") from None
        out[str(key)] = text
    return out


def _copy_of(report: Report) -> Report:
    """``report`` with values and histograms of its own (the histograms' tensors cloned)."""
    return dataclasses.replace(
        report,
        values=dict(report.values),
        histograms={name: values.clone() for name, values in report.histograms.items()},
    )
