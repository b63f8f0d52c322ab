"""Aggregation metrics on 2 and 4 gloo ranks against a direct computation on all shards."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from sidestream import ComposeMetric
from sidestream.testing import RankPool, count_collectives, rank_device
from tests._checkpoints import states_only
from tests.conftest import Pools
from tests.core.cases import CASES, concat, feed, make_shards


def _synced_twice(seed: int) -> dict[str, tuple[float, float]]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = make_shards(seed, world_size)[rank]
    out = {}
    for name, case in CASES.items():
        metric = case.factory().to(rank_device())
        feed(name, metric, shard)
        metric.sync()
        first = metric.compute().item()
        metric.reset()
        feed(name, metric, shard)
        metric.sync()
        out[name] = (first, metric.compute().item())
    return out


def _assert_close(actual: float, expected: float) -> None:
    if math.isnan(expected):
        assert math.isnan(actual)
    else:
        assert actual == pytest.approx(expected, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_synced_equals_direct_on_all_shards(dist_pool: RankPool, seed: int) -> None:
    per_rank = dist_pool.run(_synced_twice, seed)
    everything = concat(make_shards(seed, dist_pool.world_size))
    for name, case in CASES.items():
        expected = case.reference(everything)
        for first, second in (result[name] for result in per_rank):
            _assert_close(first, expected)
            assert second == first or (math.isnan(first) and math.isnan(second))


def _compose_synced(seed: int) -> dict[str, float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = make_shards(seed, world_size)[rank]
    inner = ComposeMetric({name: case.factory() for name, case in CASES.items()})
    inner.to(rank_device())
    compose = ComposeMetric({"inner": inner})
    for name in CASES:
        feed(name, inner[name], shard)
    compose.sync()
    return {name: value.item() for name, value in compose.compute()["inner"].items()}


def test_compose_sync(dist_pool: RankPool) -> None:
    per_rank = dist_pool.run(_compose_synced, 5)
    everything = concat(make_shards(5, dist_pool.world_size))
    for result in per_rank:
        for name, case in CASES.items():
            _assert_close(result[name], case.reference(everything))


def _checkpoint_mid_window(seed: int) -> dict[str, float]:
    """Feed the first half, save, restore into fresh metrics, feed the second half, sync."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    first = make_shards(seed, world_size)[rank]
    second = make_shards(seed + 100, world_size)[rank]
    out = {}
    for name, case in CASES.items():
        metric = case.factory().to(rank_device())
        feed(name, metric, first)
        saved = metric.state_dict()  # a collective: the global state, same on every rank
        restored = case.factory().to(rank_device())
        restored.load_state_dict(saved)
        feed(name, restored, second)
        restored.sync()
        out[name] = restored.compute().item()
    return out


def test_state_dict_mid_window_continues(dist_pool: RankPool) -> None:
    per_rank = dist_pool.run(_checkpoint_mid_window, 9)
    world = dist_pool.world_size
    everything = concat(make_shards(9, world) + make_shards(109, world))
    for result in per_rank:
        for name, case in CASES.items():
            _assert_close(result[name], case.reference(everything))


def _all_metrics(device: torch.device | None = None) -> ComposeMetric:
    metrics = ComposeMetric({name: case.factory() for name, case in CASES.items()})
    return metrics.to(device or torch.device("cpu"))


def _dcp_save(path: str, seed: int) -> dict[str, Any]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = _all_metrics(rank_device())
    for name in CASES:
        feed(name, metrics[name], make_shards(seed, world_size)[rank])
    dcp.save({"metrics": metrics}, checkpoint_id=path)
    return {k: v.tolist() for k, v in states_only(metrics.state_dict()).items()}


def _dcp_load_and_continue(path: str, seed: int) -> dict[str, float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    metrics = _all_metrics(rank_device())
    dcp.load({"metrics": metrics}, checkpoint_id=path)
    for name in CASES:
        feed(name, metrics[name], make_shards(seed, world_size)[rank])
    metrics.sync()
    return {name: value.item() for name, value in metrics.compute().items()}


@pytest.mark.parametrize("load_world", [2, 1], ids=["load2", "load1"])
def test_torch_distributed_checkpoint_reshards(
    pools: Pools, tmp_path: Any, load_world: int
) -> None:
    """Save on 2 ranks (and on 4), load on 2 ranks or in one process, continue exactly."""
    for save_world in (2, 4):
        pool = pools.get(save_world)
        path = str(tmp_path / f"ckpt{save_world}")
        saved = pool.run(_dcp_save, path, 21)
        assert all(s == saved[0] for s in saved), "state_dict must be identical on every rank"
        if load_world == 1:
            results = [_dcp_load_and_continue_single(path, 22)]
            later = make_shards(22, 1)
        else:
            load_pool = pools.get(load_world)
            results = load_pool.run(_dcp_load_and_continue, path, 22)
            later = make_shards(22, load_world)
        everything = concat(make_shards(21, save_world) + later)
        for result in results:
            for name, case in CASES.items():
                _assert_close(result[name], case.reference(everything))


def _dcp_load_and_continue_single(path: str, seed: int) -> dict[str, float]:
    metrics = _all_metrics()
    dcp.load({"metrics": metrics}, checkpoint_id=path)
    for name in CASES:
        feed(name, metrics[name], make_shards(seed, 1)[0])
    return {name: value.item() for name, value in metrics.compute().items()}


def _count_collectives(number_of_metrics: int) -> int:
    metrics = ComposeMetric(
        {f"m{i}": CASES["weighted_mean"].factory() for i in range(number_of_metrics)}
    ).to(rank_device())
    ones = torch.ones(3, device=rank_device())
    for i in range(number_of_metrics):
        metrics[f"m{i}"].update(values=ones, weights=ones)
    with count_collectives() as calls:
        metrics.sync()
    return len(calls)


def test_collectives_do_not_grow_with_metric_count(pools: Pools) -> None:
    pool = pools.get(2)
    one, many = pool.run(_count_collectives, 1)[0], pool.run(_count_collectives, 20)[0]
    assert one == many >= 1


def _async_sync(seed: int) -> float:
    from sidestream.sync import CallFingerprint

    rank, world_size = dist.get_rank(), dist.get_world_size()
    metric = CASES["weighted_mean"].factory().to(rank_device())
    feed("weighted_mean", metric, make_shards(seed, world_size)[rank])
    handle = metric.start_sync(None, CallFingerprint("sync", 1), async_op=True)
    assert handle.works, "async_op must start the collectives without waiting"
    handle.wait()
    return metric.compute().item()


def test_async_sync_matches(pools: Pools) -> None:
    pool = pools.get(2)
    expected = CASES["weighted_mean"].reference(concat(make_shards(4, 2)))
    for value in pool.run(_async_sync, 4):
        _assert_close(value, expected)
