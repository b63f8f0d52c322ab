"""docs/runs.md: a resumed job that adds a collector the checkpoint lacks loads the run with
``DefaultLoadPlanner(allow_partial_load=True)``, and the new collector starts from zero.

DCP leaves the new collector's part at its own template; the metric's partial-load check took
that for a checkpoint of it lacking its states and refused the whole run with ``KeyError``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from sidestream import MeanMetric, Run
from sidestream.sinks import JsonlSink, read_jsonl


def test_a_collector_added_since_the_checkpoint_starts_from_zero(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)])
    train = run.collector(MeanMetric(), prefix="train").bind("cpu")
    train.metric.update(torch.tensor([1.0, 2.0]))
    train.schedule_collection(1)
    train.metric.update(torch.tensor([3.0]))  # mid-window at the checkpoint
    dcp.save({"run": run}, checkpoint_id=tmp_path / "ckpt")
    run.close()

    resumed = Run([JsonlSink(path)])
    train = resumed.collector(MeanMetric(), prefix="train")
    val = resumed.collector(MeanMetric(), prefix="val")  # not in the checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            {"run": resumed},
            checkpoint_id=tmp_path / "ckpt",
            planner=DefaultLoadPlanner(allow_partial_load=True),
        )
    train.bind("cpu")
    val.bind("cpu")
    train.metric.update(torch.tensor([5.0]))
    val.metric.update(torch.tensor([7.0]))
    train.schedule_collection(2)
    val.schedule_collection(2)
    resumed.close()
    # Streams reach a sink in any order at one step: compared by (step, stream).
    rows = sorted(
        ((r["step"], r["stream"], r["values"]) for r in read_jsonl(path)), key=lambda r: r[:2]
    )
    assert rows == [
        (1, "train", {"train": (1.0 + 2.0) / 2}),
        (2, "train", {"train": (3.0 + 5.0) / 2}),  # the saved mid-window sample continued
        (2, "val", {"val": 7.0}),
    ]
