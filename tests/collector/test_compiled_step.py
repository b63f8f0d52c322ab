"""A training step compiled whole may call the collector, the run and a sync.

Dynamo traced into ``schedule_collection`` and ``run.log`` (locks, queues, the slots' copies,
the sync's layout) and broke the step's graph inside them: 49 frames compiled for 5 steps
instead of 5, about 200 µs more a step on one CPU thread. They run eagerly now, never traced:
the step's graph breaks at each call and nowhere inside.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch._dynamo.utils import counters

from sidestream import MeanMetric, Run
from sidestream.sinks import JsonlSink, read_jsonl


def test_a_compiled_step_is_not_traced_into_the_host_calls_and_delivers(tmp_path: Path) -> None:
    torch._dynamo.reset()
    metric = MeanMetric()
    alone = MeanMetric()
    with Run([JsonlSink(tmp_path / "m.jsonl")]) as run:
        collector = run.collector(metric, prefix="train").bind("cpu")

        @torch.compile(backend="aot_eager")
        def step(x: torch.Tensor, i: int) -> torch.Tensor:
            y = x * 2
            metric.update(y)
            collector.schedule_collection(i)
            run.log(i, {"lr": 0.5})
            alone.update(y)
            alone.sync()
            return y + 1

        counters.clear()
        for i in range(1, 6):
            step(torch.full((4,), float(i)), i)
        reasons = list(counters["graph_break"])
    assert reasons, "the calls break the graph (they are host work)"
    assert all("torch.compiler.disable" in reason for reason in reasons), reasons
    assert alone.compute().item() == 6.0  # the mean of 2, 4, ..., 10
    records = list(read_jsonl(tmp_path / "m.jsonl"))
    trained = {r["step"]: r["values"]["train"] for r in records if "train" in r["values"]}
    assert trained == {i: 2.0 * i for i in range(1, 6)}
    assert sorted(r["step"] for r in records if "lr" in r["values"]) == [1, 2, 3, 4, 5]
