"""A Run's checkpoint or close whose timeout ran out keeps the logged values the pipe still held."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest

from sidestream import Run, _log_pipe
from sidestream.sinks import JsonlSink, read_jsonl, read_spool
from tests.collector.helpers import NeverCompletedCopy

STEPS = range(1, 201)


@pytest.fixture
def slow_log_pipe(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold the log pipe's thread back until the event is set.

    So the entries of a burst of ``run.log`` calls are still in the pipe when the checkpoint
    or the close runs, as on a loaded machine (the race these tests pin down).
    """
    release = threading.Event()
    work = _log_pipe.LogPipe._work

    def late(self: _log_pipe.LogPipe) -> None:
        release.wait(30)
        work(self)

    monkeypatch.setattr(_log_pipe.LogPipe, "_work", late)
    return release


def test_a_checkpoint_with_no_time_left_holds_the_logged_values(
    tmp_path: Path, slow_log_pipe: threading.Event
) -> None:
    # state_dict(timeout=0) read the sinks' undelivered reports while the values were still
    # in the log pipe: the checkpoint had them in neither the sink's state nor "undelivered".
    run = Run([JsonlSink(tmp_path / "m.jsonl")], spool_dir=tmp_path)
    try:
        for step in STEPS:
            run.log(step, {"x": float(step)})
        state = run.state_dict(timeout=0)
        (sink_state,) = state["sinks"].values()
        last = dict(sink_state["last_steps"]).get("", 0)
        (lines,) = state["undelivered"].values()
        held = {json.loads(line)["step"] for line in lines.splitlines()}
        assert [step for step in STEPS if step > last and step not in held] == []
    finally:
        slow_log_pipe.set()
        run.close(30)


def test_a_close_with_no_time_left_keeps_the_logged_values_in_a_spool_file(
    tmp_path: Path, slow_log_pipe: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    # close(timeout=0) stopped the pipe with the values still in it: they reached neither the
    # sink nor the spool file, and the warning blamed CUDA copies on a CPU-only run.
    run = Run([JsonlSink(tmp_path / "m.jsonl")], spool_dir=tmp_path)
    for step in STEPS:
        run.log(step, {"x": float(step)})
    with caplog.at_level(logging.WARNING):
        assert not run.close(0)
    slow_log_pipe.set()
    path = tmp_path / "m.jsonl"
    delivered = {record["step"] for record in read_jsonl(path)} if path.exists() else set()
    kept = {r.step for path in tmp_path.glob("*.spool.jsonl") for r in read_spool(path)}
    assert [step for step in STEPS if step not in delivered | kept] == []
    assert "CUDA" not in caplog.text


def test_a_checkpoint_that_lacks_values_behind_a_stalled_copy_says_so(
    tmp_path: Path, slow_log_pipe: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    # The hand-over stops at a copy not completed (a later step first would make the sinks
    # skip it): that value and every later one were in neither the sink's state nor
    # "undelivered", and nothing said so; a job resumed from it never logged them.
    import torch

    from sidestream._log_pipe import LogEntry

    run = Run([JsonlSink(tmp_path / "m.jsonl")], spool_dir=tmp_path)
    try:
        run.log(1, {"x": 1.0})
        stalled = LogEntry(step=2, time=0.0, numbers={}, device_names=("y",))
        stalled.host, stalled.done = torch.zeros(1, dtype=torch.float64), NeverCompletedCopy()  # type: ignore[assignment]
        assert run._log_pipe is not None
        run._log_pipe.put(stalled)
        run.log(3, {"x": 3.0})
        with caplog.at_level(logging.WARNING, logger="sidestream.run"):
            state = run.state_dict(timeout=0)
        (lines,) = state["undelivered"].values()
        assert {json.loads(line)["step"] for line in lines.splitlines()} <= {1}
        assert "state_dict: 2 Run.log call(s) still waited for a CUDA copy" in caplog.text
        assert "this checkpoint lacks their values" in caplog.text
    finally:
        assert run._log_pipe is not None
        for entry in run._log_pipe._entries:
            entry.done = None  # let the close end
        slow_log_pipe.set()
        run.close(30)
