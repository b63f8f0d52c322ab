"""A checkpoint keeps only what its sinks made durable: an fsync that fails is not a delivery."""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from sidestream import Run
from sidestream.sinks import JsonlSink, ProcessSink, Report, RunInfo, TrackerSink
from tests.collector.child_sinks import SlowDurableSink

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX fsync")


def _last_steps(state: dict) -> dict[str, int]:
    return {stream: step for stream, step in state["sinks"]["jsonl"]["last_steps"]}


def _run_past_a_durable_checkpoint(path: Path) -> Run:
    """A run that logged steps 1..5, checkpointed them durably, then logged 6..10."""
    run = Run([JsonlSink(path)])
    for step in range(1, 6):
        run.log(step, {"x": float(step)})
    assert _last_steps(run.state_dict(timeout=10)) == {"": 5}
    for step in range(6, 11):
        run.log(step, {"x": float(step)})
    return run


def _steps_in(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _checkpoint_with_failing_fsync(run: Run, monkeypatch: pytest.MonkeyPatch) -> dict:
    """``run.state_dict()`` while every ``os.fsync`` fails as a disk's write-back error does."""

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", failing_fsync)
        return run.state_dict(timeout=10)


def test_failed_fsync_keeps_the_last_durable_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "m.jsonl"
    run = _run_past_a_durable_checkpoint(path)
    checkpoint = _checkpoint_with_failing_fsync(run, monkeypatch)
    # Steps 6..10 were written but never made durable: a machine crash may lose them, so the
    # checkpoint must not count them as delivered (the resumed job would never send them).
    assert _last_steps(checkpoint) == {"": 5}
    assert any("make_durable or state_dict failed" in r.getMessage() for r in caplog.records)
    assert run.close(timeout=10)

    # Resumed from it with the lines still there (a process crash): none is written twice.
    resumed = Run([JsonlSink(path)])
    resumed.load_state_dict(checkpoint)
    for step in range(11, 13):
        resumed.log(step, {"x": float(step)})
    assert resumed.close(timeout=10)
    assert _steps_in(path) == list(range(1, 13))


def test_failed_fsync_before_any_durable_checkpoint_keeps_the_starting_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.jsonl"
    run = Run([JsonlSink(path)])
    for step in range(1, 4):
        run.log(step, {"x": float(step)})
    checkpoint = _checkpoint_with_failing_fsync(run, monkeypatch)
    assert _last_steps(checkpoint) == {}
    assert checkpoint["sinks"]["jsonl"]["offset"] == 0
    assert run.close(timeout=10)


def test_fsync_that_does_not_finish_in_time_keeps_the_last_durable_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # make_durable returning False (the fsync still running when the checkpoint's time ran
    # out: a hung disk, an NFS server gone) leaves steps 6..10 as unsafe as an fsync that
    # raised. The checkpoint kept the newest state, counting them as delivered, and warned
    # that it "holds the rest", which it did not: a machine crash then lost them for good.
    import threading

    path = tmp_path / "m.jsonl"
    run = _run_past_a_durable_checkpoint(path)
    disk = threading.Event()
    real_fsync = os.fsync

    def hung_fsync(fd: int) -> None:
        disk.wait(10)  # the disk answers only after the checkpoint gave up
        real_fsync(fd)

    try:
        with monkeypatch.context() as patch:
            patch.setattr(os, "fsync", hung_fsync)
            checkpoint = run.state_dict(timeout=0.2)
    finally:
        disk.set()
    assert _last_steps(checkpoint) == {"": 5}
    assert checkpoint["undelivered"]["jsonl"] == ""  # steps 6..10 were sent: not carried
    assert any("make_durable failed or did not finish" in r.getMessage() for r in caplog.records)
    assert run.close(timeout=10)

    resumed = Run([JsonlSink(path)])
    resumed.load_state_dict(checkpoint)
    resumed.log(11, {"x": 11.0})
    assert resumed.close(timeout=10)
    assert _steps_in(path) == list(range(1, 12))


def test_failed_fsync_in_a_child_process_keeps_the_last_durable_state(tmp_path: Path) -> None:
    # The same EIO in a ProcessSink's child: ProcessSink.make_durable says False (the child's
    # error), and the checkpoint kept the runner's newest state, steps 4..6 counted as
    # delivered (and a warning that the checkpoint "holds the rest", which it did not).
    from sidestream.sinks import ProcessSink
    from tests.collector.child_sinks import EioOnSecondSyncJsonlSink

    run = Run([ProcessSink(EioOnSecondSyncJsonlSink(tmp_path / "m.jsonl"))])
    try:
        for step in (1, 2, 3):
            run.log(step, {"x": float(step)})
        assert _last_steps(run.state_dict(timeout=30)) == {"": 3}
        for step in (4, 5, 6):
            run.log(step, {"x": float(step)})
        assert _last_steps(run.state_dict(timeout=30)) == {"": 3}
    finally:
        run.close(timeout=30)


class _DeliversDuringFsync(JsonlSink):
    """A JSONL sink whose checkpoint fsync is followed by a delivery on the sink's thread.

    Records how many bytes of the file the fsync covered. ``during`` (set by the test) runs on
    the checkpoint's thread once the fsync is done, before ``make_durable`` returns: there
    the sink's thread delivers a report logged meanwhile (another thread's ``run.log``, a
    window that finished late), as it may at any time.
    """

    synced = 0
    during = None

    def _sync_file(self) -> None:
        super()._sync_file()
        if self._file is not None:
            self.synced = os.fstat(self._file.fileno()).st_size

    def make_durable(self, timeout: float | None = None) -> bool:
        durable = super().make_durable(timeout)
        if self.during is not None:
            self.during()
        return durable


def test_a_report_delivered_after_the_fsync_is_not_counted_as_durable(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = _DeliversDuringFsync(path)
    run = Run([sink])
    for step in range(1, 4):
        run.log(step, {"x": float(step)})
    (runner,) = run.sink_runners

    def deliver_step_4() -> None:
        sink.during = None
        run.log(4, {"x": 4.0})  # handed to the runner by the run's log thread
        deadline = time.monotonic() + 10
        while runner.delivered < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.delivered == 4

    sink.during = deliver_step_4
    checkpoint = run.state_dict(timeout=10)
    state = checkpoint["sinks"]["jsonl"]
    # Step 4 reached the file after the fsync: a machine crash may lose it, so the
    # checkpoint must neither count it nor point past it (the resumed job would skip it).
    assert _last_steps(checkpoint) == {"": 3}
    assert state["offset"] <= sink.synced
    assert run.close(timeout=10)

    # Resumed with the line still there (a process crash): it is found, not written twice.
    resumed = Run([JsonlSink(path)])
    resumed.load_state_dict(checkpoint)
    resumed.log(5, {"x": 5.0})
    assert resumed.close(timeout=10)
    assert _steps_in(path) == [1, 2, 3, 4, 5]


def test_a_later_fsync_that_succeeds_does_not_count_lines_an_earlier_one_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linux reports a write-back error to fsync once per file descriptor and drops the pages
    # it could not write: the next fsync succeeds with steps 6..10 gone. The checkpoint after
    # it counted them as durable (and 11..12), so a resumed job never sent them again.
    path = tmp_path / "m.jsonl"
    run = _run_past_a_durable_checkpoint(path)
    real_fsync = os.fsync
    failed: list[int] = []

    def eio_once(fd: int) -> None:
        if not failed:
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", eio_once)
        assert _last_steps(run.state_dict(timeout=10)) == {"": 5}
        for step in range(11, 13):
            run.log(step, {"x": float(step)})
        assert _last_steps(run.state_dict(timeout=10)) == {"": 5}
    assert failed
    assert run.close(timeout=10)


class _HangingMakeDurable(TrackerSink):
    """A sink of one's own whose ``make_durable`` ignores its timeout (a client call hangs)."""

    name = "hangs"
    identity_key = "run_id"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.calls = 0

    @property
    def identity(self) -> str | None:
        return "run-1"

    def open(self, run: RunInfo) -> None:
        pass

    def send(self, reports: Sequence[Report]) -> None:
        pass

    def make_durable(self, timeout: float | None = None) -> bool:
        self.calls += 1
        self.release.wait(60)  # its timeout ignored
        return True


def test_a_make_durable_that_ignores_its_timeout_does_not_hold_the_checkpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = _HangingMakeDurable()
    run = Run([sink])
    try:
        for step in range(1, 4):
            run.log(step, {"x": float(step)})
        began = time.monotonic()
        checkpoint = run.state_dict(timeout=0.5)
        # The time left and the grace (2 s), not the sink's hang of 60 s.
        assert time.monotonic() - began < 10
        # Sent, but not made durable: not counted as delivered.
        assert checkpoint["sinks"]["hangs"]["last_steps"] == []
        assert any("make_durable did not return" in r.getMessage() for r in caplog.records)
        # The hung call still runs: a second checkpoint starts no other beside it.
        began = time.monotonic()
        run.state_dict(timeout=0.5)
        assert time.monotonic() - began < 2
        assert sink.calls == 1
    finally:
        sink.release.set()
    assert run.close(timeout=10)


def test_a_checkpoint_with_no_timeout_starts_no_make_durable_beside_a_hung_one() -> None:
    # timeout=None skipped the check for a make_durable still running: a second call started
    # beside the hung one, and the checkpoint waited on it.
    sink = _HangingMakeDurable()
    run = Run([sink])
    try:
        run.log(1, {"x": 1.0})
        run.state_dict(timeout=0.5)  # stops waiting; the call still runs
        began = time.monotonic()
        checkpoint = run.state_dict(timeout=None)
        assert time.monotonic() - began < 2
        assert sink.calls == 1
        assert checkpoint["sinks"]["hangs"]["last_steps"] == []  # not durable
    finally:
        sink.release.set()
    assert run.close(timeout=10)


def test_a_process_sinks_make_durable_that_waited_for_a_write_is_not_cut_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A ProcessSink's make_durable waits its timeout for the pipe (a write under way) and as
    # long again for the child: a healthy one cut off at the timeout and 2 s counted as not
    # durable, with an error, and the checkpoint kept the older state.
    sink = ProcessSink(SlowDurableSink(tmp_path / "m.jsonl", seconds=4.0))
    run = Run([sink])
    try:
        run.log(1, {"x": 1.0})
        run.state_dict(timeout=60)  # opened, step 1 durable
        run.log(2, {"x": 2.0})
        deadline = time.monotonic() + 60
        while sink.state_dict().get("last_steps") != [["", 2]]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        held = threading.Event()

        def writing() -> None:  # the sink's thread in a write as the checkpoint begins
            with sink._pipe_lock:
                held.set()
                time.sleep(5.0)

        writer = threading.Thread(target=writing)
        writer.start()
        held.wait()
        # 5 s for the pipe and 4 s in the child: within 6 s each, 9 s in all (past 6 + 2 s).
        checkpoint = run.state_dict(timeout=6.0)
        writer.join()
        assert checkpoint["sinks"]["jsonl"]["last_steps"] == [["", 2]]
        assert not any("make_durable did not return" in r.getMessage() for r in caplog.records)
    finally:
        assert run.close(timeout=30)


def test_a_checkpoint_after_a_ctrl_c_in_the_wait_starts_no_second_make_durable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The hung call was recorded only once the wait ran out: a Ctrl-C inside the wait left it
    # unrecorded, and a checkpoint in the handler started a second one beside it. The Ctrl-C
    # is raised by the wait itself (a real SIGINT is ignored in pytest-xdist's workers).
    from sidestream import _delivery

    call_within = _delivery.call_within

    def interrupted(action: Any, timeout: float | None, name: str) -> Any:
        started = threading.Thread(target=action, daemon=True)
        started.start()
        raise KeyboardInterrupt

    sink = _HangingMakeDurable()
    run = Run([sink])
    try:
        run.log(1, {"x": 1.0})
        monkeypatch.setattr(_delivery, "call_within", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run.state_dict(timeout=30)
        monkeypatch.setattr(_delivery, "call_within", call_within)
        run.state_dict(timeout=0.5)
        deadline = time.monotonic() + 10
        while sink.calls < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the interrupted call's thread has begun
        assert sink.calls == 1  # none beside the one still running
    finally:
        sink.release.set()
    assert run.close(timeout=10)
