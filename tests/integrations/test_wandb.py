from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from sidestream.sinks import Report, RunInfo
from sidestream.testing import RankPool
from tests.integrations._workload import HISTOGRAM_EDGES, expected, train
from tests.integrations.wandb_reader import (
    HistoryRow,
    read_history,
    read_records,
    read_step_metrics,
    run_id_of,
)

pytest.importorskip("wandb")
from sidestream_wandb import WandbSink

STEPS = 200


def _config(root: Path) -> dict[str, Any]:
    options = {
        "project": "sidestream-it",
        "mode": "offline",
        "dir": str(root),
        "histogram_edges": HISTOGRAM_EDGES,
    }
    return {"wandb": options}


def _history(path: Path, timeout: float = 30.0) -> list[HistoryRow]:
    """Read the history once wandb's service process has finished writing the file.

    ``run.finish()`` returns when the service acknowledged the run's end; on a loaded machine
    the last block can reach the disk a moment later, so wait until the file has stopped
    growing for 1.5 s (a paused service process must not look finished).
    """
    deadline = time.monotonic() + timeout
    rows, agreeing = read_history(path), 0
    while time.monotonic() < deadline and agreeing < 3:
        time.sleep(0.5)
        again = read_history(path)
        agreeing = agreeing + 1 if rows and len(again) == len(rows) else 0
        rows = again
    return rows


def _data_file(run_dir: str) -> Path:
    files = list(Path(run_dir).glob("*.wandb"))
    assert len(files) == 1, files
    return files[0]


def _check_rows(rows: list[HistoryRow], steps: range) -> None:
    # Each row carries its stream's step metric ("step" for the stream ""), not W&B's _step.
    assert [row.items["step"] for row in rows] == list(steps)
    for row in rows:
        step = row.items["step"]
        values, histogram = expected(step)
        for key, want in values.items():
            np.testing.assert_allclose(row.items[key], want, rtol=1e-12, err_msg=f"{key}@{step}")
        scores = row.items["scores"]
        assert scores["_type"] == "histogram"
        np.testing.assert_array_equal(scores["values"], histogram)
        np.testing.assert_allclose(scores["bins"], HISTOGRAM_EDGES["scores"])


def _data_files(root: Path) -> list[Path]:
    """Every offline run's ``.wandb`` file under ``root``, ordered by the first step it holds."""
    files = [_data_file(str(run)) for run in (root / "wandb").glob("offline-run-*")]
    return sorted(files, key=lambda f: _history(f)[0].items["step"] if _history(f) else -1)


def test_two_ranks_every_window_once_offline(tmp_path: Path, pool2: RankPool) -> None:
    results = pool2.run(train, _config(tmp_path), range(STEPS), timeout=240)
    assert [r["sink_threads"] for r in results] == [1, 0]
    assert [r["closed"] for r in results] == [True, True]
    assert results[0]["delivered"] == [STEPS]
    (idle,) = results[1]["sink_states"]  # rank 1's sink never opened: its own id, no steps
    assert idle["last_steps"] == [] and idle["run_dir"] is None
    (data,) = _data_files(tmp_path)  # rank 1 created no run
    state = results[0]["sink_states"][0]
    assert run_id_of(data) == state["run_id"] and state["last_steps"] == [["", STEPS - 1]]
    _check_rows(_history(data), range(STEPS))


def test_resume_from_collector_checkpoint_keeps_the_run_id_and_never_repeats_a_step(
    tmp_path: Path, pool2: RankPool
) -> None:
    # Stop after step 100's update with a checkpoint; step 100 is not logged yet.
    first = pool2.run(train, _config(tmp_path), range(101), checkpoint_at=100, timeout=240)
    saved = first[0]["checkpoint"]["sinks"]["wandb"]
    assert saved["last_steps"] == [["", 99]]
    second = pool2.run(
        train, _config(tmp_path), range(100, STEPS), first[0]["checkpoint"], timeout=240
    )
    assert [r["closed"] for r in first + second] == [True] * 4
    (resumed,) = second[0]["sink_states"]
    assert resumed["run_id"] == saved["run_id"] and resumed["last_steps"] == [["", STEPS - 1]]
    # Offline, W&B writes the continuation to a second directory of the same run id (joined by
    # `wandb sync`); together they hold every step once.
    files = _data_files(tmp_path)
    assert len(files) == 2
    assert [run_id_of(f) for f in files] == [saved["run_id"]] * 2
    _check_rows(_history(files[0]) + _history(files[1]), range(STEPS))


