"""At exit, runs and collectors close before the teardowns of their trackers' clients."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = """
import atexit
from sidestream._exit import close_at_exit, close_before_backends_exit, forget_close_at_exit

def say(text):
    return lambda: print(text, flush=True)

close_at_exit(say("first run closed"))
atexit.register(say("client torn down"))  # a client registers its teardown at open...
close_before_backends_exit()  # ...and its sink moves the closes in front of it
forgotten = say("closed run closed again")
close_at_exit(forgotten)
forget_close_at_exit(forgotten)  # closed already: not again at exit

def opening_late():
    # A sink that opens while the interpreter exits: moving hooks now would drop them.
    close_before_backends_exit()
    print("second run closed", flush=True)

close_at_exit(opening_late)
"""


def _python(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter, whose exit runs the hooks under test."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )


def test_closes_run_newest_first_before_the_clients_teardown_and_none_is_lost() -> None:
    done = _python(_SCRIPT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "second run closed",
        "first run closed",
        "client torn down",
    ], done.stderr


def test_a_block_left_by_an_exception_fails_only_its_own_closes() -> None:
    """``with Run(...)`` closes before the exception is uncaught: its sinks must hear the
    failure, and a later run of the same process (the exception caught) must not."""
    from sidestream._exit import ending_with, failed_exit_code

    assert failed_exit_code() is None
    with ending_with(RuntimeError):
        assert failed_exit_code() == 1
    with ending_with(KeyboardInterrupt):
        assert failed_exit_code() == 255
    with ending_with(None):
        assert failed_exit_code() is None
    assert failed_exit_code() is None


def test_a_block_left_by_sys_exit_takes_its_code() -> None:
    # sys.exit(0) inside `with Run(...)` told every tracker the job failed (W&B finish(1),
    # MLflow FAILED), while the process exited 0.
    from sidestream._exit import ending_with, failed_exit_code

    for value, expected in (
        (SystemExit(), None),
        (SystemExit(0), None),
        (SystemExit(False), None),
        (SystemExit(3), 3),
        (SystemExit("bad config"), 1),  # printed, exit status 1
    ):
        with ending_with(SystemExit, value):
            assert failed_exit_code() == expected, value
    assert failed_exit_code() is None


_INTERRUPTED_SCRIPT = """
from sidestream._exit import close_at_exit

def closes(name, interrupted=False):
    def close():
        if interrupted:
            # Ctrl-C while this run closes at exit, as Python raises it (a real SIGINT is
            # ignored in processes that pytest-xdist's workers start).
            raise KeyboardInterrupt
        print(name, "closed", flush=True)
    return close

close_at_exit(closes("older run"))
close_at_exit(closes("newer run", interrupted=True))
"""


def test_ctrl_c_while_a_run_closes_at_exit_still_closes_the_others() -> None:
    # Only Exception was caught: the interrupt left the loop, and the older run's sink threads
    # died with the process, their reports in no spool file and in no warning.
    done = _python(_INTERRUPTED_SCRIPT)
    assert done.stdout.splitlines() == ["older run closed"], done.stderr
    assert "closing at exit was interrupted (KeyboardInterrupt)" in done.stderr


_HUNG_SINKS_SCRIPT = """
import atexit
import sys
import threading
import time

atexit.register(lambda: print(f"exit closes done {time.monotonic()}", flush=True))  # runs last

from sidestream import AsyncMetricCollector, MeanMetric, Run
from sidestream.sinks import Sink


class Hung(Sink):
    # A tracker that stopped answering: write and close never return.
    def __init__(self, name):
        self.name = name

    def open(self, run):
        pass

    def write(self, report):
        threading.Event().wait()

    def close(self, timeout=None):
        threading.Event().wait()
        return True


