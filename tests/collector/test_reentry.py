"""User code that calls sidestream again from where sidestream calls it: a logging handler that
forwards warnings to ``run.log``, a sink's methods and a metric's ``compute`` (on sidestream's
own threads), a signal handler inside ``log``. Each scenario runs on a thread with a deadline, so
a deadlock fails the test instead of hanging the suite."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import sidestream.run as run_module
from sidestream import MeanMetric, Run
from sidestream._log_pipe import LogPipe
from sidestream.sinks import JsonlSink, Report, RunInfo, Sink, read_jsonl

_DEADLINE_S = 10.0


def _within_deadline(scenario: Callable[[], None], what: str) -> None:
    """Run ``scenario`` on a thread; fail (not hang) if it has not ended by the deadline."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            scenario()
        except BaseException as error:  # raised below, on the test's thread
            errors.append(error)

    thread = threading.Thread(target=body, name="scenario", daemon=True)
    thread.start()
    thread.join(_DEADLINE_S)
    assert not thread.is_alive(), f"{what}: still blocked after {_DEADLINE_S} s (a deadlock)"
    if errors:
        raise errors[0]


def test_a_handler_forwarding_a_warning_of_the_log_thread_to_log_does_not_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "Send warnings to the tracker": a handler on the sidestream logger calls run.log. The
    # Run.log thread warned (a name two streams report) inside a delivery; meanwhile the
    # training loop's log found the queue full and waited for that delivery holding Run.log's
    # lock, which the handler's run.log waited for: both threads hung for good.
    monkeypatch.setattr(run_module, "LogPipe", functools.partial(LogPipe, capacity=2))
    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)])
    steps = itertools.count(2)
    logged: list[int] = []
    filled = threading.Event()

    class ToRun(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno < logging.WARNING or threading.current_thread() is main:
                return
            filled.wait(_DEADLINE_S)
            time.sleep(0.2)  # the loop's next log finds the queue full and waits meanwhile
            step = next(steps)
            run.log(step, {"warnings": 1.0})
            logged.append(step)

    handler = ToRun()
    logger = logging.getLogger("sidestream")
    main: threading.Thread | None = None

    def scenario() -> None:
        nonlocal main
        main = threading.current_thread()
        collector = run.collector(MeanMetric(), prefix="train").bind("cpu")
        collector.metric.update(torch.tensor([1.0]))
        collector.schedule_collection(1)
        collector.collect_results(5)
        run.log(1, {"train": 1.0})  # the stream "train" reports "train" too: warned
        logged.append(1)
        time.sleep(0.05)  # the Run.log thread takes it, and its handler waits
        for _ in range(4):  # two fill the queue; the next ones find it full
            step = next(steps)
            run.log(step, {"lr": float(step)})
            logged.append(step)
            if len(logged) == 3:
                filled.set()

    logger.addHandler(handler)
    try:
        _within_deadline(scenario, "run.log with a warning-forwarding handler")
    finally:
        logger.removeHandler(handler)
        filled.set()
    assert run.close(10) is True
    assert sorted(r["step"] for r in read_jsonl(path) if r["stream"] == "") == sorted(logged)
    assert len(logged) == 6  # the handler's log too


def test_a_log_inside_a_log_call_on_its_thread_is_refused_not_delivered_out_of_order(
    tmp_path: Path,
) -> None:
    # A signal handler (or a logging handler) whose run.log ran inside run.log(2) on its
    # thread, before that call handed its values over: step 3 reached the sinks first, the
    # JSONL sink skipped step 2 as delivered, the outer call put the previous step back to 2,
    # and step 3 logged again by the loop was skipped too; every call returned, close said
    # True.
    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)])
    run.log(1, {"x": 1.0})
    real_start = run._delivery.start
    inner: list[BaseException] = []

    def start(where: str) -> Any:
        run._delivery.start = real_start  # type: ignore[method-assign]
        try:
            run.log(3, {"handler": 1.0})  # what a handler landing here runs
        except RuntimeError as error:
            inner.append(error)
            raise
        return real_start(where)

    run._delivery.start = start  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="inside a log call on the same thread"):
        run.log(2, {"x": 2.0})
    assert inner
    run.log(2, {"x": 2.0})  # refused before its step was taken: the call made again logs it
    run.log(3, {"x": 3.0})
    assert run.close(10) is True
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]


