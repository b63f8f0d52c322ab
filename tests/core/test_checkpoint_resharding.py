"""Checkpoints are world-size independent: save mid-window on 4 ranks, resume on 2, then on 1.

The resumed run must continue to the numbers an uninterrupted single-process run gives on the
same data (exactly for integer counts), and to a direct numpy computation on all of it.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sklearn.metrics import roc_auc_score
from torch import Tensor

from sidestream import ComposeMetric, MeanMetric, Metric
from sidestream._samples import SavedRows
from sidestream.metrics.classification import BinaryAUROCMetric
from sidestream.state import MetricAccumulator, ReduceOp
from sidestream.sync import CallFingerprint
from sidestream.testing import RankPool, on_rank_device, rank_device
from tests._checkpoints import states_only
from tests.conftest import Pools
from tests.core.cases import CASES, Shard, concat, feed, make_shards
from tests.core.test_state_arena import arena_views_intact

NUM_CLASSES = 10


class ClassCounts(Metric[Tensor]):
    """Per-class label counts (int64) and the largest label seen: integer state of both ops."""

    def __init__(self) -> None:
        self._counts = MetricAccumulator(torch.zeros(NUM_CLASSES, dtype=torch.int64))
        self._largest = MetricAccumulator(torch.tensor(-1), ReduceOp.MAX)

    def update(self, labels: Tensor) -> None:
        self._counts.scatter_add(labels, torch.ones_like(labels))
        if labels.numel():
            self._largest.accumulate(labels.max())

    def compute(self) -> Tensor:
        return torch.cat([self._counts.value, self._largest.value.reshape(1)])


def _labels(shard: Shard) -> Tensor:
    # Derived from the shard so every phase sees different, reproducible labels.
    return torch.as_tensor(shard["weights"] % NUM_CLASSES)


def _metrics() -> ComposeMetric:
    children: dict[str, Metric[Any]] = {name: case.factory() for name, case in CASES.items()}
    # A growing state too: its row count is known only from the checkpoint.
    exact = BinaryAUROCMetric(exact=True, logits=True)
    return ComposeMetric({**children, "classes": ClassCounts(), "exact_auroc": exact})


def _feed(metrics: ComposeMetric, shard: Shard) -> None:
    for name in CASES:
        feed(name, metrics[name], shard)
    metrics["classes"].update(_labels(shard))
    device = metrics["classes"].device
    logits = torch.as_tensor(shard["values"], device=device)
    metrics["exact_auroc"].update(logits, (_labels(shard) % 2).to(device))


def _results(metrics: ComposeMetric) -> dict[str, Any]:
    return {name: value.tolist() for name, value in metrics.compute().items()}


def _plain(value: Any) -> Any:
    return value.rows.tolist() if isinstance(value, SavedRows) else value.tolist()


def _references(shards: list[Shard]) -> dict[str, Any]:
    everything = concat(shards)
    out: dict[str, Any] = {name: case.reference(everything) for name, case in CASES.items()}
    labels = everything["weights"] % NUM_CLASSES
    largest = int(labels.max()) if len(labels) else -1
    out["classes"] = [*np.bincount(labels, minlength=NUM_CLASSES).tolist(), largest]
    out["exact_auroc"] = roc_auc_score(labels % 2, everything["values"].astype(np.float64))
    return out


def _assert_matches(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["classes"] == expected["classes"]  # integer counts: exact
    assert actual["exact_auroc"] == pytest.approx(expected["exact_auroc"], abs=1e-12)
    for name in CASES:
        if math.isnan(expected[name]):
            assert math.isnan(actual[name]), name
        else:
            assert actual[name] == pytest.approx(expected[name], rel=1e-12, abs=1e-12), name


@on_rank_device
def _save_on_four(path: str, seed: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = _metrics().to(rank_device())
    _feed(metrics, make_shards(seed, world)[rank])
    dcp.save({"metrics": metrics}, checkpoint_id=path)  # state_dict() is a collective here
    assert arena_views_intact(metrics)
    return {name: _plain(value) for name, value in states_only(metrics.state_dict()).items()}


@on_rank_device
def _resume_on_two(load_path: str, save_path: str, seed: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    metrics = _metrics().to(rank_device())
    dcp.load({"metrics": metrics}, checkpoint_id=load_path)
    assert arena_views_intact(metrics)  # loading copies into the arena, never replaces views
    _feed(metrics, make_shards(seed, world)[rank])
    metrics.sync()  # log mid-window; the window goes on
    logged = _results(metrics)
    dcp.save({"metrics": metrics}, checkpoint_id=save_path)
    return logged


def test_save_on_four_resume_on_two_then_one(pools: Pools, tmp_path: Path) -> None:
    four = pools.get(4)
    two = pools.get(2)
    first, second = str(tmp_path / "four"), str(tmp_path / "two")

    saved = four.run(_save_on_four, first, 31)
    assert all(state == saved[0] for state in saved), "state_dict must match on every rank"

    logged = two.run(_resume_on_two, first, second, 32)
    seen = make_shards(31, 4) + make_shards(32, 2)
    for per_rank in logged:
        _assert_matches(per_rank, _references(seen))

    resumed = _metrics().to("cpu")  # one process, torch.distributed not initialized
    dcp.load({"metrics": resumed}, checkpoint_id=second)
    assert arena_views_intact(resumed)
    last = make_shards(33, 1)
    _feed(resumed, last[0])

    uninterrupted = _metrics()
    for shard in [*seen, *last]:
        _feed(uninterrupted, shard)

    _assert_matches(_results(resumed), _references([*seen, *last]))
    _assert_matches(_results(resumed), _results(uninterrupted))
    assert _results(resumed)["max"] == _results(uninterrupted)["max"]


@on_rank_device
def _checkpoint_between_uneven_updates() -> dict[str, float]:
    """Rank 0 updates after the sync, the others do not; then a checkpoint is taken."""
    rank = dist.get_rank()
    metric = ComposeMetric({"mean": MeanMetric(), "auroc": BinaryAUROCMetric(num_bins=10)})
    metric["mean"].update(torch.tensor([float(rank + 1)]))
    metric["auroc"].update(torch.tensor([0.15, 0.85]), torch.tensor([0, 1]))
    metric.sync()
    at_sync = metric.compute()
    if rank == 0:
        # Its own last batch (uneven data): only rank 0's metric reads local state now.
        metric["mean"].update(torch.tensor([100.0]))
        metric["auroc"].update(torch.tensor([0.95]), torch.tensor([0]))
    before = metric.compute()
    saved = metric.state_dict()
    after = metric.compute()
    return {
        "mean_at_sync": float(at_sync["mean"]),
        "mean_before": float(before["mean"]),
        "mean_after": float(after["mean"]),
        "auroc_before": float(before["auroc"]),
        "auroc_after": float(after["auroc"]),
        "saved_count": float(saved["mean.count"]),
    }


def test_a_checkpoint_leaves_compute_as_it_was_on_a_rank_that_did_not_update(
    dist_pool: RankPool,
) -> None:
    # state_dict reduced into the synced views: on a rank still reading its last sync's result,
    # compute then showed another rank's later batch (rank 1 of 2: 2.0 became 34.67).
    world = dist_pool.world_size
    results = dist_pool.run(_checkpoint_between_uneven_updates)
    global_mean = sum(range(1, world + 1)) / world
    for rank, result in enumerate(results):
        assert result["mean_after"] == result["mean_before"], (rank, result)
        assert result["auroc_after"] == result["auroc_before"], (rank, result)
        assert result["saved_count"] == world + 1, result  # the checkpoint holds every batch
        if rank > 0:
            assert result["mean_after"] == pytest.approx(global_mean), result


@on_rank_device
def _checkpoint_before_an_async_sync_is_waited() -> dict[str, float]:
    """Every rank starts an async sync; rank 0 updates, then a checkpoint, then the wait."""
    rank = dist.get_rank()
    metric = MeanMetric()
    metric.update(torch.tensor([float(rank + 1)]))
    handle = metric.start_sync(None, CallFingerprint("sync", 1), async_op=True)
    if rank == 0:
        metric.update(torch.tensor([100.0]))  # after the start: not part of that sync
    time.sleep(0.2)  # let the collective land in the layout's buffers (gloo runs it meanwhile)
    saved = metric.state_dict()
    handle.wait()
    return {"compute": float(metric.compute()), "saved_count": float(saved["count"])}


def test_a_checkpoint_before_an_async_sync_is_waited_leaves_that_sync_as_it_was(
    dist_pool: RankPool,
) -> None:
    # The checkpoint's reduction reused the layout's buffers, which the sync's wait unpacks:
    # rank 1 (no update since the start) then read rank 0's later batch (1.5 became 34.33).
    world = dist_pool.world_size
    results = dist_pool.run(_checkpoint_before_an_async_sync_is_waited)
    at_start = sum(range(1, world + 1)) / world
    assert results[0]["compute"] == pytest.approx((1.0 + 100.0) / 2)  # updated: local state
    for rank, result in enumerate(results):
        assert result["saved_count"] == world + 1, result  # the checkpoint holds every batch
        if rank > 0:
            assert result["compute"] == pytest.approx(at_start), (rank, result)


@on_rank_device
def _second_start_before_the_first_wait() -> dict[str, float]:
    """Two async syncs in a row, each waited on only after both started (rank 0 updates between)."""
    rank = dist.get_rank()
    metric = MeanMetric()
    metric.update(torch.tensor([float(rank + 1)]))
    first = metric.start_sync(None, CallFingerprint("sync", 1), async_op=True)
    if rank == 0:
        metric.update(torch.tensor([100.0]))
    second = metric.start_sync(None, CallFingerprint("sync", 2), async_op=True)
    first.wait()
    after_first = float(metric.compute())
    second.wait()
    return {"after_first": after_first, "after_second": float(metric.compute())}


def test_a_second_start_sync_before_the_first_wait_finishes_the_first(
    dist_pool: RankPool,
) -> None:
    # The second start wrote the layout's buffers under the first collective: gloo sent the
    # second payload in the first all_gather, reported as "ranks paired different calls"
    # though every rank called alike.
    world = dist_pool.world_size
    results = dist_pool.run(_second_start_before_the_first_wait)
    everything = (sum(range(1, world + 1)) + 100.0) / (world + 1)
    # Between the waits the second sync is in flight: compute reads local state (docs/sync.md).
    assert results[0]["after_first"] == pytest.approx((1.0 + 100.0) / 2)
    for rank, result in enumerate(results):
        if rank > 0:
            assert result["after_first"] == pytest.approx(rank + 1.0), (rank, result)
        assert result["after_second"] == pytest.approx(everything), (rank, result)
