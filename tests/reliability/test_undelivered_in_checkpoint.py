"""A checkpoint holds what the sinks had not delivered, so a job resumed from it loses nothing.

The job's steps up to the checkpoint are not logged again by the resumed job (it continues
after them): reports a tracker had not taken by then (down, failed for good, or sent and not
confirmed) must travel in the checkpoint and be delivered first by the resumed job. Each
test "crashes" the first job (its sinks never deliver the rest and no spool file is left, as
after kill -9), resumes from the checkpoint and reads the backend back by hand.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sidestream import Run
from sidestream.sinks import (
    JsonlSink,
    PermanentSinkError,
    Report,
    RunInfo,
    Sink,
    SinkRunner,
    TrackerSink,
    read_kept_state,
    read_spool,
    replay_spool,
    tracker,
)


def _rows(path: Path) -> list[tuple[str, int, float]]:
    """(stream, step, value) of every line of the JSONL file, read with json alone."""
    rows = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            record = json.loads(line)
            for value in record["values"].values():
                rows.append((record["stream"], record["step"], value))
    return rows


class _Outage:
    """Makes every JsonlSink's send fail (transiently, or for good) while switched on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.error: Exception | None = None
        send = JsonlSink.send

        def failing_send(sink: JsonlSink, reports: Sequence[Report]) -> None:
            if self.error is not None:
                raise self.error
            send(sink, reports)

        monkeypatch.setattr(JsonlSink, "send", failing_send)


@pytest.fixture
def spool_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "spool"
    yield folder
    for leftover in glob.glob(str(folder / "*")):
        os.unlink(leftover)


def _crash(run: Run, spool_dir: Path) -> None:
    """End the first job as kill -9 would: nothing more delivered, no spool file left."""
    run.close(timeout=0.2)
    for leftover in glob.glob(str(spool_dir / "*")):
        os.unlink(leftover)


def _log(run: Run, steps: range) -> None:
    for step in steps:
        run.log(step, {"x": float(step)})


@pytest.mark.parametrize("checkpoint", ["run.state_dict", "dcp"])
@pytest.mark.parametrize("failure", ["down", "failed for good"])
def test_reports_undelivered_at_a_checkpoint_reach_the_backend_after_resume(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    spool_dir: Path,
    checkpoint: str,
    failure: str,
) -> None:
    path, outage = tmp_path / "metrics.jsonl", _Outage(monkeypatch)
    options: dict[str, Any] = {"spool_dir": str(spool_dir), "sink_capacity": 4}
    first = Run([JsonlSink(path, flush_every=1)], **options)
    _log(first, range(1, 11))
    assert first.state_dict(timeout=10)["sinks"]  # 1..10 delivered
    if failure == "down":
        outage.error = ConnectionError("tracker down")
    else:
        outage.error = PermanentSinkError("tracker refused the run")
    _log(first, range(11, 21))  # beyond the in-memory capacity: some are spooled
    if checkpoint == "dcp":
        dcp.save({"run": first}, checkpoint_id=tmp_path / "ckpt")
    else:
        saved = first.state_dict(timeout=0.5)
        assert saved["sinks"]["jsonl"]["last_steps"] == [["", 10]]
    _crash(first, spool_dir)
    outage.error = None

    resumed = Run([JsonlSink(path, flush_every=1)], **options)
    if checkpoint == "dcp":
        dcp.load({"run": resumed}, checkpoint_id=tmp_path / "ckpt")
    else:
        resumed.load_state_dict(saved)
    _log(resumed, range(21, 26))  # the job continues after its checkpoint's step 20
    assert resumed.close(timeout=30)
    assert _rows(path) == [("", step, float(step)) for step in range(1, 26)]


def test_a_failed_sink_keeps_its_reports_for_close_and_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spool_dir: Path
) -> None:
    path, outage = tmp_path / "metrics.jsonl", _Outage(monkeypatch)
    run = Run([JsonlSink(path, flush_every=1)], spool_dir=str(spool_dir), sink_capacity=2)
    outage.error = PermanentSinkError("bad project")
    _log(run, range(1, 6))
    saved = run.state_dict(timeout=0.5)
    lines = saved["undelivered"]["jsonl"].splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert not run.close(timeout=1)
    (kept,) = glob.glob(str(spool_dir / "*.spool.jsonl"))  # left for replay, named in a warning
    with open(kept, encoding="utf-8") as file:
        assert [json.loads(line)["step"] for line in file] == [1, 2, 3, 4, 5]


