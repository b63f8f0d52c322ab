"""Random sharded data and direct numpy references for the aggregation metrics."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sidestream import MaxMetric, MeanMetric, Metric, MinMetric, SumMetric, WeightedMeanMetric

Shard = dict[str, np.ndarray]


def make_shards(seed: int, world_size: int) -> list[Shard]:
    """Uneven random shards; the last rank gets no data when there are several ranks."""
    rng = np.random.default_rng(seed)
    shards = []
    for rank in range(world_size):
        size = 0 if (world_size > 1 and rank == world_size - 1) else int(rng.integers(1, 200))
        shards.append(
            {
                "values": rng.normal(loc=rank, scale=3.0, size=size).astype(np.float32),
                "weights": rng.integers(0, 50, size=size).astype(np.int64),
            }
        )
    return shards


def concat(shards: list[Shard]) -> Shard:
    return {key: np.concatenate([s[key] for s in shards]) for key in shards[0]}


def batches(shard: Shard, pieces: int = 3) -> list[Shard]:
    """Split a shard into uneven batches, with an empty batch in the middle."""
    n = len(shard["values"])
    cuts = [0, n // 3, n // 3, n]
    return [{k: v[a:b] for k, v in shard.items()} for a, b in itertools.pairwise(cuts)]


def _nan_if_empty(fn: Callable[[np.ndarray], float]) -> Callable[[Shard], float]:
    return lambda d: fn(d["values"]) if len(d["values"]) else float("nan")


@dataclass(frozen=True)
class Case:
    factory: Callable[[], Metric[Any]]
    feed: Callable[[Metric[Any], Shard], None]
    reference: Callable[[Shard], float]


def on_device(metric: Metric[Any], array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor on the metric's device (the CPU, or this rank's GPU on NCCL)."""
    return torch.from_numpy(array).to(metric.device)


def _values(metric: Metric[Any], batch: Shard) -> None:
    metric.update(on_device(metric, batch["values"]))


def _weighted(metric: Metric[Any], batch: Shard) -> None:
    metric.update(
        values=on_device(metric, batch["values"]), weights=on_device(metric, batch["weights"])
    )


def _weighted_reference(d: Shard) -> float:
    v, w = d["values"].astype(np.float64), d["weights"].astype(np.float64)
    return float((v * w).sum() / w.sum()) if w.sum() else float("nan")


CASES: dict[str, Case] = {
    "sum": Case(SumMetric, _values, lambda d: float(d["values"].astype(np.float64).sum())),
    "mean": Case(MeanMetric, _values, _nan_if_empty(lambda v: float(v.astype(np.float64).mean()))),
    "weighted_mean": Case(WeightedMeanMetric, _weighted, _weighted_reference),
    "max": Case(
        MaxMetric, _values, lambda d: float(d["values"].max()) if len(d["values"]) else -np.inf
    ),
    "min": Case(
        MinMetric, _values, lambda d: float(d["values"].min()) if len(d["values"]) else np.inf
    ),
}


def feed(name: str, metric: Metric[Any], shard: Shard) -> None:
    for batch in batches(shard):
        CASES[name].feed(metric, batch)
