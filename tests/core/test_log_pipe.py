"""Run.log's queue when it is full: host numbers are never dropped; a stalled copy's step is."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sidestream import Run, _log_pipe
from sidestream._log_pipe import LogEntry, LogPipe
from sidestream.sinks import JsonlSink, Report, read_jsonl, read_spool


class _Copy:
    """Stands in for a CUDA copy's event: done once ``finish`` is called."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def finish(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait(30)

    def query(self) -> bool:
        return self._done.is_set()


def _slow_deliveries() -> tuple[list[Report], LogPipe]:
    delivered: list[Report] = []

    def deliver(report: Report, given: set[str]) -> None:
        time.sleep(0.001)  # slower than the calls: the queue fills
        delivered.append(report)

    return delivered, LogPipe(deliver, capacity=4)


def test_a_burst_of_host_numbers_past_the_capacity_is_delivered_in_order() -> None:
    # 50,000 run.log calls of Python floats in a tight loop lost 37,091 of them (counted in
    # log_dropped, which close() ignored: it returned True).
    delivered, pipe = _slow_deliveries()
    for step in range(1, 201):
        pipe.put(LogEntry(step=step, time=0.0, numbers={"lr": step / 10}))
    assert pipe.stop(timeout=30)
    assert pipe.dropped == 0
    assert [report.step for report in delivered] == list(range(1, 201))
    assert [report.values["lr"] for report in delivered] == [step / 10 for step in range(1, 201)]


def test_a_full_queue_behind_a_stalled_copy_drops_the_new_step_and_never_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # wait_on_host reads CUDA's sync debug mode, which a CPU build of torch has not.
    monkeypatch.setattr(_log_pipe, "wait_on_host", lambda event: event.synchronize())
    delivered, pipe = _slow_deliveries()
    copy = _Copy()
    host = torch.tensor([2.5], dtype=torch.float64)
    stalled = LogEntry(step=1, time=0.0, numbers={}, device_names=("loss",), host=host)
    stalled.done = copy  # type: ignore[assignment]
    pipe.put(stalled)
    for step in range(2, 5):  # fills the queue (4) behind the copy
        pipe.put(LogEntry(step=step, time=0.0, numbers={"lr": 0.1}))
    started = time.monotonic()
    for step in range(5, 9):
        pipe.put(LogEntry(step=step, time=0.0, numbers={"lr": 0.1}))
    assert time.monotonic() - started < 1.0, "the caller waited for the copy"
    assert pipe.dropped == 4
    copy.finish()
    assert pipe.stop(timeout=30)
    assert [report.step for report in delivered] == [1, 2, 3, 4]
    assert delivered[0].values == {"loss": 2.5}


def test_a_run_whose_log_dropped_a_step_closes_false_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run([JsonlSink(tmp_path / "run.jsonl")])
    run.log(1, {"lr": 0.1})
    assert run._log_pipe is not None
    run._log_pipe.dropped = 2  # as two calls behind a stalled CUDA copy were
    with caplog.at_level(logging.WARNING, logger="sidestream.run"):
        assert run.close(timeout=10) is False
    assert "2 Run.log call(s) were dropped" in caplog.text
    assert [record["step"] for record in read_jsonl(tmp_path / "run.jsonl")] == [1]


