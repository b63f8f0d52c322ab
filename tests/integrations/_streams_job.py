"""A job with train, validation and plain-value streams in one ``Run`` (runs on every rank).

Data come from generators seeded by (kind, rank, step), so the test process recomputes every
logged value directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sidestream import ComposeMetric, MeanMetric, Run
from sidestream.sinks import RunInfo, sinks_from_config

WORLD_SIZE = 2
TRAIN_EVERY = 10
VAL_STEPS = (50, 100)
LAST_STEP = 110  # validation at 100 is scheduled after the training window of 110


def losses(kind: str, rank: int, step: int) -> np.ndarray:
    """One rank's losses of one step (``kind`` "train" or "val"); sizes vary."""
    rng = np.random.default_rng([len(kind), rank, step])
    return rng.gamma(2.0, 0.5, 2 + (rank * 3 + step) % 5)


def lr(step: int) -> float:
    return 0.1 / step


def expected_train(step: int) -> float:
    """The training window ending at ``step``: every rank's losses of its ten steps."""
    window = range(step - TRAIN_EVERY + 1, step + 1)
    data = [losses("train", r, s) for s in window for r in range(WORLD_SIZE)]
    return float(np.concatenate(data).mean())


def expected_val(step: int) -> float:
    return float(np.concatenate([losses("val", r, step) for r in range(WORLD_SIZE)]).mean())


def config(root: str, mlflow_uri: str) -> dict[str, Any]:
    return {
        "jsonl": {"path": f"{root}/run.jsonl"},
        "tensorboard": {"log_dir": f"{root}/tb"},
        "mlflow": {"tracking_uri": mlflow_uri, "experiment": "streams"},
        "wandb": {"project": "streams", "mode": "offline", "dir": root},
    }


def job(
    root: str,
    mlflow_uri: str,
    steps: range,
    state: dict[str, Any] | None = None,
    checkpoint_at: int | None = None,
) -> dict[str, Any]:
    """Train over ``steps``; optionally resume from ``state`` / checkpoint after a step."""
    rank = dist.get_rank()
    run = Run(
        sinks_from_config(config(root, mlflow_uri)),
        info=RunInfo(name="streams", config={"lr": 0.1}),
        sink_retry_initial_s=0.05,
        sink_retry_max_s=0.5,
    )
    if state is not None:
        run.load_state_dict(state)
    train = run.collector(ComposeMetric({"loss": MeanMetric()}), prefix="train").bind("cpu")
    val = run.collector(ComposeMetric({"loss": MeanMetric()}), prefix="val").bind("cpu")
    checkpoint = None
    for step in steps:
        train.metric["loss"].update(torch.from_numpy(losses("train", rank, step)))
        if step in VAL_STEPS:
            val.metric["loss"].update(torch.from_numpy(losses("val", rank, step)))
        if step % TRAIN_EVERY == 0:
            train.schedule_collection(step)
            # Only rank 0's values are written: rank 1 logs something else to show it.
            run.log(step, {"lr": lr(step) if rank == 0 else -1.0})
        if step - TRAIN_EVERY in VAL_STEPS:
            # Make the sinks get the validation window after a later training window: the
            # case a tracker that wants steps in order would drop.
            train.wait_windows(60)
            val.schedule_collection(step - TRAIN_EVERY)
        if step == checkpoint_at:
            checkpoint = run.state_dict()
    closed = run.close(timeout=120)
    return {
        "closed": closed,
        "checkpoint": checkpoint,
        "runners": len(run.sink_runners),
        "status": {key: status.state for key, status in run.sink_status.items()},
        "files": sorted(str(p.relative_to(root)) for p in Path(root).rglob("*")),
    }
