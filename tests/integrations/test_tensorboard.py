from __future__ import annotations

import errno
import html
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidestream.sinks import PermanentSinkError, Report, RunInfo
from sidestream.testing import RankPool
from tests.integrations._workload import (
    HISTOGRAM_EDGES,
    expected,
    resume_with_names_like_streams,
    train,
)

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

from sidestream_tensorboard import TensorBoardSink

STEPS = 200


def _config(log_dir: Path | None) -> dict[str, Any]:
    options: dict[str, Any] = {"histogram_edges": HISTOGRAM_EDGES}
    if log_dir is not None:
        options["log_dir"] = str(log_dir)
    return {"tensorboard": options}


class _ByStep:
    """An ``EventAccumulator``'s events in step order (a repeated step stays repeated).

    TensorBoard reads a directory's event files in name order, and two files made in the same
    second sort by a per-process counter compared as text ("...10" before "...9"), so a
    resumed run's file can come first.
    """

    def __init__(self, accumulator: Any) -> None:
        self._accumulator = accumulator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accumulator, name)

    def Scalars(self, tag: str) -> list[Any]:  # EventAccumulator's names
        return sorted(self._accumulator.Scalars(tag), key=lambda event: event.step)

    def Histograms(self, tag: str) -> list[Any]:
        return sorted(self._accumulator.Histograms(tag), key=lambda event: event.step)


def _load(log_dir: Path) -> Any:
    # No sampling, and no purging on restarts: a repeated step would show up as a duplicate.
    guidance = dict.fromkeys(event_accumulator.DEFAULT_SIZE_GUIDANCE, 0)
    accumulator = event_accumulator.EventAccumulator(
        str(log_dir), size_guidance=guidance, purge_orphaned_data=False
    )
    return _ByStep(accumulator.Reload())


def _check(accumulator: Any, steps: range) -> None:
    names = list(expected(0)[0])
    assert sorted(accumulator.Tags()["scalars"]) == sorted(names)
    for name in names:
        events = accumulator.Scalars(name)
        assert [e.step for e in events] == list(steps), name
        for event in events:
            # TensorBoard stores scalars as float32.
            want = np.float32(expected(event.step)[0][name])
            assert np.float32(event.value) == want, f"{name}@{event.step}"
    histograms = accumulator.Histograms("scores")
    assert [h.step for h in histograms] == list(steps)
    edges = HISTOGRAM_EDGES["scores"]
    for event in histograms:
        counts = expected(event.step)[1]
        value = event.histogram_value
        np.testing.assert_array_equal(value.bucket, counts)
        np.testing.assert_allclose(value.bucket_limit, edges[1:])
        assert value.num == counts.sum()


def test_two_ranks_every_window_once(tmp_path: Path, pool2: RankPool) -> None:
    log_dir = tmp_path / "tb"
    results = pool2.run(train, _config(log_dir), range(STEPS), timeout=240)
    assert [r["sink_threads"] for r in results] == [1, 0]
    assert [r["closed"] for r in results] == [True, True]
    assert results[0]["delivered"] == [STEPS]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # rank 1 wrote nothing
    # Rank 1 delivers nothing; its sink's earlier_files is read whenever it is asked.
    (rank_1_state,) = results[1]["sink_states"]
    assert {k: rank_1_state[k] for k in ("log_dir", "last_steps")} == {
        "log_dir": str(log_dir),
        "last_steps": [],
    }
    accumulator = _load(log_dir)
    _check(accumulator, range(STEPS))
    content = accumulator.PluginTagToContent("hparams")
    start = hparams_metadata.parse_session_start_info_plugin_data(
        content["_hparams_/session_start_info"]
    )
    assert start.hparams["optimizer.lr"].number_value == 3e-4
    assert start.hparams["optimizer.betas"].string_value == "[0.9, 0.95]"
    assert results[0]["sink_states"] == [
        {
            "log_dir": str(log_dir),
            "last_steps": [["", STEPS - 1]],
            "earlier_files": [],
            "skipped_values": [],
        }
    ]


def test_from_a_child_process(tmp_path: Path, pool2: RankPool) -> None:
    """``child_process: true`` runs the writer in a child of rank 0; the files are the same."""
    log_dir = tmp_path / "tb"
    config = _config(log_dir)
    config["tensorboard"]["child_process"] = True
    results = pool2.run(train, config, range(50), timeout=240)
    assert results[0]["delivered"] == [50]
    assert [r["closed"] for r in results] == [True, True]
    assert results[0]["sink_states"] == [
        {
            "log_dir": str(log_dir),
            "last_steps": [["", 49]],
            "earlier_files": [],
            "skipped_values": [],
        }
    ]
    _check(_load(log_dir), range(50))


