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

from tests._scripts import run_python

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_distributed.py"
CUSTOM = ROOT / "examples" / "custom_metric.py"


def _run(launcher: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    arguments = ["--steps", "40", "--log-every", "10", "--val-every", "20", "--samples", "512"]
    # No --plot: the curves go beside --out (they went to runs/demo/ whatever --out said).
    paths = ["--out", str(tmp_path / "metrics.jsonl")]
    return subprocess.run(
        [*launcher, str(SCRIPT), *arguments, *paths],
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # gloo: CI has no GPU
        capture_output=True,
        text=True,
        timeout=300,
    )


def _demo_lr(step: int, steps: int = 40, peak: float = 0.2) -> float:
    """The demo's schedule by its documented rule: 10% linear warm-up, cosine to 10% of peak."""
    warmup = steps // 10
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))))


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
def test_demo_logs_train_val_and_lr_in_one_run(launcher: list[str], tmp_path: Path) -> None:
    done = _run(launcher, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 ranks, 40 steps" in done.stdout
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_stream: dict[str, dict[int, dict[str, float]]] = {}
    for line in lines:
        steps = by_stream.setdefault(line["stream"], {})
        assert line["step"] not in steps, line  # once each: rank 0 only
        steps[line["step"]] = line["values"]
    assert {name: sorted(steps) for name, steps in by_stream.items()} == {
        "train": [10, 20, 30, 40],
        "val": [20, 40],
        "": [10, 20, 30, 40],
    }
    for values in by_stream["train"].values():
        assert set(values) == {"train/loss", "train/accuracy", "train/max_loss"}
        assert 0.0 <= values["train/accuracy"] <= 1.0
        assert 0.0 < values["train/loss"] <= values["train/max_loss"]
    for values in by_stream["val"].values():
        assert set(values) == {"val/loss", "val/accuracy"}
        assert 0.0 <= values["val/accuracy"] <= 1.0 and values["val/loss"] > 0.0
    # run.log wrote the learning rate the optimizer used at each logged step.
    for step, values in by_stream[""].items():
        assert values == {"lr": pytest.approx(_demo_lr(step - 1), rel=1e-12)}
    # It trains: the last window's loss is below the first one's, in both streams.
    assert by_stream["train"][40]["train/loss"] < by_stream["train"][10]["train/loss"]
    assert by_stream["val"][40]["val/loss"] < by_stream["val"][20]["val/loss"]
    # The plot: printed, and a PNG.
    image = tmp_path / "curves.png"
    assert f"curves: {image}" in done.stdout
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(image) as png:
        png.verify()
    # TensorBoard, read with its own reader: the same streams, steps and values.
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    guidance = dict.fromkeys(event_accumulator.DEFAULT_SIZE_GUIDANCE, 0)
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"), guidance).Reload()
    written = {
        tag: {e.step: e.value for e in reader.Scalars(tag)} for tag in reader.Tags()["scalars"]
    }
    want = {
        name: {step: values[name] for step, values in steps.items() if name in values}
        for steps in by_stream.values()
        for name in {name for values in steps.values() for name in values}
    }
    assert sorted(written) == sorted(want)
    for name, steps in want.items():
        assert written[name] == {step: pytest.approx(v, rel=1e-6) for step, v in steps.items()}


def test_demo_leaves_its_process_group_destroyable() -> None:
    # torch.distributed.nn (DDP imports it) holds the default group in its functions' defaults
    # when first imported after init_process_group: destroy_process_group() then frees nothing,
    # and gloo aborts a rank's exit now and then. The demo imports it before any group.
    check = f"""
import gc, importlib.util, sys, tempfile
import torch, torch.distributed as dist
spec = importlib.util.spec_from_file_location("demo", {str(SCRIPT)!r})
spec.loader.exec_module(importlib.util.module_from_spec(spec))
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
group = dist.group.WORLD
before = sys.getrefcount(group)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
del model
gc.collect()
print(sys.getrefcount(group) - before)
dist.destroy_process_group()
"""
    done = run_python("-c", check, CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0"]


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


def _expected(record: Path) -> dict[str, dict[int, float]]:
    """Every logged series of a tracker example, computed from its recorded raw values.

    Train windows close every 10 steps, validation windows every 20 (one evaluation each);
    the learning rate is 0.5, times 0.2 from step 21 on (StepLR, step size 20 of 40 steps).
    """
    samples: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for line in record.read_text().splitlines():
        stream, step, losses, correct = json.loads(line)
        window = -(-step // 10) * 10 if stream == "train" else step
        kept = samples.setdefault((stream, window), ([], []))
        kept[0].extend(losses)
        kept[1].extend(correct)
    series: dict[str, dict[int, float]] = {}
    for (stream, step), (losses, correct) in samples.items():
        series.setdefault(f"{stream}/loss", {})[step] = float(np.mean(losses))
        series.setdefault(f"{stream}/accuracy", {})[step] = float(np.mean(correct))
    series["lr"] = {step: 0.5 * 0.2 ** ((step - 1) // 20) for step in (10, 20, 30, 40)}
    assert {name: sorted(steps) for name, steps in series.items()} == {
        "train/loss": [10, 20, 30, 40],
        "train/accuracy": [10, 20, 30, 40],
        "val/loss": [20, 40],
        "val/accuracy": [20, 40],
        "lr": [10, 20, 30, 40],
    }
    return series


def _tracker_example(
    name: str, tmp_path: Path, env: dict[str, str] | None = None
) -> tuple[Path, dict[str, dict[int, float]]]:
    out, record = tmp_path / "out", tmp_path / "record.jsonl"
    script = ROOT / "examples" / f"track_{name}.py"
    command = [sys.executable, str(script), "--out", str(out), "--steps", "40"]
    _run_example([*command, "--log-every", "10", "--val-every", "20", "--record", str(record)], env)
    return out, _expected(record)


def _assert_series(
    got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], rel: float
) -> None:
    assert sorted(got) == sorted(want)
    for name, steps in want.items():
        assert got[name] == {step: pytest.approx(v, rel=rel) for step, v in steps.items()}, name


@pytest.mark.integration
def test_wandb_example_writes_every_stream_offline(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from tests.integrations.wandb_reader import read_history

    out, want = _tracker_example("wandb", tmp_path, {"WANDB_SILENT": "true"})
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # one W&B run for all three streams
    (data,) = runs[0].glob("*.wandb")
    rows_wanted = sum(len(steps) for name, steps in want.items() if not name.endswith("accuracy"))
    # wandb's service process may land the last block just after the script exits.
    deadline = time.monotonic() + 30
    while len(rows := read_history(data)) < rows_wanted and time.monotonic() < deadline:
        time.sleep(0.5)
    got: dict[str, dict[int, float]] = {}
    for row in rows:  # each row carries its stream's step metric: train/step, val/step, step
        for name, value in row.items.items():
            stream = name.rpartition("/")[0]
            if name in want:
                step = row.items[f"{stream}/step" if stream else "step"]
                assert step not in got.setdefault(name, {}), (name, step)  # once each
                got[name][step] = value
    _assert_series(got, want, 1e-12)


@pytest.mark.integration
def test_mlflow_example_writes_every_stream_to_sqlite(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    out, want = _tracker_example("mlflow", tmp_path, {"MLFLOW_DISABLE_TELEMETRY": "true"})
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("sidestream-examples")
    (run,) = client.search_runs([experiment.experiment_id])  # one run for all three streams
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "track-mlflow"
    got: dict[str, dict[int, float]] = {}
    for name in run.data.metrics:
        history = client.get_metric_history(run.info.run_id, name)
        got[name] = {m.step: m.value for m in history}
        assert len(got[name]) == len(history), name  # each step once
    _assert_series(got, want, 1e-12)


@pytest.mark.integration
def test_tensorboard_example_writes_every_stream(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    out, want = _tracker_example("tensorboard", tmp_path)
    assert len(list(out.glob("events.out.tfevents.*"))) == 1  # one run directory, one file
    guidance = dict.fromkeys(event_accumulator.DEFAULT_SIZE_GUIDANCE, 0)
    reader = event_accumulator.EventAccumulator(str(out), size_guidance=guidance).Reload()
    got: dict[str, dict[int, float]] = {}
    for name in reader.Tags()["scalars"]:
        events = reader.Scalars(name)
        got[name] = {e.step: e.value for e in events}
        assert len(got[name]) == len(events), name  # each step once
    _assert_series(got, want, 1e-6)  # TensorBoard stores float32


def test_examples_with_ddp_import_torch_distributed_nn_before_any_group() -> None:
    # manual_loop.py did not: under torchrun a rank's exit aborted now and then ("terminate
    # called without an active exception", a CI failure), see train_distributed.py's main().
    for example in sorted((ROOT / "examples").glob("*.py")):
        text = example.read_text()
        if "DistributedDataParallel" in text:
            imported = text.find("import torch.distributed.nn")
            assert 0 <= imported < text.find("init_process_group("), example.name


def test_examples_start_under_python_OO() -> None:
    """``python -OO`` strips docstrings: each example read its --help text from ``__doc__``
    and failed at start with AttributeError ('NoneType' object has no attribute 'splitlines')."""
    scripts = sorted(str(path) for path in (ROOT / "examples").glob("*.py"))
    code = (
        "import runpy, sys\n"
        "for script in sys.argv[1:]:\n"
        "    sys.argv = [script, '--help']\n"
        "    try:\n"
        "        runpy.run_path(script, run_name='__main__')\n"
        "    except SystemExit as done:\n"
        "        assert done.code in (0, None), (script, done.code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-OO", "-c", code, *scripts],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("usage:") == len(scripts)
