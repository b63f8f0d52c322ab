"""A small training run logged to MLflow, into a local SQLite store (no server needed).

The sinks come from a config dict, as they would from a YAML file. Look at the run with
``mlflow ui --backend-store-uri sqlite:///runs/mlflow-example/mlflow.db``.

    pip install ./integrations/sidestream-mlflow   # or: pip install "sidestream[mlflow]"
    python examples/track_mlflow.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from sidestream import ComposeMetric, MeanMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import RunInfo, sinks_from_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/mlflow-example"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--record", type=Path, help="append each step's raw values (for tests)")
    args = parser.parse_args()

    store = f"sqlite:///{args.out.resolve() / 'mlflow.db'}"
    config = {"mlflow": {"tracking_uri": store, "experiment": "sidestream-examples"}}
    args.out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    true_weights = torch.randn(8, 4)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = ComposeMetric({"loss": MeanMetric(), "accuracy": MeanMetric()})
    collector = AsyncMetricCollector(
        metrics,
        sinks=sinks_from_config(config),
        prefix="train",
        run=RunInfo(name="track-mlflow", config={"lr": 0.1, "steps": args.steps}),
    )
    collector.bind("cpu")  # rank 0 (here: the only process) opens the sinks
    for step in range(1, args.steps + 1):
        inputs = torch.randn(32, 8)
        labels = (inputs @ true_weights).argmax(1)
        logits = model(inputs)
        losses = nn.functional.cross_entropy(logits, labels, reduction="none")
        optimizer.zero_grad()
        losses.mean().backward()
        optimizer.step()

        correct = (logits.argmax(1) == labels).float()
        metrics["loss"].update(losses.detach())
        metrics["accuracy"].update(correct)
        if args.record is not None:
            with args.record.open("a") as record:
                print(json.dumps([step, losses.tolist(), correct.tolist()]), file=record)
        if step % args.log_every == 0:
            collector.schedule_collection(step)  # returns at once
    if not collector.close():  # delivers every window, then ends the MLflow run
        raise SystemExit("some windows did not reach MLflow: see the warning above")
    print(f"MLflow run in {store}")


if __name__ == "__main__":
    main()