def test_resume_from_collector_checkpoint_appends_to_the_same_directory(
    tmp_path: Path, pool2: RankPool
) -> None:
    log_dir = tmp_path / "tb"
    # Stop after step 100's update with a checkpoint; step 100 is not logged yet.
    first = pool2.run(train, _config(log_dir), range(101), checkpoint_at=100, timeout=240)
    checkpoint = first[0]["checkpoint"]
    assert checkpoint["sinks"]["tensorboard"] == {
        "log_dir": str(log_dir),
        "last_steps": [["", 99]],
        "earlier_files": [],
        "skipped_values": [],
    }
    # The restarted job names no directory: the checkpoint's is used.
    second = pool2.run(train, _config(None), range(100, STEPS), checkpoint, timeout=240)
    assert [r["closed"] for r in first + second] == [True] * 4
    assert second[0]["sink_states"] == [
        {
            "log_dir": str(log_dir),
            "last_steps": [["", STEPS - 1]],
            "earlier_files": [],
            "skipped_values": [],
        }
    ]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2
    _check(_load(log_dir), range(STEPS))


def test_a_checkpoint_taken_before_the_default_directory_opened_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With no log_dir the directory was known only once SummaryWriter made it: a checkpoint
    # taken while it could not open named none, and the resumed job wrote every step again
    # into a second directory.
    monkeypatch.chdir(tmp_path)
    first = TensorBoardSink()
    checkpoint = first.state_dict()
    log_dir = Path(checkpoint["log_dir"])
    assert log_dir.is_absolute() and log_dir.parent == tmp_path / "runs"
    first.open(RunInfo())
    for step in range(5):
        first.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
    assert first.close(30.0)
    monkeypatch.chdir(tmp_path / "runs")  # restarted from elsewhere: the path still holds
    resumed = TensorBoardSink()
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo())
    for step in range(8):  # the job repeats steps 0 to 4 from its checkpoint
        resumed.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
    assert resumed.close(30.0)
    assert [path.name for path in (tmp_path / "runs").iterdir()] == [log_dir.name]
    events = _load(log_dir).Scalars("loss")
    assert [(e.step, e.value) for e in events] == [(step, float(step)) for step in range(8)]


def test_retry_after_failure_midway_writes_each_value_once(tmp_path: Path) -> None:
    sink = TensorBoardSink(log_dir=tmp_path)
    sink.open(RunInfo())
    writer = sink._writer
    original = writer.add_scalar
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return original(*args, **kwargs)

    writer.add_scalar = flaky
    report = Report(step=7, values={"a": 1.0, "b": 2.0, "c": 3.0}, time=time.time())
    with pytest.raises(OSError):
        sink.write(report)
    sink.write(report)
    assert sink.close(timeout=30)
    accumulator = _load(tmp_path)
    got = {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in "abc"}
    assert got == {"a": [(7, 1.0)], "b": [(7, 2.0)], "c": [(7, 3.0)]}


def test_resume_skips_steps_delivered_after_the_checkpoint(tmp_path: Path) -> None:
    first = TensorBoardSink(log_dir=tmp_path)
    first.open(RunInfo(name="late", config={"lr": 0.1}, tags={"a": "b"}))
    for step in range(7):
        first.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
        if step == 3:
            checkpoint = first.state_dict()  # the job goes on delivering after this
    assert first.close(timeout=30)
    resumed = TensorBoardSink()
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo(name="late"))
    for step in range(4, 9):  # windows recomputed from the checkpoint
        resumed.write(Report(step=step, values={"loss": 100.0 + step}, time=time.time()))
    assert resumed.close(timeout=30)
    got = [(e.step, e.value) for e in _load(tmp_path).Scalars("loss")]
    assert got == [(s, float(s)) for s in range(7)] + [(7, 107.0), (8, 108.0)]


def test_resume_skips_each_value_delivered_after_the_checkpoint_whatever_its_name(
    tmp_path: Path,
) -> None:
    resume_with_names_like_streams(TensorBoardSink(log_dir=tmp_path), TensorBoardSink())
    accumulator = _load(tmp_path)
    steps = {
        tag: [e.step for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }
    assert steps == {
        "lr": list(range(1, 11)),
        "train/grad_norm": list(range(1, 11)),
        "train": [2, 4, 6, 8, 10],
        "val@ema/loss": [3, 6, 9],
    }


def test_a_relative_log_dir_resumes_in_the_same_directory_from_another_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first = TensorBoardSink(log_dir="runs/job")
    first.open(RunInfo())
    for step in range(1, 6):
        first.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
        if step == 3:
            assert first.flush(30)
            checkpoint = first.state_dict()
    assert first.close(timeout=30)
    monkeypatch.chdir(tmp_path / "b")  # the requeued job starts elsewhere
    resumed = TensorBoardSink()
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo())
    for step in range(4, 8):
        resumed.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
    assert resumed.close(timeout=30)
    assert not (tmp_path / "b" / "runs").exists()
    events = _load(tmp_path / "a" / "runs" / "job").Scalars("loss")
    assert [e.step for e in events] == list(range(1, 8))


