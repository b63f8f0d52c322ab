"""The at-exit closes of runs and collectors, kept ahead of their backends' own teardowns.

``atexit`` runs the newest registration first. A run registers its close when it is made, but
a tracker client registers its teardown (wandb stops its service process) when the sink opens,
later, so at exit the client would be gone before the run's close delivers what is left. So
the closes run from one hook of their own, newest close first, and that hook moves in front of
the others whenever a close is registered or a sink calls ``close_before_backends_exit`` after
its client registered a teardown. Once exit has begun nothing moves: Python does not run a
hook registered again while the hooks run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import TracebackType

from sidestream._logs import get_logger

__all__ = [
    "KILLED_EXIT_CODE",
    "close_at_exit",
    "close_before_backends_exit",
    "closing_at_exit",
    "ending_with",
    "exit_time_left",
    "failed_exit_code",
    "fork_mark",
    "forked_since",
    "forget_close_at_exit",
    "in_ipython",
    "ipython_shell",
    "record_failed_exit",
    "refuse_in_forked_child",
    "scoped_exit_code",
]

KILLED_EXIT_CODE = 255
"""The code of a job stopped from outside (Ctrl-C, as wandb's hooks count it, or killed)."""

_LOCK = threading.Lock()
_CLOSES: list[Callable[[], object]] = []  # oldest first
_exiting = False
_failed_code: int | None = None  # set by an uncaught exception on its way out
# Set while a block left by an exception closes (ending_with), on that block's thread only: a
# process-wide value told every run closing meanwhile that its job failed (trials of a sweep run
# in threads, as Optuna's n_jobs does: a trial that finished ended its MLflow run FAILED while
# another trial's block was left by an exception). A sink's close, on its own thread, is told
# the code its run's close saw (``scoped_exit_code``, then ``exiting_with``).
_scope = threading.local()
_hooked = False
_exit_began: float | None = None  # time.monotonic() when the closes at exit began
_terminated = False  # a SIGTERM came while the closes at exit ran: the rest keep, at once


def _record_failure(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    global _failed_code
    # As wandb's own exit hooks count it: Ctrl-C is 255, any other exception 1.
    _failed_code = KILLED_EXIT_CODE if issubclass(kind, KeyboardInterrupt) else 1
    _previous_excepthook(kind, value, tb)


_previous_excepthook = sys.excepthook


def _hook_exceptions() -> None:
    """Note an uncaught exception (lock held): a close at exit tells the tracker the job failed."""
    global _hooked, _previous_excepthook
    if not _hooked:
        _hooked = True
        _previous_excepthook = sys.excepthook
        sys.excepthook = _record_failure


def record_failed_exit(code: int) -> None:
    """Say that the job is ending with ``code``: for a process that learns it otherwise.

    A ``ProcessSink`` child has no exception of its own to see: the trainer sends its code
    with the close, and a trainer that vanished (killed) counts as 255, as Ctrl-C does.
    """
    global _failed_code
    _failed_code = code


@contextlib.contextmanager
def ending_with(
    exception: type[BaseException] | None, value: BaseException | None = None
) -> Iterator[None]:
    """Within the block, ``failed_exit_code`` is that of ``exception`` (``None``: as before).

    For a ``with Run(...)`` block left by an exception: its closes run before the exception
    reaches ``sys.excepthook``, and only they should tell the trackers the job failed (a caught
    exception leaves later runs of the process alone). ``value``, the exception itself, gives
    a ``SystemExit`` its own code: ``sys.exit(0)`` (or ``sys.exit()``) is a success.
    """
    with exiting_with(None if exception is None else _exit_code(exception, value)):
        yield


@contextlib.contextmanager
def exiting_with(code: int | None) -> Iterator[None]:
    """Within the block, ``failed_exit_code`` is ``code`` (``None``: as before).

    For a replay that closes a job's sink after that job ended: the tracker is told how the
    job ended (a failed job's run FAILED), not how the replay does.
    """
    previous = scoped_exit_code()
    if code is not None:
        _scope.code = code
    try:
        yield
    finally:
        _scope.code = previous


def scoped_exit_code() -> int | None:
    """The code ``exiting_with`` set on this thread (``None``: none set).

    For a close that goes on on other threads (a sink's): they take it with ``exiting_with``.
    """
    code: int | None = getattr(_scope, "code", None)
    return code


def _exit_code(exception: type[BaseException], value: BaseException | None) -> int | None:
    """The process's exit code if ``exception`` ends it, ``None`` for a success (or no end)."""
    if issubclass(exception, GeneratorExit):
        return None
    if issubclass(exception, KeyboardInterrupt):
        return KILLED_EXIT_CODE
    if issubclass(exception, SystemExit):
        code = value.code if isinstance(value, SystemExit) else 1
        if code is None or code is False or code == 0:
            return None
        # An int is the exit status; anything else is printed and exits 1, as Python does.
        return code if isinstance(code, int) else 1
    return 1


def failed_exit_code() -> int | None:
    """The exit code of the uncaught exception the interpreter is exiting with, else None.

    For sinks closed at exit: wandb marks a run finished with code 0 as successful, so a job
    that crashed without closing its ``Run`` would show as finished (its own exit hook, which
    knows better, runs after the closes). A ``with Run(...)`` block left by an exception sets
    the code for its own close only, on the closing thread (``ending_with``), and a sink's
    close on its runner's thread sees it too; another thread of a sink's own sees ``None``
    there (read it in the sink's ``close``).
    """
    scoped = scoped_exit_code()
    if scoped is not None:
        return scoped
    if _failed_code is None and _exit_began is not None:
        return _uncaught_exit_code()
    return _failed_code


def _uncaught_exit_code() -> int | None:
    """At exit, the code of an uncaught exception that ``sys.excepthook`` did not pass on.

    The interpreter notes an uncaught exception in ``sys.last_type`` before it calls the hook,
    so a hook installed after a run's (``rich.traceback.install()`` after the ``Run``), which
    does not call the one it replaced, no longer lets a crashed job's trackers hear it ended
    well (MLflow FINISHED, W&B exit code 0). Not in an interactive session, where
    ``last_type`` is the last error shown at a prompt (a notebook cell's), not how it ends.

    Only an exception that went up through the program's first frame counts: others note
    one they caught there too (pytest a failed or ``xfail`` test's, for a debugger;
    ``code.interact`` a line's), and a session that went on to pass told the trackers of its
    runs closed at exit that it failed (MLflow FAILED for ``1 passed, 1 xfailed``, exit 0).
    """
    kind = getattr(sys, "last_type", None)
    if not isinstance(kind, type) or not issubclass(kind, BaseException) or _interactive():
        return None
    if not _reached_the_top(getattr(sys, "last_traceback", None)):
        return None
    return KILLED_EXIT_CODE if issubclass(kind, KeyboardInterrupt) else 1


def _reached_the_top(traceback: TracebackType | None) -> bool:
    """Whether an exception with ``traceback`` left the program's outermost Python frame.

    A traceback starts at the frame where the exception was caught: uncaught, the script's
    module frame (or ``runpy``'s for ``python -m``), which no Python frame called.
    """
    return traceback is not None and traceback.tb_frame.f_back is None


def _interactive() -> bool:
    """Whether this process has a prompt: ``python -i``, the REPL, IPython or a notebook."""
    return bool(sys.flags.interactive) or hasattr(sys, "ps1") or in_ipython()


def in_ipython() -> bool:
    """Whether this process is an IPython shell or a Jupyter kernel (a notebook)."""
    return ipython_shell() is not None


def ipython_shell() -> object | None:
    """The running IPython shell (a Jupyter kernel's too), or ``None``; IPython not imported."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_ipython() if callable(get_ipython) else None


def closing_at_exit() -> bool:
    """Whether the closes at interpreter exit have begun (a close now is one of them)."""
    return _exit_began is not None


def exit_time_left(timeout: float) -> float:
    """What is left of ``timeout`` (an ``exit_timeout``) for a close run at interpreter exit.

    The closes at exit run one after another; each given its whole ``exit_timeout``, two runs
    with a hung sink each kept the exit waiting twice as long. Counted from when the closes
    began, they all end within the largest ``exit_timeout``. Before exit: ``timeout``.
    """
    began = _exit_began
    if began is None:
        return timeout
    if _terminated:
        return 0.0
    return max(0.0, timeout - (time.monotonic() - began))


def _forget_in_child() -> None:
    """In a child made by ``os.fork``: the parent's runs and collectors are not this process's.

    Their threads were not copied, so a close at the child's exit would only fail to deliver
    (spooling copies of the parent's reports and warning of them); the parent closes them.
    """
    global _LOCK, _forks, _child_hooked
    _LOCK = threading.Lock()  # another thread of the parent may have held it at the fork
    _CLOSES.clear()
    _forks += 1
    # multiprocessing forgets the parent's finalizers in a child it starts: register anew.
    _child_hooked = False


_forks = 0  # os.fork calls between the process that imported this module and this one


def fork_mark() -> int:
    """A mark of this process: it differs in a child made by ``os.fork`` since it was taken."""
    return _forks


def forked_since(mark: int | None, call: str, what: str) -> bool:
    """Whether this process is a fork of the one that took ``mark`` (a warning says so).

    ``mark`` is ``fork_mark()`` where the threads started (``None``: none started yet).

    For a close: the process that started the run or collector delivers its reports and
    closes it, so a close in the child does nothing (and says nothing was delivered). Not an
    error: a child that leaves a ``with Run(...)`` block on its way out closes it.
    """
    if mark is None or mark == _forks:
        return False
    get_logger("sidestream").warning(
        "%s: this %s was started in the process this one was forked from (os.fork), which "
        "delivers its reports and closes it; nothing was done here",
        call,
        what,
    )
    return True


def refuse_in_forked_child(call: str, mark: int | None, what: str) -> None:
    """Raise ``RuntimeError`` if this process is a fork of the one that took ``mark``.

    ``mark`` is ``fork_mark()`` where the threads started (``None``: none started yet, and
    this process may start them).

    The threads of a run or a collector (dispatcher, sinks) are not copied by ``os.fork``: in
    the child its calls returned normally and nothing was delivered, and its close said every
    report was.
    """
    if mark is not None and mark != _forks:
        raise RuntimeError(
            f"{call}: this {what} was started in the process this one was forked from (os.fork); "
            f"its threads, which deliver, stay there. Log from that process, or make a "
            f"{what} in this one"
        )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _close_all() -> None:
    global _exiting, _exit_began
    with _LOCK:
        _exiting = True
        _exit_began = time.monotonic()
        closes = list(reversed(_CLOSES))
        _CLOSES.clear()
    if not closes:
        return
    global _in_close
    with _terminate_interrupts_closes():
        for close in closes:
            try:
                _in_close = True
                try:
                    close()
                finally:
                    _in_close = False
            except Exception:  # as atexit does: say so, and go on with the others
                traceback.print_exc()
            except BaseException as error:  # Ctrl-C, SIGTERM: that run kept its reports
                # in spool files. The others still close (each keeps its own if interrupted
                # too), or their reports would die with the process's sink threads, unsaid.
                print(
                    f"sidestream: closing at exit was interrupted ({type(error).__name__}); "
                    "closing the other runs",
                    file=sys.stderr,
                )
                if _terminated:
                    # A SIGTERM before the close claimed its run left it open: closed again
                    # with no time left (exit_time_left), it keeps its reports at once. Once
                    # claimed, a close again returns the first one's answer.
                    with contextlib.suppress(Exception):
                        close()


_TERMINATED_CODE = 128 + 15  # a process that SIGTERM ended, as a shell reports it
_in_close = False  # a close of _close_all is running (on the main thread)


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM during the closes at exit: interrupt the close in progress (it keeps its spool).

    Once only: the closes after it keep what they hold at once (``exit_time_left`` is 0), and
    a second SIGTERM must not cut off the first one's keeping. Raised inside a close only:
    between two, it would skip the closes left.
    """
    global _terminated
    if _terminated:
        return
    _terminated = True
    if _in_close:  # between two closes: the next one sees exit_time_left at 0
        raise SystemExit(_TERMINATED_CODE)


@contextlib.contextmanager
def _terminate_interrupts_closes() -> Iterator[None]:
    """While the closes at exit run, a SIGTERM interrupts them instead of killing the process.

    What stops a process sends SIGTERM, then SIGKILL after a grace period: Jupyter's kernel
    shutdown and restart 2.5 s after asking the kernel to exit, then SIGKILL at 5 s (a Run
    left open in a notebook is closed at the kernel's exit), as do Slurm, Kubernetes and
    ``docker stop`` later. Python's default action for SIGTERM ends the process where it is:
    a close still delivering a slow sink's backlog lost it all, with no spool file and no
    word (149 of 200 reports in the probe). Interrupted instead, each close keeps what its
    sinks had not delivered in a spool file (within about a second), as a Ctrl-C does. Only
    where nobody set a handler of their own, from the main thread (the one that runs the
    ``atexit`` hooks); the default comes back after the closes, and a process that was sent
    SIGTERM then ends by it.
    """
    if not hasattr(signal, "SIGTERM") or threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            yield  # the job's own handler (the docs' sys.exit one) already interrupts
            return
        signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        yield
        return
    try:
        yield
    finally:
        # Only if still ours: a close may have set a handler of its own meanwhile.
        if signal.getsignal(signal.SIGTERM) is _interrupt_on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _terminated:
        # Ended as the sender meant, by SIGTERM (its launcher sees that, not a clean exit),
        # now that the closes kept what they held; the later exit hooks are skipped, as the
        # default action would have.
        signal.raise_signal(signal.SIGTERM)


_hook_slots: int | None = None  # atexit's count of hooks just after ours was registered


def _move_to_front() -> None:
    """Register the hook again, in front of every hook registered so far (lock held).

    Only when some hook was registered after it: CPython's ``atexit.unregister`` leaves an
    empty slot behind that stays until exit, and every later call scans them all, so moving it
    for each run of a sweep (and each tracker sink's open) grew that list without bound and
    made each move slower. ``atexit._ncallbacks`` counts the slots, empty ones too: unchanged
    means nothing was registered since ours.
    """
    global _hook_slots
    if _exiting:
        return
    count = getattr(atexit, "_ncallbacks", None)
    if count is not None and _hook_slots is not None and count() == _hook_slots:
        return
    atexit.unregister(_close_all)
    atexit.register(_close_all)
    _hook_slots = count() if count is not None else None


_child_hooked = False  # _close_all is registered with this multiprocessing child's own exit


def _close_at_child_exit() -> None:
    """In a ``multiprocessing`` child, run the closes at its exit too (lock held).

    A child started by the fork or forkserver method (Lightning's ``ddp_fork`` and
    ``ddp_notebook``, Accelerate's ``notebook_launcher``, ``multiprocessing.Process`` under
    those methods) ends with ``os._exit`` once its target returns, which runs no ``atexit``
    hook: a run made there and not closed lost what its sinks had not delivered yet, without
    a word. ``multiprocessing`` runs its finalizers there, after the target, before it joins
    the threads and terminates daemonic children. A spawned child runs them too, then the
    ``atexit`` hook, which finds nothing left to close.
    """
    global _child_hooked
    process = sys.modules.get("multiprocessing.process")  # an mp child has imported it
    if _child_hooked or process is None or process.parent_process() is None:
        return
    from multiprocessing import util

    _child_hooked = True
    # Above the default priority 0 of other finalizers: before the child's daemonic
    # processes (a ProcessSink's) are terminated, as at a normal exit.
    util.Finalize(None, _close_all_at_child_exit, exitpriority=100)


def _close_all_at_child_exit() -> None:
    """``_close_all`` from a ``multiprocessing`` child's finalizers, told how the child ends.

    They run in a ``finally`` after the target, while an exception it raised (or its
    ``sys.exit(code)``) is still on its way out; ``multiprocessing`` prints it itself, so the
    child's ``sys.excepthook`` never records it. Without this a crashed child's run was closed
    as a success (MLflow FINISHED, wandb exit code 0, its spool file's exit code unset).
    """
    kind, value, _ = sys.exc_info()
    with ending_with(kind, value) if kind is not None else contextlib.nullcontext():
        _close_all()


def close_at_exit(close: Callable[[], object]) -> None:
    """Run ``close`` at interpreter exit (newest first, before the hooks registered so far)."""
    with _LOCK:
        _CLOSES.append(close)
        _move_to_front()
        _close_at_child_exit()
        _hook_exceptions()


def forget_close_at_exit(close: Callable[[], object]) -> None:
    """Undo ``close_at_exit`` (the run or collector was closed already)."""
    with _LOCK:
        if close in _CLOSES:
            _CLOSES.remove(close)


def close_before_backends_exit() -> None:
    """Run the registered closes before the at-exit hooks registered so far.

    For sinks: call it in ``open``, after the tracker's client registered its own at-exit
    teardown. A no-op once exit has begun.
    """
    with _LOCK:
        _move_to_front()