def test_skips_bad_histograms_and_keeps_credentials_out(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import torch

    key = "fake0api0key0" + "7" * 27  # 40 characters, like a real key
    monkeypatch.setenv("WANDB_API_KEY", key)
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="creds", config={"deep": {"x": object()}}, tags={"k": "v"}))
    sink.write(
        Report(
            step=5,
            values={"loss": 0.5},
            time=time.time(),
            histograms={
                "ok": torch.tensor([1.0, 2.0]),
                "bad": torch.ones(2, 2),
                "negative": torch.tensor([3.0, -1.0]),
            },
        )
    )
    sink.write(Report(step=5, values={"loss": 9.0}, time=time.time()))  # already delivered
    sink.write(Report(step=4, values={"loss": 9.0}, time=time.time()))  # backwards
    # Logged, not yet in the .wandb file: delivered only once wandb's periodic write has run.
    assert sink.state_dict()["last_steps"] == []
    assert sink.flush(timeout=30)
    state = sink.state_dict()
    run_dir = sink.run_dir
    # The run lacks a value it was given: close says so (it said True, and run.close too).
    assert not sink.close(timeout=60)
    assert "WandbSink: closed, but the run lacks the values the backend could not take (bad" in (
        caplog.text
    )
    assert run_dir is not None
    rows = _history(_data_file(run_dir))
    assert [(row.items["step"], row.items["loss"]) for row in rows] == [(5, 0.5)]
    assert rows[0].items["ok"]["values"] == [1.0, 2.0] and "bad" not in rows[0].items
    assert "histogram 'bad' skipped" in caplog.text
    assert (
        "histogram 'negative' skipped: expected bin counts that are finite and >= 0, got -1.0"
        in (caplog.text)
    )
    assert "negative" not in rows[0].items
    assert state == {
        "run_id": state["run_id"],
        "last_steps": [["", 5]],
        "run_dir": run_dir,
        "skipped_values": ["bad", "negative"],  # a resumed job's close still says the run lacks it
    }
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    assert all(key.encode() not in content for content in written)
    assert key not in repr(state) + repr(sink) + caplog.text


def test_values_named_like_the_step_or_a_wandb_column_keep_their_own_columns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    values = {
        "step": 123.0,
        "_step": 7.0,
        "_runtime": 9.0,
        "_timestamp": 8.0,
        "eval/step": 4.0,  # the step column a stream eval would have
        "loss": 0.5,
    }
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="names"))
    for step in (1, 2):
        sink.write(Report(step=step, values=values, time=time.time()))
    collector_like = {"train/step": 5.0, "train/loss": 0.25}
    sink.write(Report(step=3, values=collector_like, time=time.time(), stream="train"))
    run_dir = sink.run_dir
    assert sink.close(timeout=60) and run_dir is not None
    rows = _history(_data_file(run_dir))
    assert [row.items.get("step") for row in rows] == [1, 2, None]
    assert [row.items.get("train/step") for row in rows] == [None, None, 3]  # only its own
    for row in rows[:2]:
        # W&B's own columns are W&B's: its step counts rows, the runtime is not 9.
        assert row.items["_step"] != 7.0 and row.items["_runtime"] != 9.0
        assert row.items["_timestamp"] != 8.0
        own = {key: value for key, value in row.items.items() if "-" in key}
        assert sorted(own.values()) == [4.0, 7.0, 8.0, 9.0, 123.0], row.items
        assert {key.split("-")[0] for key in own} == {"step", "runtime", "timestamp", "eval/step"}
        assert row.items["loss"] == 0.5
    renamed = [key for key in rows[2].items if key.startswith("train/step-")]
    assert len(renamed) == 1 and rows[2].items[renamed[0]] == 5.0
    for name in ("'step'", "'_step'", "'_runtime'", "'_timestamp'", "'eval/step'", "'train/step'"):
        assert f"{name} is logged as" in caplog.text


def test_each_row_carries_its_reports_time_as_wall_time(tmp_path: Path) -> None:
    """W&B's ``_timestamp`` is the report's time, as MLflow and TensorBoard keep it: a row
    delivered late (behind ``wandb.init``, a backlog, a resumed job's undelivered reports) is
    not shown at the time it reached wandb."""
    past = time.time() - 3600.0
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="times"))
    sink.write(Report(step=1, values={"loss": 1.0}, time=past))
    sink.write(Report(step=2, values={"train/loss": 2.0}, time=past + 1.5, stream="train"))
    run_dir = sink.run_dir
    assert sink.close(timeout=60) and run_dir is not None
    rows = _history(_data_file(run_dir))
    assert [row.items["_timestamp"] for row in rows] == [past, past + 1.5]


def test_tags_with_a_false_value_keep_it(tmp_path: Path) -> None:
    """Only ``""`` makes a bare tag: a seed of 0 or a flag set to False is shown with its
    value, as the other trackers keep it."""
    tags = {"seed": 0, "ablation": False, "lr": 0.0, "bare": "", "team": "nlp"}
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="tags", tags=tags))
    run_dir = sink.run_dir
    assert sink.close(timeout=60) and run_dir is not None
    tags = list(_run_record(run_dir).tags)
    assert tags == ["seed:0", "ablation:False", "lr:0.0", "bare", "team:nlp"]


def test_a_nan_hyperparameter_is_kept_in_the_config(tmp_path: Path) -> None:
    """wandb writes a NaN config value as null: it goes as the text "nan" (infinities stay)."""
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    config = {"opt": {"lr": float("nan")}, "clip": float("inf"), "wd": 0.5}
    sink.open(RunInfo(name="nan-config", config=config))
    run_dir = sink.run_dir
    assert sink.close(timeout=60) and run_dir is not None
    stored = {item.key: item.value_json for item in _run_record(run_dir).config.update}
    assert json.loads(stored["opt.lr"]) == "nan"
    assert stored["clip"] == "Infinity" and json.loads(stored["wd"]) == 0.5