def test_a_given_log_dir_other_than_the_checkpoints_is_written_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same relative log_dir given again from another working directory split the job's
    TensorBoard run in two without a word (JSONL warns in that case)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first = TensorBoardSink(log_dir="runs/job")
    first.open(RunInfo())
    first.write(Report(step=1, values={"loss": 1.0}, time=time.time()))
    assert first.flush(30)
    checkpoint = first.state_dict()
    assert first.close(timeout=30)
    monkeypatch.chdir(tmp_path / "b")
    resumed = TensorBoardSink(log_dir="runs/job")  # the config given again: a given one wins
    resumed.load_state_dict(checkpoint)
    with caplog.at_level("WARNING", logger="sidestream"):
        resumed.open(RunInfo())
    assert resumed.close(timeout=30)
    warned = [r.getMessage() for r in caplog.records if "checkpoint's run is in" in r.getMessage()]
    assert len(warned) == 1 and str(tmp_path / "a" / "runs" / "job") in warned[0]
    assert str(tmp_path / "b" / "runs" / "job") in warned[0]
    caplog.clear()
    (tmp_path / "link").symlink_to(tmp_path / "a")
    for log_dir in (tmp_path / "a" / "runs" / "job", tmp_path / "link" / "runs" / "job"):
        same = TensorBoardSink(log_dir=log_dir)  # the same directory: no warning
        same.load_state_dict(checkpoint)
        with caplog.at_level("WARNING", logger="sidestream"):
            same.open(RunInfo())
        assert same.close(timeout=30)
        assert not [r for r in caplog.records if "checkpoint's run is in" in r.getMessage()]


def test_a_resume_after_the_checkpoints_step_does_not_warn_of_a_restarted_counter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint's undelivered reports are read before the sinks' states, so rows sent in
    between are in both: re-sent first by the resumed job, they were taken for a step counter
    that went back past the checkpoint (a warning on every ordinary resume)."""
    import torch

    from sidestream import Run, SumMetric

    def job(steps: range, checkpoint: dict[str, Any] | None) -> dict[str, Any]:
        run = Run([TensorBoardSink(log_dir=tmp_path)])
        if checkpoint is not None:
            run.load_state_dict(checkpoint)
        train = run.collector(SumMetric(), prefix="train").bind("cpu")
        for step in steps:
            train.metric.update(torch.tensor([float(step)]))
            train.schedule_collection(step)
            run.log(step, {"lr": 0.1})
        saved = run.state_dict()
        assert run.close(timeout=30)
        return saved

    checkpoint = job(range(1, 6), None)
    below = [line for line in checkpoint["undelivered"]["tensorboard"].splitlines()]
    assert below, "the checkpoint holds no undelivered rows: the case is not exercised"
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        job(range(6, 9), checkpoint)
    assert not [r for r in caplog.records if "at or below" in r.getMessage()]
    # An older state's one last_step for every stream is the saved step of each.
    older = dict(checkpoint, sinks=dict(checkpoint["sinks"]))
    state = older["sinks"]["tensorboard"]
    older["sinks"]["tensorboard"] = {"log_dir": state["log_dir"], "last_step": 5}
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        job(range(6, 10), older)
    assert not [r for r in caplog.records if "at or below" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        job(range(1, 4), checkpoint)  # a step counter that started again: said per stream
    warned = sorted(r.getMessage() for r in caplog.records if "at or below" in r.getMessage())
    assert len(warned) == 2 and "stream 'train' step 1" in warned[0], warned
    assert "the unnamed stream" in warned[1]
    assert [e.step for e in _load(tmp_path).Scalars("train")] == list(range(1, 10))


def test_purge_step_is_refused_since_tensorboard_would_hide_kept_steps(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="purge_step is not supported"):
        TensorBoardSink(log_dir=tmp_path, purge_step=6)
    assert TensorBoardSink(log_dir=tmp_path, purge_step=None).log_dir == str(tmp_path)  # default
    # Nor is it listed among the valid options a typo's error names.
    with pytest.raises(TypeError, match="did you mean 'flush_secs'") as typo:
        TensorBoardSink(log_dir=tmp_path, flush_sec=5)
    assert "max_queue" in str(typo.value) and "purge_step" not in str(typo.value)
    # A URL goes to TensorBoard's file layer as it is, not under the working directory.
    assert TensorBoardSink(log_dir="s3://bucket/runs/a").log_dir == "s3://bucket/runs/a"


def test_a_new_run_in_a_directory_with_event_files_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job started again without its checkpoint writes its steps next to the earlier run's:
    TensorBoard would show both in one chart. Warned, as the JSONL sink warns; not on resume."""
    import logging

    caplog.set_level(logging.WARNING, logger="sidestream.sinks")
    first = TensorBoardSink(tmp_path)
    first.open(RunInfo())
    first.write(Report(step=1, values={"loss": 1.0}, time=time.time()))
    assert first.close()
    assert "earlier run" not in caplog.text
    resumed = TensorBoardSink(tmp_path)
    resumed.load_state_dict(first.state_dict())
    resumed.open(RunInfo())
    assert resumed.close()
    assert "earlier run" not in caplog.text
    again = TensorBoardSink(tmp_path)
    again.open(RunInfo())
    assert again.close()
    # The resumed run's file holds no event (it wrote none): only the first one counts.
    assert f"TensorBoardSink: {tmp_path} already holds 1 event file(s) of an earlier run" in (
        caplog.text
    )