class _Backend:
    """A tracker's store: rows arrive buffered and are kept only once flushed."""

    def __init__(self) -> None:
        self.kept: list[tuple[str, int]] = []
        self.buffered: list[tuple[str, int]] = []
        self.up = True


class _BufferingSink(TrackerSink):
    """A tracker whose sends are buffered (``durable_on_send`` False) until ``persist``."""

    name = "buffering"
    durable_on_send = False

    def __init__(self, backend: _Backend) -> None:
        super().__init__()
        self._backend = backend
        self.identity = "run-1"

    def open(self, run: RunInfo) -> None:
        del run
        if self._backend.kept:
            last = max(step for _, step in self._backend.kept)
            self.found_in_backend({"": last})

    def send(self, reports: Sequence[Report]) -> None:
        self._backend.buffered += [(r.stream, r.step) for r in reports]

    def persist(self, timeout: float | None) -> bool:
        del timeout
        if not self._backend.up:
            return False
        self._backend.kept += self._backend.buffered
        self._backend.buffered = []
        return True

    def make_durable(self, timeout: float | None = None) -> bool:
        return self.flush(timeout)  # persist, then count what it confirmed


def test_reports_sent_and_not_confirmed_at_a_checkpoint_are_sent_again(
    spool_dir: Path,
) -> None:
    backend = _Backend()
    first = Run([_BufferingSink(backend)], spool_dir=str(spool_dir))
    _log(first, range(1, 6))
    first.state_dict(timeout=10)  # persisted: 1..5 kept
    backend.up = False
    _log(first, range(6, 11))  # sent into the buffer, never confirmed
    saved = first.state_dict(timeout=1.0)
    assert saved["sinks"]["buffering"]["last_steps"] == [["", 5]]
    _crash(first, spool_dir)
    backend.buffered = []  # the tracker's process died with its buffer
    backend.up = True

    resumed = Run([_BufferingSink(backend)], spool_dir=str(spool_dir))
    resumed.load_state_dict(saved)
    _log(resumed, range(11, 13))
    assert resumed.close(timeout=30)
    assert backend.kept == [("", step) for step in range(1, 13)]


class _DownAfter(_BufferingSink):
    """Sends into the tracker's buffer up to step ``last``; the tracker is down after it."""

    def __init__(self, backend: _Backend, last: int) -> None:
        super().__init__(backend)
        self._last = last

    def send(self, reports: Sequence[Report]) -> None:
        if reports[-1].step > self._last:
            raise ConnectionError("tracker down")
        super().send(reports)