def test_a_close_that_times_out_behind_a_stalled_copy_says_how_many_calls_were_lost(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # close() returned False and said nothing: the queued steps vanished uncounted.
    monkeypatch.setattr(_log_pipe, "wait_on_host", lambda event: event.synchronize())
    run = Run([JsonlSink(tmp_path / "run.jsonl")], spool_dir=str(tmp_path / "spool"))
    run.log(1, {"lr": 0.1})
    assert run._log_pipe is not None and run._log_pipe.wait_idle(30)
    copy = _Copy()
    host = torch.tensor([2.5], dtype=torch.float64)
    stalled = LogEntry(step=2, time=0.0, numbers={}, device_names=("loss",), host=host)
    stalled.done = copy  # type: ignore[assignment]
    run._log_pipe.put(stalled)
    run._log_pipe.put(LogEntry(step=3, time=0.0, numbers={"lr": 0.1}))
    try:
        with caplog.at_level(logging.WARNING, logger="sidestream.run"):
            assert run.close(timeout=0.5) is False
        # The stalled copy's call is lost; step 3's host numbers are handed over past it, to
        # the file or (the timeout spent) the spool file the close keeps.
        assert "1 Run.log call(s) still waited for CUDA copies" in caplog.text
    finally:
        copy.finish()
    written = [record["step"] for record in read_jsonl(tmp_path / "run.jsonl")]
    kept = [r.step for f in (tmp_path / "spool").glob("*.spool.jsonl") for r in read_spool(f)]
    assert sorted(written) == sorted(set(written))  # each once in the file
    # A write under way as the timeout ran out may be in both (at least once: a replay skips
    # the steps the file has), so the steps are compared as a set.
    assert sorted(set(written + kept)) == [1, 3]


def test_a_zero_timeout_close_with_nothing_waiting_says_nothing_of_cuda_copies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The idle log thread had not ended within a zero timeout: "0 Run.log call(s) still waited
    # for CUDA copies" was warned on a CPU run.
    run = Run([JsonlSink(tmp_path / "run.jsonl")])
    run.log(1, {"lr": 0.1})
    assert run._log_pipe is not None and run._log_pipe.wait_idle(30)
    with caplog.at_level(logging.WARNING, logger="sidestream.run"):
        run.close(timeout=0)
    assert "waited for CUDA copies" not in caplog.text


@pytest.mark.parametrize("taken", [False, True], ids=["before-taken", "after-taken"])
def test_a_ctrl_c_in_log_uses_the_step_only_if_its_values_were_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: bool
) -> None:
    # The step was used before the values were queued: a Ctrl-C in between lost them, and the
    # call made again was refused ("expected > the previous log call's 2").
    run = Run([JsonlSink(tmp_path / "run.jsonl")])
    run.log(1, {"lr": 1.0})
    real = LogPipe.take  # how Run.log hands the entry over

    def interrupted(self: LogPipe, entry: LogEntry) -> bool:
        if taken:
            real(self, entry)
        raise KeyboardInterrupt

    monkeypatch.setattr(LogPipe, "take", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:
        run.log(2, {"lr": 2.0})
    monkeypatch.undo()
    if taken:
        assert "the values of step 2 were logged" in "".join(caught.value.__notes__)
        with pytest.raises(ValueError, match="previous log call's 2"):
            run.log(2, {"lr": 2.0})
    else:
        run.log(2, {"lr": 2.0})
    run.log(3, {"lr": 3.0})
    assert run.close(timeout=30)
    logged = [(r["step"], r["values"]["lr"]) for r in read_jsonl(tmp_path / "run.jsonl")]
    assert logged == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_a_ctrl_c_as_log_takes_the_queue_lock_leaves_it_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The call entered the queue's Condition, whose __enter__ is Python code: a Ctrl-C there
    # left its lock held, and the pipe's thread never delivered another value.
    delivered: list[Report] = []
    pipe = LogPipe(lambda report, given: delivered.append(report))
    caller = threading.current_thread()
    real_enter = threading.Condition.__enter__
    interrupts = [1]

    def enter(self: threading.Condition) -> bool:
        acquired = real_enter(self)
        if threading.current_thread() is caller and interrupts:
            interrupts.pop()
            raise KeyboardInterrupt
        return acquired

    monkeypatch.setattr(threading.Condition, "__enter__", enter)
    with contextlib.suppress(KeyboardInterrupt):
        pipe.put(LogEntry(step=1, time=0.0, numbers={"x": 1.0}))
    pipe.put(LogEntry(step=2, time=0.0, numbers={"x": 2.0}))
    monkeypatch.undo()
    assert pipe.wait_idle(timeout=10)
    assert [report.step for report in delivered] == [1, 2]
    assert pipe.stop(timeout=10)


def test_a_ctrl_c_as_a_full_queue_waits_to_deliver_marks_the_entry_taken_only_if_it_was() -> None:
    # The call that finds the queue full waits for the delivery in progress before it
    # delivers the queue itself; a Ctrl-C in that wait left the entry marked queued though it
    # was in no queue: run.log used its step (its note said "logged"), refused the call made
    # again, and close returned True without it.
    gate = threading.Event()
    delivered: list[int] = []

    def deliver(report: Report, given: set[str]) -> None:
        if report.step == 1:
            gate.wait(30)
        delivered.append(report.step)

    pipe = LogPipe(deliver, capacity=2)
    pipe.put(LogEntry(step=1, time=0.0, numbers={"x": 1.0}))
    deadline = time.monotonic() + 30
    while not pipe._busy and time.monotonic() < deadline:  # the thread delivers step 1
        time.sleep(0.01)
    pipe.put(LogEntry(step=2, time=0.0, numbers={"x": 2.0}))
    pipe.put(LogEntry(step=3, time=0.0, numbers={"x": 3.0}))  # the queue is full
    caller = threading.current_thread()

    class Interrupted:
        """The delivery lock, whose wait this thread leaves by a Ctrl-C (once)."""

        def __init__(self, lock: Any) -> None:
            self.lock, self.armed = lock, True

        def __enter__(self) -> Any:
            if self.armed and threading.current_thread() is caller:
                self.armed = False
                raise KeyboardInterrupt
            return self.lock.__enter__()

        def __exit__(self, *exc: Any) -> Any:
            return self.lock.__exit__(*exc)

        def held_here(self) -> bool:
            return bool(self.lock.held_here())

    pipe._delivering = Interrupted(pipe._delivering)  # type: ignore[assignment]
    entry = LogEntry(step=4, time=0.0, numbers={"x": 4.0})
    with pytest.raises(KeyboardInterrupt):
        pipe.put(entry)
    gate.set()
    assert pipe.wait_idle(timeout=30)
    assert pipe.stop(timeout=30)
    assert delivered == ([1, 2, 3, 4] if entry.queued else [1, 2, 3])
    # Queued before the wait (take), then delivered by the thread: the step is used, which
    # Run.log's note says ("logged before this error").
    assert entry.queued


def test_a_ctrl_c_in_a_delivery_of_a_full_queue_loses_no_entry_and_repeats_none() -> None:
    # The caller draining a full queue took the entry off before delivering it: a Ctrl-C while
    # the second sink waited for room lost it there (the first sink had it already).
    got: dict[str, list[int]] = {"a": [], "b": []}
    armed = [True]

    def deliver(report: Report, given: set[str]) -> None:
        for key in ("a", "b"):
            if key in given:
                continue
            if key == "b" and report.step == 2 and armed:
                armed.clear()
                raise KeyboardInterrupt  # as in SinkRunner.submit's wait for room
            got[key].append(report.step)
            given.add(key)

    pipe = LogPipe(deliver, capacity=2)
    assert pipe.stop(timeout=30)  # no thread: this caller delivers what fills the queue
    for step in (1, 2):
        pipe.put(LogEntry(step=step, time=0.0, numbers={"x": float(step)}))
    with pytest.raises(KeyboardInterrupt):
        pipe.put(LogEntry(step=3, time=0.0, numbers={"x": 3.0}))  # delivers 1, 2, 3
    assert got == {"a": [1, 2], "b": [1]}
    pipe.put(LogEntry(step=4, time=0.0, numbers={"x": 4.0}))  # full again: delivers the rest
    assert got == {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}


def test_delivery_skips_the_sinks_an_entry_was_given_to(tmp_path: Path) -> None:
    first, second = JsonlSink(tmp_path / "a.jsonl"), JsonlSink(tmp_path / "b.jsonl")
    run = Run([first, second])
    run.log(1, {"x": 1.0})  # starts the sinks
    assert run._log_pipe is not None and run._log_pipe.wait_idle(30)
    keys = [runner.key for runner in run.sink_runners]
    given = {keys[0]}
    run._delivery.submit(Report(step=2, values={"x": 2.0}, time=0.0, stream=""), given)
    assert given == set(keys)
    assert run.close(timeout=30)
    assert [r["step"] for r in read_jsonl(tmp_path / "a.jsonl")] == [1]
    assert [r["step"] for r in read_jsonl(tmp_path / "b.jsonl")] == [1, 2]


class _LetThreadDeliverFirst:
    """The pipe's delivery lock, with which a ``hand_over`` caller waits for the pipe's thread.

    A caller's timed ``acquire`` (hand_over's) waits until the pipe's thread has delivered
    every queued entry before taking the lock: the thread, which lets go of the lock between
    entries and takes it again at once, wins that race on a busy machine.
    """

    def __init__(self, pipe: LogPipe) -> None:
        self._pipe = pipe
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.current_thread() is not self._pipe._thread:
            assert self._pipe.wait_idle(30)
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@pytest.mark.parametrize("refuse_later", [False, True])
def test_a_hand_over_behind_the_threads_deliveries_delivers_each_entry_once(
    refuse_later: bool,
) -> None:
    # hand_over counted the queue before it had the delivery lock; the thread delivered some
    # meanwhile, and hand_over indexed the emptied queue: IndexError out of a checkpoint
    # (state_dict(timeout=0)) or a close(0) after a burst of run.log calls, 5 times in 10.
    delivered: list[int] = []
    first, go = threading.Event(), threading.Event()

    def deliver(report: Report, given: set[str]) -> None:
        if report.step == 1:
            first.set()
            assert go.wait(30)  # the thread's delivery in progress as hand_over is called
        delivered.append(report.step)

    pipe = LogPipe(deliver)
    pipe._delivering = _LetThreadDeliverFirst(pipe)  # type: ignore[assignment]
    for step in range(1, 6):
        pipe.put(LogEntry(step=step, time=0.0, numbers={"x": float(step)}))
    assert first.wait(30)
    go.set()
    assert pipe.hand_over(1.0, refuse_later=refuse_later) == 0
    assert pipe.stop(30)
    assert delivered == [1, 2, 3, 4, 5]
    assert pipe.undelivered == 0 and pipe._on_device == 0
