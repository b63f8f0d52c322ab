"""Run a sink in a child process, so its client's Python work never holds the trainer's GIL."""

from __future__ import annotations

import ast
import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from sidestream._exit import KILLED_EXIT_CODE, failed_exit_code, record_failed_exit
from sidestream._logs import get_logger
from sidestream._validation import check_int
from sidestream.sinks.base import Report, RunInfo, Sink, batch_size
from sidestream.sinks.status import PermanentSinkError, is_permanent
from sidestream.sinks.support import check_seconds, seconds_left
from sidestream.sinks.tracker import TrackerSink, UnconfirmedBacklogError

__all__ = ["ProcessSink", "SinkProcessError"]

logger = get_logger("sidestream.sinks")

_OK, _ERROR = "ok", "error"


class SinkProcessError(RuntimeError):
    """The wrapped sink raised in the child process, or the child died or stopped answering.

    Attributes:
        child_traceback: The traceback from the child when the sink raised there, else ``""``.
        child_gone: How the child ended when it died or hung (``"ended (exit code 9)"``,
            ``"hung and was stopped"``), else ``None``.
    """

    def __init__(self, message: str, child_traceback: str = "") -> None:
        super().__init__(message)
        self.child_traceback = child_traceback
        self.child_gone: str | None = None  # how the child ended, if it died or hung


class _ParentGone(Exception):
    """The trainer's end of the pipe is closed: it was killed, or stopped this child."""


def _reply(conn: Connection, *message: Any) -> None:
    try:
        conn.send_bytes(pickle.dumps(message))
    except OSError as error:  # BrokenPipeError, ConnectionResetError: nobody reads the answer
        raise _ParentGone from error


class _PermanentSinkProcessError(SinkProcessError, PermanentSinkError):
    """An error that retrying cannot fix.

    The sink in the child raised one (``is_permanent``), or no child can be started from here
    (a daemonic process, a main script without a guard).
    """


def _child_gone(message: str, how: str) -> SinkProcessError:
    """The error for a child that died or hung (and was stopped); ``how`` says which.

    A ``SinkProcessError`` as any other (its class name is what logs and the sink status
    show), marked for ``open``, which counts the child it replaces as a restart.
    """
    error = SinkProcessError(message)
    error.child_gone = how
    return error


def _failure(error: BaseException) -> tuple[str, str, bool]:
    return f"{type(error).__name__}: {error}", traceback.format_exc(), is_permanent(error)


def _serve(
    conn: Connection,
    sink_bytes: bytes,
    run: RunInfo,
    state: Mapping[str, Any] | None,
    orphan_close_s: float,
) -> None:
    """The child: open the sink, then answer write / flush / close until told to stop.

    A trainer that vanishes (killed: the pipe breaks) is noticed at the next call or answer:
    the child makes what its sink has durable, closes it and ends with one line on stderr, not
    a ``BrokenPipeError`` traceback. A watch thread ends it anyway ``orphan_close_s`` (and a
    grace) after the trainer is gone, should the sink be stuck in a call that never returns.
    """
    # Ctrl-C in a terminal reaches the whole process group: the trainer decides how the run
    # ends (its close, or it leaves and this child closes the sink as for a killed trainer).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_trainer(orphan_close_s)
    sink: Sink | None = None
    opened = False
    try:
        try:
            sink = pickle.loads(sink_bytes)
        except Exception as error:
            # A sink that cannot be rebuilt here never will be: permanent, not retried.
            message, child_traceback, _ = _failure(error)
            _reply(
                conn,
                _ERROR,
                f"the sink could not be rebuilt in the child process ({message})",
                child_traceback,
                True,
            )
            return
        assert sink is not None
        try:
            if state is not None:
                sink.load_state_dict(state)
            sink.open(run)
            opened = True
            _reply(conn, _OK, None, sink.state_dict())
        except _ParentGone:
            raise
        except Exception as error:
            _reply(conn, _ERROR, *_failure(error))
            return
        _answer_calls(conn, sink)
    except _ParentGone:
        _orphaned(sink if opened else None, orphan_close_s)


