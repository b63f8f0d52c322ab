"""Cost of one metric sync on 4 gloo ranks: sidestream vs torchmetrics vs a per-tensor loop."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from sidestream import (
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    MinMetric,
    SumMetric,
    WeightedMeanMetric,
)
from sidestream.testing import DistributedPool

WORLD_SIZE = 4
REPEATS = 20


def _counting_collectives() -> tuple[dict[str, int], Any]:
    counts = {"n": 0}
    originals = {}
    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "all_gather_object",
    ):
        original = getattr(dist, name)
        originals[name] = original

        def wrapper(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            counts["n"] += 1
            return __original(*args, **kwargs)

        setattr(dist, name, wrapper)

    def restore() -> None:
        for name, original in originals.items():
            setattr(dist, name, original)

    return counts, restore


def _time_sync(sync: Any) -> tuple[float, int]:
    sync()  # warm-up
    dist.barrier()
    counts, restore = _counting_collectives()
    try:
        sync()
        per_sync = counts["n"]
    finally:
        restore()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(REPEATS):
        sync()
    dist.barrier()
    return (time.perf_counter() - start) / REPEATS, per_sync


def _measure() -> dict[str, tuple[float, int]]:
    import torchmetrics

    values = torch.randn(256)
    weights = torch.randint(0, 5, (256,)).float()

    ours = ComposeMetric(
        {
            "mean": MeanMetric(),
            "sum": SumMetric(),
            "max": MaxMetric(),
            "min": MinMetric(),
            "weighted": WeightedMeanMetric(),
        }
    )
    for name in ("mean", "sum", "max", "min"):
        ours[name].update(values)
    ours["weighted"].update(values=values, weights=weights)

    theirs = torchmetrics.MetricCollection(
        {
            "mean": torchmetrics.MeanMetric(),
            "sum": torchmetrics.SumMetric(),
            "max": torchmetrics.MaxMetric(),
            "min": torchmetrics.MinMetric(),
        },
        compute_groups=False,
    )
    weighted = torchmetrics.MeanMetric()
    theirs.update(values)
    weighted.update(values, weights)

    def torchmetrics_sync() -> None:
        for metric in [*theirs.values(), weighted]:
            metric.sync(should_sync=True, distributed_available=lambda: True)
            metric.unsync()

    states = [acc.local for _, acc in ours.named_accumulators()]

    def loop_sync() -> None:
        for state in states:
            dist.all_reduce(state.clone())

    return {
        "sidestream": _time_sync(ours.sync),
        "torchmetrics": _time_sync(torchmetrics_sync),
        "all_reduce per tensor": _time_sync(loop_sync),
    }


def run() -> str:
    with DistributedPool(WORLD_SIZE) as pool:
        result = pool.run(_measure, timeout=600)[0]
    ours_time, ours_count = result["sidestream"]
    lines = [
        f"## Sync of five aggregation metrics on {WORLD_SIZE} gloo ranks\n",
        "mean, sum, max, min and a weighted mean; one sync, mean of "
        f"{REPEATS} repeats on rank 0.\n",
        "| implementation | collectives per sync | ms per sync | time / sidestream |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (seconds, count) in result.items():
        lines.append(f"| {name} | {count} | {seconds * 1e3:.2f} | {seconds / ours_time:.1f}x |")
    print("\n".join(lines))
    assert ours_count > 0
    return "\n".join(lines) + "\n"
