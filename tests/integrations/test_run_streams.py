"""One Run, four real trackers, three streams on two ranks; checkpoint, restart, resume.

Read back with each tracker's own reader: exactly one run per tracker holding ``train/loss``,
``val/loss`` and ``lr`` at every step they were logged, once, each value checked against a
direct computation on both ranks' data.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidestream.sinks import read_jsonl
from sidestream.testing import RankPool
from tests.integrations._streams_job import (
    LAST_STEP,
    TRAIN_EVERY,
    VAL_STEPS,
    expected_train,
    expected_val,
    job,
    lr,
)
from tests.integrations.wandb_reader import read_history, run_id_of

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing import event_accumulator

TRAIN_STEPS = list(range(TRAIN_EVERY, LAST_STEP + 1, TRAIN_EVERY))
STREAMS = {"train/loss": TRAIN_STEPS, "val/loss": list(VAL_STEPS), "lr": TRAIN_STEPS}


def _want(name: str, step: int) -> float:
    if name == "train/loss":
        return expected_train(step)
    if name == "val/loss":
        return expected_val(step)
    return lr(step)


def _check_series(series: dict[str, list[tuple[int, float]]], tracker: str, rtol: float) -> None:
    assert sorted(series) == sorted(STREAMS), tracker
    for name, points in series.items():
        assert sorted(step for step, _ in points) == STREAMS[name], f"{tracker}: {name}"
        for step, value in points:
            np.testing.assert_allclose(
                value, _want(name, step), rtol=rtol, err_msg=f"{tracker}: {name}@{step}"
            )


def _check_trackers(root: Path, mlflow_uri: str, jobs: int) -> None:
    # JSONL: lines in delivery order; validation at 50 arrived after training up to 60.
    records = list(read_jsonl(root / "run.jsonl"))
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for record in records:
        for name, value in record["values"].items():
            series[name].append((record["step"], value))
    _check_series(series, "jsonl", 1e-12)
    order = [(r["stream"], r["step"]) for r in records]
    assert order.index(("val", 50)) > order.index(("train", 60))

    # TensorBoard: one log directory with one event file per job (none from rank 1).
    assert len(list((root / "tb").glob("*tfevents*"))) == jobs
    guidance = dict.fromkeys(event_accumulator.DEFAULT_SIZE_GUIDANCE, 0)
    accumulator = event_accumulator.EventAccumulator(
        str(root / "tb"), size_guidance=guidance, purge_orphaned_data=False
    ).Reload()
    tb = {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }
    _check_series(tb, "tensorboard", 1e-6)

    # MLflow: exactly one run in the experiment.
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("streams")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "streams"
    mlflow_series = {
        name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        for name in run.data.metrics
    }
    _check_series(mlflow_series, "mlflow", 1e-12)

    # W&B offline: each job wrote a directory of the same run id; every row carries its
    # stream's step metric, so out-of-order validation rows were kept, not dropped.
    files = sorted((root / "wandb").glob("offline-run-*/*.wandb"))
    assert len(files) == jobs
    assert len({run_id_of(f) for f in files}) == 1
    wandb_series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for file in files:
        for row in read_history(file):
            for name in STREAMS:
                if name in row.items:
                    key = {"train/loss": "train/step", "val/loss": "val/step"}.get(name, "step")
                    wandb_series[name].append((row.items[key], row.items[name]))
    _check_series(wandb_series, "wandb", 1e-12)


def _check_ranks(results: list[dict[str, Any]]) -> None:
    assert [r["closed"] for r in results] == [True, True]
    assert [r["runners"] for r in results] == [4, 0], "rank 1 opened no sink"
    assert results[0]["status"] == dict.fromkeys(
        ["jsonl", "tensorboard", "mlflow", "wandb"], "healthy"
    )


def test_one_run_per_tracker_with_every_stream(
    tmp_path: Path, shm_path: Path, pool2: RankPool
) -> None:
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    results = pool2.run(job, str(tmp_path), uri, range(1, LAST_STEP + 1), timeout=300)
    _check_ranks(results)
    _check_trackers(tmp_path, uri, jobs=1)


def test_checkpoint_restart_resume_every_step_once_in_the_same_runs(
    tmp_path: Path, shm_path: Path, pool2: RankPool
) -> None:
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    # The first job checkpoints after step 75, logs on to 80 (the window of 80 and its lr reach
    # every tracker), then dies; the restarted job resumes from the checkpoint at step 76.
    first = pool2.run(job, str(tmp_path), uri, range(1, 81), checkpoint_at=75, timeout=300)
    _check_ranks(first)
    state = first[0]["checkpoint"]
    assert state["sinks"]["jsonl"]["last_steps"] == [["", 70], ["train", 70], ["val", 50]]
    second = pool2.run(job, str(tmp_path), uri, range(76, LAST_STEP + 1), state, timeout=300)
    _check_ranks(second)
    _check_trackers(tmp_path, uri, jobs=2)