def _answer_calls(conn: Connection, sink: Sink) -> None:
    """Answer the trainer's calls until it closes the sink (ends the process) or is gone.

    Raises:
        _ParentGone: If the trainer's end of the pipe is closed.
    """
    while True:
        try:
            operation, argument = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as error:
            raise _ParentGone from error
        try:
            result: object = None
            if operation == "write_batch":
                sink.write_batch(argument)
            elif operation == "flush":
                result = sink.flush(argument)
            elif operation == "make_durable":
                result = _make_durable(sink, argument)
            else:
                # (timeout, exit code, unfinished); a bare timeout from an older release.
                timeout, exit_code, *unfinished = (
                    argument if isinstance(argument, tuple) else (argument, None)
                )
                if exit_code is not None:  # the trainer is ending on an uncaught exception
                    record_failed_exit(exit_code)
                if unfinished and unfinished[0]:
                    sink.leave_unfinished()
                result = sink.close(timeout)
            _reply(conn, _OK, result, sink.state_dict())
        except _ParentGone:
            raise
        except Exception as error:
            _reply(conn, _ERROR, *_failure(error))
        if operation == "close":
            _exit_closed()


def _make_durable(sink: Sink, timeout: float | None) -> bool:
    durable = getattr(sink, "make_durable", None)
    return bool(durable(timeout) if durable is not None else sink.flush(timeout))


def _orphaned(sink: Sink | None, limit_s: float) -> None:
    """The trainer is gone: make what ``sink`` was given durable, close it, say so once.

    It closes its sinks before it ends, even on an exception: gone without that, it was
    killed, and a tracker must not show the run as a clean finish. What the sink has is what
    a checkpoint's resume would otherwise find missing, so it is kept (durable, then closed)
    rather than dropped with this process.
    """
    record_failed_exit(KILLED_EXIT_CODE)
    if sink is None:
        return  # nothing opened: no run to end
    deadline = time.monotonic() + limit_s
    durable = closed = False
    with contextlib.suppress(Exception):
        durable = _make_durable(sink, seconds_left(deadline))
    with contextlib.suppress(Exception):
        closed = bool(sink.close(seconds_left(deadline)))
    outcome = (
        "made what it had durable and closed it"
        if durable and closed
        else "could not make what it had durable and close it"
    )
    _say(f"sink {sink.name!r}: the training process is gone; this child {outcome}")


def _say(line: str) -> None:
    """One line on stderr from this child (no logging: nothing here configured a handler)."""
    with contextlib.suppress(Exception):
        print(f"sidestream (child process {os.getpid()}): {line}", file=sys.stderr, flush=True)


def _watch_trainer(orphan_close_s: float) -> None:
    """End this child ``orphan_close_s`` and a grace after the trainer is gone, if still here.

    The serving thread notices a gone trainer only between calls: a sink stuck in a call that
    never returns (a hung network request) would otherwise keep an orphan alive for good.
    """
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # its sentinel: returns once the trainer's process has ended
        time.sleep(orphan_close_s + _ORPHAN_GRACE_S)
        _say(
            f"the training process is gone and the sink did not close within "
            f"{orphan_close_s:g} s; ending without it"
        )
        os._exit(KILLED_EXIT_CODE)

    threading.Thread(target=watch, name="sidestream-sink-orphan-watch", daemon=True).start()


DEFAULT_MAX_UNFLUSHED = 65_536
"""``ProcessSink``'s default ``max_unflushed``: as many as a tracker sink keeps unconfirmed."""

_ORPHAN_CLOSE_S = 30.0
"""How long a child whose trainer vanished gives its sink to end the run: nothing waits on it,
and a loaded tracker (a SQLite store) may take seconds to mark the run."""

_ORPHAN_GRACE_S = 5.0
"""Added to ``_ORPHAN_CLOSE_S`` before the watch thread ends a child whose sink is stuck."""


