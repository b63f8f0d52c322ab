"""ProcessSink: a sink in a child process; nothing lost when the child raises, dies or hangs."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.queues import Queue
from pathlib import Path

import pytest
import torch

from sidestream import MeanMetric
from sidestream._exit import KILLED_EXIT_CODE
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import (
    JsonlSink,
    ProcessSink,
    Report,
    RunInfo,
    SinkProcessError,
    SinkRunner,
    is_permanent,
    sinks_from_config,
)
from tests._scripts import ROOT, run_python
from tests.collector.child_sinks import (
    BatchSizesSink,
    BuggySink,
    ChildlessSink,
    CloseMarkerSink,
    DiesAtFirstOpenSink,
    DurableCountSink,
    FailingOpenSink,
    FlushFailsOnceSink,
    FlushHangSink,
    SlowDurableRefusingSink,
    SlowExitSink,
    SlowOpenSink,
    SlowReopenSink,
    StalledFlushSink,
    TemporaryFolderSink,
    TroubleJsonlSink,
)

STEPS = list(range(1, 21))


def _run(sink: ProcessSink, steps: list[int] = STEPS) -> list[float]:
    """Log the mean of ``step * [1, 2, 3]`` at every step through the real collector."""
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric, sinks=[sink], sink_retry_initial_s=0.05)
    expected = []
    with collector.bind("cpu"):
        for step in steps:
            values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) * step
            metric.update(values)
            collector.schedule_collection(step)
            expected.append(float(values.mean()))
    return expected


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_delivers_from_another_process(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = ProcessSink(TroubleJsonlSink(path))
    expected = _run(sink)
    lines = _lines(path)
    assert [line["step"] for line in lines] == STEPS
    assert [line["values"] for line in lines] == [{"value": value} for value in expected]
    assert sink.state_dict()["pid"] != os.getpid()
    assert sink.state_dict()["last_steps"] == [["", STEPS[-1]]]
    assert sink.restarts == 0


def test_a_sink_opened_again_after_its_close_delivers_with_a_new_child(tmp_path: Path) -> None:
    # A runner started in place of one that closed the sink (a bind undone while the open was
    # in progress) opens it again: it stayed closed, so every write failed "the sink is
    # closed", was retried until close, and the new child was never stopped.
    path = tmp_path / "m.jsonl"
    sink = ProcessSink(TroubleJsonlSink(path))
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    assert sink.close(30) is True
    sink.open(RunInfo())
    sink.write(Report(step=2, values={"x": 2.0}, time=0.0))
    assert sink.close(30) is True
    assert [line["step"] for line in _lines(path)] == [1, 2]  # the file goes on, once each
    assert not [child for child in mp.active_children() if child.name.startswith("sidestream-sink")]


def test_a_child_dying_while_it_opens_counts_as_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Children killed while opening were replaced by the next open unsaid: ``restarts``
    stayed 0 after 7 replacements, and no warning named them."""
    path = tmp_path / "m.jsonl"
    sink = ProcessSink(DiesAtFirstOpenSink(path))
    with pytest.raises(SinkProcessError, match="died during open"):
        sink.open(RunInfo())
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        sink.open(RunInfo())  # the pipeline's retry
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    assert sink.close(30) is True
    assert sink.restarts == 1
    assert "its child process ended (exit code 9) while opening; starting another (restart 1)" in (
        caplog.text
    )
    assert [line["step"] for line in _lines(path)] == [1]


def test_a_childs_death_at_open_counts_once_however_often_the_sink_then_fails(
    tmp_path: Path,
) -> None:
    """After one death, every later open the wrapped sink failed itself counted a restart
    (1, 2, 3, ...) and logged the death again."""
    sink = ProcessSink(DiesAtFirstOpenSink(tmp_path / "m.jsonl", then_fail=True))
    with pytest.raises(SinkProcessError, match="died during open"):
        sink.open(RunInfo())
    for _ in range(3):
        with pytest.raises(SinkProcessError, match="tracker down"):
            sink.open(RunInfo())
    assert sink.restarts == 1


