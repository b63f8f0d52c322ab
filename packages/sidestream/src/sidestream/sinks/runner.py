"""One sink's bounded queue and thread: retries with backoff, spools overflow, reports once."""

from __future__ import annotations

import copy
import json
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from sidestream._exit import exiting_with, scoped_exit_code
from sidestream._logs import get_logger
from sidestream._threads import own_thread
from sidestream._validation import check_int
from sidestream.sinks._lost import LostSteps
from sidestream.sinks._spool import DEFAULT_SPOOL_MAX_BYTES, Spool, SpoolWriteError
from sidestream.sinks._spool_format import (
    decode_report,
    encode_report,
    read_kept_state,
    write_kept_state,
)
from sidestream.sinks.base import Report, RunInfo, Sink, batch_size
from sidestream.sinks.status import SinkStatus, is_permanent
from sidestream.sinks.support import MAX_RETRY_WAIT_S, check_retry_waits, check_seconds

__all__ = ["SinkRunner", "state_before_open"]

logger = get_logger("sidestream.sinks")

_LEFTOVERS_NAMED = 5  # leftover spool files a warning names (the rest are counted)


class SinkRunner:
    """Delivers reports to one sink, in step order, from a thread of its own.

    ``submit`` never touches the disk and never raises into the caller (except after
    ``close``): up to ``capacity`` reports wait in memory, more go to a spool file (JSON lines,
    owner-only), written by a second thread of the runner's own, and are read back in order; at most
    ``max(capacity, INBOX_MIN_CAPACITY)`` wait in memory for that thread: past that a submitter
    waits while the thread writes (a burst faster than the disk), and drops the oldest waiting once
    it has written nothing for ``INTAKE_STALL_S`` (a hung disk). The spool holds at most
    ``spool_max_bytes``; past that the oldest spooled reports are dropped. A report that cannot be
    spooled (unusable directory, full disk) or read back (damaged file) is dropped too. Every drop
    is counted in ``dropped`` and logged (the first of a streak, which ends once a report is spooled
    into a spool at most half full, and the total at ``close``), and ``close`` then returns
    ``False``: a failing spool affects this sink only. A ``write`` that raises is retried with
    exponential backoff until it succeeds; a sink with ``max_batch > 1`` and a ``write_batch``
    of its own gets a backlog in calls of up to that many reports, retried whole (with the
    default ``write_batch``, one report at a time: see ``sinks.base.batch_size``). The first
    failure of a streak is logged (logger ``sidestream.sinks``) and so is the recovery, never
    each attempt. Every sink method runs on this thread, so a slow or failing sink delays
    nothing else.

    Args:
        sink: The sink to drive.
        run: Passed to ``sink.open``.
        key: A name for messages, thread and spool file (the sink's name by default).
        resume_state: Given to ``sink.load_state_dict`` before ``open``, if not ``None``.
        capacity: Reports kept in memory before spooling to disk.
        spool_dir: Directory of the spool file (the system temp dir by default); a relative
            one is taken from the working directory when the runner is made.
        spool_max_bytes: Most bytes the spool file holds (256 MiB by default).
        retry_initial_s: First backoff after a failure; doubles up to ``retry_max_s``.
        retry_max_s: Longest backoff.
        flush_interval_s: An idle sink with unflushed writes is flushed after this long (0 to
            86,400 seconds).
        before_open: Called with the sink after ``resume_state`` is loaded and before each
            ``open`` (its identity then is the tracker run it will write); what it raises fails
            the open like the sink's own error (a ``PermanentSinkError``: for good).
    """

    def __init__(
        self,
        sink: Sink,
        run: RunInfo | None = None,
        *,
        key: str | None = None,
        resume_state: Mapping[str, Any] | None = None,
        capacity: int = 64,
        spool_dir: str | None = None,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        retry_initial_s: float = 0.1,
        retry_max_s: float = 10.0,
        flush_interval_s: float = 1.0,
        before_open: Callable[[Sink], None] | None = None,
    ) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink: expected a sidestream.sinks.Sink, got {type(sink)}")
        # Checked here, naming the argument, as a run checks its own options: a str capacity
        # failed with "'<' not supported ...", a spool_max_bytes with the spool's "max_bytes",
        # and a str flush_interval_s passed and then failed the sink for good on its thread.
        check_int("capacity", capacity, 1)
        check_int("spool_max_bytes", spool_max_bytes, 1)
        check_seconds("flush_interval_s", flush_interval_s)
        if not 0 <= flush_interval_s <= MAX_RETRY_WAIT_S:
            # The idle sink waits this long for its flush: inf (or 1e300) passed the check
            # above and failed the sink for good on its thread ("timestamp out of range").
            raise ValueError(
                f"flush_interval_s: expected seconds in [0, {MAX_RETRY_WAIT_S:g}], got "
                f"{flush_interval_s!r}"
            )
        if run is not None and not isinstance(run, RunInfo):
            # A dict was taken, and failed the sink's open on its thread.
            raise TypeError(f"run: expected a sidestream.sinks.RunInfo or None, got {run!r}")
        if key is not None and not isinstance(key, str):
            raise TypeError(f"key: expected a str or None, got {key!r}")
        if resume_state is not None and not isinstance(resume_state, Mapping):
            raise TypeError(f"resume_state: expected a dict or None, got {resume_state!r}")
        if spool_dir is not None and not isinstance(spool_dir, str | os.PathLike):
            # 3 was taken, and every report past the queue then dropped as unspoolable.
            raise TypeError(f"spool_dir: expected a directory path or None, got {spool_dir!r}")
        check_retry_waits("retry_initial_s", "retry_max_s", retry_initial_s, retry_max_s)
        self.sink = sink
        self.key = key or sink.name
        self._run = run or RunInfo()
        self._resume_state = resume_state
        self._before_open = before_open
        self._capacity = capacity
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._flush_interval_s = flush_interval_s
        check_int(f"{type(sink).__name__}.max_batch", getattr(sink, "max_batch", 1), 1)
        self._max_batch = batch_size(sink)
        # Entered as the lock itself (with self._lock), never as the Condition: its
        # __enter__ is a Python frame, and a Ctrl-C there leaves the lock held for good.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[Report] = deque()
        self._spool = Spool(spool_dir, label=self.key, max_bytes=spool_max_bytes)
        self._in_flight: list[Report] = []
        self._submitted = 0  # under _inbox_lock: submit never waits for _cond
        self._delivered = 0
        self._dropped = 0  # spool drops, under _cond
        # The steps of reports lost here (the spool notes those it loses itself), for messages:
        # under _cond, as _dropped; the inbox's drops in _inbox_lost, under _inbox_lock, as
        # _inbox_dropped (a submitter drops them holding that lock alone, while the intake
        # thread notes a failed spool write holding _cond alone: one record written under
        # either lost counts, and made a stream's first entry twice).
        self._lost_steps = LostSteps()
        self._inbox_lost = LostSteps()
        self._dropping = False  # inside a streak of drops: logged once
        self._closing = False  # under _cond: the sink thread stops once all is delivered
        # How the job was ending as the close began (``exiting_with`` on the closing thread: a
        # ``with Run(...)`` block left by an exception), told to the sink's close on this
        # runner's threads: that scope is the closing thread's own, so that runs closing in
        # other threads meanwhile (a sweep's trials) are not told their job failed.
        self._ending_code: int | None = None
        # Reports for the spool wait here, in memory, for the intake thread to write them, so
        # no submitting thread (the dispatcher, the training thread in run.log) ever waits for
        # the spool's disk; _cond is held across that disk's reads and writes, _inbox_lock
        # never is.
        self._inbox_lock = threading.Lock()
        self._inbox_ready = threading.Condition(self._inbox_lock)
        self._room = threading.Condition(self._inbox_lock)  # the intake thread took one
        self._intake_progress = time.monotonic()  # when it last took one (under _inbox_lock)
        self._inbox: deque[Report] = deque()
        # The report the intake thread is queueing or spooling (set and cleared under both
        # locks): a checkpoint taken while a hung disk holds _cond keeps it from here.
        self._admitting: Report | None = None
        # The thread keeping the undelivered reports at close, and where it puts its result.
        self._keeper: (
            tuple[
                threading.Thread,
                list[tuple[list[str], int, Exception | None]],
                Callable[[list[str], int, Exception | None], None],
            ]
            | None
        ) = None
        self._keeper_lock = threading.Lock()
        self._keeper_gave_up = False  # under _keeper_lock: close stopped waiting for it
        # Set by the keeper thread as it ends. Not Thread.is_alive(): a second interrupt in
        # close's join of the keeper (Ctrl-C twice) marks it stopped while it still writes on
        # Python 3.11 (bpo-45274), as _sink_thread_running says of the sink thread.
        self._keeper_ended = threading.Event()
        self._kept_all = False  # a close kept every undelivered report in a spool file
        self._inbox_capacity = max(capacity, INBOX_MIN_CAPACITY)
        self._inbox_dropped = 0
        self._inbox_dropping = False
        self._inbox_unsaid: Report | None = None  # under _inbox_lock: see _say_inbox_drop
        self._close_requested = False  # under _inbox_lock: no more submit
        self._close_timeout: float | None = None  # the first close's, which its messages name
        self._close_deadline: float | None = None
        self._abandon = threading.Event()
        self._close_result: bool | None = None  # what a close that ended returned
        self._interrupted = False  # close_now: an earlier close was interrupted
        self._failing = False
        self._failed_attempts = 0
        self._failing_since = 0.0  # time.monotonic() of the streak's first failure
        self._flush_failures = 0  # in a row: only the first of a streak is logged
        self._flush_failure_kind: str | None = None  # how the streak's flushes fail
        self._status = SinkStatus("healthy", None)
        # Until the sink delivers (or if it never opens): the state it resumes from, else its
        # state before open, so a checkpoint taken meanwhile keeps them and the keys a fresh
        # run's sink has (torch.distributed.checkpoint loads into those).
        self._state: dict[str, Any] = (
            copy.deepcopy(dict(resume_state))
            if resume_state is not None
            else state_before_open(sink, self.key)
        )
        # The state a checkpoint falls back to when the sink's make_durable fails before any
        # succeeded (Delivery._durable_state): what it resumed from, or had before open.
        self._first_state = copy.deepcopy(self._state)
        self._sink_closed = False  # the sink's final flush and close both succeeded
        self._state_failing = False  # the sink's state_dict raised when last read
        self._opened = False  # set by the sink thread once open succeeded
        self._close_tried = False  # the sink thread called the sink's close
        # Set once this runner's sink thread ended (or will never start): a runner started
        # on the sink later opens it only then (see _SINK_USERS).
        self._done = threading.Event()
        self._earlier: list[threading.Event] = []  # those of runners started on it before
        self._thread = own_thread(
            self._work_or_fail,
            name=f"sidestream-sink-{self.key}",
            role=f"thread of sink {self.key!r} (from the sink's methods, or a logging handler)",
        )
        self._intake = own_thread(
            self._take_in_or_fail,
            name=f"sidestream-spool-{self.key}",
            role=f"spool thread of sink {self.key!r} (from a logging handler)",
        )

    # ------------------------------------------------------------------ caller side

    def start(self) -> None:
        """Start the thread; it opens the sink, then delivers.

        A runner started on this sink before whose thread has not ended (a start undone
        while the sink's open was in progress: ``withdraw``) is waited for by the thread
        before it opens the sink: that thread closes the sink once its open returns.

        Spool files this sink's earlier jobs left behind (a crash, or a close that timed out)
        hold reports never delivered: a warning names them, with how to replay them. Files
        whose kept state names another run (a kept spool of another job in the same
        directory), or names none (a console sink's), are only counted, at INFO: their job
        named them when it closed.
        """
        left, others = _leftovers_of(self._spool.leftovers(), self._state)
        if others:
            logger.info(
                "sink %r: %d spool file(s) in the spool directory were kept by other runs, or by "
                "jobs whose state files name no run to tell them apart; each was named when its "
                "job closed",
                self.key,
                len(others),
            )
        more = len(left) - _LEFTOVERS_NAMED
        if left:
            logger.warning(
                "sink %r: %d spool file(s) of earlier jobs hold reports they had not delivered "
                "when they ended: %s. If this job resumed that job from its checkpoint, delete "
                "them: the checkpoint holds the reports undelivered at that point and this job "
                "logs the later steps again (a replay would deliver later steps first, and "
                "MLflow and TensorBoard then skip the earlier ones). For a job that is not "
                "resumed, deliver them with python -m sidestream replay FILE %s (where this "
                "job's sink delivers); with --resume-state (the sink's state from that job's "
                "last checkpoint) they go into its run",
                self.key,
                len(left),
                ", ".join(left[:_LEFTOVERS_NAMED]) + (f" and {more} more" if more > 0 else ""),
                _replay_arguments(self.sink),
            )
        self._intake.start()
        try:
            with _SINK_USERS_LOCK:
                users = _SINK_USERS.setdefault(id(self.sink), [])
                self._earlier = list(users)
                users.append(self._done)
            self._thread.start()
        except BaseException:
            # A start that raises leaves no thread behind: the caller drops this runner
            # (withdraw lets go of its sink too, as no thread of its own will).
            self.withdraw(None)
            raise

    def withdraw(self, timeout: float | None = None) -> bytes:
        """Stop without delivering anything more; the reports it had not delivered.

        For a start that is undone (a failed bind): the caller keeps the reports (spool lines,
        as ``undelivered`` gives them) for the runner made in this one's place, and no spool
        file is kept. The threads end after the sink's open, write or close in progress
        (waited for up to ``timeout`` seconds); a sink it opened is closed, by its thread, even
        after that. A runner started on the same sink in this one's place opens it only once
        that thread ended, so the two never use the sink at once. A runner never started, or
        started in part, is stopped as well.
        """
        self.begin_close(timeout)
        self._abandon.set()  # no more writes, nor retries of the open
        if self._thread.ident is None:
            self._let_go()  # registered on its sink, but no thread of its own will let it go
        if self._acquire_within(self._remaining()):  # not held for good by a hung spool disk
            self._cond.notify_all()
            self._cond.release()
        for thread in (self._intake, self._thread):
            if thread.ident is not None:
                thread.join(self._remaining())
        left = self.undelivered(self._remaining())
        if self._acquire_within(self._remaining()):
            try:
                self._forget_queued()
                self._in_flight = []
                self._spool.discard()
            finally:
                self._cond.release()
        return left

    def submit(self, report: Report) -> None:
        """Queue ``report``, without touching the disk; returns at once unless a burst outruns it.

        With room in the queue and nothing waiting beyond it, the report is queued here. Else
        it waits in memory for the intake thread, which spools it (a full queue) or queues it.
        At most ``max(capacity, INBOX_MIN_CAPACITY)`` wait so: a caller that finds them full
        waits for room while the intake thread writes (a burst faster than the disk pays for
        it, as when the caller wrote the spool itself), but not for a disk that has written
        nothing for ``INTAKE_STALL_S``: then the oldest waiting is dropped. Before ``start``
        the report is queued or spooled here (a checkpoint's backlog: nothing else runs yet).
        A spool that cannot take the report (full: the oldest are dropped; unusable: this one
        is) costs reports of this sink only; they are counted in ``dropped``, never raised.

        Raises:
            RuntimeError: After ``close``.
        """
        if self._intake.ident is None:
            with self._lock:
                with self._inbox_lock:
                    self._refuse_after_close()
                    self._submitted += 1
                self._admit(report)
            return
        # Never waits for _cond: the intake or sink thread may hold it across a slow disk.
        if self._cond.acquire(blocking=False):
            try:
                with self._inbox_lock:
                    self._refuse_after_close()
                    if (
                        not self._inbox
                        and not len(self._spool)
                        and len(self._queue) < self._capacity
                    ):
                        self._submitted += 1
                        self._queue.append(report)
                        self._cond.notify_all()
                        return
            finally:
                self._cond.release()
        try:
            with self._inbox_lock:  # _cond released: the intake thread needs it to make room
                self._wait_in_inbox(report)
        finally:
            self._say_inbox_drop()

    def _say_inbox_drop(self) -> None:
        """Warn about the first drop of a streak ``_wait_in_inbox`` made, with no lock held.

        Under ``_inbox_lock``, a logging handler that logs to the run (``run.log``, on the
        dispatcher's thread) waited for the ``Run.log`` thread's delivery, which waited for
        that lock: both threads hung.
        """
        if self._inbox_unsaid is None:  # the usual case: no lock taken again
            return
        with self._inbox_lock:
            lost, self._inbox_unsaid = self._inbox_unsaid, None
        if lost is not None:
            logger.warning(
                "sink %r: %d report(s) wait to be spooled and the spool's disk wrote none "
                "for %.0f s (spool_dir on a hung disk?); dropped the oldest, %s step %d "
                "(counted in SinkRunner.dropped; not logged again until the wait drains; the "
                "total at close names every lost step)",
                self.key,
                self._inbox_capacity,
                INTAKE_STALL_S,
                lost.stream or "Run.log",
                lost.step,
            )

    def _refuse_after_close(self) -> None:
        if self._close_requested:  # _inbox_lock held
            raise RuntimeError(f"sink {self.key!r}: submit after close")

    def _wait_in_inbox(self, report: Report) -> None:
        """Give ``report`` to the intake thread (``_inbox_lock`` held, ``_cond`` not).

        Waits for room while the intake thread makes progress; past ``INTAKE_STALL_S`` without
        any, drops the oldest waiting instead (the first of a streak is kept in
        ``_inbox_unsaid``, for ``_say_inbox_drop`` to warn about once the lock is free).
        """
        if not self._inbox:
            # Nothing waited: the intake thread has had no work, so no time without progress.
            self._intake_progress = time.monotonic()
        while len(self._inbox) >= self._inbox_capacity:
            self._refuse_after_close()
            stalled = time.monotonic() - self._intake_progress
            if stalled < INTAKE_STALL_S and self._intake.is_alive():
                self._room.wait(INTAKE_STALL_S - stalled)
                continue
            lost = self._inbox.popleft()
            self._inbox_dropped += 1
            self._inbox_lost.add(lost.stream, lost.step)
            if not self._inbox_dropping:
                self._inbox_dropping = True
                self._inbox_unsaid = lost
        # Checked again after any wait: close takes what waits, so nothing may come later.
        self._refuse_after_close()
        self._submitted += 1
        self._inbox.append(report)
        self._inbox_ready.notify()

    def _admit(self, report: Report) -> None:
        """Queue ``report``, or spool it behind what is spooled (``_cond`` held)."""
        if len(self._spool) or len(self._queue) >= self._capacity:
            try:
                dropped = self._spool.append(report)
            except Exception as error:
                # And the older reports dropped for room before the write failed.
                lost = 1 + (error.dropped if isinstance(error, SpoolWriteError) else 0)
                self._lost_steps.add(report.stream, report.step)  # the spool notes the older
                reason = f"could not spool step {report.step}: {_describe(error)}"
                if isinstance(error, OSError):
                    # A write's error names no file: say which spool, on which disk, and what
                    # helps (a job may spool to the temp dir on another disk than its logs).
                    reason += (
                        f" (spool {self._spool.location}: free space there, or give the run a "
                        "spool_dir with room that this process may write)"
                    )
                self._drop(lost, reason)
            else:
                if dropped:
                    self._drop(
                        dropped,
                        f"spool full ({self._spool.nbytes} bytes, its cap spool_max_bytes="
                        f"{self._spool.max_bytes}): the oldest report(s) made room for step "
                        f"{report.step}",
                    )
                else:
                    self._end_drop_streak_if_room()
        else:
            self._queue.append(report)
        self._cond.notify_all()

    def _take_in_or_fail(self) -> None:
        """``_take_in``; an error it did not expect fails the sink (its reports are kept)."""
        try:
            self._take_in()
        except BaseException as error:
            self._fail("spooling", f"{type(error).__name__}: {error} (an error in sidestream)")

    def _take_in(self) -> None:
        """The intake thread: queue or spool what waits in the inbox, in order, until closed."""
        while True:
            with self._inbox_lock:
                while not self._inbox and not self._close_requested:
                    self._inbox_ready.wait()
                if not self._inbox:
                    break
            with self._lock:
                with self._inbox_lock:
                    if self._keeper is not None:  # a close keeps what waits: not twice
                        break
                    if not self._inbox:  # a close took what waited
                        continue
                    # Moved under both locks: undelivered() sees it in one place, never none.
                    report = self._admitting = self._inbox.popleft()
                    self._intake_progress = time.monotonic()
                    if len(self._inbox) <= self._inbox_capacity // 2:
                        self._inbox_dropping = False  # drained: a new streak is logged again
                    self._room.notify()
                try:
                    self._admit(report)
                finally:
                    self._admitting = None  # queued or spooled now: found there
        with self._lock:  # everything submitted is queued or spooled: the sink may finish
            self._closing = True
            self._cond.notify_all()

    def _drop(self, count: int, reason: str) -> None:
        """Count ``count`` lost reports (lock held); log the first of a streak."""
        self._dropped += count
        if not self._dropping:
            self._dropping = True
            logger.warning(
                "sink %r: %s; dropped %d report(s) (counted in SinkRunner.dropped, %d so far%s; "
                "not logged again until the spool works and is at most half full)",
                self.key,
                reason,
                count,
                self._dropped,
                self._lost_steps_said(", lost "),
            )

    # The counters and the status are read without _cond, which the intake and sink threads
    # hold across the spool's disk reads and writes: a hung disk must not hang a caller that
    # asks how the sink is doing (run.sink_status, a close). Each is one read under the GIL.

    @property
    def pending(self) -> int:
        """Reports submitted and not delivered yet (queued, spooled or being written)."""
        # Read one after another: a report delivered in between must not make it negative.
        return max(0, self._submitted - self._delivered - self._lost())

    @property
    def dropped(self) -> int:
        """Reports lost to this sink.

        Spool full (oldest first), unusable or damaged, or too many waiting for a spool disk
        that does not keep up.
        """
        return self._lost()

    def _lost(self) -> int:
        return self._dropped + self._inbox_dropped

    @property
    def spooled_bytes(self) -> int:
        """Bytes of reports waiting in the spool file."""
        return self._spool.nbytes

    @property
    def delivered(self) -> int:
        """Reports the sink accepted."""
        return self._delivered

    @property
    def spooled(self) -> int:
        """Reports waiting in the spool file."""
        return len(self._spool)

    @property
    def status(self) -> SinkStatus:
        """Whether the sink is healthy, retrying a transient failure, or failed for good."""
        return self._status

    @property
    def opened(self) -> bool:
        """Whether the sink's ``open`` has succeeded (its own ``state_dict`` is then live)."""
        return self._opened

    def sink_state(self) -> dict[str, Any]:
        """``sink.state_dict()`` as of the last delivered report, taken on the sink's thread.

        A copy throughout: checkpoints taken before the sink delivers again must not share
        lists (``last_steps``) with each other or with the state it resumed from.
        """
        state = self._state  # replaced whole, never changed in place: no lock (see pending)
        return copy.deepcopy(state)

    def first_state(self) -> dict[str, Any]:
        """The state the sink started from (resumed from, or had before open); a copy."""
        return copy.deepcopy(self._first_state)

    def undelivered(self, timeout: float | None = None) -> bytes:
        """Every report not delivered yet, oldest first, as spool lines (JSON, one per line).

        Those the sink took without its backend confirming them (``Sink.pending_reports``),
        the batch being written, the queue, the spool and those waiting to be spooled. A
        checkpoint holds them, so a job resumed from it delivers them first (the sink skips
        what its backend already has). A spool that cannot be read, or is busy past
        ``timeout`` seconds and a grace second (a hung disk), is left out, with a warning:
        this job still delivers its reports.
        """
        locked = self._acquire_within(timeout)
        try:
            # Without the lock, the report a hung spool write holds is read first: should that
            # write end meanwhile, the report is in the queue read next (kept twice, and the
            # resumed sink skips the second), or in the spool, left out as below.
            admitting = None if locked else self._admitting
            # Ours first, the sink's after: a write ending in between moves its reports from
            # in-flight to the sink's pending ones, so they are in one list or both, never none.
            # Without the lock (the spool's disk holds it) each list is copied in one step.
            older = [*list(self._in_flight), *list(self._queue)]
            if admitting is not None:
                older.append(admitting)
            spooled = b""
            if not locked:
                logger.warning(
                    "sink %r: the spool did not answer within %.1f s (spool_dir on a hung "
                    "disk?): the checkpoint lacks its %d spooled report(s); this job still "
                    "delivers them",
                    self.key,
                    (timeout or 0.0) + _LOCK_GRACE_S,
                    len(self._spool),
                )
            else:
                try:
                    spooled = self._spool.live_bytes()
                except OSError as error:
                    logger.warning(
                        "sink %r: the spool could not be read for the checkpoint (%s): its %d "
                        "report(s) are delivered by this job but missing from the checkpoint",
                        self.key,
                        _describe(error),
                        len(self._spool),
                    )
            with self._inbox_lock:  # the newest, not spooled yet; encoded after the lock
                newest = list(self._inbox)
        finally:
            if locked:
                self._cond.release()
        held = [encode_report(report) for report in self._held_by_sink()]  # the oldest
        ours = [*(encode_report(r) for r in older), spooled, *(encode_report(r) for r in newest)]
        return b"".join([*held, *ours])

    def submit_backlog(
        self,
        lines: bytes,
        delivered: Mapping[str, int] | None = None,
        delivered_default: int | None = None,
    ) -> None:
        """Queue a checkpoint's undelivered reports (``undelivered``) before anything else.

        Call before anything else is submitted (before ``start``, or right after it). A
        damaged line is counted in ``dropped`` and warned about. A report at or below
        ``delivered``'s step of its stream (the checkpoint's sink state, read after the
        reports) was delivered as the checkpoint was taken: it is left out. A stream
        ``delivered`` lacks has ``delivered_default`` (an older state's ``last_step``).
        """
        for line in lines.splitlines():
            if not line.strip():
                continue
            try:
                report = decode_report(line)
            except ValueError as error:
                with self._lock:
                    with self._inbox_lock:
                        self._submitted += 1
                    self._drop(1, f"damaged undelivered report in the checkpoint: {error}")
                continue
            last = (delivered or {}).get(report.stream, delivered_default)
            if last is not None and report.step <= last:
                continue
            self.submit(report)

    def wait_delivered(self, timeout: float | None = None) -> bool:
        """Block until every submitted report is delivered; whether that happened in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._acquire_within(timeout):
            return False  # the spool's disk holds the lock (a hung disk): not in time
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return self._cond.wait_for(
                lambda: self._delivered + self._lost() == self._submitted or self._abandon.is_set(),
                left,
            ) and (self._delivered + self._lost() == self._submitted)
        finally:
            self._cond.release()

    def begin_close(self, timeout: float | None = None) -> None:
        """Start closing (no more ``submit``; deliver, flush, close) without waiting.

        Lets a caller start every runner's close at once, then ``close`` each: their
        timeouts then run side by side instead of one after another. Only the first call's
        ``timeout`` counts.
        """
        with self._inbox_lock:
            if not self._close_requested:
                self._close_requested = True
                self._ending_code = scoped_exit_code()
                self._close_timeout = timeout
                self._close_deadline = None if timeout is None else time.monotonic() + timeout
            self._inbox_ready.notify_all()
            self._room.notify_all()  # a submitter waiting for room raises at once
        if not self._intake.is_alive():
            # No intake thread to say so once the inbox is empty (never started, or failed).
            with self._lock:
                self._closing = True
                self._cond.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """Deliver what is pending, flush and close the sink, stop the thread.

        When ``timeout`` runs out first, the undelivered reports are written to a spool file
        that is kept on disk (JSON lines, oldest first; ``replay_spool`` delivers them later),
        a warning names it, and ``False`` is returned. Never raises: a file that cannot be
        written is logged with the count of reports lost. Also ``False`` when reports were
        dropped (see ``dropped``), when the sink failed, and when its final ``close`` raised or
        returned ``False`` (its backend may not have everything). A later call returns what
        the first returned, unless the first was interrupted (Ctrl-C): it then finishes it.
        """
        if self._close_result is not None:
            return self._close_result
        self._close_result = self._close(timeout)
        return self._close_result

    def _close(self, timeout: float | None) -> bool:
        self.begin_close(timeout)
        # The time the sink was given: a caller that began every runner's close at once passes
        # only what is left of it here.
        timeout = self._close_timeout
        if self._thread.ident is None:  # never started: nothing was opened or delivered
            self._let_go()  # in case it was registered on its sink (a start interrupted)
            with self._lock:
                with self._inbox_lock:
                    self._lost_steps.add_reports([*self._queue, *self._inbox])
                self._spool.discard(lost=True)
                # Counted and said, as any report lost (those dropped already were).
                lost = self._submitted - self._delivered - self._lost()
                if lost:
                    self._dropped += lost
                    logger.warning(
                        "sink %r: closed before it was started; dropped the %d report(s) "
                        "submitted to it (counted in SinkRunner.dropped%s)",
                        self.key,
                        lost,
                        self._lost_steps_said(", "),
                    )
                return self._submitted == 0
        self._thread.join(self._remaining())
        ended = not self._sink_thread_running()  # else it ran past the timeout
        failed = self.status.state == "failed"
        # Held across the spool's reads and writes: on a hung disk, wait no longer than close.
        # The grace second counts from the close's deadline, not from now: runners closed one
        # after another (a run's sinks, begun at once) on one hung disk all give up by then.
        if not self._acquire_by_deadline():
            self._abandon.set()
            # Without the lock (a hung disk holds it): one assignment, seen whole.
            self._status = SinkStatus("failed", "the spool did not answer at close")
            logger.error(
                "sink %r: close: the spool did not answer within %.1f s (a hung disk?); the "
                "reports this sink had not delivered stay in memory and in %s, are kept there "
                "once the disk answers (a warning then says so), and are lost if it does not "
                "before the process ends",
                self.key,
                timeout or 0.0,
                self._spool.path or "no spool file yet",
            )
            # Those still in memory (queued, in a write) would otherwise never reach the file,
            # even when the disk comes back: kept by a thread that waits for it.
            threading.Thread(
                target=self._close_late,
                args=(timeout, ended, failed),
                name=f"sidestream-late-keep-{self.key}",
                daemon=True,  # a hung disk must not hold the interpreter's exit
            ).start()
            return False
        try:
            return self._close_locked(timeout, ended, failed)
        finally:
            self._cond.release()

    def _sink_thread_running(self) -> bool:
        """Whether the sink thread is still at work (in a write, a flush or the sink's close).

        Not ``Thread.is_alive()`` alone: on Python 3.11 a ``join`` interrupted by a signal
        handler's exception (Ctrl-C, a SIGTERM handler's ``SystemExit``) marks the thread it
        waited for as stopped while it still runs (threading's bpo-45274 handling), and an
        interrupted close is exactly when this is asked. The thread sets ``_done`` itself as it
        ends; one never started has nothing running.
        """
        if self._thread.is_alive():
            return True
        return self._thread.ident is not None and not self._done.is_set()

    def _close_late(self, timeout: float | None, ended: bool, failed: bool) -> None:
        """The rest of a close that gave up on a slow spool disk, once the disk answers."""
        with self._lock:
            self._close_locked(timeout, ended, failed)

    def close_now(self) -> bool:
        """``close`` with no time left, whatever an earlier call was given.

        For a close that was interrupted (Ctrl-C): the undelivered reports are kept in a spool
        file at once instead of dying with the sink thread when the process exits. After a
        close that ended, what it returned (``close`` says it again).
        """
        self._interrupted = True
        self.begin_close(0.0)
        with self._inbox_lock:
            self._close_deadline = time.monotonic()
        return self.close(0.0)

    def _keep_within(
        self,
        undelivered: list[Report],
        newest: list[Report],
        report: Callable[[list[str], int, Exception | None], None],
    ) -> tuple[list[str], int, Exception | None] | None:
        """``Spool.keep`` on a thread of its own, waited for while its disk writes.

        The wait ends at close's deadline or once the disk has written nothing for
        ``INTAKE_STALL_S``, whichever is later: a slow disk keeps a large spool, a hung one (an
        NFS server gone) holds close no longer (``close(None)`` waits without limit). ``None``
        when it gave up.
        """
        kept: list[tuple[list[str], int, Exception | None]] = []

        def keep() -> None:
            try:
                result = self._spool.keep(undelivered, newest)
                with self._keeper_lock:
                    kept.append(result)
                    late = self._keeper_gave_up
            finally:
                self._keeper_ended.set()
            if late:  # close stopped waiting: what was kept is said here, once the disk is back
                with self._lock:
                    report(*result)

        worker = threading.Thread(
            target=keep,
            name=f"sidestream-keep-{self.key}",
            daemon=True,  # a hung disk must not hold the interpreter's exit either
        )
        self._spool.kept_progress = time.monotonic()
        self._keeper = (worker, kept, report)
        self._forget_queued()
        try:
            worker.start()
        except RuntimeError:
            # CPython 3.12.0 and 3.12.1 start no thread once the interpreter's exit has begun
            # (the closes at exit run there; 3.12.2 lifted it): the spool file is the last
            # place these reports can go, so they are kept on this thread, without the wait's
            # bound, rather than lost with the process. ``_keeper`` stays set, so the intake
            # thread keeps nothing a second time.
            keep()
            return kept[0] if kept else None
        return self._wait_for_keeper()

    def _forget_queued(self) -> None:
        """Empty the queue and the inbox (``_cond`` held): the keeper holds their reports."""
        self._queue.clear()
        with self._inbox_lock:
            self._inbox.clear()

    def _wait_for_keeper(self) -> tuple[list[str], int, Exception | None] | None:
        """Wait for ``_keep_within``'s thread as it says; its result, ``None`` if given up."""
        assert self._keeper is not None
        worker, kept, _ = self._keeper
        if worker.ident is None:  # interrupted between registering it and starting it
            worker.start()
        with self._keeper_lock:
            if self._keeper_gave_up:  # given up before: the thread says what it kept itself
                return None
        if self._remaining() is None:  # close(None): no limit, as asked
            self._keeper_ended.wait()
            return kept[0] if kept else None
        while True:
            stalled = time.monotonic() - self._spool.kept_progress
            wait = max(self._remaining() or 0.0, INTAKE_STALL_S - stalled)
            if wait <= 0:
                with self._keeper_lock:
                    if kept:  # it ended just now
                        return kept[0]
                    self._keeper_gave_up = True  # it says what it kept, if it ever ends
                return None
            if self._keeper_ended.wait(min(wait, 0.1)):
                return kept[0] if kept else None

    def _acquire_by_deadline(self) -> bool:
        """Take ``_cond`` by the close's deadline and a grace second; whether it was taken."""
        if self._close_deadline is None:
            return self._cond.acquire()
        left = self._close_deadline + _LOCK_GRACE_S - time.monotonic()
        return self._cond.acquire(timeout=max(0.0, left))

    def _acquire_within(self, timeout: float | None) -> bool:
        """Take ``_cond`` within ``timeout`` and a grace second; whether it was taken.

        Held across the spool's disk reads and writes: a busy or slow disk that still answers
        gets its turn, a hung one holds no caller for good.
        """
        return self._cond.acquire(timeout=-1 if timeout is None else timeout + _LOCK_GRACE_S)

    def _close_locked(self, timeout: float | None, ended: bool, failed: bool) -> bool:
        """The rest of ``close``, ``_cond`` held: done, or keep the undelivered in a file."""
        if self._kept_all:  # an interrupted close kept every undelivered report already
            return False
        if self._keeper is not None:
            # An interrupted close began keeping the undelivered reports: see it through.
            self._forget_queued()  # in case it was interrupted before it emptied them
            return self._report_kept_within(self._wait_for_keeper(), self._keeper[2])
        pending = bool(self._queue or self._in_flight or len(self._spool) or self._waiting_in())
        running = self._sink_thread_running()
        if not running and not self._held_by_sink() and not failed and not pending:
            self._spool.discard()
            self._log_dropped()
            return self._delivered == self._submitted and self._sink_closed
        self._abandon.set()
        # Ours first, the sink's after (as in undelivered): a write ending in between moves
        # its reports from in-flight to the sink's, so they are in one list or both.
        # Left where they are until the keeper holds them (_keep_within): an interruption
        # before then (Ctrl-C in the sink's pending_reports) would lose local lists, and the
        # close that follows keeps them from here again.
        ours = [*self._in_flight, *self._queue]
        # The newest, which the intake thread had not spooled yet: kept behind the rest.
        with self._inbox_lock:
            newest = list(self._inbox)
        held = self._held_by_sink()
        taken = {id(report) for report in held}
        # Reports the sink took but did not make durable (a ProcessSink whose child died)
        # are older than those still queued here: they go first, each once.
        undelivered = [*held, *(report for report in ours if id(report) not in taken)]
        count = len(undelivered) + len(self._spool) + len(newest)
        if count == 0:
            self._spool.discard()  # an emptied spool file: nothing for a later job
            if not failed:  # a failure was logged at ERROR already
                # Not "healthy": the backend may not have everything its close would
                # have flushed. After an interrupt (close_now) the first close's timeout
                # never ran out: naming it would send the user looking for a hung backend.
                if self._interrupted:
                    why = "close was interrupted before the sink's flush and close finished"
                    said = why
                else:
                    why = f"close did not finish within {timeout or 0.0:.1f} s"
                    said = (
                        "flushing and closing the sink did not finish within "
                        f"{timeout or 0.0:.1f} s of close"
                    )
                self._status = SinkStatus("failed", why)
                logger.warning("sink %r: every report was delivered, but %s", self.key, said)
            self._log_dropped()
            return False
        report = partial(
            self._report_kept,
            count=count,
            held=len(held),
            timeout=timeout,
            ended=ended,
            failed=failed,
        )
        return self._report_kept_within(self._keep_within(undelivered, newest, report), report)

    def _report_kept_within(
        self,
        kept: tuple[list[str], int, Exception | None] | None,
        report: Callable[[list[str], int, Exception | None], None],
    ) -> bool:
        """Say what ``close`` kept (``report``), or that the spool's disk stopped answering.

        ``False``, what such a close returns: reports were left undelivered.
        """
        if kept is None:
            logger.error(
                "sink %r: close: the spool directory stopped answering while the undelivered "
                "report(s) were being kept in a file (a hung disk?); should it answer before "
                "the process ends, a warning names the file, else they are lost",
                self.key,
            )
            self._status = SinkStatus("failed", "the spool directory stopped answering at close")
            return False
        # Said once: a later close (this one interrupted in report) keeps nothing again.
        self._kept_all = True
        self._keeper = None
        report(*kept)
        return False

    def _report_kept(
        self,
        paths: list[str],
        lost: int,
        error: Exception | None,
        *,
        count: int,
        held: int,
        timeout: float | None,
        ended: bool,
        failed: bool,
    ) -> None:
        """Count and log what ``close`` kept in ``paths`` (``lost`` of ``count`` not kept)."""
        self._dropped += lost
        if lost:
            logger.error(
                "sink %r: %d of %d report(s) not delivered within %.1f s of close could not "
                "be kept in a spool file in %s (%s): they are lost",
                self.key,
                lost,
                count,
                timeout or 0.0,
                # The spool's folder, not a file: a full disk names none in its error.
                self._spool.directory,
                _describe(error) if error is not None else "unknown error",
            )
        self._log_dropped()
        self._cond.notify_all()
        if paths:
            state_file = None
            # Even if the sink never opened: its state names the run it would have made (the
            # MLflow run key), and the job's run (name, config) is kept for the replay to use.
            state = self.sink_state()
            try:
                options = dict(self.sink.replay_options())
            except Exception:  # a sink of one's own that fails here: the replay needs --option
                options = {}
            for path in paths:
                with exiting_with(self._ending_code):  # on a keeper's thread, maybe
                    state_file = write_kept_state(
                        path,
                        self.sink.name,
                        state,
                        self._run,
                        options,
                        interrupted=self._interrupted,
                    )
            if failed:
                why = "the sink failed"
            elif self._interrupted:
                why = "close was interrupted"
            elif ended:
                # The sink's close returned, before the timeout, without its backend's word.
                why = "the sink's close ended without its backend confirming them"
            else:
                why = f"not delivered within {timeout or 0.0:.1f} s"
            # Those the sink took are delivered as far as this runner counts, but its backend
            # had not confirmed them (a ProcessSink's child had not flushed): kept all the same,
            # and not counted as undelivered.
            unconfirmed = (
                f", and {held} the sink took but its backend had not confirmed (a replay "
                "or resumed sink skips those the backend has)"
                if held
                else ""
            )
            logger.warning(
                "sink %r: %d report(s) undelivered (%s)%s; %d kept in %s (one JSON report per "
                "line, oldest first; deliver them later with sidestream.sinks.replay_spool or "
                "python -m sidestream.sinks.replay, which resumes the sink's run from %s)",
                self.key,
                count - held,
                why,
                unconfirmed,
                count - lost,
                " and ".join(paths),
                state_file or "--resume-state: the sink's state from this job's checkpoint",
            )
            if not failed:  # a failure's own error stays the one named
                with self._lock:
                    # Nothing more is delivered: status says so, and why (not "healthy").
                    self._status = SinkStatus(
                        "failed", f"close: {count - lost} report(s) kept in a spool file ({why})"
                    )
        elif lost and not failed:
            # None could be kept (a spool directory gone or replaced by a file, a full disk):
            # nothing more is delivered either, and status read "healthy" with no error.
            cause = _describe(error) if error is not None else "unknown error"
            with self._lock:
                self._status = SinkStatus(
                    "failed",
                    f"close: {lost} report(s) lost: not delivered, and they could not be kept "
                    f"in a spool file ({cause})",
                )

    def _waiting_in(self) -> bool:
        """Whether reports wait for the intake thread."""
        with self._inbox_lock:
            return bool(self._inbox)

    def _held_by_sink(self) -> list[Report]:
        """Reports the sink took but may not have made durable, if it can say.

        A ``ProcessSink``'s are those sent to a child since its last flush. Empty once the
        sink's close succeeded.
        """
        if self._sink_closed:
            return []
        try:
            return list(self.sink.pending_reports())
        except Exception:  # a broken sink must not stop the spool
            return []

    def _log_dropped(self) -> None:
        if self._lost():
            logger.warning(
                "sink %r: %d of %d report(s) were dropped (spool full, unusable or damaged, or "
                "the spool's disk did not keep up)%s",
                self.key,
                self._lost(),
                self._submitted,
                self._lost_steps_said("; lost "),
            )

    def _lost_steps_said(self, lead: str) -> str:
        """``lead`` and the steps of the reports lost so far (``LostSteps``), or ``""``."""
        # _inbox_lost read without its lock, as _lost() reads _inbox_dropped: merged copies it.
        said = LostSteps.union(self._lost_steps, self._spool.lost, self._inbox_lost).describe()
        return f"{lead}{said}" if said else ""

    # ------------------------------------------------------------------ sink thread

    def _work_or_fail(self) -> None:
        """``_work``; an error it did not expect fails the sink instead of ending the thread.

        A thread that just ended would leave its queued reports to a ``close`` that takes them
        for delivered: failed, they are kept (queue, then spool) as a failed sink's are.
        """
        try:
            self._work()
        except BaseException as error:
            self._fail("delivery", f"{type(error).__name__}: {error} (an error in sidestream)")
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """Say this runner is done with its sink: a runner started on it later may open it."""
        with _SINK_USERS_LOCK:
            self._done.set()
            users = _SINK_USERS.get(id(self.sink), [])
            if self._done in users:
                users.remove(self._done)
            if not users:
                _SINK_USERS.pop(id(self.sink), None)

    def _work(self) -> None:
        if not self._wait_for_earlier() or not self._retry("open", self._open):
            return
        try:
            self._deliver()
        finally:
            # Given up (close, withdraw) or failed mid-way: the sink is let go all the same.
            if not self._close_tried:
                self._close_given_up()

    def _wait_for_earlier(self) -> bool:
        """Wait until the threads of runners started on this sink before have ended.

        A start undone (a bind interrupted) leaves its runner's thread in the sink's open
        when it does not end within ``withdraw``'s timeout; that thread closes the sink once
        its open returns. Opening the sink meanwhile would open it twice, and that close would
        close what this runner writes. False if this runner is given up first.
        """
        waiting = [done for done in self._earlier if not done.is_set()]
        if waiting:
            logger.warning(
                "sink %r: a runner this sink had before (a start undone, such as an "
                "interrupted bind, or a run whose close timed out) is still in its open, write "
                "or close; this one opens the sink once that ends (its reports wait, kept)",
                self.key,
            )
        for done in waiting:
            while not done.wait(0.05):
                if self._abandon.is_set():
                    return False
        self._earlier = []
        return True

    def _close_given_up(self) -> None:
        """Close the opened sink after delivery stopped early (it failed, or was given up).

        Its file, pipe or connection is let go (a named pipe's reader sees its end). The
        reports it had not delivered are kept as ever; an error here is only logged.
        """
        try:
            with exiting_with(self._ending_code):
                self.sink.leave_unfinished()  # its undelivered reports are kept for a replay
                done = self.sink.close(self._remaining())
        except Exception as error:
            logger.warning(
                "sink %r: close after delivery stopped failed: %s", self.key, _describe(error)
            )
            return
        self._sink_closed = done is not False

    def _deliver(self) -> None:
        """Deliver until closed, then flush and close the sink (the sink is open)."""
        self._snapshot_state()
        self._opened = True
        dirty = False
        last_flush = time.monotonic()
        while True:
            batch, flush_now, stop = self._next(dirty, last_flush)
            if batch:
                steps = f"step {batch[0].step}"
                if len(batch) > 1:
                    steps = f"steps {batch[0].step}..{batch[-1].step}"
                if not self._retry(f"write ({steps})", partial(self._write, batch)):
                    return
                dirty = True
                continue
            if dirty and flush_now:
                self._flush()
                dirty = False
                last_flush = time.monotonic()
            if stop:
                break
        # close() flushes too: an idle flush that failed earlier is covered by it.
        self._close_tried = True
        with exiting_with(self._ending_code):
            closed = self._once("close", lambda: self.sink.close(self._remaining()))
        self._sink_closed = closed is None

    def _open(self) -> None:
        if self._resume_state is not None:
            self.sink.load_state_dict(self._resume_state)
        if self._before_open is not None:
            self._before_open(self.sink)
        self.sink.open(self._run)

    def _write(self, batch: list[Report]) -> None:
        if len(batch) == 1:
            self.sink.write(batch[0])
        else:
            self.sink.write_batch(batch)
        # The state first: a checkpoint that finds the batch delivered (no longer in flight)
        # must find it in the sink's state. Until then it is in both, and a job resumed from
        # such a checkpoint skips what the state says the backend has.
        self._snapshot_state()
        with self._lock:
            self._in_flight = []
            self._delivered += len(batch)
            self._cond.notify_all()

    def _next(self, dirty: bool, last_flush: float) -> tuple[list[Report], bool, bool]:
        """The next reports, or whether to flush now, and whether to stop.

        Up to the sink's ``max_batch`` reports, oldest first.
        """
        with self._lock:
            while True:
                if self._abandon.is_set():
                    return [], False, True
                if self._queue or len(self._spool):
                    # The queue holds older reports than the spool (see submit).
                    while len(self._in_flight) < self._max_batch and self._queue:
                        self._in_flight.append(self._queue.popleft())
                    while len(self._in_flight) < self._max_batch and len(self._spool):
                        self._pop_spooled()
                    if self._in_flight:
                        return list(self._in_flight), False, False
                    self._cond.notify_all()  # only damaged lines: wait_delivered may be done
                    continue
                if self._closing:
                    return [], True, True
                if not dirty:
                    self._cond.wait()
                    continue
                remaining = self._flush_interval_s - (time.monotonic() - last_flush)
                if remaining <= 0:
                    return [], True, False
                self._cond.wait(remaining)

    def _pop_spooled(self) -> None:
        """Move the oldest spooled report in flight (lock held); a damaged one is dropped."""
        try:
            self._in_flight.append(self._spool.pop_oldest())
        except OSError as error:
            # That one report's bytes could not be read (a bad sector, a read cut by EIO): it
            # is lost, not the reports after it, whose lines the next reads find at their own
            # offsets. A file that cannot be read at all loses each of them here in turn,
            # every one counted, the same total as dropping them at once.
            self._drop(1, f"spool file unreadable: {_describe(error)}")
        except Exception as error:
            self._drop(1, f"damaged spool line: {_describe(error)}")
        else:
            self._end_drop_streak_if_room()

    def _end_drop_streak_if_room(self) -> None:
        """End a streak of drops once the spool is at most half full (lock held).

        Room again, not a lucky fit: a small report after a large one fits in a full spool,
        and each report the sink takes from a full one makes room for one more, so ending the
        streak there logged every drop again.
        """
        if self._spool.nbytes <= self._spool.max_bytes // 2:
            self._dropping = False

    def _retry(self, what: str, action: Callable[[], None]) -> bool:
        """Run ``action`` until it succeeds (True), fails for good or is abandoned (False).

        A permanent error (``is_permanent``: a missing client, a bad argument, HTTP 4xx other
        than 408/429) is not retried: the sink is marked failed and the reason logged once at
        ERROR. Transient errors are retried with exponential backoff and jitter.
        """
        delay = self._retry_initial_s
        while True:
            try:
                action()
            except BaseException as error:
                self._failed_attempts += 1
                reason = f"{type(error).__name__}: {error}"
                # A BaseException (SystemExit from a client, CancelledError) would end this
                # thread and lose its reports silently: the sink fails for good instead, and
                # its reports are kept as a failed sink's are.
                if is_permanent(error) or not isinstance(error, Exception):
                    self._fail(what, reason)
                    return False
                with self._lock:
                    self._status = SinkStatus("retrying", reason)
                if not self._failing:
                    self._failing = True
                    self._failing_since = time.monotonic()
                    logger.warning(
                        "sink %r: %s failed: %s; retrying with backoff, reports are kept "
                        "(not logged again until it recovers)",
                        self.key,
                        what,
                        reason,
                    )
                # Jitter: sinks (or ranks' jobs) that failed together do not retry in step.
                if self._abandon.wait(delay * random.uniform(0.5, 1.0)):
                    return False
                delay = min(delay * 2, self._retry_max_s)
                continue
            if self._failing:
                self._failing = False
                # What an operator asks once the tracker is back: how long it was away, and
                # how much it has to catch up on (the reports kept meanwhile).
                logger.warning(
                    "sink %r: %s recovered after %d failed attempt(s) over %.1f s; %d "
                    "report(s) waiting (%d of them in the spool file) are delivered now",
                    self.key,
                    what,
                    self._failed_attempts,
                    time.monotonic() - self._failing_since,
                    self.pending,
                    len(self._spool),
                )
                self._failed_attempts = 0
            with self._lock:
                # Not once close gave the sink up: its status says what close kept.
                if self._status.state != "healthy" and not self._abandon.is_set():
                    self._status = SinkStatus("healthy", self._status.last_error)
            return True

    def _fail(self, what: str, reason: str) -> None:
        """Mark the sink failed for good: stop delivering, count nothing more as delivered."""
        with self._lock:
            self._status = SinkStatus("failed", reason)
            # Set before the waiters wake: one that checked before the set would wait on.
            self._abandon.set()
            self._cond.notify_all()
        logger.error(
            "sink %r: %s failed permanently: %s. Not retried: nothing more is sent to this "
            "sink and close() returns False; its reports are kept (queue, then spool) for a "
            "checkpoint and for close to leave in a spool file. Fix what the error names "
            "(an option, a missing client, another writer on the sink's path, ...), then "
            "resume from the last checkpoint",
            self.key,
            what,
            reason,
        )

    def _flush(self) -> None:
        """An idle flush, logged once per streak of failures.

        A stalled backend fails one flush every interval: the first failure of a streak is
        logged, then only the recovery, so the log is not flooded meanwhile. A failure of
        another kind (another exception type, or a flush that raised after some returned
        False) is logged too.
        """
        streak = self._flush_failures
        kind = self._once(
            "flush", lambda: self.sink.flush(self._remaining()), quiet=self._flush_failure_kind
        )
        if kind is not None:
            self._flush_failures += 1
            self._flush_failure_kind = kind
            return
        self._flush_failures, self._flush_failure_kind = 0, None
        if streak:
            logger.warning(
                "sink %r: flush finished again after %d failed flush(es)", self.key, streak
            )

    def _once(
        self, what: str, action: Callable[[], object], *, quiet: str | None = None
    ) -> str | None:
        """Run a sink's ``flush`` or ``close``; how it failed, or ``None`` if it did not.

        The kind of failure is the exception's type name, or ``"returned False"``. A failure is
        always kept in the status; one of the kind ``quiet`` names is logged at DEBUG, not
        WARNING.
        """
        try:
            done = action()
        except Exception as error:
            kind, reason = type(error).__name__, f"{what} failed: {type(error).__name__}: {error}"
        else:
            if done is not False:
                return None
            kind = _RETURNED_FALSE
            reason = (
                "close returned False: it did not finish (a value not in the backend, or the "
                "backend's run not ended: see the sink's own warning)"
                if what == "close"
                else "flush did not finish (it returned False)"
            )
        if kind == quiet:
            logger.debug("sink %r: %s", self.key, reason)
        elif what == "flush":
            logger.warning(
                "sink %r: %s; not logged again until a flush finishes or fails otherwise",
                self.key,
                reason,
            )
        else:
            logger.warning("sink %r: %s", self.key, reason)
        # A close that raised ends the sink with an error: its status says so (a flush that
        # raised is covered by later ones and the close, so only its error is kept).
        self._note(reason, failed=what == "close" and kind != _RETURNED_FALSE)
        return kind

    def _note(self, reason: str, *, failed: bool) -> None:
        with self._lock:
            state = "failed" if failed else self._status.state
            self._status = SinkStatus(state, reason)

    def _snapshot_state(self) -> None:
        try:
            state = dict(self.sink.state_dict())
        except Exception as error:  # a broken state_dict must not stop delivery
            reason = f"state_dict failed: {type(error).__name__}: {error}"
            if not self._state_failing:  # once per streak: it is read after every write
                self._state_failing = True
                logger.warning(
                    "sink %r: %s; a checkpoint keeps the state it last read, so a job resumed "
                    "from it sends this sink the reports delivered since again (not logged "
                    "again until state_dict works)",
                    self.key,
                    reason,
                )
            self._note(reason, failed=False)
            return
        self._state_failing = False
        with self._lock:
            self._state = state

    def _remaining(self) -> float | None:
        if self._close_deadline is None:
            return None
        return max(0.0, self._close_deadline - time.monotonic())


def _replay_arguments(sink: Sink) -> str:
    """``--sink NAME --option KEY=VALUE ...`` that replay a spool of ``sink`` where it delivers.

    ``NAME`` stays a placeholder for a sink the command cannot build (no entry point).
    """
    from sidestream.sinks.config import available_sinks  # the config imports the sinks

    name = sink.name if sink.name in available_sinks() else "NAME"
    try:
        options = sink.replay_options()
    except Exception:  # a warning's hint must not fail the start
        options = {}
    given = [
        f"--option {key}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in sorted(options.items())
    ]
    return " ".join([f"--sink {name}", *given] if given else [f"--sink {name} --option ..."])


_LOCK_GRACE_S = 1.0
"""How long past its timeout a caller waits for a spool read or write in progress (``close``,
a checkpoint; see ``SinkRunner._acquire_within``)."""

INBOX_MIN_CAPACITY = 4096
"""The fewest reports that may wait in memory for the intake thread (``capacity`` if larger);
past that a submitter waits for room, or, after ``INTAKE_STALL_S`` without progress, drops the
oldest waiting."""

INTAKE_STALL_S = 2.0
"""How long the intake thread may write nothing, with reports waiting, before a submitter that
finds no room stops waiting and drops the oldest instead (a hung spool disk)."""

_SINK_USERS_LOCK = threading.Lock()
_SINK_USERS: dict[int, list[threading.Event]] = {}
"""Per sink (by ``id``; a runner's thread holds its sink, so the id is not reused meanwhile),
the ``_done`` events of the runners started on it whose threads have not ended, oldest first.
A runner opens its sink only once those before it are set: a bind retried after an interrupt
gave ``withdraw`` too little time makes a second runner for the same sink while the first one's
thread is still in its open, and that thread closes the sink when the open returns."""

_RETURNED_FALSE = "returned False"
"""The kind of failure of a ``flush`` or ``close`` that returned ``False`` (it did not raise)."""

_RUN_KEYS = ("path", "log_dir", "run_id", "run_key")
"""State keys that name a sink's run (JSONL, TensorBoard, MLflow and W&B): a kept spool whose
state names another run is another job's."""


def _leftovers_of(paths: list[str], state: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """``paths`` split into those that may be this sink's run's and those of other runs.

    A file without a readable kept state (a crashed job writes none) may be this run's. A file
    with a kept state was named in a warning when its job closed; if that state names no run
    (a console sink, a sink of one's own without a run identity), nothing tells it apart from
    another job's in a shared spool directory (the temp dir by default), so it is counted with
    the other runs' rather than named again in every later job.
    """
    mine: list[str] = []
    others: list[str] = []
    for path in paths:
        try:
            kept = read_kept_state(path)
        except ValueError:
            kept = None
        if kept is None:
            mine.append(path)
            continue
        theirs = kept.state or {}
        named = [key for key in _RUN_KEYS if theirs.get(key) is not None]
        (mine if any(theirs[key] == state.get(key) for key in named) else others).append(path)
    return mine, others


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def state_before_open(sink: Sink, key: str) -> dict[str, Any]:
    """``sink.state_dict()`` of a sink not opened yet; ``{}`` (warned) if it cannot say."""
    try:
        return dict(sink.state_dict())
    except Exception as error:  # a broken state_dict must not stop delivery
        logger.warning("sink %r: state_dict failed: %s", key, error)
        return {}