def _has_data(path: Path) -> bool:
    """Whether tensorboard's own reader finds an event other than the file version."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return any(
        event.WhichOneof("what") != "file_version" for event in EventFileLoader(str(path)).Load()
    )


def test_a_full_disk_error_names_the_log_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The event writer's ENOSPC names no file: the pipeline's warning said "OSError: [Errno 28]
    # No space left on device" and nothing of which of the job's disks was full.
    from tensorboard.compat.tensorflow_stub.io import gfile

    def full_disk_write(self: Any, filename: str, content: bytes, mode: str) -> None:
        open(filename, mode).close()  # as a full disk does: made, its write fails
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the writer thread's
    log_dir = tmp_path / "tb"
    sink = TensorBoardSink(log_dir, flush_secs=1)
    sink.open(RunInfo())
    monkeypatch.setattr(gfile.LocalFileSystem, "_write", full_disk_write)
    deadline = time.monotonic() + 10
    step = 0
    with pytest.raises(OSError) as raised:  # its thread's error, raised by a later write
        while time.monotonic() < deadline:
            step += 1
            sink.write(Report(step=step, values={"x": 1.0}, time=0.0))
            time.sleep(0.05)
    assert raised.value.errno == errno.ENOSPC
    assert str(log_dir) in str(raised.value)
    monkeypatch.undo()


def test_a_full_disk_that_frees_again_loses_and_repeats_no_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard's event writer stops for good at its first write error; the sink makes a
    new one when it retries, with the steps the old one had not written."""
    import errno

    from tensorboard.compat.tensorflow_stub.io import gfile

    from sidestream import Run

    disk_full = False
    write = gfile.LocalFileSystem._write

    def full_disk_write(self: Any, filename: str, content: bytes, mode: str) -> None:
        if disk_full:  # as a full disk does: the file is opened (made), its write fails
            open(filename, mode).close()
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, filename, content, mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", full_disk_write)
    # TensorBoard's writer thread re-raises its error: a traceback per writer went to stderr.
    uncaught: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: uncaught.append(args.thread.name))
    log_dir = tmp_path / "tb"
    run = Run(
        [TensorBoardSink(log_dir, flush_secs=1)],
        spool_dir=str(tmp_path / "spool"),
        sink_retry_max_s=0.2,
    )
    for step in range(1, 31):
        if step == 11:
            assert run.state_dict(timeout=10)["sinks"]["tensorboard"]["last_steps"]
            disk_full = True
        if step == 21:
            deadline = time.monotonic() + 10
            while run.sink_status["tensorboard"].last_error is None:  # a flush failed
                assert time.monotonic() < deadline, "the full disk was never noticed"
                time.sleep(0.05)
            disk_full = False
        run.log(step, {"x": float(step)})
        if disk_full:
            time.sleep(0.15)  # retries while the disk is full, each with a new writer
    assert run.close(timeout=30)
    events = _load(log_dir).Scalars("x")
    assert [(e.step, e.value) for e in events] == [(s, float(s)) for s in range(1, 31)]
    # Each retry's writer made an event file the full disk kept empty: none is left behind.
    files = sorted(log_dir.glob("*tfevents*"))
    assert files and all(_has_data(path) for path in files), [p.stat().st_size for p in files]
    assert uncaught == []


def test_a_checkpoint_flush_failing_while_the_sink_writes_does_not_break_the_sink(
    tmp_path: Path,
) -> None:
    """The writer is dropped only between writes: a write in progress keeps its writer."""
    import threading

    from sidestream.sinks.status import is_permanent

    sink = TensorBoardSink(log_dir=tmp_path)
    sink.open(RunInfo())
    real, writing = sink._writer, threading.Event()

    class FullDiskWriter:
        def add_scalar(self, *args: Any, **kwargs: Any) -> None:
            writing.set()
            time.sleep(0.05)

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    sink._writer = FullDiskWriter()
    errors: list[Exception] = []

    def write() -> None:
        try:
            sink.write(Report(step=1, values={f"v{i}": 1.0 for i in range(10)}, time=0.0))
        except Exception as error:
            errors.append(error)

    thread = threading.Thread(target=write)
    thread.start()
    writing.wait()
    assert not sink.flush(timeout=5)  # the checkpoint's flush, on another thread
    thread.join()
    real.close()
    assert not [error for error in errors if is_permanent(error)], errors


def test_replay_counts_tags_the_event_files_hold_at_their_steps_as_had(tmp_path: Path) -> None:
    """Reports the event files hold at their very steps (written after the state was taken)
    are counted as had; a step missing below a tag's largest one is counted as held."""
    from sidestream.sinks import replay_spool
    from sidestream.sinks._spool_format import encode_report

    def report(step: int) -> Report:
        return Report(step=step, values={"loss": float(step)}, time=0.0, stream="train")

    sink = TensorBoardSink(tmp_path / "tb")
    sink.open(RunInfo())
    sink.write(report(1))
    state = sink.state_dict()
    for step in (2, 3, 5):  # step 4 never reached the files
        sink.write(report(step))
    assert sink.close(timeout=30)
    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(b"".join(encode_report(report(step)) for step in (2, 3, 4, 5)))
    result = replay_spool(spool, TensorBoardSink(tmp_path / "tb"), resume_state=state)
    # 2 and 3 are there below the largest step 5, and 5 itself; 4 is not: held.
    assert (result.written, result.skipped, result.held) == (0, 3, 1)


def _steps_of(log_dir: Path, tag: str) -> list[int]:
    return [event.step for event in _load(log_dir).Scalars(tag)]