def test_a_sink_whose_open_raises_is_no_restart(tmp_path: Path) -> None:
    """The wrapped sink's own failure (a tracker down) is retried, not counted as a restart."""
    sink = ProcessSink(FailingOpenSink())
    for _ in range(2):
        with pytest.raises(SinkProcessError, match="no write access"):
            sink.open(RunInfo())
    assert sink.restarts == 0


@pytest.mark.parametrize("trouble", ["die_at", "hang_at"])
def test_dead_or_hung_child_is_replaced_and_nothing_is_lost(
    tmp_path: Path, trouble: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "m.jsonl"
    # The child buffers every line until close: what it held when it died must be sent again.
    sink = ProcessSink(TroubleJsonlSink(path, **{trouble: 12}), call_timeout_s=3.0)
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        expected = _run(sink)
    lines = _lines(path)
    assert [line["step"] for line in lines] == STEPS  # each once, in order
    assert [line["values"]["value"] for line in lines] == expected
    assert sink.restarts == 1
    reason = "died during write" if trouble == "die_at" else "took longer than 3.0 s"
    assert any(reason in record.getMessage() for record in caplog.records), caplog.text
    # The replacement is said too (a child killed between calls was replaced unsaid).
    assert "starting another (restart 1)" in caplog.text


def test_a_child_hung_in_an_idle_flush_is_replaced(tmp_path: Path) -> None:
    # The pipeline's idle flush passes no timeout: call_timeout_s must bound it as a write's.
    path = tmp_path / "m.jsonl"
    hang = Path(f"{path}.hang")
    sink = ProcessSink(FlushHangSink(path), call_timeout_s=1.0)
    runner = SinkRunner(sink, flush_interval_s=0.1)
    hang.touch()
    try:
        runner.start()
        for step in (1, 2, 3):
            runner.submit(Report(step=step, values={"x": float(step)}, time=0.0))
        deadline = time.monotonic() + 30.0
        while runner.status.last_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "flush took longer than 1.0 s" in str(runner.status.last_error)
    finally:
        hang.unlink()  # the old code's child hangs until it is gone
    for step in (4, 5, 6):  # the next call replaces the child, which resends 1..3
        runner.submit(Report(step=step, values={"x": float(step)}, time=0.0))
    assert runner.close(60.0)
    assert [line["step"] for line in _lines(path)] == [1, 2, 3, 4, 5, 6]
    assert sink.restarts == 1


def test_errors_in_the_child_are_retried_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "m.jsonl"
    sink = ProcessSink(TroubleJsonlSink(path, raise_at=5, raises=3))
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        _run(sink)
    assert [line["step"] for line in _lines(path)] == STEPS
    assert sink.restarts == 0  # an exception is not a crash: the same child goes on
    failures = [r.getMessage() for r in caplog.records if "write (step 5) failed" in r.getMessage()]
    assert failures == [
        "sink 'jsonl': write (step 5) failed: SinkProcessError: ConnectionError: tracker refused "
        "the connection (in the child process); retrying with backoff, reports are kept (not "
        "logged again until it recovers)"
    ]


def test_child_traceback_is_kept(tmp_path: Path) -> None:
    sink = ProcessSink(TroubleJsonlSink(tmp_path / "m.jsonl", raise_at=1))
    sink.open(RunInfo())
    with pytest.raises(SinkProcessError) as caught:
        sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    assert 'raise ConnectionError("tracker refused the connection")' in caught.value.child_traceback
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))  # raises only once
    assert sink.close(30.0)
    assert [line["step"] for line in _lines(tmp_path / "m.jsonl")] == [1]


