"""A checkpoint keeps only what its sinks made durable: an fsync that fails is not a delivery."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest

from sidestream import Run
from sidestream.sinks import JsonlSink

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX fsync")


def _last_steps(state: dict) -> dict[str, int]:
    return {stream: step for stream, step in state["sinks"]["jsonl"]["last_steps"]}


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
    run = Run([JsonlSink(path)])
    for step in range(1, 6):
        run.log(step, {"x": float(step)})
    assert _last_steps(run.state_dict(timeout=10)) == {"": 5}
    for step in range(6, 11):
        run.log(step, {"x": float(step)})
    checkpoint = _checkpoint_with_failing_fsync(run, monkeypatch)
    # Steps 6..10 were written but never made durable: a machine crash may lose them, so the
    # checkpoint must not count them as delivered (the resumed job would never send them).
    assert _last_steps(checkpoint) == {"": 5}
    assert any("make_durable failed" in r.getMessage() for r in caplog.records)
    assert run.close(timeout=10)

    # Resumed from it with the lines still there (a process crash): none is written twice.
    resumed = Run([JsonlSink(path)])
    resumed.load_state_dict(checkpoint)
    for step in range(11, 13):
        resumed.log(step, {"x": float(step)})
    assert resumed.close(timeout=10)
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, 13))


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