def test_a_new_run_in_a_used_directory_keeps_its_steps_when_its_writer_is_replaced(
    tmp_path: Path,
) -> None:
    # The new run's replaced writer (a disk error, a restarted child) read the earlier run's
    # steps as its own: its steps up to 40 counted as held, were dropped and counted delivered.
    earlier = TensorBoardSink(tmp_path)
    earlier.open(RunInfo())
    for step in range(1, 41):
        earlier.write(Report(step=step, values={"loss": 1.0}, time=time.time()))
    assert earlier.close()
    sink = TensorBoardSink(tmp_path)
    sink.open(RunInfo())
    for step in range(1, 11):
        sink.write(Report(step=step, values={"loss": 2.0}, time=time.time()))
    assert sink.flush(30)

    def disk_error(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk error")

    sink._writer.add_scalar = disk_error
    failing = Report(step=11, values={"loss": 2.0}, time=time.time())
    with pytest.raises(OSError):
        sink.write(failing)
    for step in range(11, 41):  # the retry of step 11 comes first, on a new writer
        sink.write(Report(step=step, values={"loss": 2.0}, time=time.time()))
    assert sink.close(30)
    assert sink.state_dict()["last_steps"] == [["", 40]]
    events = _load(tmp_path).Scalars("loss")
    assert sorted(e.step for e in events if e.value == 2.0) == list(range(1, 41))
    assert sorted(e.step for e in events if e.value == 1.0) == list(range(1, 41))
    # A restart (a child process's, a resumed job's) tells the files apart the same way.
    resumed = TensorBoardSink(tmp_path)
    resumed.load_state_dict({**sink.state_dict(), "last_steps": [["", 10]]})
    resumed.open(RunInfo())
    resumed.write(Report(step=20, values={"loss": 3.0}, time=time.time()))
    resumed.write(Report(step=41, values={"loss": 3.0}, time=time.time()))
    assert resumed.close(30)
    assert [e.step for e in _load(tmp_path).Scalars("loss") if e.value == 3.0] == [41]


def test_a_resumed_run_that_never_wrote_records_its_hyper_parameters_and_name(
    tmp_path: Path,
) -> None:
    # A checkpoint (or a kept spool) from before TensorBoard could open: the resumed sink
    # skipped the run's hyper-parameters, tags and name, as if the earlier job had written them.
    info = RunInfo(name="my-run", config={"lr": 0.1}, tags={"team": "a"})
    never_opened = TensorBoardSink(tmp_path / "tb")
    resumed = TensorBoardSink(tmp_path / "tb")
    resumed.load_state_dict(never_opened.state_dict())
    resumed.open(info)
    resumed.write(Report(step=1, values={"loss": 1.0}, time=time.time()))
    assert resumed.close(30)
    again = TensorBoardSink(tmp_path / "tb")  # this run wrote: nothing is recorded twice
    again.load_state_dict(resumed.state_dict())
    again.open(info)
    assert again.close(30)
    accumulator = _load(tmp_path / "tb")
    assert "_hparams_/session_start_info" in accumulator.PluginTagToContent("hparams")
    texts = accumulator.Tags()["tensors"]
    assert sorted(texts) == ["run_name/text_summary", "tags/text_summary"]
    assert len(accumulator.Tensors("run_name/text_summary")) == 1


def test_tags_are_shown_as_given_in_tensorboards_table(tmp_path: Path) -> None:
    """TensorBoard renders the tags' text as markdown: a ``|``, a newline or markdown in a tag
    is shown as written, not as another cell, another row or formatting."""
    tags = {
        "cmd": "python train.py | tee log",
        "note": "first line\nsecond line",
        "k|ey": "*not* _emphasis_ [nor](a link) &amp; <b>",
        "path": "C:\\runs\\a",
        "plain": "nlp",
    }
    cells = _tag_table_cells(tmp_path, tags)
    assert cells == [[key, value] for key, value in tags.items()]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"flush_secs": 0}, "flush_secs: expected a finite number of seconds >= 0.01"),
        ({"flush_secs": 1e-6}, "flush_secs: expected a finite number"),  # spins a fifth of a core
        ({"flush_secs": -1}, "flush_secs: expected a finite number"),
        ({"flush_secs": float("nan")}, "flush_secs: expected a finite number"),
        ({"max_queue": 0}, "max_queue: expected an int >= 1"),
        ({"log_dir": ""}, "log_dir: expected a directory path, got ''"),
        ({"log_dir": "runs/a\0b"}, "log_dir: expected a directory path"),
    ],
)
def test_writer_options_out_of_range_are_refused_when_built(
    options: dict[str, Any], message: str
) -> None:
    # flush_secs <= 0 or NaN made TensorBoard's writer thread spin for the whole job; an empty
    # log_dir became the working directory.
    with pytest.raises(ValueError, match=message):
        TensorBoardSink(**options)