def _exit_closed() -> None:
    """End the child once its sink is closed, skipping the interpreter's teardown.

    Tracker clients' exit hooks can take seconds, which would only delay the trainer's own
    shutdown. Temporary directories (``tempfile``'s, such as wandb's media and artifact folders
    made at import) are removed all the same: their finalizers run here, as at a normal exit.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    # weakref.finalize's at-exit hook (what atexit would run for them); absent, nothing leaks
    # but those folders.
    run_finalizers = getattr(weakref.finalize, "_exitfunc", None)
    if run_finalizers is not None:
        with contextlib.suppress(Exception):
            run_finalizers()
    os._exit(0)


_GUARD_HELP = (
    'put the training code under `if __name__ == "__main__":` (or in a function called from '
    "there): the child process is started with multiprocessing's spawn method, which imports "
    "the main script again, so unguarded top-level code would run a second time in the child "
    "(the whole training job)"
)


def _main_module_frame() -> FrameType | None:
    """The main thread's frame running the main script's top-level code, if it is doing so.

    Only read on the main thread itself (``None`` elsewhere): walking another thread's running
    stack (``sys._current_frames``) races with it, and on Python 3.11 ``f_back`` then returned
    a stale object (seen as "'dict' object has no attribute 'f_code'" from a sink runner's
    restart of the child). ``ProcessSink`` checks when it is made, on the thread that makes it.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return frame
        frame = frame.f_back
    return None


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    parts = [node.test.left, *node.test.comparators]
    names = [p.id for p in parts if isinstance(p, ast.Name)]
    texts = [p.value for p in parts if isinstance(p, ast.Constant)]
    return names == ["__name__"] and texts == ["__main__"]


def unguarded_main_line() -> tuple[str, int] | None:
    """``(script, line)`` when the main script is running top-level code outside a guard.

    That is where starting a spawned child re-runs the script in the child. ``None`` when the
    main thread is inside ``if __name__ == "__main__":``, or there is no script (interactive,
    ``python -c``) or its source cannot be read.
    """
    frame = _main_module_frame()
    path = frame.f_globals.get("__file__") if frame is not None else None
    if frame is None or not isinstance(path, str):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in tree.body:
        end = node.end_lineno or node.lineno
        if _is_main_guard(node) and node.lineno <= line <= end:
            return None
    return path, line