def test_close_counts_reports_sent_and_not_confirmed_apart_from_the_undelivered(
    spool_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Steps 1 and 2 reached the tracker's buffer (never confirmed: it does not persist); 3..10
    # never left this process. All ten are kept, but only eight are undelivered.
    backend = _Backend()
    backend.up = False
    runner = SinkRunner(_DownAfter(backend, last=2), spool_dir=str(spool_dir), capacity=4)
    for step in range(1, 11):
        runner.submit(Report(step=step, values={"x": float(step)}, time=0.0))
    runner.start()
    deadline = time.monotonic() + 20.0
    while len(backend.buffered) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        assert runner.close(timeout=1.0) is False
    (warning,) = [r.getMessage() for r in caplog.records if "kept in" in r.getMessage()]
    assert warning.startswith(
        "sink 'buffering': 8 report(s) undelivered (not delivered within 1.0 s), and 2 the "
        "sink took but its backend had not confirmed"
    ), warning
    assert "; 10 kept in " in warning
    (kept,) = glob.glob(str(spool_dir / "*.spool.jsonl"))
    with open(kept, encoding="utf-8") as file:
        assert [json.loads(line)["step"] for line in file] == list(range(1, 11))


def test_a_spool_kept_at_close_replays_into_the_same_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    spool_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The sink's state at close is written beside the kept spool; replay resumes from it."""
    from sidestream.sinks.replay import main as replay

    path, outage = tmp_path / "metrics.jsonl", _Outage(monkeypatch)
    run = Run([JsonlSink(path, flush_every=1)], spool_dir=str(spool_dir))
    _log(run, range(1, 6))
    run.state_dict(timeout=10)
    outage.error = ConnectionError("tracker down")
    _log(run, range(6, 11))
    assert not run.close(timeout=0.5)
    (kept,) = glob.glob(str(spool_dir / "*.spool.jsonl"))
    assert os.stat(kept + ".state.json").st_mode & 0o777 == 0o600  # as private as the spool
    with open(kept + ".state.json", encoding="utf-8") as file:
        beside = json.load(file)
    assert beside["sink"] == "jsonl"
    assert beside["state"]["last_steps"] == [["", 5]] and beside["state"]["path"] == str(path)
    outage.error = None
    assert replay([kept, "--sink", "jsonl", "--option", f"path={path}"]) == 0
    assert "resumed the sink's run from" in capsys.readouterr().out
    assert _rows(path) == [("", step, float(step)) for step in range(1, 11)]
    assert not os.path.exists(kept + ".state.json")  # renamed with its spool
    assert os.path.exists(kept + ".replayed.state.json")


class _KeyedSink(TrackerSink):
    """A tracker that finds its run by a key in its state (MLflow's run key); down: no open."""

    name = "keyed"

    def __init__(self, backend: _Backend) -> None:
        super().__init__()
        self._backend = backend
        self.key = uuid.uuid4().hex
        self.opened: list[tuple[str, RunInfo]] = []

    def open(self, run: RunInfo) -> None:
        if not self._backend.up:
            raise ConnectionError("tracker down")
        self.opened.append((self.key, run))

    def send(self, reports: Sequence[Report]) -> None:
        self._backend.kept += [(r.stream, r.step) for r in reports]

    def extra_state(self) -> dict[str, Any]:
        return {"key": self.key}

    def load_extra_state(self, state_dict: Any) -> None:
        self.key = state_dict.get("key", self.key)


def test_a_spool_kept_by_a_sink_that_never_opened_replays_into_the_jobs_run(
    spool_dir: Path,
) -> None:
    """Down for the whole job: the replay opens the run the job would have (its key, name,
    config and tags), not an anonymous one."""
    backend = _Backend()
    backend.up = False
    sink = _KeyedSink(backend)
    info = RunInfo("job-7", {"lr": 0.1, "dtype": torch.float32}, {"team": "a"})
    run = Run([sink], info=info, spool_dir=str(spool_dir))
    _log(run, range(1, 6))
    assert not run.close(timeout=0.5)
    (kept,) = glob.glob(str(spool_dir / "*.spool.jsonl"))
    backend.up = True
    fresh = _KeyedSink(backend)
    result = replay_spool(kept, fresh)
    assert result.resumed_from == kept + ".state.json" and result.written == 5
    # The config value JSON cannot hold is kept as its str, as trackers log it.
    expected = RunInfo("job-7", {"lr": 0.1, "dtype": "torch.float32"}, {"team": "a"})
    assert fresh.opened == [(sink.key, expected)]
    assert backend.kept == [("", step) for step in range(1, 6)]
    kept_state = read_kept_state(kept)
    assert kept_state is not None and kept_state.sink == "keyed" and kept_state.run == expected


def test_a_run_config_json_cannot_hold_is_kept_as_text(tmp_path: Path) -> None:
    # Tuple keys made json.dumps raise inside SinkRunner.close (default=str covers values only).
    from sidestream.sinks._spool_format import write_kept_state

    spool = str(tmp_path / "a.spool.jsonl")
    info = RunInfo("job", {(1, 2): 3, "dtype": torch.float32, "nested": {4: [float("inf")]}})
    assert write_kept_state(spool, "jsonl", {"not json": torch.zeros(1)}, info) is not None
    kept = read_kept_state(spool)
    assert kept is not None and kept.state is None  # the state was not JSON: left out
    assert kept.run == RunInfo(
        "job", {"(1, 2)": 3, "dtype": "torch.float32", "nested": {"4": ["inf"]}}
    )


def test_a_kept_state_whose_config_is_refused_now_still_resumes_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Kept before RunInfo refused two config entries of one flattened name: the whole kept
    # state was dropped, and the replay opened a new run instead of the job's.
    spool = str(tmp_path / "old.spool.jsonl")
    kept = {
        "sink": "keyed",
        "state": {"key": "job-key", "last_steps": []},
        "run": {"name": "job", "config": {"opt.lr": 0.1, "opt": {"lr": 0.2}}, "tags": {}},
    }
    with open(spool + ".state.json", "w", encoding="utf-8") as file:
        json.dump(kept, file)
    with caplog.at_level("WARNING", logger="sidestream.sinks"):
        state = read_kept_state(spool)
    assert state is not None and state.state == kept["state"]
    assert state.run == RunInfo("job", {}, {})
    assert "the kept run config is left out" in caplog.text and spool in caplog.text


def test_a_backend_that_confirms_nothing_holds_sends_at_the_cap_and_loses_no_report(
    spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # wandb's service stalled (its disk full): past 65,536 unconfirmed reports the oldest were
    # forgotten, neither in the backend nor in the spool, and nothing counted them (4,330 of
    # 70,000 steps lost, "0 report(s) undelivered"). Now the sink sends no more at the cap.
    monkeypatch.setattr(tracker, "_MAX_UNCONFIRMED", 8)
    backend = _Backend()
    backend.up = False  # confirms nothing
    run = Run([_BufferingSink(backend)], spool_dir=str(spool_dir), sink_retry_max_s=0.1)
    _log(run, range(1, 31))
    deadline = time.monotonic() + 10
    while run.sink_status["buffering"].state != "retrying" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run.sink_status["buffering"].state == "retrying"
    assert "has not confirmed 8 reports" in (run.sink_status["buffering"].last_error or "")
    assert len(backend.buffered) == 8  # sent: no more than the cap
    assert run.close(timeout=1.0) is False
    (kept,) = spool_dir.glob("*.spool.jsonl")
    assert [report.step for report in read_spool(kept)] == list(range(1, 31))
    assert run.sink_runners[0].dropped == 0


def test_a_close_that_keeps_reports_says_why_and_leaves_the_status_failed(
    spool_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The warning said "not delivered within 30.0 s" of a close that returned in 4.5 s (the
    # backend confirmed nothing: a full disk), and the status stayed "healthy".
    backend = _Backend()
    backend.up = False  # its close's flush confirms nothing, at once
    run = Run([_BufferingSink(backend)], spool_dir=str(spool_dir))
    _log(run, range(1, 4))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        assert run.close(timeout=30) is False
    assert time.monotonic() - started < 10
    assert "the sink's close ended without its backend confirming them" in caplog.text
    assert "within 30.0 s" not in caplog.text
    status = run.sink_status["buffering"]
    assert status.state == "failed"
    assert status.last_error is not None and "3 report(s) kept in a spool file" in status.last_error


class _SlowStateSink(Sink):
    """Its state (the last step written) takes a while to read on the sink's thread."""

    name = "slowstate"

    def __init__(self) -> None:
        self.last = 0

    def open(self, run: RunInfo) -> None:
        del run

    def write(self, report: Report) -> None:
        self.last = report.step

    def state_dict(self) -> dict[str, Any]:
        last = self.last
        if last and threading.current_thread().name.startswith("sidestream-sink"):
            time.sleep(0.5)  # a state asked of the backend
        return {"last": last}

    def load_state_dict(self, state_dict: Any) -> None:
        del state_dict


def test_a_report_just_written_is_in_the_checkpoint_state_or_its_undelivered() -> None:
    """The runner counted a batch delivered before it read the sink's state: a checkpoint in
    between had the report in neither (state ``last=0``, nothing undelivered)."""
    sink = _SlowStateSink()
    run = Run([sink])
    run.log(1, {"x": 1.0})
    deadline = time.monotonic() + 30
    while sink.last != 1 and time.monotonic() < deadline:  # written: the state read begins
        time.sleep(0.005)
    saved = run.state_dict(timeout=10)
    assert run.close(timeout=10)
    in_state = saved["sinks"]["slowstate"]["last"] == 1
    assert in_state or '"step":1' in saved["undelivered"]["slowstate"], saved