def test_each_value_is_charted_against_its_own_streams_step(tmp_path: Path) -> None:
    """Nested prefixes, a value named as its stream, and names holding ``*``: each value is
    declared against its own stream's step, and no row gets another stream's step."""
    reports = [
        Report(step=100, values={"val/loss": 1.0}, time=time.time(), stream="val"),
        Report(step=150, values={"val/ood/loss": 2.0}, time=time.time(), stream="val/ood"),
        Report(step=5, values={"tokens": 3.0}, time=time.time(), stream="tokens"),
        Report(step=1, values={"lr*warmup": 4.0}, time=time.time()),
        Report(step=2, values={"s*/x": 5.0}, time=time.time(), stream="s*"),
        Report(step=3, values={"lr": 6.0}, time=time.time()),
    ]
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="streams"))
    for report in reports:
        sink.write(report)  # a '*' used to fail here, and every later write with it
    run_dir = sink.run_dir
    assert sink.close(timeout=60) and run_dir is not None
    data = _data_file(run_dir)
    rows = _history(data)
    declared = read_step_metrics(data)
    assert len(rows) == len(reports)
    for report, row in zip(reports, rows, strict=True):
        own = {key: value for key, value in row.items.items() if not key.startswith("_")}
        steps = {key: value for key, value in own.items() if key.endswith("/step") or key == "step"}
        assert list(steps.values()) == [report.step], own  # its own step, no other stream's
        (step_key,) = steps
        values = {key: value for key, value in own.items() if key != step_key}
        assert list(values.values()) == list(report.values.values())
        for column in values:
            assert declared[column] == step_key, (column, declared)
    assert not any("*" in name for name in declared)


def test_names_with_dots_declare_their_own_columns_and_add_nothing_to_the_rows(
    tmp_path: Path,
) -> None:
    """wandb reads a ``.`` in a ``define_metric`` name as nesting: a stream ``val.ood`` once
    declared its step as ``val`` -> ``ood/step``, and wandb added ``{"val": {"ood/step": 0}}``
    to each of its rows, over the value ``val`` of the unnamed stream."""
    reports = [
        Report(step=10, values={"val.ood/f0.5": 0.5}, time=time.time(), stream="val.ood"),
        Report(step=10, values={"val": 1.0, "top1.acc": 0.25}, time=time.time()),
        Report(step=20, values={"val.ood/f0.5": 0.75}, time=time.time(), stream="val.ood"),
        Report(step=30, values={"a\\.b": 2.0}, time=time.time(), stream="x\\y"),
    ]
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="dots"))
    for report in reports:
        sink.write(report)
    run_dir = sink.run_dir
    assert sink.close(timeout=60) and run_dir is not None
    data = _data_file(run_dir)
    rows = _history(data)
    assert len(rows) == len(reports)
    for report, row in zip(reports, rows, strict=True):
        own = {key: value for key, value in row.items.items() if not key.startswith("_")}
        step_key = f"{report.stream}/step" if report.stream else "step"
        assert own == {**report.values, step_key: report.step}, own
    # Declared escaped: unescaped, each name is a row's column, against its stream's step.
    unescaped = {
        re.sub(r"\\(.)", r"\1", name): re.sub(r"\\(.)", r"\1", step)
        for name, step in read_step_metrics(data).items()
    }
    assert unescaped["val.ood/f0.5"] == "val.ood/step"
    assert unescaped["top1.acc"] == "step"
    assert unescaped["a\\.b"] == "x\\y/step"


def test_rows_a_stalled_service_has_not_written_do_not_count_as_delivered(
    tmp_path: Path,
) -> None:
    """Rows count by time since they were logged only while the file grows: a service that
    is alive but stalled (here stopped; a blocked disk alike) writes nothing."""
    from sidestream_wandb.sink import _service_process

    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="stall"))
    for step in range(1, 4):
        sink.write(Report(step=step, values={"x": float(step)}, time=time.time()))
    assert sink.flush(timeout=30)
    assert sink.state_dict()["last_steps"] == [["", 3]]
    service = _service_process()
    assert service is not None, "wandb-core is not a child of this process"
    os.kill(service, signal.SIGSTOP)
    try:
        for step in range(4, 7):
            sink.write(Report(step=step, values={"x": float(step)}, time=time.time()))
        assert not sink.flush(timeout=5)  # waits past the periodic write: nothing came
        state = sink.state_dict()
        run_dir = sink.run_dir
        assert run_dir is not None
        in_file = [row.items["step"] for row in read_history(_data_file(run_dir))]
    finally:
        os.kill(service, signal.SIGCONT)
    assert in_file == [1, 2, 3]
    assert state["last_steps"] == [["", 3]]
    assert sink.flush(timeout=30)  # running again: the periodic write wrote them
    assert sink.state_dict()["last_steps"] == [["", 6]]
    assert sink.close(timeout=60)
    assert [row.items["step"] for row in _history(_data_file(run_dir))] == list(range(1, 7))


