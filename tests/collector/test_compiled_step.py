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
        frames = counters["frames"]["total"]
        for i in range(6, 11):
            step(torch.full((4,), float(i)), i)
        assert counters["frames"]["total"] == frames, "nothing compiled again after warm-up"
    assert reasons, "the calls break the graph (they are host work)"
    # At each call, never inside it; the first compiled call of a wrapper also breaks once on
    # the wrapper's own setup (made lazily: torch._dynamo is not imported by sidestream).
    setup = ("`skip_code`", "function `disable`")
    assert all(
        "torch.compiler.disable" in reason or any(name in reason for name in setup)
        for reason in reasons
    ), reasons
    assert frames <= 15, frames  # 49 when Dynamo traced into them
    assert alone.compute().item() == 11.0  # the mean of 2, 4, ..., 20
    records = list(read_jsonl(tmp_path / "m.jsonl"))
    trained = {r["step"]: r["values"]["train"] for r in records if "train" in r["values"]}
    assert trained == {i: 2.0 * i for i in range(1, 11)}
    assert sorted(r["step"] for r in records if "lr" in r["values"]) == list(range(1, 11))
