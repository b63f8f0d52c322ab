"""The demo script runs both ways it documents: starting its own ranks, and under torchrun."""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import brier_score_loss

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_distributed.py"
CUSTOM = ROOT / "examples" / "custom_metric.py"


def _run(launcher: list[str], out: Path) -> subprocess.CompletedProcess[str]:
    arguments = ["--steps", "40", "--log-every", "10", "--samples", "512", "--out", str(out)]
    return subprocess.run(
        [*launcher, str(SCRIPT), *arguments],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # gloo: CI has no GPU
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param([sys.executable], id="spawn"),
        pytest.param(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
            id="torchrun",
        ),
    ],
)
def test_demo_logs_every_window_from_rank_zero(launcher: list[str], tmp_path: Path) -> None:
    out = tmp_path / "metrics.jsonl"
    done = _run(launcher, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 ranks, 40 steps" in done.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["step"] for line in lines] == [10, 20, 30, 40]  # once each: rank 0 only
    for line in lines:
        values = line["values"]
        assert set(values) == {"train/loss", "train/accuracy", "train/max_loss"}
        assert 0.0 <= values["train/accuracy"] <= 1.0
        assert 0.0 < values["train/loss"] <= values["train/max_loss"]
        assert all(math.isfinite(v) for v in values.values())
    # It trains: the last window's loss is below the first one's.
    assert lines[-1]["values"]["train/loss"] < lines[0]["values"]["train/loss"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_custom_metric_example_matches_sklearn_on_all_ranks_data(world_size: int) -> None:
    done = subprocess.run(
        [sys.executable, str(CUSTOM), "--world-size", str(world_size), "--samples", "700"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    example = runpy.run_path(str(CUSTOM))  # its make_data, to rebuild every rank's data
    parts = [example["make_data"](rank, 700) for rank in range(world_size)]
    probs = np.concatenate([p for p, _ in parts])
    target = np.concatenate([t for _, t in parts])
    assert printed == {
        "world_size": world_size,
        "brier": pytest.approx(brier_score_loss(target, probs), rel=1e-12),
    }


def test_custom_metric_rejects_mismatched_shapes() -> None:
    example = runpy.run_path(str(CUSTOM))
    metric = example["BrierScoreMetric"]()
    with pytest.raises(ValueError, match=r"target: expected the shape of probs \(3,\)"):
        metric.update(torch.rand(3), torch.zeros(4))
    assert math.isnan(float(metric.compute()))  # nothing was added


MANUAL = ROOT / "examples" / "manual_loop.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def _run_example(command: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(
    "launcher",
    [pytest.param([sys.executable], id="1-process"), pytest.param(TORCHRUN, id="torchrun-2")],
)
def test_manual_loop_prints_the_token_weighted_loss_of_every_rank(
    launcher: list[str], tmp_path: Path
) -> None:
    epochs, world_size = 3, 1 if len(launcher) == 1 else 2
    stdout = _run_example(
        [*launcher, str(MANUAL), "--epochs", str(epochs), "--steps", "6", "--record", str(tmp_path)]
    )
    printed = [line for line in stdout.splitlines() if line.startswith("epoch ")]
    assert len(printed) == epochs, stdout  # rank 0 only
    records = [
        json.loads(line)
        for rank in range(world_size)
        for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
    ]
    assert len(records) == epochs * 6 * world_size
    for epoch, line in enumerate(printed):
        rows = np.array([(loss, tokens) for e, loss, tokens in records if e == epoch])
        want = np.sum(rows[:, 0] * rows[:, 1]) / np.sum(rows[:, 1])
        assert line.startswith(f"epoch {epoch}: token-weighted loss ")
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(want, rel=1e-12)
    # It trains: the last epoch's loss is below the first one's.
    assert float(printed[-1].rsplit(" ", 1)[1]) < float(printed[0].rsplit(" ", 1)[1])


def _windows(record: Path, every: int) -> dict[int, dict[str, float]]:
    """Each logged window's mean loss and accuracy, computed from the recorded raw values."""
    losses: dict[int, list[float]] = {}
    correct: dict[int, list[float]] = {}
    for line in record.read_text().splitlines():
        step, step_losses, step_correct = json.loads(line)
        window = -(-step // every) * every  # the step that logs this one's window
        losses.setdefault(window, []).extend(step_losses)
        correct.setdefault(window, []).extend(step_correct)
    return {
        step: {
            "train/loss": float(np.mean(losses[step])),
            "train/accuracy": float(np.mean(correct[step])),
        }
        for step in losses
    }


def _tracker_example(
    name: str, tmp_path: Path, env: dict[str, str] | None = None
) -> tuple[Path, dict[int, dict[str, float]]]:
    out, record = tmp_path / "out", tmp_path / "record.jsonl"
    script = ROOT / "examples" / f"track_{name}.py"
    command = [sys.executable, str(script), "--out", str(out), "--steps", "40", "--log-every", "10"]
    _run_example([*command, "--record", str(record)], env)
    want = _windows(record, 10)
    assert sorted(want) == [10, 20, 30, 40]
    return out, want


@pytest.mark.integration
def test_wandb_example_writes_every_window_offline(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from tests.integrations.wandb_reader import read_history

    out, want = _tracker_example("wandb", tmp_path, {"WANDB_SILENT": "true"})
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    (data,) = runs[0].glob("*.wandb")
    # wandb's service process may land the last block just after the script exits.
    deadline = time.monotonic() + 30
    while len(rows := read_history(data)) < len(want) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [row.step for row in rows] == sorted(want)
    for row in rows:
        for key, value in want[row.step].items():
            assert row.items[key] == pytest.approx(value, rel=1e-12), (key, row.step)


@pytest.mark.integration
def test_mlflow_example_writes_every_window_to_sqlite(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    out, want = _tracker_example("mlflow", tmp_path, {"MLFLOW_DISABLE_TELEMETRY": "true"})
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sidestream-examples")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "track-mlflow"
    assert sorted(run.data.metrics) == ["train/accuracy", "train/loss"]
    for key in run.data.metrics:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == sorted(want)
        for metric in history:
            assert metric.value == pytest.approx(want[metric.step][key], rel=1e-12)


@pytest.mark.integration
def test_tensorboard_example_writes_every_window(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    out, want = _tracker_example("tensorboard", tmp_path)
    guidance = dict.fromkeys(event_accumulator.DEFAULT_SIZE_GUIDANCE, 0)
    reader = event_accumulator.EventAccumulator(str(out), size_guidance=guidance).Reload()
    assert sorted(reader.Tags()["scalars"]) == ["train/accuracy", "train/loss"]
    for key in reader.Tags()["scalars"]:
        events = reader.Scalars(key)
        assert [e.step for e in events] == sorted(want)
        for event in events:
            # TensorBoard stores float32.
            assert event.value == pytest.approx(want[event.step][key], rel=1e-6)