def test_resumes_and_flushes_through_the_child(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    first = ProcessSink(JsonlSink(path, flush_every=1000))
    first.open(RunInfo())
    for step in (1, 2):
        first.write(Report(step=step, values={"x": float(step)}, time=0.0))
    assert first.flush(30.0) and len(_lines(path)) == 2
    saved = first.state_dict()
    assert first.close(30.0)

    resumed = ProcessSink(JsonlSink(path))
    resumed.load_state_dict(saved)
    resumed.open(RunInfo())
    for step in (2, 3):  # step 2 was delivered before the checkpoint
        resumed.write(Report(step=step, values={"x": float(step)}, time=0.0))
    assert resumed.close(30.0)
    assert [line["step"] for line in _lines(path)] == [1, 2, 3]


def test_batches_reach_the_child_sink_whole() -> None:
    sink = ProcessSink(BatchSizesSink())
    assert sink.max_batch == BatchSizesSink.max_batch
    sink.open(RunInfo())
    sink.write_batch([Report(step=s, values={"x": 1.0}, time=0.0) for s in range(3)])
    sink.write(Report(step=3, values={"x": 1.0}, time=0.0))
    assert sink.state_dict()["sizes"] == [3, 1]
    assert sink.state_dict()["pid"] != os.getpid()
    assert sink.close(30.0)


def test_a_failed_flush_after_a_write_does_not_make_the_write_repeat() -> None:
    # The flush after every flush_every reports raised out of write_batch: the runner then
    # retried the write, and the same child wrote the batch again ([0, 1, 0, 1]).
    sink = ProcessSink(FlushFailsOnceSink(), flush_every=2)
    sink.open(RunInfo())
    for step in (0, 1):
        sink.write(Report(step=step, values={"x": 1.0}, time=0.0))  # the second flushes: fails
    assert [r.step for r in sink.pending_reports()] == [0, 1]  # not confirmed yet
    assert sink.flush(30.0)
    assert sink.state_dict()["steps"] == [0, 1] and sink.pending_reports() == []
    assert sink.close(30.0)


def test_a_restarted_child_gets_the_unflushed_reports_in_its_sinks_batches() -> None:
    # All of them went in one write_batch, past the sink's max_batch (a per-request limit).
    sink = ProcessSink(BatchSizesSink())
    sink.open(RunInfo())
    for step in range(10):
        sink.write(Report(step=step, values={"x": 1.0}, time=0.0))
    os.kill(sink.state_dict()["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while sink._alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    sink.write(Report(step=10, values={"x": 1.0}, time=0.0))
    assert sink.restarts == 1
    assert sink.state_dict()["sizes"] == [4, 4, 2, 1]
    assert sink.close(30.0)


def test_open_failure_names_the_original_error() -> None:
    sink = ProcessSink(FailingOpenSink(), start_timeout_s=60.0)
    with pytest.raises(SinkProcessError, match="PermissionError: no write access"):
        sink.open(RunInfo())
    assert sink.close(5.0)


def test_bad_arguments_fail_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"sink: expected a sidestream\.sinks\.Sink"):
        ProcessSink("jsonl")  # type: ignore[arg-type]
    unpicklable = JsonlSink(tmp_path / "m.jsonl")
    unpicklable.lock = threading.Lock()  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="sink: JsonlSink must be picklable"):
        ProcessSink(unpicklable)
    with pytest.raises(TypeError, match="already a ProcessSink"):
        ProcessSink(ProcessSink(JsonlSink(tmp_path / "m.jsonl")))
    with pytest.raises(ValueError, match="call_timeout_s"):
        ProcessSink(JsonlSink(tmp_path / "m.jsonl"), call_timeout_s=0)
    with pytest.raises(ValueError, match="start_timeout_s"):
        ProcessSink(JsonlSink(tmp_path / "m.jsonl"), start_timeout_s=-1)
    with pytest.raises(ValueError, match="flush_every"):
        ProcessSink(JsonlSink(tmp_path / "m.jsonl"), flush_every=0)


def test_config_option_wraps_the_sink(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    (sink,) = sinks_from_config({"jsonl": {"path": str(path), "child_process": True}})
    assert isinstance(sink, ProcessSink) and sink.name == "jsonl"
    (plain,) = sinks_from_config([{"type": "jsonl", "path": str(path), "child_process": False}])
    assert isinstance(plain, JsonlSink)
    (unset,) = sinks_from_config({"jsonl": {"path": str(path), "child_process": None}})
    assert isinstance(unset, JsonlSink)
    with pytest.raises(TypeError, match=r"child_process must be true, false \(or null\) or a"):
        sinks_from_config({"jsonl": {"path": str(path), "child_process": "yes"}})


def test_a_checkpoint_makes_the_child_sinks_writes_durable(tmp_path: Path) -> None:
    """``state_dict`` asks the child's sink to make its writes durable, then saves its state."""
    path = tmp_path / "m.jsonl"
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric, sinks=[ProcessSink(DurableCountSink(path))])
    with collector.bind("cpu"):
        for step in (1, 2, 3):
            metric.update(torch.tensor([float(step)]))
            collector.schedule_collection(step)
        assert collector.wait_windows(30.0)
        (saved,) = collector.state_dict()["sinks"].values()
        # Saved as delivered only once on disk: the child flushed (and fsynced) what its
        # state counts. The state is read just before (a report delivered during the fsync
        # must not count), so the call shows in the next checkpoint's.
        assert saved["last_steps"] == [["", 3]]
        assert [line["step"] for line in _lines(path)] == [1, 2, 3]
        (again,) = collector.state_dict()["sinks"].values()
        assert again["durable_calls"] == 1


def test_a_ctrl_c_in_make_durable_leaves_no_reply_for_the_next_call(tmp_path: Path) -> None:
    """A KeyboardInterrupt while a checkpoint's make_durable (training thread) waits for the
    child stops the child: its reply, left in the pipe, was read by the next call, and each
    call after by the one after it, so a write the child refused counted as written (lost)."""
    path = tmp_path / "m.jsonl"
    sink = ProcessSink(SlowDurableRefusingSink(path, seconds=1.5, refuse_at=3))
    sink.open(RunInfo())
    for step in (1, 2):
        sink.write(Report(step=step, values={"x": float(step)}, time=0.0))
    # The Ctrl-C arrives in the wait for the child's reply (raised by the pipe's poll: a real
    # SIGINT, or interrupt_main, does nothing in pytest-xdist's workers, which ignore it).
    conn = sink._conn
    assert conn is not None
    poll = conn.poll

    def interrupted(wait: float = 0.0) -> bool:
        conn.poll = poll  # type: ignore[method-assign]
        raise KeyboardInterrupt

    conn.poll = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        sink.make_durable(10.0)
    # The next call's own reply: the refusal, which the pipeline retries.
    with pytest.raises(SinkProcessError, match="refused the connection"):
        sink.write(Report(step=3, values={"x": 3.0}, time=0.0))
    sink.write(Report(step=3, values={"x": 3.0}, time=0.0))
    assert sink.flush(30.0)
    assert sink.close(30.0)
    assert [line["step"] for line in _lines(path)] == [1, 2, 3]


def test_a_checkpoint_during_the_childs_open_waits_for_it_instead_of_killing_it(
    tmp_path: Path,
) -> None:
    """make_durable (a checkpoint, on the training thread) while the child still opens the sink
    gives up after its timeout; the child finishes opening, once, and delivers."""
    path = tmp_path / "m.jsonl"
    sink = ProcessSink(SlowOpenSink(path, seconds=2.0))
    opening = threading.Thread(target=sink.open, args=(RunInfo(name="slow"),))
    opening.start()
    try:
        while not Path(f"{path}.opens").exists():  # the child is inside open
            opening.join(0.05)
        assert sink.make_durable(timeout=0.5) is False
    finally:
        opening.join(60)
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    assert sink.make_durable(timeout=30) is True
    assert sink.close(timeout=30)
    assert len(Path(f"{path}.opens").read_text().split()) == 1  # one child opened it
    assert sink.restarts == 0
    assert [line["step"] for line in _lines(path)] == [1]


def test_a_bug_in_the_childs_sink_is_permanent() -> None:
    # An AttributeError is the sink's own bug: the pipeline must not retry it forever.
    sink = ProcessSink(BuggySink())
    sink.open(RunInfo())
    with pytest.raises(SinkProcessError, match="AttributeError") as caught:
        sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    assert is_permanent(caught.value)
    assert sink.close(30.0)


def _deliver_from_a_daemon(path: str, out: Queue[tuple[str, str | None, bool]]) -> None:
    runner = SinkRunner(ProcessSink(JsonlSink(path)), retry_initial_s=0.05)
    runner.start()
    runner.submit(Report(step=1, values={"x": 1.0}, time=0.0))
    closed = runner.close(5.0)
    out.put((runner.status.state, runner.status.last_error, closed))


def test_a_daemonic_trainer_fails_the_sink_at_once(tmp_path: Path) -> None:
    # A daemonic process can never start the child: retrying until close would only wait.
    context = mp.get_context("spawn")
    out = context.Queue()
    daemon = context.Process(
        target=_deliver_from_a_daemon, args=(str(tmp_path / "m.jsonl"), out), daemon=True
    )
    daemon.start()
    state, error, closed = out.get(timeout=60)
    daemon.join(30)
    assert state == "failed", error
    assert "a daemonic process cannot start the child process" in str(error)
    assert closed is False
    assert not (tmp_path / "m.jsonl").exists()


def test_close_after_the_child_died_still_closes_the_backend_run(tmp_path: Path) -> None:
    # A W&B run that is never finished stays open: a dead child is started again to close it.
    marks = tmp_path / "marks.txt"
    sink = ProcessSink(CloseMarkerSink(marks))
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    assert sink.flush(30.0)
    first = sink._process
    assert first is not None and first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    first.join(30.0)
    assert sink.close(60.0)
    lines = marks.read_text().split()
    assert lines[0::2] == ["open", "open", "close"]
    assert lines[1] != lines[3] == lines[5]  # the second child opened and closed the run
    assert sink.restarts == 1
    assert sink.close(1.0)  # closed already: nothing starts again
    assert marks.read_text().count("close") == 1


@pytest.mark.parametrize("call", ["close", "flush"])
def test_a_dead_childs_restart_keeps_to_the_timeout_of_close_and_flush(
    tmp_path: Path, call: str
) -> None:
    # The restart's open took start_timeout_s (120 s by default) whatever timeout was given.
    sink = ProcessSink(SlowReopenSink(tmp_path / "m.jsonl", seconds=30.0))
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    first = sink._process
    assert first is not None and first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    first.join(30.0)
    # A close or flush given less time than a child takes to start starts none (see the
    # tests below): this one has time for a start, not for the slow reopen.
    assert sink._start_s is not None
    timeout = max(1.0, 2 * sink._start_s)
    started = time.monotonic()
    with pytest.raises(SinkProcessError, match="open took longer than"):
        getattr(sink, call)(timeout)
    assert time.monotonic() - started < timeout + 9.0
    assert not sink._alive()  # the slow child was stopped, not left running
    assert [r.step for r in sink.pending_reports()] == [1]  # still owed to the backend


@pytest.mark.parametrize("timeout", [0.0, 0.2])
def test_a_close_without_time_to_start_a_child_starts_none(
    tmp_path: Path, timeout: float, caplog: pytest.LogCaptureFixture
) -> None:
    # close(0) (a pipeline that gave up) after the child died spawned a child only to kill it
    # before it opened: past its timeout (a whole poll slice, 0.5 s), and a restart counted.
    marks = tmp_path / "marks.txt"
    sink = ProcessSink(CloseMarkerSink(marks))
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    first = sink._process
    assert first is not None and first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    first.join(30.0)
    started = time.monotonic()
    assert sink.close(timeout) is False
    assert time.monotonic() - started < timeout + 2.0  # a child's start takes seconds
    assert sink.restarts == 0
    assert marks.read_text().split()[0::2] == ["open"]  # no second child opened
    assert [r.step for r in sink.pending_reports()] == [1]  # kept for the spool
    assert any("none is started" in r.getMessage() for r in caplog.records)
    assert sink.close(60.0)  # given time, a later close still closes the backend's run
    assert marks.read_text().split()[0::2] == ["open", "open", "close"]


def test_a_runs_close_without_time_to_start_a_child_starts_none_for_its_flush_either(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A pipeline's close flushes before it closes, with the same time left: close started no
    # child, but the flush before it did, only to stop it unopened (a restart counted, "open
    # took longer than 0.0 s").
    from sidestream import Run
    from sidestream.sinks import read_spool

    # A restarted child's open is slow (a cold machine): a start attempted is sure to fail.
    sink = ProcessSink(SlowReopenSink(tmp_path / "m.jsonl", seconds=30.0))
    run = Run([sink], spool_dir=str(tmp_path / "spool"))
    for step in (1, 2, 3):
        run.log(step, {"x": float(step)})
    deadline = time.monotonic() + 60
    while len(sink.pending_reports()) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first = sink._process
    assert first is not None and first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    first.join(30.0)
    # Time for the sink's thread to flush and close, not for a child to start.
    assert sink._start_s is not None
    assert run.close(timeout=sink._start_s / 2) is False
    assert sink.restarts == 0
    assert not any("open took longer" in r.getMessage() for r in caplog.records)
    (spool,) = (tmp_path / "spool").rglob("*.spool.jsonl")
    assert [report.step for report in read_spool(spool)] == [1, 2, 3]  # kept for a replay


def test_a_call_on_a_hung_child_ends_at_its_timeout_not_at_the_next_poll(tmp_path: Path) -> None:
    # The pipe was polled in 0.5 s slices past the deadline: a flush(0.1) took 0.5 s.
    path = tmp_path / "m.jsonl"
    sink = ProcessSink(FlushHangSink(path))
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    Path(f"{path}.hang").touch()
    conn = sink._conn
    assert conn is not None
    waits: list[float] = []
    poll = conn.poll

    def recorded_poll(wait: float = 0.0) -> bool:
        waits.append(wait)
        return poll(wait)

    conn.poll = recorded_poll  # type: ignore[method-assign]
    started = time.monotonic()
    with pytest.raises(SinkProcessError, match=r"took longer than 0\.1 s"):
        sink.flush(0.1)
    # Each poll waits at most what is left (timed with the calls' own clock, not a bound on
    # a loaded machine's wall time): the old slices were 0.5 s whatever the deadline.
    assert waits and max(waits) <= 0.1
    assert time.monotonic() - started < 5.0
    assert not sink._alive()  # stopped; the next call starts another


def test_a_closed_child_leaves_no_temporary_folders() -> None:
    # wandb makes its media and artifact folders at import; a child ended without its
    # interpreter's teardown left both behind after every job.
    sink = ProcessSink(TemporaryFolderSink())
    sink.open(RunInfo())
    folder = sink.state_dict()["folder"]
    assert folder is not None and os.path.isdir(folder)
    assert sink.close(60.0)
    assert not os.path.exists(folder)


def test_a_runner_that_never_started_closes_quietly() -> None:
    runner = SinkRunner(BuggySink())
    assert runner.close(1.0)


def test_a_write_before_open_or_after_close_raises_instead_of_starting_a_child(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.jsonl"
    sink = ProcessSink(JsonlSink(path))
    report = Report(step=1, values={"x": 1.0}, time=0.0)
    with pytest.raises(RuntimeError, match="write: call open"):
        sink.write(report)
    sink.open(RunInfo())
    sink.write(report)
    assert sink.close(timeout=30)
    with pytest.raises(RuntimeError, match="write: the sink is closed"):
        sink.write(Report(step=2, values={"x": 2.0}, time=0.0))
    assert [line["step"] for line in _lines(path)] == [1]  # no second child wrote step 2


def test_a_sink_the_child_cannot_rebuild_fails_for_good_naming_why(tmp_path: Path) -> None:
    # The child raised while unpickling the sink, before it could answer: each retry started
    # another child (importing torch again) and the error showed only as multiprocessing's
    # traceback on stderr, as "the child process died during open".
    runner = SinkRunner(ProcessSink(ChildlessSink(tmp_path / "m.jsonl")), retry_initial_s=0.05)
    runner.start()
    runner.submit(Report(step=1, values={"x": 1.0}, time=0.0))
    assert not runner.close(30.0)
    assert runner.status.state == "failed"
    assert "could not be rebuilt in the child process" in str(runner.status.last_error)
    assert "cannot construct in child" in str(runner.status.last_error)


class _Unrebuildable(JsonlSink):
    def __setstate__(self, state: dict[str, object]) -> None:
        raise RuntimeError("cannot construct")


def test_a_sink_that_cannot_be_rebuilt_from_its_pickle_fails_when_wrapped(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"sink: _Unrebuildable must be picklable, and rebuilt .*cannot construct"
    ):
        ProcessSink(_Unrebuildable(tmp_path / "m.jsonl"))


_TRAINER = """
import sys
from pathlib import Path

from sidestream.sinks import ProcessSink, Report, RunInfo
from tests.collector.child_sinks import GatedMarkerSink


def main() -> None:
    sink = ProcessSink(GatedMarkerSink(Path(sys.argv[1]), gate=sys.argv[2]))
    sink._orphan_close_s = float(sys.argv[3])
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    print("wrote", flush=True)
    sys.stdin.read()  # until the test kills this process


if __name__ == "__main__":
    main()
"""


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie nobody reaped counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_for(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("gate", ["open", "write", "idle", "stuck"])
def test_a_child_whose_trainer_was_killed_closes_its_sink_quietly(
    tmp_path: Path, gate: str
) -> None:
    # A SIGKILLed trainer left a BrokenPipeError traceback (two, chained) from a child that was
    # answering a call; a child stuck in a call never ended.
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    marks = tmp_path / "marks.txt"
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        trainer = subprocess.Popen(
            [sys.executable, str(script), str(marks), "write" if gate == "stuck" else gate, "1.0"],
            cwd=ROOT,
            # The root, then the suite's own path (the GPU machines' src folders).
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))
                ),
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        if gate == "idle":  # the child waits for the next call
            assert trainer.stdout is not None and trainer.stdout.readline() == "wrote\n"
        waited = "write" if gate in ("write", "stuck", "idle") else "open"
        assert _wait_for(lambda: marks.exists() and waited in marks.read_text(), 60), (
            stderr.read_text()
        )
        child = int(marks.read_text().split()[-1])
        trainer.kill()
    finally:
        trainer.kill()
        trainer.wait(30)
    if gate != "stuck":  # the call in progress returns, and its answer finds no reader
        Path(f"{marks}.go").touch()
    # stuck: the watch thread ends the child 1 s (its orphan_close_s) and a grace later.
    assert _wait_for(lambda: _gone(child), 30), marks.read_text()
    lines = [line for line in stderr.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0] and "the training process is gone" in lines[0]
    done = [line.split()[0] for line in marks.read_text().splitlines()]
    if gate == "stuck":
        assert "sink did not close within 1 s" in lines[0]
        assert done == ["open", "write"]
    else:
        # It made durable what it had and ended the run as a killed job's (255), not as a
        # clean finish.
        assert done[-2:] == ["durable", f"close:{KILLED_EXIT_CODE}"], done
        assert "made what it had durable and closed it" in lines[0]


def test_reports_held_for_re_sending_are_capped_and_the_rest_wait_in_the_runner(
    tmp_path: Path,
) -> None:
    # A child whose flushes never finished made the parent hold every report written since,
    # for re-sending, without a cap of its own (5000 of 5000 in a probe with flush_every=16).
    flag = tmp_path / "stalled"
    flag.touch()
    sink = ProcessSink(StalledFlushSink(flag), flush_every=4, max_unflushed=8)
    runner = SinkRunner(sink, capacity=64, retry_initial_s=0.01, retry_max_s=0.05)
    runner.start()
    for step in range(1, 31):
        runner.submit(Report(step=step, values={"x": float(step)}, time=0.0))
    assert _wait_for(lambda: runner.status.state == "retrying", 60), runner.status
    assert "UnconfirmedBacklogError" in str(runner.status.last_error)
    assert "max_unflushed=8" in str(runner.status.last_error)
    time.sleep(0.5)  # retries go on: the cap holds
    assert [r.step for r in sink.pending_reports()] == list(range(1, 9))
    flag.unlink()  # the backend confirms again
    assert runner.close(60.0)
    assert runner.dropped == 0
    assert sink.state_dict()["steps"] == list(range(1, 31))  # each once, in order
    assert sink.pending_reports() == []


def test_max_unflushed_below_flush_every_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_unflushed: expected at least flush_every \(16\)"):
        ProcessSink(BatchSizesSink(), flush_every=16, max_unflushed=8)


def test_close_keeps_to_its_timeout_when_the_child_is_slow_to_exit() -> None:
    # The child answered close in time, then close waited its whole timeout again for the
    # child to exit: 1.6 s of close(timeout=1.0), 9 s of close(timeout=5.0).
    sink = ProcessSink(SlowExitSink(exit_s=60.0))
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    started = time.monotonic()
    # Its sink closed: the slow exit loses nothing. Before, close waited its whole timeout
    # again after the child's answer (60% of it): about 6.4 s of close(4.0). Room for a loaded
    # machine's kill and reap.
    assert sink.close(4.0)
    assert time.monotonic() - started < 4.0 + 1.5
    assert not sink._alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_that_exits_normally_leaves_the_sinks_child_process_alone(
    tmp_path: Path,
) -> None:
    # multiprocessing's exit hook, which a child made by os.fork() runs when it exits normally,
    # sent SIGTERM to every daemonic child it found in the list it inherited: the parent's sink
    # process. The parent restarted it (a warning, the reports since its last flush sent
    # again) and the forked child printed join's "can only join a child process".
    script = tmp_path / "train.py"
    script.write_text(
        f"""
import os, sys, time
from sidestream import MeanMetric, Run
from sidestream.sinks import JsonlSink, ProcessSink

def main():
    sink = ProcessSink(JsonlSink({str(tmp_path / "m.jsonl")!r}))
    run = Run([sink])
    train = run.collector(MeanMetric(), prefix="train").bind("cpu")
    for step in range(1, 11):
        train.metric.update(float(step))
        train.schedule_collection(step)
        if step == 5:
            deadline = time.monotonic() + 60
            while sink._process is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the sink's thread starts the child
            assert sink._process is not None
            pid = os.fork()
            if pid == 0:
                sys.exit(0)  # the at-exit hooks it inherited run
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
    assert run.close(timeout=60)
    print("restarts", sink.restarts)

if __name__ == "__main__":
    main()
"""
    )
    done = run_python(str(script), timeout=180)
    assert done.returncode == 0, done.stderr
    assert "restarts 0" in done.stdout, done.stderr
    assert "can only join a child process" not in done.stderr, done.stderr
    assert [line["step"] for line in _lines(tmp_path / "m.jsonl")] == list(range(1, 11))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_close_does_not_wait_for_a_process_forked_while_the_child_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A DataLoader worker forked by the training thread while the sink's thread started the
    # child holds the write end of the child's sentinel pipe: close waited on that sentinel for
    # the rest of its timeout although the child had ended (a persistent worker outlives it),
    # and the run warned that the sink's close did not finish. The spawn is slowed here so the
    # fork lands in that window every time.
    import multiprocessing.util

    in_window = threading.Event()
    spawn = multiprocessing.util.spawnv_passfds

    def slow_spawn(path: str, args: list[str], passfds: list[int]) -> int:
        if any(b"spawn_main" in os.fsencode(arg) for arg in args):  # not the resource tracker
            in_window.set()
            time.sleep(0.5)
        return spawn(path, args, passfds)

    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", slow_spawn)
    sink = ProcessSink(BatchSizesSink())
    opening = threading.Thread(target=sink.open, args=(RunInfo(),))
    opening.start()
    assert in_window.wait(60)
    pid = os.fork()
    if pid == 0:  # a worker that outlives the sink's child
        time.sleep(30)
        os._exit(0)
    try:
        opening.join(60)
        sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
        started = time.monotonic()
        assert sink.close(10.0)
        assert time.monotonic() - started < 5.0
        assert not sink._alive()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