@pytest.mark.parametrize(
    ("counts", "bad"),
    [([1.0, float("nan"), 2.0], "nan in bin 1"), ([1.0, 2.0, -1.0], "-1.0 in bin 2")],
)
def test_a_histogram_with_a_nan_or_negative_count_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, counts: list[float], bad: str
) -> None:
    import torch

    sink = TensorBoardSink(log_dir=str(tmp_path))
    sink.open(RunInfo(name="bad-counts"))
    histograms = {"scores": torch.tensor(counts), "ok": torch.tensor([4.0, 0.0])}
    sink.write(Report(step=1, values={"loss": 0.5}, time=time.time(), histograms=histograms))
    assert not sink.close(timeout=30)  # the run lacks "scores"
    assert (
        f"histogram 'scores' skipped: expected bin counts that are finite and >= 0, got {bad}"
        in (caplog.text)
    )
    accumulator = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"*": 0})
    accumulator.Reload()
    assert accumulator.Tags()["histograms"] == ["ok"]
    assert [e.value for e in accumulator.Scalars("loss")] == [0.5]


def test_a_histogram_it_cannot_write_is_skipped_and_close_says_the_run_lacks_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import torch

    sink = TensorBoardSink(log_dir=str(tmp_path), histogram_edges={"scores": [0.0, 0.5, 1.0]})
    sink.open(RunInfo(name="skips"))
    histograms = {"scores": torch.tensor([1.0, 2.0, 3.0]), "ok": torch.tensor([4.0])}
    sink.write(Report(step=1, values={"loss": 0.5}, time=time.time(), histograms=histograms))
    assert not sink.close(timeout=30)  # 3 bins, 2 given edges: the run lacks it
    assert "histogram 'scores' skipped" in caplog.text
    assert "the run lacks the values the backend could not take (scores" in caplog.text
    accumulator = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"*": 0})
    accumulator.Reload()
    assert [e.value for e in accumulator.Scalars("loss")] == [0.5]
    assert accumulator.Tags()["histograms"] == ["ok"]
    # A job resumed from the checkpoint still says the run lacks it (it said True before).
    state = sink.state_dict()
    assert state["skipped_values"] == ["scores"]
    resumed = TensorBoardSink(log_dir=str(tmp_path), histogram_edges={"scores": [0.0, 0.5, 1.0]})
    resumed.load_state_dict(state)
    resumed.open(RunInfo(name="skips"))
    resumed.write(Report(step=2, values={"loss": 0.25}, time=time.time()))
    assert not resumed.close(timeout=30)
    with pytest.raises(ValueError, match=r"state_dict\['skipped_values'\]: expected a list"):
        TensorBoardSink(log_dir=str(tmp_path)).load_state_dict({**state, "skipped_values": "x"})


def test_ints_a_float64_cannot_hold_exactly_are_hyper_parameters_as_text(tmp_path: Path) -> None:
    # TensorBoard keeps numbers as doubles: 10**400 raised OverflowError at every open.
    config = {
        "huge": 10**400,
        "negative": -(10**309),
        "odd": 2**53 + 1,
        "fits": 2**53,
        "n": 3,
        "flag": True,  # torch's writer made it the number 1
        "off": False,
    }
    sink = TensorBoardSink(tmp_path / "tb")
    sink.open(RunInfo(config=config))
    sink.write(Report(step=1, values={"loss": 1.0}, time=time.time()))
    assert sink.close(30)
    accumulator = _load(tmp_path / "tb")
    start = hparams_metadata.parse_session_start_info_plugin_data(
        accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    )
    assert start.hparams["huge"].string_value == str(10**400)
    assert start.hparams["negative"].string_value == str(-(10**309))
    assert start.hparams["odd"].string_value == str(2**53 + 1)
    assert start.hparams["fits"].number_value == 2**53
    assert start.hparams["n"].number_value == 3
    assert start.hparams["flag"].string_value == "True"
    assert start.hparams["off"].string_value == "False"


def test_a_skipped_value_survives_a_distributed_checkpoint(tmp_path: Path) -> None:
    # torch.distributed.checkpoint loads only the keys a fresh run's state has: the sink's
    # state always holds skipped_values, so the resumed run's close still says it lacks one.
    import torch
    import torch.distributed.checkpoint as dcp

    from sidestream import ComposeMetric, Metric, ReduceOp, Run

    class ThreeBins(Metric[torch.Tensor]):
        def __init__(self) -> None:
            super().__init__()
            self._counts = self.add_state("counts", torch.zeros(3), ReduceOp.SUM)

        def update(self, counts: torch.Tensor) -> None:
            self._counts.local.add_(counts)

        def compute(self) -> torch.Tensor:
            return self._counts.value

    def start(run: Run) -> Any:
        metric = ComposeMetric({"bins": ThreeBins()})
        return run.collector(metric, prefix="h", histograms=["bins"])

    # 3 bins for 2 given edges: TensorBoard cannot draw it, so the sink leaves it out.
    edges = {"h/bins": [0.0, 0.5, 1.0]}
    first = Run([TensorBoardSink(log_dir=tmp_path / "tb", histogram_edges=edges)])
    collector = start(first).bind("cpu")
    collector.metric["bins"].update(torch.ones(3))
    collector.schedule_collection(1)
    collector.collect_results(30)
    first.log(1, {"lr": 0.1})
    assert first.state_dict(timeout=30)["sinks"]["tensorboard"]["skipped_values"] == ["h/bins"]
    dcp.save({"run": first}, checkpoint_id=tmp_path / "checkpoint")
    assert not first.close(timeout=30)
    resumed = Run([TensorBoardSink(log_dir=tmp_path / "tb", histogram_edges=edges)])
    start(resumed)
    dcp.load({"run": resumed}, checkpoint_id=tmp_path / "checkpoint")
    resumed.log(2, {"lr": 0.2})
    assert not resumed.close(timeout=30)  # True before: the key was dropped by the load