class _CallingSink(Sink):
    """A sink whose first write calls ``call`` (a run's blocking method) on its own thread."""

    name = "calling"

    def __init__(self, call: Callable[[], object]) -> None:
        self.call = call
        self.outcome: list[object] = []
        self.steps: list[int] = []

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        if not self.outcome:
            try:
                self.outcome.append(self.call())
            except RuntimeError as error:
                self.outcome.append(error)
        self.steps.append(report.step)

    def state_dict(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("call", ["close", "state_dict"])
def test_a_sinks_blocking_call_to_its_run_raises_instead_of_waiting_for_itself(
    call: str,
) -> None:
    # From a sink's write: run.state_dict(None) waited for that write for good; run.close()
    # returned False at once ("cannot join current thread" at ERROR), kept no spool file, and
    # the reports still queued died with the process.
    holder: list[Run] = []

    def blocking() -> object:
        run = holder[0]
        return run.close(5) if call == "close" else run.state_dict(None)

    sink = _CallingSink(blocking)
    run = Run([sink])
    holder.append(run)
    for step in range(1, 6):
        run.log(step, {"x": float(step)})
    deadline = time.monotonic() + _DEADLINE_S
    while not sink.outcome and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.outcome, f"run.{call} from the sink's write did not return: it waited for itself"
    assert isinstance(sink.outcome[0], RuntimeError)
    assert f"{call}: called on sidestream's thread of sink 'calling'" in str(sink.outcome[0])
    assert run.close(10) is True  # the failed write was retried: nothing lost
    assert sink.steps == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("call", ["run.state_dict", "collector.close", "schedule_collection"])
def test_a_computes_blocking_call_raises_instead_of_waiting_for_itself(
    tmp_path: Path, call: str
) -> None:
    # From a metric's compute, on the dispatcher thread: run.state_dict(None) waited for the
    # window being computed, for good; collector.close() failed with "cannot join current
    # thread"; schedule_collection with every staging slot in use waited for ever for a slot.
    holder: list[Any] = []

    class Calling(MeanMetric):
        def compute(self) -> torch.Tensor:
            if len(holder) == 2:
                run, collector = holder
                holder.append(None)  # once
                if call == "run.state_dict":
                    run.state_dict(None)
                elif call == "collector.close":
                    collector.close(5)
                else:
                    collector.schedule_collection(100)
            return super().compute()

    run = Run([JsonlSink(tmp_path / "run.jsonl")])
    collector = run.collector(Calling(), prefix="train", max_slots=1).bind("cpu")
    holder.extend([run, collector])
    collector.metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    with pytest.raises(RuntimeError, match=r"called on sidestream's dispatcher thread"):
        collector.collect_results(_DEADLINE_S)
    collector.metric.update(torch.tensor([3.0]))
    collector.schedule_collection(2)  # the collector goes on
    assert collector.collect_results(_DEADLINE_S) == 3.0
    run.close(10)


def test_the_hung_spool_disk_warning_is_logged_with_no_lock_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A submitter (the dispatcher, the Run.log thread) that dropped a report for a spool disk
    # writing nothing warned holding the runner's inbox lock: a handler forwarding it to
    # run.log on the dispatcher thread waited for the Run.log thread's delivery, which waited
    # for that lock (both hung for good).
    from sidestream.sinks import _spool
    from sidestream.sinks import runner as runner_module
    from tests.reliability.faults import GatedSink

    disk = threading.Event()
    write_at_end = _spool.Spool._write_at_end

    def hung_write(self: _spool.Spool, line: bytes) -> None:
        disk.wait(_DEADLINE_S)
        write_at_end(self, line)

    monkeypatch.setattr(_spool.Spool, "_write_at_end", hung_write)
    monkeypatch.setattr(runner_module, "INBOX_MIN_CAPACITY", 4)
    monkeypatch.setattr(runner_module, "INTAKE_STALL_S", 0.2)
    sink = GatedSink()
    runner = runner_module.SinkRunner(sink, capacity=1, spool_dir=str(tmp_path))
    held: list[bool] = []

    class Check(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "wrote none for" in record.getMessage():
                held.append(runner._inbox_lock.locked())

    handler = Check()
    logger = logging.getLogger("sidestream.sinks")
    logger.addHandler(handler)
    runner.start()
    try:

        def submit_all() -> None:
            for step in range(1, 31):
                runner.submit(Report(step=step, values={"x": 1.0}, time=float(step)))

        _within_deadline(submit_all, "submits to a hung spool disk")
    finally:
        logger.removeHandler(handler)
        disk.set()
        sink.gate.set()
        runner.close(10)
    assert held == [False], "warned while holding the inbox lock"


def test_a_close_waits_for_another_threads_log_delivering_a_full_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A data-loader thread's run.log found the queue full and delivered it itself, outside
    # Run.log's lock, holding the entries aside; the training thread's close meanwhile found the
    # pipe's queue empty, closed the sinks, and said True: the entries held aside were lost.
    draining = threading.Event()
    release = threading.Event()
    loader: threading.Thread | None = None

    def slow_pipe(deliver: Callable[..., Any]) -> LogPipe:
        def slowly(*args: Any) -> Any:
            if threading.current_thread() is loader and not draining.is_set():
                draining.set()  # the loader's drain is inside its first delivery
                release.wait(_DEADLINE_S)
            else:
                time.sleep(0.02)  # the pipe's thread falls behind: the queue fills
            return deliver(*args)

        return LogPipe(slowly, capacity=2)

    monkeypatch.setattr(run_module, "LogPipe", slow_pipe)
    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)])
    returned: list[int] = []

    def log_until_draining() -> None:
        for step in range(1, 200):
            if draining.is_set():
                return
            run.log(step, {"x": float(step)})
            returned.append(step)

    def scenario() -> None:
        nonlocal loader
        loader = threading.Thread(target=log_until_draining, name="loader", daemon=True)
        loader.start()
        assert draining.wait(_DEADLINE_S), "the loader never delivered the queue itself"
        threading.Timer(0.3, release.set).start()
        closed = run.close(_DEADLINE_S)
        loader.join(_DEADLINE_S)
        assert closed
        delivered = {record["step"] for record in read_jsonl(path)}
        assert set(returned) <= delivered, sorted(set(returned) - delivered)

    _within_deadline(scenario, "close during another thread's drain")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_from_a_sidestream_thread_may_make_blocking_calls() -> None:
    """The child of a fork runs on the forking thread's object: it kept the role of the
    sidestream thread it was forked from, and every blocking call in it was refused."""
    from sidestream._threads import own_thread, refuse_on_own_thread

    codes: list[int] = []

    def fork_and_ask() -> None:
        child = os.fork()
        if child == 0:  # the child: its only thread is its own
            try:
                refuse_on_own_thread("close")
            except RuntimeError:
                os._exit(3)
            os._exit(0)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))

    thread = own_thread(fork_and_ask, name="forker", role="thread of a test")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: as asked
        thread.start()
        thread.join(30)
    assert codes == [0]
    with pytest.raises(RuntimeError, match="thread of a test"):
        # The parent's thread keeps its role.
        _ask_on_a_new_own_thread(own_thread, refuse_on_own_thread)


def _ask_on_a_new_own_thread(
    make: Callable[..., threading.Thread], refuse: Callable[[str], None]
) -> None:
    """Call ``refuse("close")`` on a new thread made by ``make``; raise what it raised."""
    raised: list[BaseException] = []

    def ask() -> None:
        try:
            refuse("close")
        except RuntimeError as error:
            raised.append(error)

    thread = make(ask, name="asker", role="thread of a test")
    thread.start()
    thread.join(30)
    if raised:
        raise raised[0]