def test_a_relative_dir_keeps_counting_rows_after_the_script_changes_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    sink = WandbSink(project="sidestream-it", mode="offline", dir="relative")
    sink.open(RunInfo(name="chdir"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    for step in (1, 2):
        sink.write(Report(step=step, values={"x": float(step)}, time=time.time()))
    assert sink.flush(timeout=30)
    assert sink.state_dict()["last_steps"] == [["", 2]]
    run_dir = sink.run_dir
    assert run_dir is not None and run_dir.startswith(str(tmp_path / "relative"))
    assert sink.close(timeout=60)
    assert (Path(run_dir) / "sidestream-steps.json").is_file()  # the progress file too


_CRASHING_JOB = """
import json, os, sys, time
from sidestream.sinks import Report, RunInfo
from sidestream_wandb import WandbSink

sink = WandbSink(project="sidestream-it", mode="offline", dir=sys.argv[1])
sink.open(RunInfo(name="crash"))
for step in range(5):
    sink.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
assert sink.make_durable(timeout=30)  # as a checkpoint does: steps 0 to 4 in the file
with open(sys.argv[2], "w") as out:
    json.dump(sink.state_dict(), out)
for step in range(5, 10):
    sink.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
time.sleep(1)
os._exit(1)  # killed: the run never finishes
"""


def _crash(job: str, tmp_path: Path) -> dict[str, Any]:
    """Run ``job`` (which checkpoints its sink, then dies), return the checkpoint it wrote."""
    import json
    import os
    import subprocess
    import sys

    script, saved = tmp_path / "job.py", tmp_path / "checkpoint.json"
    script.write_text(job)
    # Its own wandb service (not this process's, named in WANDB_SERVICE), as a real job has.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(saved), str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    checkpoint: dict[str, Any] = json.loads(saved.read_text())
    return checkpoint


def test_a_crashed_job_resumes_logging_every_step_after_its_checkpoint(tmp_path: Path) -> None:
    """A checkpoint's steps are in the crashed run's .wandb file (make_durable waited for
    wandb's periodic write); of the steps logged after it, those wandb wrote to that file
    before the crash are skipped (the resumed sink reads it), and the rest logged again: every
    step once, in one directory or the other."""
    checkpoint = _crash(_CRASHING_JOB, tmp_path)
    assert checkpoint["last_steps"] == [["", 4]]
    crashed = _losses(checkpoint["run_dir"])
    assert crashed[:5] == [(step, float(step)) for step in range(5)]
    # The job repeats steps 3 to 9 from its checkpoint.
    rows = _resume(checkpoint, tmp_path, range(3, 12))
    assert sorted(crashed + rows) == [(step, float(step)) for step in range(12)]
    # Rows wandb wrote after the sink last read the file were logged again before.
    assert rows[0][0] == crashed[-1][0] + 1


def _losses(run_dir: str) -> list[tuple[Any, Any]]:
    """(step, loss) of every row of the run's .wandb file, as wandb recorded them."""
    return [(row.items["step"], row.items["loss"]) for row in _history(_data_file(run_dir))]


def _resume(checkpoint: dict[str, Any], tmp_path: Path, steps: range) -> list[tuple[Any, Any]]:
    """Resume the crashed run from ``checkpoint``, write ``steps``, close: the rows written."""
    resumed = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo(name="resumed"))
    for step in steps:
        resumed.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
    run_dir = resumed.run_dir
    assert resumed.close(timeout=60) and run_dir is not None
    return _losses(run_dir)


_WAIT_WRITTEN = """
sys.path.insert(0, sys.argv[3])  # tests/integrations, for the independent .wandb reader
from wandb_reader import read_history


def wait_written(step, since):
    # Until the .wandb file holds step (wandb's periodic write) and the sink's rule (logged
    # at least 1.5 s ago) counts it: then the next write records it as delivered.
    path = next(Path(sink.run_dir).glob("*.wandb"))
    deadline = time.monotonic() + 60
    while True:
        try:
            if any(row.items.get("step") == step for row in read_history(path)):
                break
        except Exception:
            pass  # a block being written
        if time.monotonic() > deadline:
            raise SystemExit(f"wandb did not write step {step} within 60 s")
        time.sleep(0.1)
    time.sleep(max(0.0, since + 1.6 - time.monotonic()))
"""
"""Job-script code: ``wait_written(step, since)`` (the sink must be open as ``sink``)."""


_LATE_CRASH_JOB = (
    """
import json, os, sys, time
from pathlib import Path
from sidestream.sinks import Report, RunInfo
from sidestream_wandb import WandbSink

sink = WandbSink(project="sidestream-it", mode="offline", dir=sys.argv[1])
sink.open(RunInfo(name="late"))
"""
    + _WAIT_WRITTEN
    + """
for step in range(5):
    sink.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
assert sink.make_durable(timeout=30)
with open(sys.argv[2], "w") as out:
    json.dump(sink.state_dict(), out)
for step in range(5, 10):
    sink.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
wait_written(9, time.monotonic())
sink.write(Report(step=10, values={"loss": 10.0}, time=time.time()))  # counts 5 to 9
os._exit(1)  # killed: the run never finishes
"""
)


def test_a_job_resumed_after_a_late_crash_skips_the_steps_in_the_crashed_file(
    tmp_path: Path,
) -> None:
    """Steps counted as delivered after the checkpoint (in the .wandb file by wandb's periodic
    write) are in the progress file the resumed job reads: each step is in one file only, and
    every step is in one."""
    checkpoint = _crash(_LATE_CRASH_JOB, tmp_path)
    assert checkpoint["last_steps"] == [["", 4]]
    assert _losses(checkpoint["run_dir"])[:10] == [(step, float(step)) for step in range(10)]
    # The job repeats steps 5 to 10 from its checkpoint.
    rows = _resume(checkpoint, tmp_path, range(5, 13))
    # Step 10 was logged just before the crash, not counted. wandb's service outlives the
    # killed job and may still write it to the crashed file (on a loaded machine it does):
    # then the resumed job finds it there and skips it; else it logs it again. Once in all.
    crashed = _losses(checkpoint["run_dir"])
    again = [] if (10, 10.0) in crashed else [(10, 10.0)]
    assert rows == again + [(step, float(step)) for step in range(11, 13)]


_RESUMED_CRASH_JOB = (
    """
import json, os, sys, time
from pathlib import Path
from sidestream.sinks import Report, RunInfo
from sidestream_wandb import WandbSink

sink = WandbSink(project="sidestream-it", mode="offline", dir=sys.argv[1])
with open(sys.argv[2]) as saved:
    sink.load_state_dict(json.load(saved))
sink.open(RunInfo(name="late"))
"""
    + _WAIT_WRITTEN
    + """
for step in range(5, 16):  # the job repeats steps 5 to 9 from the checkpoint: skipped
    sink.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
wait_written(15, time.monotonic())
sink.write(Report(step=16, values={"loss": 16.0}, time=time.time()))  # counts 10 to 15
os._exit(1)  # killed again, before a checkpoint of its own
"""
)


def test_a_second_crash_before_a_new_checkpoint_is_resumed_past_both_jobs(
    tmp_path: Path,
) -> None:
    """The second job's steps are found through the checkpointed job's directory (the only one
    the checkpoint names), so the third job does not log them again."""
    import json

    checkpoint = _crash(_LATE_CRASH_JOB, tmp_path)
    _crash(_RESUMED_CRASH_JOB, tmp_path)  # writes no checkpoint of its own
    progress = Path(checkpoint["run_dir"]) / "sidestream-steps.json"
    assert json.loads(progress.read_text()) == {"": 15}  # the second job's steps, found here
    second = [
        path
        for path in (tmp_path / "wandb").glob("offline-run-*")
        if str(path) != checkpoint["run_dir"]
    ]
    assert len(second) == 1
    second_rows = _losses(str(second[0]))
    # Step 10 is the second job's unless wandb's service wrote it into the first job's file
    # after that job was killed (see the test above): then the second job skipped it.
    start = 11 if (10, 10.0) in _losses(checkpoint["run_dir"]) else 10
    assert second_rows[: 16 - start] == [(step, float(step)) for step in range(start, 16)]
    rows = _resume(checkpoint, tmp_path, range(5, 19))
    # Each step once over the three jobs' directories: the second job's rows past its
    # progress file (16, 17 when wandb wrote them before the crash) are skipped too.
    every = sorted(_losses(checkpoint["run_dir"]) + second_rows + rows)
    assert every == [(step, float(step)) for step in range(19)]
    assert rows[0][0] == second_rows[-1][0] + 1


_BACKLOG_JOB = """
import json, os, sys, time
from sidestream.sinks import Report, RunInfo
from sidestream_wandb import WandbSink

sink = WandbSink(project="sidestream-it", mode="offline", dir=sys.argv[1])
sink.open(RunInfo(name="backlog"))
step = 0
def log_for(seconds):
    global step
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # a steady backlog: never a quiet interval
        sink.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
        step += 1
        time.sleep(0.05)
log_for(4.0)
# A checkpoint under the backlog: no time to wait for a quiet interval.
sink.make_durable(timeout=0.1)
with open(sys.argv[2], "w") as out:
    json.dump({**sink.state_dict(), "logged": step}, out)
log_for(2.0)
os._exit(1)  # killed: the run never finishes
"""


def test_a_checkpoint_under_a_steady_backlog_records_the_rows_already_written(
    tmp_path: Path,
) -> None:
    """Rows logged an interval (plus margin) before the checkpoint are in the .wandb file, so
    they count as delivered although the sink never waited for a quiet interval."""
    checkpoint = _crash(_BACKLOG_JOB, tmp_path)
    recorded = dict(checkpoint["last_steps"]).get("")
    # Rows logged before (checkpoint - 1.5 s), of about 4 s of rows: most of them. All of
    # them when wandb's periodic write (every 1 s) lands in make_durable's 0.1 s: then every
    # row is in the file, and counts (never more than that: checked below).
    assert recorded is not None and 0 < recorded <= checkpoint["logged"] - 1, checkpoint
    # What the checkpoint claims is in the crashed run's file (wandb's own records).
    crashed = [
        (row.items["step"], row.items["loss"])
        for row in _history(_data_file(checkpoint["run_dir"]))
    ]
    assert crashed[: recorded + 1] == [(step, float(step)) for step in range(recorded + 1)]


def test_a_mode_wandb_rejects_fails_when_the_sink_is_built() -> None:
    """Not at open on rank 0 after training started, where it fails the sink for the job."""
    from sidestream.sinks import sinks_from_config

    with pytest.raises(ValueError, match=r"mode: wandb does not take 'ofline' .*'offline'"):
        WandbSink(project="sidestream-it", mode="ofline")
    with pytest.raises(ValueError, match=r"mode: wandb does not take 'ofline'"):
        sinks_from_config({"wandb": {"project": "sidestream-it", "mode": "ofline"}})
    assert len(WandbSink(project="sidestream-it", mode="offline").run_id) == 8


def test_a_settings_key_wandb_rejects_fails_when_the_sink_is_built() -> None:
    from sidestream.sinks import sinks_from_config

    with pytest.raises(ValueError, match=r"settings: .*'silnt'.*did you mean 'silent'"):
        sinks_from_config({"wandb": {"mode": "offline", "settings": {"silnt": True}}})
    # A known key with a bad value, and a rule over several keys, are not unknown keys (the
    # message said "does not take 'x' (did you mean 'x'?)", or named the key '').
    bad_value = {"x_transaction_log_flush_interval": "soon"}
    with pytest.raises(ValueError, match=r"refuses 'x_transaction_log_flush_interval' = 'soon': "):
        WandbSink(mode="offline", settings=bad_value)
    with pytest.raises(ValueError, match=r"refuses these settings together: .*offline"):
        WandbSink(mode="offline", settings={"x_skip_transaction_log": True})
    with pytest.raises(ValueError, match=r"refuses 'ignore_globs'\[0\] = \[1\]: .*string"):
        WandbSink(mode="offline", settings={"ignore_globs": [1]})
    assert len(WandbSink(mode="offline", settings={"silent": True}).run_id) == 8


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"tags": "baseline"}, TypeError, r"tags: expected a list of str .*'baseline'"),
        ({"tags": ["a", 3]}, TypeError, r"tags: expected a list of str"),
        ({"tags": ["x" * 65]}, ValueError, r"tags: each W&B tag must have 1 to 64 .*\(65 "),
        ({"tags": ["ok", ""]}, ValueError, r"tags: each W&B tag must have 1 to 64 .*''"),
        ({"config": [1, 2]}, TypeError, r"config: expected a mapping"),
        ({"resume": "sometimes"}, ValueError, r"resume: expected one of .*'sometimes'"),
        ({"id": "a/b"}, ValueError, r"id: W&B run ids cannot hold '/'"),
        ({"id": " a"}, ValueError, r"id: expected a run id without surrounding spaces"),
        ({"reinit": "return_previous"}, ValueError, r"reinit: .*'return_previous'"),
        ({"reinit": True}, ValueError, r"reinit: the sink always starts its own run"),
    ],
)
def test_run_options_wandb_would_refuse_or_misread_fail_when_the_sink_is_built(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    # They failed at open on rank 0 after training started (a str of tags became one tag per
    # letter without any error).
    with pytest.raises(error, match=message):
        WandbSink(project="sidestream-it", mode="offline", **options)
    WandbSink(project="p", mode="offline", tags=["a", "b" * 64], config={"x": 1}, resume="must")
    WandbSink(project="p", mode="offline", reinit="create_new")


def test_a_checkpoint_taken_before_the_sink_opened_resumes_the_same_run(tmp_path: Path) -> None:
    # W&B unreachable at the first checkpoint: the state named no run and no directory, so the
    # resumed job started a second run and logged the steps the first job delivered again.
    first = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    checkpoint = first.state_dict()
    assert checkpoint["run_id"] == first.run_id and checkpoint["run_dir"] is None
    first.open(RunInfo(name="job"))
    for step in range(5):
        first.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
    first_dir = first.run_dir
    assert first.close(timeout=60) and first_dir is not None  # progress file: steps 0 to 4
    rows = _resume(checkpoint, tmp_path, range(8))  # the job repeats steps 0 to 4
    assert rows == [(step, float(step)) for step in range(5, 8)]
    files = _data_files(tmp_path)
    assert [run_id_of(f) for f in files] == [first.run_id] * 2  # one run, two directories
    assert _losses(first_dir) == [(step, float(step)) for step in range(5)]


def test_the_sink_runs_in_a_child_process(tmp_path: Path) -> None:
    """Its locks are made anew in the child (one was not, so it could not be pickled)."""
    from sidestream import Run
    from sidestream.sinks import ProcessSink, sinks_from_config

    options = {"type": "wandb", "project": "sidestream-it", "mode": "offline"}
    (sink,) = sinks_from_config([{**options, "dir": str(tmp_path), "child_process": True}])
    assert isinstance(sink, ProcessSink)
    with Run([sink], spool_dir=str(tmp_path)) as run:
        for step in (1, 2, 3):
            run.log(step, {"loss": float(step)})
        checkpoint = run.state_dict(timeout=60)["sinks"]["wandb"]
    assert run.close() is True
    assert _losses(checkpoint["run_dir"]) == [(step, float(step)) for step in (1, 2, 3)]


_SERVICE_KILLED_JOB = """
import json, os, signal, sys, time
from sidestream.sinks import Report, RunInfo
from sidestream_wandb import WandbSink
from sidestream_wandb.sink import _service_process

sink = WandbSink(project="sidestream-it", mode="offline", dir=sys.argv[1])
sink.open(RunInfo(name="service killed"))
for step in range(5):
    sink.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
assert sink.make_durable(timeout=30)  # steps 0 to 4 in the file
for step in range(5, 8):
    sink.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
os.kill(_service_process(), signal.SIGKILL)  # before its next periodic write
flushed = sink.flush(timeout=30)  # waits as long as a periodic write takes
with open(sys.argv[2], "w") as out:
    json.dump({"flushed": flushed, "state": sink.state_dict(),
               "pending": [r.step for r in sink.pending_reports()]}, out)
os._exit(1)
"""


def test_rows_are_not_counted_when_the_service_died_before_writing_them(
    tmp_path: Path,
) -> None:
    """Rows count by time since they were logged only while wandb's service lives: killed
    before its periodic write, they stay unconfirmed (a checkpoint and close keep them)."""
    outcome = _crash(_SERVICE_KILLED_JOB, tmp_path)
    assert outcome["flushed"] is False
    assert outcome["state"]["last_steps"] == [["", 4]]
    assert outcome["pending"] == [5, 6, 7]


def test_wandb_picks_the_run_where_the_user_asked_it_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sink's own id (with resume="allow") overrode WANDB_RUN_ID (a requeued job started a
    # new run each time), and made fork_from / resume_from fail at open.
    monkeypatch.setenv("WANDB_RUN_ID", "requeued1")
    assert WandbSink(project="p", mode="offline").run_id == "requeued1"
    monkeypatch.delenv("WANDB_RUN_ID")
    assert WandbSink(project="p", mode="offline", resume="auto").run_id is None
    forked = WandbSink(project="p", mode="offline", dir=str(tmp_path), fork_from="abc?_step=1")
    assert forked.run_id is None
    assert len(WandbSink(project="p", mode="offline").run_id or "") == 8


def test_a_resumed_run_reads_only_its_own_directories(tmp_path: Path) -> None:
    # Every "*-<id>" directory was read: run "1" took another run's "offline-run-...-exp-1"
    # progress for its own and skipped those steps.
    from sidestream_wandb.sink import _earlier_run_dirs

    wandb_dir = tmp_path / "wandb"
    names = [
        "offline-run-20261202_101010-1",
        "run-20261202_111111-1",
        "offline-run-20261202_121212-exp-1",
    ]
    for name in names:
        (wandb_dir / name).mkdir(parents=True)
    here = wandb_dir / "offline-run-20261202_131313-1"
    here.mkdir()
    found = sorted(Path(path).name for path in _earlier_run_dirs(str(here), "1"))
    assert found == names[:2]


def test_a_dir_wandb_cannot_use_is_refused_when_built_or_named_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # wandb silently wrote the run to a temporary folder instead: the user's dir was ignored.
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"dir: '.*/file' is a file, not a directory"):
        WandbSink(project="p", mode="offline", dir=str(blocker / "runs"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    later = tmp_path / "later"
    sink = WandbSink(project="p", mode="offline", dir=str(later / "runs"))
    later.write_text("")  # a file where the folder was to be, by the time rank 0 opens
    sink.open(RunInfo(name="elsewhere"))
    assert sink.run_dir is not None and not sink.run_dir.startswith(str(later))
    assert "wandb could not write in dir=" in caplog.text and sink.run_dir in caplog.text
    assert sink.close(timeout=60)


def test_the_wandb_extra_installs_the_numpy_its_histograms_need() -> None:
    # sidestream[wandb] installed no numpy (wandb does not need it): every histogram failed.
    import tomllib

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((root / "integrations/sidestream-wandb/pyproject.toml").read_text())
    names = {Requirement(dependency).name for dependency in pyproject["project"]["dependencies"]}
    assert "numpy" in names


def test_the_declared_wandb_floor_is_the_first_release_with_the_periodic_write() -> None:
    # wandb>=0.19.10 was declared, but clients before 0.31 write logged rows only at finish
    # (the .wandb file was 0 bytes when finish returned): no row could count as delivered
    # by the backend having it.
    import tomllib

    import wandb
    from packaging.requirements import Requirement

    from sidestream_wandb import MIN_WANDB_VERSION
    from sidestream_wandb.sink import FLUSH_SETTING

    root = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((root / "integrations/sidestream-wandb/pyproject.toml").read_text())
    requirements = [Requirement(dependency) for dependency in pyproject["project"]["dependencies"]]
    (declared,) = [str(r.specifier) for r in requirements if r.name == "wandb"]
    assert declared == f">={MIN_WANDB_VERSION}"
    assert FLUSH_SETTING in wandb.Settings.model_fields  # the wandb this suite runs on has it


def test_a_wandb_older_than_the_sink_needs_fails_when_the_sink_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # pip keeps the floor only when it installs the sink's dependencies (not with --no-deps,
    # a conda wandb, a later pip install wandb==0.30.0): the sink worked on, counting rows as
    # delivered that wandb had not written, with no word of it.
    import wandb

    from sidestream.sinks import sinks_from_config

    class SettingsOf030:  # wandb 0.30's Settings: no x_transaction_log_flush_interval
        model_fields: ClassVar[dict[str, Any]] = {"mode": None, "silent": None}

        def __init__(self, **settings: Any) -> None:
            self.__dict__.update(settings)

    monkeypatch.setattr(wandb, "Settings", SettingsOf030)
    monkeypatch.setattr(wandb, "__version__", "0.30.0")
    message = r'needs wandb 0\.31 or later, found 0\.30\.0.*pip install --upgrade "wandb>=0\.31"'
    with pytest.raises(LookupError, match=r"sink 'wandb': WandbSink " + message) as raised:
        sinks_from_config({"wandb": {"project": "sidestream-it", "mode": "offline"}})
    assert str(raised.value).count("pip install") == 1  # the upgrade, not an install beside it
    with pytest.raises(ImportError, match=message):
        WandbSink(project="sidestream-it", mode="offline")


def test_a_histogram_torch_cannot_hand_to_numpy_fails_the_sink_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's "Numpy is not available" is a RuntimeError, which the pipeline took for a
    # transient failure and retried forever.
    import torch

    from sidestream.sinks import PermanentSinkError, is_permanent

    def no_numpy(self: torch.Tensor) -> Any:
        raise RuntimeError("Numpy is not available")

    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="no-numpy"))
    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    histogram = {"scores": torch.tensor([3.0, 5.0])}
    with pytest.raises(PermanentSinkError, match=r"'scores' needs numpy.*sidestream\[wandb\]") as e:
        sink.write(Report(step=0, values={"loss": 0.7}, time=time.time(), histograms=histogram))
    assert is_permanent(e.value)
    monkeypatch.undo()
    sink.close(timeout=60)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"fork_from": "abcd1234?_step=1", "resume": "must"}, "fork_from, resume"),
        ({"resume_from": "abcd1234?_step=1", "resume": "allow"}, "resume, resume_from"),
        ({"fork_from": "abcd1234?_step=1", "resume_from": "abcd1234?_step=1"}, "fork_from, "),
    ],
)
def test_two_ways_to_start_from_an_earlier_run_fail_when_the_sink_is_built(
    options: dict[str, Any], named: str
) -> None:
    # fork_from or resume_from with resume built, and failed only at open on rank 0 once
    # training ran ("fork_from, resume, or resume_from are mutually exclusive").
    from sidestream.sinks import sinks_from_config

    message = rf"{named}.*wandb takes only one of fork_from, resume and resume_from"
    with pytest.raises(ValueError, match=message):
        sinks_from_config({"wandb": {"mode": "offline", **options}})
    with pytest.raises(ValueError, match=message):
        WandbSink(project="p", mode="offline", **options)
    # resume=False is no resume (wandb reads it as None).
    WandbSink(project="p", mode="offline", fork_from="abcd1234?_step=1", resume=False)