def test_a_checkpoint_flush_behind_a_hung_write_returns_within_its_timeout(
    tmp_path: Path,
) -> None:
    # A write to a hung disk holds the writer's lock on the sink's thread: the checkpoint's
    # flush (make_durable from run.state_dict(timeout=2)) waited for that lock without end.
    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    sink.open(RunInfo(name="hung"))
    sink.write(Report(step=1, values={"x": 1.0}, time=1.0))
    answer: list[bool] = []
    with sink._writer_lock:  # as the sink's thread, inside a write that hangs
        waiting = threading.Thread(target=lambda: answer.append(sink.make_durable(0.3)))
        started = time.monotonic()
        waiting.start()
        waiting.join(10)
        took = time.monotonic() - started
    assert not waiting.is_alive() and answer == [False]
    assert took < 5
    assert sink.make_durable(5) is True  # the write ended: durable again
    assert sink.close(5) is True


def test_a_checkpoint_flush_shares_one_timeout_between_the_lock_and_the_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wait for the writer's lock and the flush after it each got the whole timeout: a
    # write that held the lock most of it, then a hung flush, took up to twice the timeout.
    from sidestream_tensorboard import sink as sink_module

    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    sink.open(RunInfo(name="shared"))
    sink.write(Report(step=1, values={"x": 1.0}, time=1.0))
    given: list[float | None] = []
    call_within = sink_module.call_within

    def recorded(action: Any, timeout: float | None, name: str) -> tuple[bool, Exception | None]:
        given.append(timeout)
        return call_within(action, timeout, name)

    monkeypatch.setattr(sink_module, "call_within", recorded)
    held = threading.Event()

    def a_long_write() -> None:
        with sink._writer_lock:
            held.set()
            time.sleep(0.6)

    writer = threading.Thread(target=a_long_write)
    writer.start()
    held.wait(10)
    assert sink.make_durable(1.0) is True
    writer.join(10)
    assert len(given) == 1 and given[0] is not None and given[0] <= 0.5, given
    assert sink.close(5) is True


def test_a_close_that_did_not_end_counts_nothing_more_as_delivered(tmp_path: Path) -> None:
    # The writer's close ran past its timeout (a hung disk): close said False, but a flush
    # after it found no writer, said True, and counted the step as on disk.
    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    sink.open(RunInfo(name="hung close"))
    sink.write(Report(step=1, values={"x": 1.0}, time=1.0))
    disk = threading.Event()
    writer = sink._writer
    real_close = writer.close

    def hung_close() -> None:
        disk.wait(30)
        real_close()

    writer.close = hung_close
    assert sink.close(0.2) is False
    assert sink.flush(0) is False
    assert not sink.all_delivered and sink.state_dict()["last_steps"] == []
    disk.set()


@pytest.mark.parametrize("refusal", [errno.EACCES, errno.EROFS, errno.ENOSPC])
def test_a_log_dir_it_may_not_write_fails_at_open_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int
) -> None:
    # A read-only file system was retried with backoff until close (status "retrying"), while
    # JSONL failed at once; a full disk (ENOSPC) is still retried.
    def refuse(self: TensorBoardSink, summary_writer: Any) -> None:
        del summary_writer
        raise OSError(refusal, os.strerror(refusal), str(self._log_dir))

    monkeypatch.setattr(TensorBoardSink, "_new_writer", refuse)
    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    if refusal == errno.ENOSPC:
        with pytest.raises(OSError) as raised:
            sink.open(RunInfo())
        assert not isinstance(raised.value, PermanentSinkError)
        return
    with pytest.raises(PermanentSinkError, match=r"tb cannot be written .*a log_dir in a folder"):
        sink.open(RunInfo())


def test_a_sink_built_by_object_without_tensorboard_names_the_extra_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # open raised a bare "ModuleNotFoundError: No module named 'tensorboard'", naming no
    # install command (MlflowSink and WandbSink name theirs).
    from sidestream.sinks import is_permanent

    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # "import tensorboard" fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    message = r"tensorboard is not installed .*pip install \"sidestream\[tensorboard\]\""
    with pytest.raises(PermanentSinkError, match=message) as raised:
        sink.open(RunInfo())
    assert is_permanent(raised.value)


def test_a_writer_made_anew_without_tensorboard_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The other place the sink makes a writer: after a failed one, on the retry.
    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"))
    sink.open(RunInfo())
    sink._discard_writer()  # as a failed write does
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(PermanentSinkError, match=r"sidestream\[tensorboard\]"):
        sink.write(Report(step=0, values={"loss": 0.5}, time=time.time()))
    monkeypatch.undo()
    sink.close(timeout=30)


