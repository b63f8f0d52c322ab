"""A metric with its own ``sync`` and data besides its states (docs/metrics.md's sample buffer).

The collector stages such data with the states, and resets it with them, whether the metric
is the collector's root or a child of a ``ComposeMetric``; the reference is numpy on the
concatenated data of every rank.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import ComposeMetric, MeanMetric, Metric, MetricAccumulator, SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.testing import RankPool

STEPS = (1, 2, 3)


class SampleMedian(Metric[Tensor]):
    """Keeps its samples in a plain tensor attribute and gathers them in its own ``sync``."""

    def __init__(self) -> None:
        self._count = MetricAccumulator(torch.zeros((), dtype=torch.int64))
        self.samples = torch.empty(0, dtype=torch.float64)
        self.gathered: Tensor | None = None

    def update(self, values: Tensor) -> None:
        self.samples = torch.cat([self.samples, values.double()])
        self.gathered = None
        self._count.accumulate(torch.tensor(values.numel()))

    def reset(self) -> None:
        super().reset()
        self.samples = torch.empty(0, dtype=torch.float64)
        self.gathered = None

    def sync(self, group: Any = None) -> None:
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, self.samples, group=group)
        self.gathered = torch.cat(parts)
        super().sync(group)

    def compute(self) -> Tensor:
        data = self.samples if self.gathered is None else self.gathered
        return data.median() if data.numel() else torch.tensor(float("nan"))


class DequeMedian(SampleMedian):
    """The same, its samples a deque of numpy arrays (staged by a copy too)."""

    def __init__(self) -> None:
        super().__init__()
        self.samples = collections.deque()  # type: ignore[assignment]

    def update(self, values: Tensor) -> None:
        self.samples.append(values.double().numpy().copy())  # type: ignore[attr-defined]
        self.gathered = None
        self._count.accumulate(torch.tensor(values.numel()))

    def reset(self) -> None:
        super().reset()
        self.samples = collections.deque()  # type: ignore[assignment]

    def sync(self, group: Any = None) -> None:
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, list(self.samples), group=group)
        self.gathered = torch.from_numpy(np.concatenate([a for part in parts for a in part]))
        Metric.sync(self, group)

    def compute(self) -> Tensor:
        if self.gathered is None:
            local = list(self.samples)  # type: ignore[call-overload]
            data = torch.from_numpy(np.concatenate(local)) if local else torch.empty(0)
        else:
            data = self.gathered
        return data.median() if data.numel() else torch.tensor(float("nan"))


def _data(rank: int, step: int) -> Tensor:
    size = 3 + 2 * rank + step  # uneven across ranks and windows
    return torch.from_numpy(np.random.default_rng([rank, step]).normal(size=size))


def _collect(composed: bool, kind: type[SampleMedian]) -> tuple[list[Any], list[int]]:
    median = kind()
    metric: Metric[Any] = ComposeMetric({"median": median, "mean": MeanMetric()})
    if not composed:
        metric = median
    results, left = [], []
    with AsyncMetricCollector(metric).bind("cpu") as collector:
        for step in STEPS:
            values = _data(dist.get_rank(), step)
            median.update(values)
            if composed:
                metric["mean"].update(values)  # type: ignore[index]
            collector.schedule_collection(step)
            results.append(collector.collect_results(timeout=60))
            left.append(len(median.samples))
    return results, left


@pytest.mark.parametrize("kind", [SampleMedian, DequeMedian], ids=["tensor", "deque"])
def test_own_sync_data_is_staged_and_reset_by_the_collector(
    dist_pool: RankPool, kind: type[SampleMedian]
) -> None:
    world = dist_pool.world_size
    for composed in (False, True):
        outcomes = dist_pool.run(_collect, composed, kind, timeout=120)
        for step, *per_rank in zip(STEPS, *(results for results, _ in outcomes), strict=True):
            data = torch.cat([_data(rank, step) for rank in range(world)]).numpy()
            # torch's median of an even count is the lower middle value, not numpy's mean of two.
            expected = float(np.sort(data)[(data.size - 1) // 2])
            for result in per_rank:
                if composed:
                    assert result["median"] == expected
                    assert abs(result["mean"] - data.mean()) <= 1e-12 * max(1.0, abs(data.mean()))
                else:
                    assert result == expected
        for _, left in outcomes:
            assert left == [0, 0, 0], "the live buffer is reset with the window"


class LoggedCompose(ComposeMetric):
    """A composition that overrides sync (to count its syncs): its children dict is structure."""

    syncs = 0

    def sync(self, group: Any = None) -> None:
        type(self).syncs += 1
        super().sync(group)


def _compose_with_own_sync() -> list[Any]:
    metric = LoggedCompose({"n": SumMetric()})
    results = []
    with AsyncMetricCollector(metric).bind("cpu") as collector:
        for step in (1, 2):
            metric["n"].update(torch.tensor([float(dist.get_rank() + 1)]))
            collector.schedule_collection(step)
            results.append(collector.collect_results(timeout=60)["n"])
    return results


def test_a_composition_that_overrides_sync_reports_the_reduced_children(
    dist_pool: RankPool,
) -> None:
    # Its private dict of children was taken for data and copied from the live metric every
    # window, so compute read the live, unreduced children.
    expected = float(sum(rank + 1 for rank in range(dist_pool.world_size)))
    for results in dist_pool.run(_compose_with_own_sync, timeout=120):
        assert results == [expected, expected]


def _over_a_mesh() -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    values = torch.tensor([float(dist.get_rank() + 1)])
    composed = ComposeMetric({"median": SampleMedian()})
    composed["median"].update(values)
    composed.sync(mesh)  # the child's own sync is handed the mesh's process group
    out = {"composed": float(composed.compute()["median"])}
    median = SampleMedian()
    with AsyncMetricCollector(median, group=mesh).bind("cpu") as collector:
        median.update(values)
        collector.schedule_collection(1)
        out["collector"] = float(collector.collect_results(timeout=60))
    direct = SampleMedian()
    direct.update(values)
    try:
        direct.sync(mesh)  # called directly: the override gets what the caller passed
    except ValueError as error:
        out["direct"] = str(error)
    return out


def test_an_own_sync_under_a_mesh_gets_a_process_group(pools: Any) -> None:
    # A collector or a ComposeMetric over a 1-D DeviceMesh handed the override the mesh, which
    # its all_gather_object refused ("not initialized in the world group map").
    for result in pools.get(2).run(_over_a_mesh, timeout=120):
        assert result["composed"] == 1.0 and result["collector"] == 1.0  # the lower middle of 1, 2
        # torch refuses the mesh itself, as docs/metrics.md says
        assert "direct" in result
