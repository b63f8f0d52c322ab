"""Recorded sync programs (the collector's fast path) on 2 and 4 gloo ranks, and in one process.

A program recorded for one metric structure must give, on every start, exactly what a direct
``sync`` of the same data gives (checked against numpy / Python references), issue only the
data collectives (no structure check after the first recording of a structure), keep programs
of different structures apart, and still reject ranks that hold different structures.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import ComposeMetric, MaxMetric, MeanMetric, Metric, MinMetric, SumMetric
from sidestream import sync as sync_module
from sidestream.collector import AsyncMetricCollector
from sidestream.state import MetricAccumulator, ReduceOp
from sidestream.sync import CallFingerprint, RankMismatchError
from sidestream.testing import RankPool, count_collectives, on_rank_device
from tests.conftest import GATHER
from tests.core.test_sync import (
    MixedState,
    gather_limit,
    mixed_local,
    mixed_reference,
)

SEEDS = (5, 6, 7)


def _small(rank: int, seed: int) -> list[float]:
    return [float(rank * 10 + seed), float(seed - rank)]


def _small_metric(token: str) -> ComposeMetric:
    children: dict[str, Metric[Any]] = {
        "sum": SumMetric(),
        "mean": MeanMetric(),
        "max": MaxMetric(),
        "min": MinMetric(),
    }
    return ComposeMetric({f"small_{token}": ComposeMetric(children)})


def _small_values(metric: ComposeMetric) -> dict[str, float]:
    (inner,) = metric.compute().values()
    return {name: float(value) for name, value in inner.items()}


@on_rank_device
def _programs(token: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for mode, limit in (("gather", sync_module.GATHER_LIMIT_BYTES), ("all_reduce", 0)):
        with gather_limit(limit):
            mixed = MixedState()
            wrapped = ComposeMetric({f"mixed_{token}_{mode}": mixed})  # a new structure
            small = _small_metric(f"{token}_{mode}")
            with count_collectives() as record_calls:
                wrapped.prepare_sync(None)
                small.prepare_sync(None)
        out[f"{mode} record"] = record_calls
        for seed in SEEDS:
            # Interleave the two structures' programs: each keeps its own layout and buffers.
            mixed.update(mixed_local(rank, seed))
            for leaf in small[f"small_{token}_{mode}"].items():
                leaf[1].reset()
                leaf[1].update(torch.tensor(_small(rank, seed), dtype=torch.float64))
            with count_collectives() as calls:
                small_batch = small.start_sync(None, CallFingerprint("window", seed))
                wrapped.start_sync(None, CallFingerprint("window", seed), async_op=False)
                small_batch.wait()
            replayed_mixed = {k: v.reshape(-1).tolist() for k, v in mixed.compute().items()}
            replayed_small = _small_values(small)
            with gather_limit(limit):
                wrapped.sync()  # the direct path, same data
                small.sync()
            direct_mixed = {k: v.reshape(-1).tolist() for k, v in mixed.compute().items()}
            out[f"{mode} {seed}"] = {
                "calls": calls,
                "mixed": replayed_mixed,
                "direct mixed": direct_mixed,
                "small": replayed_small,
                "direct small": _small_values(small),
            }
    # A structure that differs on one rank fails at recording, on every rank.
    odd = dist.get_world_size() - 1
    shape = (4,) if rank == odd else (3,)
    differing = ComposeMetric({f"odd_{token}": _Shaped(shape)})
    try:
        differing.prepare_sync(None)
        out["mismatch"] = "no error"
    except RankMismatchError as error:
        out["mismatch"] = str(error)
    return out


class _Shaped(Metric[Tensor]):
    def __init__(self, shape: tuple[int, ...]) -> None:
        self._state = MetricAccumulator(torch.zeros(shape, dtype=torch.int64), ReduceOp.SUM)

    def update(self) -> None:
        self._state.accumulate(torch.ones((), dtype=torch.int64))

    def compute(self) -> Tensor:
        return self._state.value


def test_recorded_programs_match_numpy_and_direct_sync(dist_pool: RankPool) -> None:
    world = dist_pool.world_size
    token = uuid.uuid4().hex[:6]
    for rank, result in enumerate(dist_pool.run(_programs, token, timeout=120)):
        for mode, collective in (("gather", [GATHER]), ("all_reduce", None)):
            # Recording issues only the structure checks of the two new structures.
            assert result[f"{mode} record"] == [GATHER, GATHER], mode
            for seed in SEEDS:
                outcome = result[f"{mode} {seed}"]
                if collective is not None:
                    assert outcome["calls"] == collective * 2, (mode, seed)
                else:
                    # small: SUM and MAX buffers; mixed: SUM, MAX and int MAX buffers.
                    assert outcome["calls"] == ["all_reduce"] * 5, (mode, seed)
                expected = mixed_reference(world, seed)
                for name, reference in expected.items():
                    got = outcome["mixed"][name]
                    if name == "float_sum":
                        assert got == pytest.approx(reference, rel=1e-6)
                    else:
                        assert got == reference, (mode, seed, name)
                assert outcome["mixed"] == outcome["direct mixed"], (mode, seed)
                values = np.array([_small(r, seed) for r in range(world)])
                assert outcome["small"] == pytest.approx(
                    {
                        "sum": values.sum(),
                        "mean": values.mean(),
                        "max": values.max(),
                        "min": values.min(),
                    },
                    rel=1e-12,
                )
                assert outcome["small"] == outcome["direct small"]
        assert f"has shape (4,) on rank {world - 1}" in result["mismatch"], rank
        assert f"seen from rank {rank}" in result["mismatch"]


def test_single_process_program_hands_out_copies() -> None:
    metric = MeanMetric()
    metric.prepare_sync(None)
    metric.update(torch.tensor([1.0, 3.0]))
    metric.start_sync(None, CallFingerprint("sync", 1)).wait()
    assert float(metric.compute()) == 2.0
    metric.update(torch.tensor([8.0]))  # the local state moves on; the synced copy was fresh
    metric.start_sync(None, CallFingerprint("sync", 2), async_op=False)
    assert float(metric.compute()) == 4.0


def test_single_process_copy_of_a_whole_arena_is_one_copy() -> None:
    # float64 SUM and MAX, int64 SUM and float32 MAX segments: back to back in one block.
    metric = ComposeMetric({"mean": MeanMetric(), "max": MaxMetric(), "mixed": MixedState()})
    metric["mean"].update(torch.tensor([1.0, 3.0]))
    metric["max"].update(torch.tensor([-2.0, 7.5]))
    metric["mixed"].update(mixed_local(0, 1))
    copies = metric.prepare_sync(None).every_state._copies
    assert copies is not None
    assert len(metric._own_arena().segments) >= 3  # type: ignore[union-attr]
    assert len(copies._outs) == 1  # the segments' copies merged into one of their bytes
    metric.sync()
    assert float(metric["mean"].compute()) == 2.0
    assert float(metric["max"].compute()) == 7.5
    mixed = metric["mixed"].compute()
    expected = mixed_reference(1, 1)
    assert {key: torch.atleast_1d(value).tolist() for key, value in mixed.items()} == expected


def test_copies_that_cast_or_broadcast_are_not_merged() -> None:
    first = MetricAccumulator(torch.zeros(2))
    second = MetricAccumulator(torch.zeros(2))
    block = torch.zeros(4, dtype=torch.float64)  # out of another dtype: copy_ casts
    first.accumulate(torch.tensor([1.0, 2.0]))
    second.accumulate(torch.tensor([3.0, 4.0]))
    batch = sync_module.SyncBatch()
    batch.add(first, None, block[:2], name="first")
    batch.add(second, None, block[2:], name="second")
    program = batch.program()
    assert program._copies is not None and len(program._copies._outs) == 2
    program.start(CallFingerprint("sync", 1)).wait()
    assert block.tolist() == [1.0, 2.0, 3.0, 4.0]


class _CountingSum(SumMetric):
    """A metric with its own ``sync``: the collector must keep calling it every window."""

    calls = 0  # on the class: the collector syncs private copies of the metric

    def sync(self, group: Any = None) -> None:
        type(self).calls += 1
        super().sync(group)


def test_collector_keeps_calling_a_metric_s_own_sync() -> None:
    metric = _CountingSum()
    collector = AsyncMetricCollector(metric).bind("cpu")
    at_bind = _CountingSum.calls  # the structure check
    calls = []
    for window in range(4):
        metric.update(torch.tensor([float(window), 1.0]))
        collector.schedule_collection(window + 1)
        assert collector.collect_results() == window + 1.0
        calls.append(_CountingSum.calls - at_bind)
    assert collector.close()
    assert calls == [1, 2, 3, 4]