def test_a_comment_names_the_default_directory_and_is_refused_with_a_log_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SummaryWriter appends comment to its default directory's name only: with a log_dir it
    # was accepted and silently did nothing.
    with pytest.raises(ValueError, match=r"comment: it only ends the name of the default .*'-lr3'"):
        TensorBoardSink(log_dir=str(tmp_path / "tb"), comment="-lr3")
    TensorBoardSink(log_dir=str(tmp_path / "tb"), comment="")  # no comment: nothing lost
    monkeypatch.chdir(tmp_path)
    default = TensorBoardSink(comment="-lr3")
    assert default.log_dir.startswith(str(tmp_path / "runs")) and default.log_dir.endswith("-lr3")


@pytest.mark.skipif(sys.platform == "win32", reason="needs os.fork")
def test_a_forked_child_leaves_the_parents_run_to_the_parent(tmp_path: Path) -> None:
    # A child made by os.fork() that exited normally closed its copy of the parent's Run at
    # its exit: no sink thread there, so it kept the reports TensorBoard had not confirmed in
    # a spool file of its own and warned of them (the parent delivered them all).
    from tests._scripts import run_python

    script = f"""
import os, sys
import torch
from sidestream import Run, SumMetric
from sidestream_tensorboard import TensorBoardSink
run = Run([TensorBoardSink({str(tmp_path / "tb")!r})], spool_dir={str(tmp_path / "spool")!r})
train = run.collector(SumMetric(), prefix="train").bind("cpu")
for step in range(1, 31):
    train.metric.update(torch.tensor([float(step)]))
    train.schedule_collection(step)
    if step == 15:
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the child's at-exit hooks run
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
assert run.close(timeout=60)
"""
    done = run_python("-c", script, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "undelivered" not in done.stderr, done.stderr
    spool = tmp_path / "spool"
    assert not spool.exists() or not any(spool.iterdir())


def test_a_tilde_or_a_carriage_return_in_a_tag_is_shown_as_given(tmp_path: Path) -> None:
    # "~" was backslash-escaped, which TensorBoard's markdown does not take (shown "v\~2"),
    # and a "\r" alone (which it reads as a line end) split the row.
    tags = {"range": "v~2", "note": "one\rtwo", "crlf": "a\r\nb"}
    cells = _tag_table_cells(tmp_path, tags)
    assert cells == [["range", "v~2"], ["note", "one\ntwo"], ["crlf", "a\nb"]]


def _tag_table_cells(tmp_path: Path, tags: dict[str, str]) -> list[list[str]]:
    """The tags table's cells as TensorBoard's own markdown renderer shows them."""
    from tensorboard.plugin_util import markdown_to_safe_html

    sink = TensorBoardSink(tmp_path / "tb")
    sink.open(RunInfo(name="tags", tags=tags))
    assert sink.close(30)
    (event,) = _load(tmp_path / "tb").Tensors("tags/text_summary")
    shown = markdown_to_safe_html(event.tensor_proto.string_val[0].decode())
    rows = re.findall(r"<tr>(.*?)</tr>", shown, re.S)[1:]  # after the header
    return [
        [
            html.unescape(re.sub(r"<br\s*/?>", "\n", cell))
            for cell in re.findall(r"<td>(.*?)</td>", row, re.S)
        ]
        for row in rows
    ]


def test_close_while_a_checkpoint_persists_counts_every_report(tmp_path: Path) -> None:
    # A checkpoint's make_durable (persist, on another thread) held the lock that close's
    # final flush takes: flush(0) said False, so close failed with its last report held by
    # the sink (a runner spools it, and a replay writes the event again).
    sink = TensorBoardSink(tmp_path / "tb")
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": 1.0}, time=time.time()))
    writer = sink._writer
    assert writer is not None
    flush = writer.flush

    def slow_flush() -> None:
        time.sleep(0.5)  # a slow disk
        flush()

    writer.flush = slow_flush  # type: ignore[method-assign]
    outcome: list[bool] = []
    checkpoint = threading.Thread(target=lambda: outcome.append(sink.make_durable(5.0)))
    checkpoint.start()
    time.sleep(0.1)
    assert sink.close(5.0) is True
    assert sink.pending_reports() == []
    checkpoint.join(5)
    assert outcome == [True]


def test_the_trials_of_a_fast_sweep_get_default_directories_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SummaryWriter's default name changes once a second: the trials of a sweep (or a notebook
    # cell run again) made within one second shared a directory, and TensorBoard showed their
    # points as one run's, each step repeated (a warning said so, nothing more).
    from sidestream import Run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    made = [TensorBoardSink() for _ in range(3)]  # within a second (at most two seconds)
    existing = Path(made[-1].log_dir + "-4")  # another job's, this second: not taken either
    existing.mkdir()
    made.append(TensorBoardSink())
    names = [Path(sink.log_dir).name for sink in made]
    assert len(set(names)) == 4 and existing.name not in names, names
    for trial, sink in enumerate(made[:2]):
        with Run([sink]) as run:
            for step in (1, 2):
                run.log(step, {"trial": trial})
    for trial, sink in enumerate(made[:2]):
        events = _load(Path(sink.log_dir)).Scalars("trial")
        assert [(e.step, e.value) for e in events] == [(1, trial), (2, trial)]
