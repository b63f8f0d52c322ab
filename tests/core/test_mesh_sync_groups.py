"""Checkpoints of metrics synced over one dimension of a 2x2 device mesh (dp x tp).

The tensor-parallel ranks of a data-parallel replica see the same batch: a checkpoint must
reduce their state over the data-parallel dimension only, or the replicas count twice. Each
reference is the direct sum of the data-parallel replicas' values (1 + dp), each once: 3.0.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sidestream import ComposeMetric, SumMetric
from sidestream.collector import AsyncMetricCollector
from tests.conftest import Pools

REPLICAS_ONCE = 1.0 + 2.0  # the two data-parallel replicas' values, each counted once


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _child_after_its_parent_synced() -> float:
    mesh = _mesh()
    metrics = ComposeMetric({"a": SumMetric(), "b": SumMetric()})
    metrics["a"].update(torch.tensor([1.0 + mesh["dp"].get_local_rank()]))
    metrics.sync(group=mesh["dp"])
    return float(metrics["a"].state_dict()["total"])  # a collective over the parent's group


def test_a_child_checkpoints_over_the_group_its_parent_synced_over(pools: Pools) -> None:
    # The parent's sync recorded its group on the parent alone: the child's state_dict
    # reduced over the default group and saved 6.0, the replicas counted twice.
    assert pools.get(4).run(_child_after_its_parent_synced) == [REPLICAS_ONCE] * 4


def _children_over_different_groups() -> tuple[dict[str, float], str]:
    mesh = _mesh()
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    metrics = ComposeMetric({"a": SumMetric(), "b": SumMetric()})
    metrics["a"].update(torch.tensor([1.0 + dp]))  # replicated over tp
    metrics["b"].update(torch.tensor([10.0 * (1 + dp) + tp]))  # sharded over tp
    metrics["a"].sync(group=mesh["dp"])
    metrics["b"].sync()  # the whole world
    computed = {name: float(value) for name, value in metrics.compute().items()}
    try:
        metrics.state_dict()
    except RuntimeError as error:
        return computed, str(error)
    return computed, "saved"


def test_a_tree_whose_children_synced_over_different_groups_refuses_to_checkpoint(
    pools: Pools,
) -> None:
    # The tree's state_dict reduced both children over the default group: 'a' saved 6.0.
    for computed, outcome in pools.get(4).run(_children_over_different_groups):
        assert computed == {"a": REPLICAS_ONCE, "b": 10.0 + 11.0 + 20.0 + 21.0}
        assert "metric 'a' was last synced over the group of global ranks" in outcome, outcome


def _collector_after_a_look_over_the_world() -> tuple[float, float]:
    mesh = _mesh()
    metric = SumMetric()
    collector = AsyncMetricCollector(metric, group=mesh["dp"]).bind("cpu")
    try:
        metric.update(torch.tensor([1.0 + mesh["dp"].get_local_rank()]))  # mid-window
        metric.sync()  # a look at the live metric over the default group
        saved = float(collector.state_dict(timeout=30)["metric"]["total"])
        collector.schedule_collection(1)
        window = collector.collect_results(timeout=30)
    finally:
        collector.close(timeout=30)
    return saved, window


def test_a_collector_checkpoints_over_its_own_group(pools: Pools) -> None:
    # The checkpoint reduced over the group of the metric's last sync (the world), not the
    # collector's: 6.0 saved while the window of the same updates reported 3.0.
    results = pools.get(4).run(_collector_after_a_look_over_the_world)
    assert results == [(pytest.approx(REPLICAS_ONCE), pytest.approx(REPLICAS_ONCE))] * 4


def _tree_synced_again_after_a_child_alone() -> tuple[float, float]:
    dp = _mesh()["dp"]  # one object (each mesh["dp"] is a new one)
    metrics = ComposeMetric({"a": SumMetric(), "b": SumMetric()})
    metrics["a"].update(torch.tensor([1.0 + dp.get_local_rank()]))
    metrics.sync(group=dp)
    metrics["a"].sync()  # a look over the whole world
    metrics.sync(group=dp)  # the tree's group again: the child's too
    saved = metrics.state_dict()
    return float(saved["a.total"]), float(metrics["a"].state_dict()["total"])


def test_a_tree_synced_again_takes_back_a_child_synced_alone_over_another_group(
    pools: Pools,
) -> None:
    # A sync walks the tree only when a group changed somewhere since its last walk: the
    # child's own sync was such a change, and the tree's next sync must see it.
    results = pools.get(4).run(_tree_synced_again_after_a_child_alone)
    assert results == [(REPLICAS_ONCE, REPLICAS_ONCE)] * 4


def _collector_after_a_look_at_one_child() -> tuple[float, float]:
    mesh = _mesh()
    metrics = ComposeMetric({"a": SumMetric(), "b": SumMetric()})
    collector = AsyncMetricCollector(metrics, group=mesh["dp"]).bind("cpu")
    try:
        metrics["a"].update(torch.tensor([1.0 + mesh["dp"].get_local_rank()]))  # mid-window
        metrics["a"].sync()  # a look at one child over the default group
        saved = float(collector.state_dict(timeout=30)["metric"]["a.total"])
        collector.schedule_collection(1)
        window = collector.collect_results(timeout=30)["a"]
    finally:
        collector.close(timeout=30)
    return saved, window


def test_a_collector_checkpoints_over_its_own_group_after_a_look_at_one_child(
    pools: Pools,
) -> None:
    # The collector gave its group back to the root alone, whose group had not changed: the
    # child's other group made the checkpoint raise as a tree synced over mixed groups.
    results = pools.get(4).run(_collector_after_a_look_at_one_child)
    assert results == [(pytest.approx(REPLICAS_ONCE), pytest.approx(REPLICAS_ONCE))] * 4


def _tree_started_again_after_a_child_alone() -> tuple[float, float]:
    from sidestream.sync import CallFingerprint

    dp = _mesh()["dp"]
    metrics = ComposeMetric({"a": SumMetric(), "b": SumMetric()})
    metrics["a"].update(torch.tensor([1.0 + dp.get_local_rank()]))
    metrics.sync(group=dp)
    metrics["a"].sync()  # a look over the whole world
    metrics.start_sync(dp, CallFingerprint("sync", 1), async_op=True).wait()  # the tree again
    return float(metrics.state_dict()["a.total"]), float(metrics["a"].state_dict()["total"])


def test_a_tree_started_again_takes_back_a_child_synced_alone_over_another_group(
    pools: Pools,
) -> None:
    # start_sync walked the tree only when the root's own group changed: the child kept the
    # world as its group, and the tree's state_dict raised as if synced over mixed groups.
    results = pools.get(4).run(_tree_started_again_after_a_child_alone)
    assert results == [(REPLICAS_ONCE, REPLICAS_ONCE)] * 4
