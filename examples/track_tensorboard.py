"""A small training run logged to TensorBoard event files.

One ``Run`` holds the job's three streams in one TensorBoard run directory: ``train`` windows
every ``--log-every`` steps, ``val`` windows every ``--val-every`` steps and the learning rate.
The sinks come from a config dict, as they would from a YAML file. Look at the run with
``tensorboard --logdir runs/tensorboard-example``.

    pip install ./integrations/sidestream-tensorboard  # or: pip install "sidestream[tensorboard]"
    python examples/track_tensorboard.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from sidestream import ComposeMetric, MeanMetric, Run
from sidestream.sinks import RunInfo, sinks_from_config


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/tensorboard-example"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--record", type=Path, help="append each step's raw values (for tests)")
    args = parser.parse_args()

    config = {"tensorboard": {"log_dir": str(args.out)}}

    torch.manual_seed(0)
    true_weights = torch.randn(8, 4)
    val_inputs = torch.randn(256, 8)
    val_labels = (val_inputs @ true_weights).argmax(1)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.steps // 2, gamma=0.2)

    info = RunInfo(name="track-tensorboard", config={"lr": 0.5, "steps": args.steps})
    run = Run(sinks_from_config(config), info=info)
    train_metrics = ComposeMetric({"loss": MeanMetric(), "accuracy": MeanMetric()})
    val_metrics = ComposeMetric({"loss": MeanMetric(), "accuracy": MeanMetric()})
    train = run.collector(train_metrics, prefix="train").bind("cpu")
    val = run.collector(val_metrics, prefix="val").bind("cpu")
    for step in range(1, args.steps + 1):
        inputs = torch.randn(32, 8)
        labels = (inputs @ true_weights).argmax(1)
        logits = model(inputs)
        losses = nn.functional.cross_entropy(logits, labels, reduction="none")
        optimizer.zero_grad()
        losses.mean().backward()
        optimizer.step()

        correct = (logits.argmax(1) == labels).float()
        train_metrics["loss"].update(losses.detach())
        train_metrics["accuracy"].update(correct)
        _record(args.record, "train", step, losses, correct)
        if step % args.log_every == 0:
            train.schedule_collection(step)  # returns at once
            run.log(step, {"lr": schedule.get_last_lr()[0]})
        if step % args.val_every == 0:
            with torch.no_grad():
                val_logits = model(val_inputs)
            val_losses = nn.functional.cross_entropy(val_logits, val_labels, reduction="none")
            val_correct = (val_logits.argmax(1) == val_labels).float()
            val_metrics["loss"].update(val_losses)
            val_metrics["accuracy"].update(val_correct)
            _record(args.record, "val", step, val_losses, val_correct)
            val.schedule_collection(step)
        schedule.step()
    if not run.close():  # delivers every window of every stream, then closes the event file
        raise SystemExit(f"not everything reached TensorBoard: {run.sink_status}")
    print(f"TensorBoard event files in {args.out}")


def _record(
    path: Path | None, stream: str, step: int, losses: torch.Tensor, correct: torch.Tensor
) -> None:
    """The test's own copy of what went into the metrics (reads values: for tests only)."""
    if path is not None:
        with path.open("a") as record:
            print(json.dumps([stream, step, losses.tolist(), correct.tolist()]), file=record)


if __name__ == "__main__":
    main()