spool = sys.argv[1]
first = Run([Hung("first")], exit_timeout=2.0, spool_dir=spool)
first.log(1, {"x": 1.0})
second = Run([Hung("second")], exit_timeout=2.0, spool_dir=spool)
second.log(1, {"x": 1.0})
metric = MeanMetric()
collector = AsyncMetricCollector(metric, sinks=[Hung("third")], exit_timeout=2.0, spool_dir=spool)
collector.bind("cpu")
metric.update(1.0)
collector.schedule_collection(1)
print(f"last line {time.monotonic()}", flush=True)
"""


def test_closes_at_exit_share_the_exit_timeout(tmp_path: Path) -> None:
    # Each close at exit got its whole exit_timeout: two runs and a collector with a hung
    # tracker kept the exit waiting 3 x 2 s.
    done = subprocess.run(
        [sys.executable, "-c", _HUNG_SINKS_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    times = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in done.stdout.split("\n")
        if line
    }
    took = times["exit closes done"] - times["last line"]
    # One shared 2 s budget, with room for a loaded machine (2.3 s seen); the bug took 6 s
    # and each close on its own budget at least 4.
    assert 2.0 <= took < 3.8, (took, done.stderr)
    # What no close had time for is kept, for each of them.
    kept = sorted(path.name.split("@")[0] for path in tmp_path.glob("*.spool.jsonl"))
    assert kept == ["sidestream-first", "sidestream-second", "sidestream-third"], done.stderr


_SWEEP = """
import atexit
from sidestream._exit import close_at_exit, close_before_backends_exit, forget_close_at_exit

def say(text):
    return lambda: print(text, flush=True)

slots = atexit._ncallbacks()
for index in range(200):  # a sweep: a run made and closed, its tracker sink opened, 200 times
    close = say(f"run {index}")
    close_at_exit(close)
    close_before_backends_exit()
    forget_close_at_exit(close)
print("slots added", atexit._ncallbacks() - slots, flush=True)
close_at_exit(say("last run closed"))
atexit.register(say("client torn down"))
close_before_backends_exit()  # a hook registered since: still moved in front of it
"""


def test_a_sweep_of_runs_leaves_no_atexit_slots_behind() -> None:
    """Each move of the hook unregistered and registered it again; CPython's ``unregister``
    leaves an empty slot for good, so a sweep of runs grew atexit's list by one or two per run
    (and every later move scanned them all)."""
    done = _python(_SWEEP)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "slots added 1", done.stdout  # the first registration only
    assert lines[1:] == ["last run closed", "client torn down"], done.stderr


_REPLACED_HOOK_SCRIPT = """
import sys
from sidestream._exit import close_at_exit, failed_exit_code

close_at_exit(lambda: print("closed with", failed_exit_code(), flush=True))
# Installed after the run's hook, as rich.traceback.install() after the Run is: it prints
# and does not call the hook it replaced.
sys.excepthook = lambda kind, value, tb: print("own hook:", kind.__name__, flush=True)
raise {exception}
"""


def test_an_uncaught_exception_fails_the_closes_at_exit_past_a_replaced_excepthook() -> None:
    # Before: only sidestream's own excepthook noted the failure, so a hook installed after it
    # that did not chain made a crashed job's closes at exit hear None: MLflow FINISHED.
    for exception, code in (("RuntimeError('boom')", 1), ("KeyboardInterrupt", 255)):
        done = _python(_REPLACED_HOOK_SCRIPT.format(exception=exception))
        assert done.returncode != 0, done.stdout
        lines = done.stdout.splitlines()
        assert lines[-1] == f"closed with {code}", (exception, done.stdout, done.stderr)


def test_a_clean_exit_after_a_caught_exception_is_not_a_failure() -> None:
    done = _python(
        """
        from sidestream._exit import close_at_exit, failed_exit_code
        close_at_exit(lambda: print("closed with", failed_exit_code(), flush=True))
        try:
            raise RuntimeError("handled")
        except RuntimeError:
            pass
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["closed with None"]


def _caught_in(catcher: str) -> BaseException:
    """An exception caught in a function, as pytest catches a test's (its frame had a caller)."""
    try:
        raise ZeroDivisionError(catcher)
    except ZeroDivisionError as error:
        return error


def test_an_exception_caught_and_noted_by_a_tool_is_not_a_failure_at_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pytest notes a failed (or xfailed) test's exception in ``sys.last_type`` for a debugger,
    as ``code.interact`` does a line's. Before: a session that then passed (``1 passed,
    1 xfailed``, exit 0) told its runs closed at exit that it failed (MLflow FAILED, W&B exit
    code 1). An uncaught one left the script's first frame: still a failure (the test above,
    and ``python -m`` whose first frame is runpy's)."""
    from sidestream import _exit

    error = _caught_in("a test")
    monkeypatch.setattr(sys, "last_type", type(error), raising=False)
    monkeypatch.setattr(sys, "last_value", error, raising=False)
    monkeypatch.setattr(sys, "last_traceback", error.__traceback__, raising=False)
    monkeypatch.setattr(_exit, "_exit_began", 0.0)  # the closes at exit are running
    monkeypatch.setattr(_exit, "_failed_code", None)
    assert _exit.failed_exit_code() is None