def test_a_forked_run_resumed_from_a_checkpoint_continues_the_fork(tmp_path: Path) -> None:
    # The resumed job passed the fork's id with resume="allow" and fork_from again: wandb
    # refused them together at open. And so did a given id with fork_from.
    first = WandbSink(project="p", mode="offline", dir=str(tmp_path), fork_from="abcd1234?_step=1")
    first.open(RunInfo(name="fork"))
    first.write(Report(step=0, values={"loss": 0.5}, time=time.time()))
    assert first.close(timeout=60)
    checkpoint = first.state_dict()
    resumed = WandbSink(
        project="p", mode="offline", dir=str(tmp_path), fork_from="abcd1234?_step=1"
    )
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo(name="fork"))
    assert resumed.run_id == first.run_id
    assert resumed.close(timeout=60)
    named = WandbSink(
        project="p", mode="offline", dir=str(tmp_path), id="myfork01", fork_from="abcd1234?_step=1"
    )
    named.open(RunInfo(name="named fork"))
    assert named.run_id == "myfork01"
    assert named.close(timeout=60)


def _run_record(run_dir: str, timeout: float = 30.0) -> Any:
    """The ``run`` record wandb wrote for the run in ``run_dir`` (W&B's own protobuf).

    As for ``_history``: on a loaded machine the block holding it can reach the disk a moment
    after ``run.finish()`` returned (seen in CI at a load average of 15), so wait for it.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(_data_file(run_dir))
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        if runs or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.parametrize(
    "options",
    [
        {"fork_from": "abcd1234?_step=1"},
        {"resume_from": "abcd1234?_step=1"},
        {"fork_from": "abcd1234?_step=1", "id": "myfork01"},
    ],
    ids=["fork", "rewind", "named-fork"],
)
def test_a_branched_run_opened_again_after_close_continues_the_same_run(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    # The second open passed the run's id with fork_from (or resume_from) again: wandb made a
    # second fork (rewind) under the same id offline, and refuses one online.
    sink = WandbSink(project="p", mode="offline", dir=str(tmp_path), **options)
    run_dirs = []
    for step in range(2):
        sink.open(RunInfo(name="branch"))
        assert sink.run_dir is not None
        run_dirs.append(sink.run_dir)
        sink.write(Report(step=step, values={"loss": 0.5}, time=time.time()))
        assert sink.close(timeout=60)
    made, continued = (_run_record(run_dir) for run_dir in run_dirs)
    assert made.HasField("branch_point") and made.branch_point.run == "abcd1234"
    assert not made.resume
    assert continued.run_id == made.run_id
    assert not continued.HasField("branch_point")
    assert continued.resume  # wandb.init(id=..., resume="allow"): the same run, continued
    assert [row.items["step"] for row in _history(_data_file(run_dirs[1]))] == [1]


def test_a_disabled_run_keeps_no_memory_per_row(tmp_path: Path) -> None:
    """mode="disabled" reads no .wandb file and counts no row by time: a row kept for that
    count was never let go, one per row for the whole job (DESIGN: memory has caps)."""
    import tracemalloc

    sink = WandbSink(project="sidestream-it", mode="disabled", dir=str(tmp_path))
    sink.open(RunInfo(name="disabled"))

    def write(steps: range) -> None:
        for step in steps:
            sink.write(Report(step=step, values={"loss": 1.0}, time=0.0, stream="train"))
        assert sink.flush(1.0)

    write(range(0, 2_000))  # wandb's own caches warmed up
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        write(range(2_000, 22_000))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sink.close(timeout=60)
    # 20,000 rows kept took about 3 MB.
    assert grown < 500_000, grown


def test_a_progress_file_the_full_disk_refused_leaves_no_temporary_and_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk made sidestream-steps.tmp and failed its write: the empty file stayed in the
    # run's directory, and the steps counted as recorded, so the file was not written again.
    import errno

    from sidestream_wandb import sink as sink_module

    run_dir = tmp_path / "offline-run-1"
    run_dir.mkdir()
    sink = WandbSink(project="p", mode="offline", dir=str(tmp_path))
    real = Path.write_text

    def full_disk(self: Path, text: str, *args: Any, **kwargs: Any) -> int:
        real(self, "", *args, **kwargs)  # made, as a full disk does; nothing written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    assert sink._write_progress(str(run_dir), {"train": 3}) is False
    assert sorted(p.name for p in run_dir.iterdir()) == []
    monkeypatch.setattr(Path, "write_text", real)
    assert sink._write_progress(str(run_dir), {"train": 3}) is True
    assert json.loads((run_dir / sink_module.PROGRESS_FILE).read_text()) == {"train": 3}