def _check_main_guard(name: str) -> None:
    """Raise if a spawned child started now would run the main script's training code again.

    Permanent: the script stays as it is however often the pipeline retries.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        # We are the spawned child, importing the main script again: it is unguarded.
        raise _PermanentSinkProcessError(
            f"sink {name!r}: ProcessSink was started while a child process imported the main "
            f"script; {_GUARD_HELP}"
        )
    where = unguarded_main_line()
    if where is not None:
        raise _PermanentSinkProcessError(
            f"sink {name!r}: ProcessSink used by top-level code of {where[0]} (line {where[1]}) "
            f'outside an `if __name__ == "__main__":` block; {_GUARD_HELP}'
        )


class ProcessSink(Sink):
    """Delivers to ``sink`` from a child process of its own.

    A tracker client that does much Python work per report (TensorBoard's protobuf encoding,
    W&B's history serialisation) competes with the training thread for the GIL even from the
    sink's own thread. Wrapped in a ``ProcessSink``, that work runs in a spawned child; this
    process only pickles each report and waits on a pipe, which releases the GIL.

    Nothing is lost when the child dies or hangs: the call raises ``SinkProcessError``, the
    pipeline retries it, and the retry starts a fresh child that resumes the run from the state
    of the last flush and first re-sends every report written since, so reports that sat in
    the dead child's buffers are delivered again. A sink that skips steps it has already
    delivered (JSONL, MLflow, TensorBoard) then delivers each report once; others may repeat
    the reports of that last unflushed stretch.

    Args:
        sink: The sink to run in the child; it must be picklable before ``open`` (the built-in
            and tracker sinks are). It is copied: later changes to it are not seen.
        call_timeout_s: How long any call to the child (``write``, ``flush``, ``close``) may
            take before the child is killed and the call raises (a hung network call); the
            next call starts a fresh child. A ``flush`` or ``close`` given a shorter timeout
            gets that. ``None``: only the caller's timeout bounds a call (none for ``write``).
        start_timeout_s: How long starting the child and opening the sink there may take.
        flush_every: Reports written before the child is asked to flush on its own, which
            bounds how many reports are held here for re-sending while flushes succeed.
        max_unflushed: Most reports held here for re-sending (written since the child's last
            flush that finished). A write that would pass it first asks the child to flush;
            if that does not finish (a stalled backend) the write raises
            ``UnconfirmedBacklogError``: the pipeline retries it later and keeps the reports
            in its queue and spool meanwhile, whose cap and counted drops then apply.

    Attributes:
        restarts: How many times a child was started again after dying or hanging.

    Raises:
        TypeError: If ``sink`` is not a ``Sink`` or cannot be pickled, or an option is not a
            number (``"30"`` from a config file).
        ValueError: If a timeout is not positive, ``flush_every`` < 1 or ``max_unflushed`` <
            ``flush_every``.
        SinkProcessError: If the main script creates it (or later opens it) from top-level
            code outside ``if __name__ == "__main__":``, where the spawned child would run the
            script again; the message says so.

    Example:
        >>> sinks = [ProcessSink(JsonlSink("runs/a.jsonl"))]  # doctest: +SKIP
    """

    def __repr__(self) -> str:
        return f"ProcessSink({getattr(self, '_wrapped_repr', '')})"

    def __init__(
        self,
        sink: Sink,
        *,
        call_timeout_s: float | None = 300.0,
        start_timeout_s: float = 120.0,
        flush_every: int = 256,
        max_unflushed: int = DEFAULT_MAX_UNFLUSHED,
    ) -> None:
        if not isinstance(sink, Sink):
            raise TypeError(f"sink: expected a sidestream.sinks.Sink, got {type(sink)}")
        if isinstance(sink, ProcessSink):
            raise TypeError("sink: already a ProcessSink")
        if call_timeout_s is not None:
            check_seconds("call_timeout_s", call_timeout_s)
            if call_timeout_s <= 0:
                raise ValueError(
                    f"call_timeout_s: expected seconds > 0 or None, got {call_timeout_s}"
                )
        check_seconds("start_timeout_s", start_timeout_s)
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s: expected seconds > 0, got {start_timeout_s}")
        check_int("flush_every", flush_every, 1)
        check_int("max_unflushed", max_unflushed, 1)
        if max_unflushed < flush_every:
            raise ValueError(
                f"max_unflushed: expected at least flush_every ({flush_every}), got {max_unflushed}"
            )
        _check_main_guard(sink.name)
        try:
            self._sink_bytes = pickle.dumps(sink)
            # The child rebuilds it from these bytes: one it cannot rebuild fails here, once.
            pickle.loads(self._sink_bytes)
        except Exception as error:
            raise TypeError(
                f"sink: {type(sink).__name__} must be picklable, and rebuilt from its pickle, "
                "to run in a child process "
                f"({type(error).__name__}: {error})"
            ) from error
        self.name = sink.name
        self._wrapped_repr = repr(sink)
        # Whether the child's state counts a step once its send returned, so that only its
        # make_durable (JSONL's fsync) makes it survive a machine crash: a checkpoint whose
        # make_durable fell short must not keep that state (Delivery._durable_state).
        self.send_is_delivery = isinstance(sink, TrackerSink) and sink.durable_on_send
        self.max_batch = batch_size(sink)  # the child's write_batch calls take no more
        self._place = sink.written_place()
        self._replay_options = sink.replay_options()
        self._call_timeout_s = call_timeout_s
        self._start_timeout_s = start_timeout_s
        self._flush_every = flush_every
        self._max_unflushed = max_unflushed
        # How long a child whose trainer vanished may take to close its sink (tests shorten it).
        self._orphan_close_s = _ORPHAN_CLOSE_S
        self._run: RunInfo | None = None
        self._resume: dict[str, Any] | None = None
        self._state: dict[str, Any] = {}
        # The wrapped sink's state before it opens: state_dict's keys until the child reports
        # one (torch.distributed.checkpoint loads only keys that exist at load time).
        self._fresh_state = dict(sink.state_dict())
        self._flushed_state: dict[str, Any] | None = None
        self._unflushed: list[Report] = []
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        # The sink's thread writes while a checkpoint calls make_durable from the training
        # thread: one call on the pipe at a time.
        self._pipe_lock = threading.RLock()
        self._opened = False  # a child opened the sink once
        self._closed: bool | None = None  # what a finished close returned
        self.restarts = 0
        self._unfinished = False  # leave_unfinished: passed to the child's close
        # How the last child that failed to open ended ("ended (exit code -9)"), until an open
        # succeeds: the next open replaces it, and counts a restart.
        self._open_failed: str | None = None
        # How long the last child took to start and open its sink (spawn, imports): a close
        # with less time left than that does not start one only to stop it unopened.
        self._start_s: float | None = None

    # ------------------------------------------------------------------ the Sink contract

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Keep the state for the child's ``load_state_dict`` before it opens.

        A copy of the wrapped sink takes it first, here, so a state it refuses raises now
        (as the sink's own ``load_state_dict`` would) instead of in the child at open.
        """
        trial: Sink = pickle.loads(self._sink_bytes)
        trial.load_state_dict(dict(state_dict))
        self._resume = dict(state_dict)
        self._state = dict(state_dict)

    def leave_unfinished(self) -> None:
        """Pass ``Sink.leave_unfinished`` on to the sink in the child, with its close."""
        self._unfinished = True

    def open(self, run: RunInfo) -> None:
        """Start the child, which resumes (if a state was loaded) and opens the sink."""
        # Under the pipe lock: a checkpoint's make_durable from the training thread must wait
        # for the opening child (or give up), not talk to it or stop it halfway through open.
        with self._pipe_lock:
            self._run = run
            # Opened again after a close (a runner started in place of one that closed it: a
            # bind undone while this open was in progress): a new child, which resumes the
            # run from the state the last one flushed. What the last one held unconfirmed was
            # kept by its runner.
            again = self._opened
            self._closed = None
            self._unfinished = False
            self._unflushed.clear()
            if self._open_failed is not None:  # the last open's child died or hung
                self.restarts += 1
                logger.warning(
                    "sink %r: its child process %s while opening; starting another (restart %d)",
                    self.name,
                    self._open_failed,
                    self.restarts,
                )
                self._open_failed = None  # counted once: a later failed open may be the sink's
            try:
                self._start((self._flushed_state or None) if again else self._resume)
            except SinkProcessError as error:
                self._open_failed = error.child_gone
                raise
            self._opened = True
            self._flushed_state = dict(self._state)

    def write(self, report: Report) -> None:
        """Hand ``report`` to the child and wait for its ``write`` to return.

        Raises:
            SinkProcessError: If the child's ``write`` raised (the message names the original
                error), or the child died or exceeded ``call_timeout_s``.
            RuntimeError: Before ``open`` or after ``close``.
        """
        self.write_batch([report])

    def write_batch(self, reports: Sequence[Report]) -> None:
        """Hand ``reports`` to the child's ``write_batch`` (for sinks with ``max_batch`` > 1).

        Raises:
            SinkProcessError: As ``write``.
            RuntimeError: Before ``open`` or after ``close`` (a write would start a child).
        """
        with self._pipe_lock:
            if not self._opened or self._closed is not None:
                when = "call open() first" if not self._opened else "the sink is closed"
                raise RuntimeError(f"ProcessSink {self.name!r}: write: {when}")
            if not self._alive():
                self._restart()
            self._make_room(len(reports))
            self._call("write_batch", list(reports), self._call_timeout_s)
            self._unflushed.extend(reports)
            if len(self._unflushed) >= self._flush_every:
                try:
                    self.flush(self._call_timeout_s)
                except Exception as error:
                    # The batch is written: a retry of this write would send it again. The
                    # reports stay unflushed (re-sent by a restart), for a later flush.
                    logger.warning(
                        "sink %r: flush after %d report(s) failed: %s; they count as delivered "
                        "only once a flush succeeds",
                        self.name,
                        len(self._unflushed),
                        error,
                    )

    def _make_room(self, adding: int) -> None:
        """Keep ``adding`` more reports within ``max_unflushed`` (pipe lock held).

        A child whose flushes never finish (a stalled backend) confirms nothing, and every
        report written since its last flush stays here to be re-sent: without a cap they would
        grow for as long as the outage lasts. At the cap the runner keeps them instead, in its
        bounded queue and spool, where drops are counted and logged.

        Raises:
            UnconfirmedBacklogError: If a flush did not make room (transient: retried).
            SinkProcessError: If that flush failed in the child (or the child is gone).
        """
        # One batch always goes when nothing waits: a max_batch above the cap still moves.
        if not self._unflushed or len(self._unflushed) + adding <= self._max_unflushed:
            return
        if self.flush(self._call_timeout_s):
            return
        raise UnconfirmedBacklogError(
            f"sink {self.name!r}: {len(self._unflushed)} reports written to the child process "
            f"since its last finished flush (max_unflushed={self._max_unflushed}); no more are "
            "sent until a flush finishes (they wait in the queue, then the spool)"
        )

    def flush(self, timeout: float | None = None) -> bool:
        """Flush the child's sink; the reports written so far no longer need re-sending.

        A child that died is started again first, unless less of ``timeout`` is left than the
        last child took to start (``_too_late_to_restart``): then False, the reports kept.
        """
        with self._pipe_lock:
            deadline = _deadline(timeout)
            if not self._alive():
                if not self._unflushed:
                    return True
                # A pipeline's close flushes before it closes, with the same time left: a
                # child started with too little of it is stopped unopened (a restart counted
                # for nothing, "open took longer than 0.0 s"), as close's would be.
                if self._too_late_to_restart(deadline, "flush"):
                    return False
                # They may have died with the child: deliver them again first.
                self._restart(deadline)
            # The pipeline's idle flushes pass no timeout: a child hung in flush must be
            # stopped (and replaced by the next call) as one hung in write is.
            limit = self._limit(seconds_left(deadline))
            done = bool(self._call("flush", limit, limit))
            if done:
                self._unflushed.clear()
                self._flushed_state = dict(self._state)
            return done

    def make_durable(self, timeout: float | None = None) -> bool:
        """Make what the child's sink was sent durable (its ``make_durable``, else ``flush``).

        Called by a checkpoint from the training thread while the sink's thread may be writing;
        it waits at most ``timeout`` for that write and as long again for the child. False
        (and the last state the child reported stands) if either runs out or the child is down.
        """
        if not self._pipe_lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        try:
            if not self._alive():
                return False
            try:
                limit = self._limit(timeout)
                done = bool(self._call("make_durable", limit, limit))
            except SinkProcessError:
                return False  # the pipeline's next write restarts the child and re-sends
            if done:
                self._unflushed.clear()
                self._flushed_state = dict(self._state)
            return done
        finally:
            self._pipe_lock.release()

    def close(self, timeout: float | None = None) -> bool:
        """Close the sink in the child and stop the child.

        A child that died since its last call is started again first (resumed, and given the
        reports since the last flush), so that the backend's run is closed all the same: a W&B
        run that is never finished stays open, and an MLflow run stays RUNNING. Not when less
        of ``timeout`` is left than the last child took to start (``_too_late_to_restart``).
        """
        with self._pipe_lock:
            if self._closed is not None:
                return self._closed
            if not self._opened:  # no child ever opened the sink: no run to close
                self._closed = True
                return True
            deadline = _deadline(timeout)
            if not self._alive():
                if self._too_late_to_restart(deadline, "close"):
                    return False
                self._restart(deadline)
            try:
                limit = self._limit(seconds_left(deadline))
                argument = (limit, failed_exit_code(), self._unfinished)
                done = bool(self._call("close", argument, limit))
            finally:
                # What is left of the timeout, not the whole of it again: a child that answered
                # close late and is slow to exit (its finalizers) kept close twice its timeout.
                # Killing it then loses nothing: its sink has closed (or the call gave up).
                left = seconds_left(deadline)
                self._stop(join_s=5.0 if left is None else max(0.1, left))
            if done:
                self._unflushed.clear()
                # A close flushes: an open after it resumes from here, not from an older state
                # (which the backend's later steps would contradict).
                self._flushed_state = dict(self._state)
            self._closed = done
            return done

    def _too_late_to_restart(self, deadline: float | None, call: str) -> bool:
        """Whether a ``call`` (close, flush) with a dead child has too little time to start one.

        One after its caller's timeout ran out (the pipeline gave up: ``close(0)``, and the
        flush before it), or with less time left than the last child took to start, would
        spawn a child only to kill it before it opened the sink: seconds of imports past the
        timeout for nothing. The call returns False (warned; a close leaves the run unclosed);
        the reports written since the last flush stay in ``pending_reports``, which the
        pipeline keeps in its spool.
        """
        left = seconds_left(deadline)
        if left is None or (left > 0 and (self._start_s is None or left >= self._start_s)):
            return False
        code = None if self._process is None else self._process.exitcode
        self._stop()
        logger.warning(
            "sink %r: its child process %s, and %s has %.1f s left, less than a child took "
            "to start (%.1f s): none is started%s; the %d report(s) written since the last "
            "flush are kept with the undelivered ones",
            self.name,
            "was stopped" if code is None else f"ended (exit code {code})",
            call,
            max(0.0, left),
            self._start_s or 0.0,
            ", so the backend's run is not closed" if call == "close" else "",
            len(self._unflushed),
        )
        return True

    def written_place(self) -> tuple[type, str, str] | None:
        """The file or folder the wrapped sink writes (checked against the run's other sinks)."""
        return self._place

    def replay_options(self) -> dict[str, Any]:
        """The wrapped sink's ``replay_options``."""
        return dict(self._replay_options)

    def pending_reports(self) -> list[Report]:
        """Reports written since the child's last flush: it may have died with them.

        A runner whose close runs out of time (or whose close failed) keeps these in its spool
        with the rest, so a child that died just before close loses nothing.
        """
        return list(self._unflushed)

    def state_dict(self) -> dict[str, Any]:
        """The child sink's ``state_dict`` as of its last answered call (or a loaded one).

        Before either, the wrapped sink's own state before it opens, so the keys are there.
        """
        return dict(self._state or self._fresh_state)

    # ------------------------------------------------------------------ the child

    def _limit(self, timeout: float | None) -> float | None:
        """How long a call given ``timeout`` may take: the shorter of it and ``call_timeout_s``."""
        if timeout is None:
            return self._call_timeout_s
        if self._call_timeout_s is None:
            return timeout
        return min(timeout, self._call_timeout_s)

    def _alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _start(self, state: Mapping[str, Any] | None, deadline: float | None = None) -> None:
        assert self._run is not None
        # Neither this nor a missing main guard changes on a retry: the sink fails at once.
        if mp.current_process().daemon:
            raise _PermanentSinkProcessError(
                f"sink {self.name!r}: a daemonic process cannot start the child process; run "
                "the trainer in a non-daemonic process (torchrun, mp.spawn) or drop child_process"
            )
        _check_main_guard(self.name)
        context = mp.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(
            target=_serve,
            args=(child, self._sink_bytes, self._run, state, self._orphan_close_s),
            name=f"sidestream-sink-{self.name}",
            daemon=True,
        )
        began = time.monotonic()
        process.start()
        _CHILDREN.add(process)
        child.close()
        self._process, self._conn = process, parent
        try:
            with self._stopped_if_interrupted():
                self._receive(_within(self._start_timeout_s, deadline), "open")
        except SinkProcessError:
            self._stop()
            raise
        self._start_s = time.monotonic() - began

    def _restart(self, deadline: float | None = None) -> None:
        """A fresh child resumed from the last flush, then the reports since, sent again.

        ``deadline`` (``time.monotonic``): a ``flush`` or ``close`` given a timeout restarts
        within it, or raises ``SinkProcessError`` (the child is stopped) once it runs out.
        """
        code = None if self._process is None else self._process.exitcode
        self._stop()
        self.restarts += 1
        logger.warning(
            "sink %r: its child process %s; starting another (restart %d), which resumes the "
            "run from the last flush and is sent again the %d report(s) since",
            self.name,
            "was stopped" if code is None else f"ended (exit code {code})",
            self.restarts,
            len(self._unflushed),
        )
        self._start(self._flushed_state or None, deadline)
        # In the wrapped sink's batches: it may have a per-request limit (max_batch).
        size = max(1, self.max_batch)
        for start in range(0, len(self._unflushed), size):
            batch = self._unflushed[start : start + size]
            self._call("write_batch", batch, _within(self._call_timeout_s, deadline))

    def _call(self, operation: str, argument: Any, timeout: float | None) -> Any:
        with self._pipe_lock:
            return self._call_locked(operation, argument, timeout)

    def _call_locked(self, operation: str, argument: Any, timeout: float | None) -> Any:
        assert self._conn is not None
        request = pickle.dumps((operation, argument))
        with self._stopped_if_interrupted():
            try:
                self._conn.send_bytes(request)
            except OSError as error:
                self._stop()
                raise SinkProcessError(f"sink {self.name!r}: the child process is gone") from error
            return self._receive(timeout, operation)

    @contextlib.contextmanager
    def _stopped_if_interrupted(self) -> Iterator[None]:
        """Stop the child when an interrupt cuts a request or the wait for its reply short.

        A Ctrl-C (``KeyboardInterrupt``) while a call waits, such as a checkpoint's
        ``make_durable`` on the training thread, left that call's reply in the pipe (or half
        a request): every later call read the reply of the one before, so a write the child
        refused counted as written and its report was lost. The next call starts a new child,
        which resumes from the last flush and is sent the reports since again.
        """
        try:
            yield
        except Exception:
            raise  # the reply was read, or the child is stopped already
        except BaseException:
            self._stop(join_s=0.0)
            raise

    def _receive(self, timeout: float | None, operation: str) -> Any:
        assert self._conn is not None and self._process is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        # Poll in slices so a child that dies without closing the pipe is noticed.
        # Never past the deadline: a close(0.2) once waited a whole 0.5 s slice.
        while not self._conn.poll(0.5 if deadline is None else _slice(deadline)):
            if not self._process.is_alive():
                code = self._process.exitcode
                self._stop()
                raise _child_gone(
                    f"sink {self.name!r}: the child process died during {operation} "
                    f"(exit code {code})",
                    f"ended (exit code {code})",
                )
            if deadline is not None and time.monotonic() >= deadline:
                self._stop(join_s=0.0)  # hung: waiting longer would not help
                raise _child_gone(
                    f"sink {self.name!r}: {operation} took longer than {timeout:.1f} s in the "
                    "child process; it was stopped",
                    "hung and was stopped",
                )
        try:
            status, *payload = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as error:
            process = self._process
            self._stop()  # joins it: its exit code is known then
            code = process.exitcode
            raise _child_gone(
                f"sink {self.name!r}: the child process died during {operation} (exit code {code})",
                f"ended (exit code {code})",
            ) from error
        if status == _ERROR:
            message, child_traceback, permanent = payload
            kind = _PermanentSinkProcessError if permanent else SinkProcessError
            raise kind(f"{message} (in the child process)", child_traceback)
        result, state = payload
        self._state = dict(state)
        return result

    def _stop(self, join_s: float = 5.0) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            if not _join(self._process, join_s):
                self._process.kill()
                _join(self._process, 5.0)
            _CHILDREN.discard(self._process)
        self._process, self._conn = None, None


def _join(process: BaseProcess, timeout: float) -> bool:
    """Wait at most ``timeout`` seconds for ``process`` to end; whether it did.

    Not on its sentinel alone, as ``join`` does: a process forked from the trainer while this
    child was being started (a DataLoader worker forked by the training thread while the sink's
    thread started the child) holds a copy of the sentinel pipe's write end, so the sentinel
    says nothing until that process ends too, and a close that had already ended the child
    waited the whole of its timeout and reported that it did not finish. ``is_alive`` asks the
    system (``waitpid``), so the wait ends within a slice of the child's exit all the same.
    """
    deadline = time.monotonic() + timeout
    while True:
        process.join(max(0.0, min(_JOIN_SLICE_S, deadline - time.monotonic())))
        if not process.is_alive():
            return True
        if time.monotonic() >= deadline:
            return False


_JOIN_SLICE_S = 0.05
"""How long one wait on a stopping child's sentinel lasts before the system is asked."""

_CHILDREN: weakref.WeakSet[BaseProcess] = weakref.WeakSet()
"""The child processes of this process's ``ProcessSink``s that have not been stopped."""


def _disown_children_in_fork() -> None:
    """In a child made by ``os.fork``: the parent's sink processes are not this process's.

    ``multiprocessing`` keeps them in its list of this process's children, and its exit hook
    (which a forked child that exits normally runs, ``sys.exit`` or the end of its script)
    sends every daemonic child there SIGTERM: each such child killed the parent's sink
    process, which the parent then restarted (a warning, the reports since the last flush sent
    again, a tracker client killed mid-call), and printed a traceback of ``join``'s "can only
    join a child process". Children ``multiprocessing`` starts itself (DataLoader workers, a
    ``Pool``'s) begin with an empty list and end with ``os._exit``: they never did this.
    """
    children = getattr(mp.process, "_children", None)  # private; absent, nothing to undo
    if children is not None:
        for process in list(_CHILDREN):
            children.discard(process)
    _CHILDREN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disown_children_in_fork)


def _deadline(timeout: float | None) -> float | None:
    """The ``time.monotonic`` by which a call given ``timeout`` must end (``None``: never)."""
    return None if timeout is None else time.monotonic() + timeout


def _slice(deadline: float) -> float:
    """How long one poll of the pipe waits: half a second, or what is left before ``deadline``."""
    return max(0.0, min(0.5, deadline - time.monotonic()))


def _within(limit: float | None, deadline: float | None) -> float | None:
    """``limit`` (seconds, ``None``: none), cut to what is left before ``deadline``."""
    left = seconds_left(deadline)
    if left is None or limit is None:
        return limit if left is None else left
    return min(limit, left)
