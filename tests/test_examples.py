"""The demo script runs both ways it documents: starting its own ranks, and under torchrun."""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
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
