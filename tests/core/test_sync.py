"""Coalesced sync on 2 and 4 gloo ranks: exact results, counted collectives, groups, mismatches.

References are computed here from every rank's data (Python integers and numpy), never from the
code under test. Collectives are counted by wrapping the functions of ``torch.distributed`` and
``torch.distributed.distributed_c10d`` inside the rank processes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import ComposeMetric, MaxMetric, MeanMetric, Metric, MinMetric, SumMetric
from sidestream import sync as sync_module
from sidestream.state import MetricAccumulator, ReduceOp
from sidestream.sync import CallFingerprint, RankMismatchError
from sidestream.testing import RankPool, count_collectives, on_rank_device, rank_device
from tests._checkpoints import states_only
from tests.conftest import GATHER, Pools
from tests.core.cases import CASES, concat, feed, make_shards


@contextlib.contextmanager
def gather_limit(limit: int) -> Iterator[None]:
    previous = sync_module.GATHER_LIMIT_BYTES
    sync_module.GATHER_LIMIT_BYTES = limit
    try:
        yield
    finally:
        sync_module.GATHER_LIMIT_BYTES = previous


# name -> (dtype, op, shape)
MIXED = {
    "big_counts": (torch.int64, ReduceOp.SUM, (5,)),
    "signed": (torch.int32, ReduceOp.SUM, (3,)),
    "flags": (torch.bool, ReduceOp.SUM, (4,)),
    "int_max": (torch.int64, ReduceOp.MAX, (3,)),
    "int_min": (torch.int64, ReduceOp.MIN, (3,)),
    "all_flags": (torch.bool, ReduceOp.MIN, (2,)),
    "float_sum": (torch.float32, ReduceOp.SUM, (4,)),
    "float_max": (torch.float64, ReduceOp.MAX, ()),
    "float_min": (torch.float64, ReduceOp.MIN, (2,)),
    "half_max": (torch.float16, ReduceOp.MAX, (2,)),
}


def mixed_local(rank: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed * 1000 + rank)
    int64 = np.iinfo(np.int64)
    return {
        # Beyond 2**53: a float64 sum would lose the low bits.
        "big_counts": 2**59 + rng.integers(0, 2**40, 5, dtype=np.int64),
        "signed": rng.integers(-1000, 1000, 3).astype(np.int32),
        "flags": rng.random(4) < 0.3,
        "int_max": rng.integers(-(2**62), 2**62, 3, dtype=np.int64),
        "int_min": np.array([int64.max if rank == 0 else 7, int64.min + rank, -(2**60) - rank]),
        "all_flags": np.array([True, rank != 1]),
        "float_sum": rng.normal(size=4).astype(np.float32),
        "float_max": np.array(rng.normal()),
        "float_min": np.array([math.inf if rank == 0 else rng.normal(), -rank - 0.5]),
        "half_max": rng.normal(size=2).astype(np.float16),
    }


def mixed_reference(world_size: int, seed: int) -> dict[str, list[Any]]:
    locals_ = [mixed_local(rank, seed) for rank in range(world_size)]
    out: dict[str, list[Any]] = {}
    for name, (_, op, _) in MIXED.items():
        stacked = np.stack([np.atleast_1d(d[name]) for d in locals_])
        if name == "big_counts" or name == "signed":
            out[name] = [sum(int(v) for v in column) for column in stacked.T]
        elif name == "flags":
            out[name] = stacked.any(axis=0).tolist()
        elif name == "float_sum":
            out[name] = stacked.astype(np.float64).sum(axis=0).astype(np.float32).tolist()
        elif op is ReduceOp.MAX:
            out[name] = stacked.max(axis=0).tolist()
        else:
            out[name] = stacked.min(axis=0).tolist()
    return out


class MixedState(Metric[dict[str, Tensor]]):
    """One accumulator of every dtype/op kind the sync packs differently."""

    def __init__(self) -> None:
        for name, (dtype, op, shape) in MIXED.items():
            setattr(self, f"_{name}", MetricAccumulator(torch.zeros(shape, dtype=dtype), op))

    def update(self, local: dict[str, np.ndarray]) -> None:
        for name, (dtype, _, shape) in MIXED.items():
            accumulator: MetricAccumulator = getattr(self, f"_{name}")
            accumulator.load_local(torch.as_tensor(local[name], dtype=dtype).reshape(shape))

    def compute(self) -> dict[str, Tensor]:
        return {name: getattr(self, f"_{name}").value.clone() for name in MIXED}


def _as_lists(values: dict[str, Tensor]) -> dict[str, list[Any]]:
    return {name: value.reshape(-1).tolist() for name, value in values.items()}


def _synced_counted(metric: Metric[Any], async_op: bool = False) -> list[str]:
    fingerprint = CallFingerprint("sync", metric.call_counter.next())
    with count_collectives() as calls:
        handle = metric.start_sync(None, fingerprint, async_op=async_op)
        if async_op:
            assert handle.works, "async_op must start the collectives without waiting"
        handle.wait()
    return calls


@on_rank_device
def _exact_in_every_mode(seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for mode, limit in (("gather", sync_module.GATHER_LIMIT_BYTES), ("all_reduce", 0)):
        for async_op in (False, True):
            with gather_limit(limit):
                metric = MixedState()
                metric.update(mixed_local(rank, seed))
                metric.sync()  # the first sync of a structure adds the fingerprint check
                calls = _synced_counted(metric, async_op)
                out[f"{mode} async={async_op}"] = (_as_lists(metric.compute()), calls)
    return out


def test_every_dtype_and_op_reduces_exactly(dist_pool: RankPool) -> None:
    world = dist_pool.world_size
    expected = mixed_reference(world, 3)
    for result in dist_pool.run(_exact_in_every_mode, 3):
        for mode, (values, calls) in result.items():
            for name, reference in expected.items():
                if name == "float_sum":
                    assert values[name] == pytest.approx(reference, rel=1e-6), mode
                else:
                    assert values[name] == reference, (mode, name)
            if mode.startswith("gather"):
                assert calls == [GATHER], mode
            else:
                # float SUM (integer counts ride in it exactly), float MAX (+MIN), int MAX (+MIN)
                assert calls == ["all_reduce"] * 3, mode


@contextlib.contextmanager
def _route(route: str) -> Iterator[None]:
    """``direct``: the public collectives raise, so a sync must call the group's methods;
    ``public``: the direct launchers are gone, so it must fall back to the public functions."""
    from sidestream import _distributed

    saved: list[tuple[Any, str, Any]] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a sync called torch.distributed's public collective")

    if route == "direct":
        replacements = {name: refuse for name in ("all_reduce", GATHER)}
        modules: tuple[Any, ...] = (dist, dist.distributed_c10d)
    else:
        replacements = {"_GATHER": None, "_REDUCE": None}
        modules = (_distributed,)
    for module in modules:
        for name, value in replacements.items():
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@on_rank_device
def _exact_through_either_route(seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for route in ("direct", "public"):
        for mode, limit in (("gather", sync_module.GATHER_LIMIT_BYTES), ("all_reduce", 0)):
            with gather_limit(limit):
                metric = MixedState()
                metric.update(mixed_local(rank, seed))
                metric.sync()  # the structure check (a blocking gather) before the routes
                with _route(route):
                    metric.sync()
                out[f"{route} {mode}"] = _as_lists(metric.compute())
    return out


def test_sync_starts_collectives_through_the_group_or_the_public_functions(
    dist_pool: RankPool,
) -> None:
    """A plain process group's sync skips torch.distributed's per-call wrappers (a third of a
    logged step's collective cost); without the group's methods it takes the public calls."""
    expected = mixed_reference(dist_pool.world_size, 5)
    for result in dist_pool.run(_exact_through_either_route, 5):
        assert len(result) == 4
        for key, values in result.items():
            for name, reference in expected.items():
                if name == "float_sum":
                    assert values[name] == pytest.approx(reference, rel=1e-6), key
                else:
                    assert values[name] == reference, (key, name)


def _aggregations(count: int, offset: int = 0) -> dict[str, Metric[Any]]:
    kinds: list[Callable[[], Metric[Any]]] = [SumMetric, MeanMetric, MaxMetric, MinMetric]
    return {f"m{offset + i}": kinds[(offset + i) % len(kinds)]() for i in range(count)}


def _nested(count: int) -> ComposeMetric:
    """Three levels deep, ``count`` leaf metrics spread over the levels."""
    third = count // 3
    inner = ComposeMetric(_aggregations(third, 2 * third))
    middle = ComposeMetric({"inner": inner, **_aggregations(third, third)})
    return ComposeMetric({"middle": middle, **_aggregations(count - 2 * third)})


def _leaves(metric: Metric[Any]) -> list[Metric[Any]]:
    if isinstance(metric, ComposeMetric):
        return [leaf for _, child in metric.items() for leaf in _leaves(child)]
    return [metric]


def _fed(metric: Metric[Any], rank: int) -> Metric[Any]:
    for index, leaf in enumerate(_leaves(metric)):
        leaf.update(torch.tensor([float(rank + index), float(2 * rank - index)]))
    return metric


def _leaf_results(metric: Metric[Any]) -> list[float]:
    return [float(leaf.compute()) for leaf in _leaves(metric)]


@on_rank_device
def _counts_by_size(token: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    builders: dict[str, Callable[[int], Metric[Any]]] = {
        "metric": lambda _: MeanMetric(),
        "nested": _nested,
        "flat": lambda count: ComposeMetric(_aggregations(count)),
    }
    for limit_name, limit in (("gather", sync_module.GATHER_LIMIT_BYTES), ("all_reduce", 0)):
        with gather_limit(limit):
            for name, build in builders.items():
                for count in (3, 60):
                    metric = _fed(build(count), rank)
                    fresh = ComposeMetric({f"fresh_{token}_{limit_name}_{name}_{count}": metric})
                    first = _synced_counted(fresh)
                    steady = _synced_counted(fresh)
                    out[f"{limit_name} {name} {count}"] = (first, steady, _leaf_results(metric))
    # A large histogram goes through all_reduce on its own, exact for int64 counts.
    histogram = MetricAccumulator(torch.zeros(70_000, dtype=torch.int64))
    histogram.accumulate(torch.arange(70_000, dtype=torch.int64) * (rank + 1) + 2**55)
    histogram.sync()
    with count_collectives() as calls:
        histogram.sync()
    assert histogram.synced is not None
    out["histogram"] = (calls, histogram.synced[[0, 1, 69_999]].tolist())
    return out


def _expected_leaves(metric: Metric[Any], world: int) -> list[float]:
    expected = []
    for index, leaf in enumerate(_leaves(metric)):
        values = np.array([[rank + index, 2 * rank - index] for rank in range(world)], float)
        if isinstance(leaf, SumMetric):
            expected.append(float(values.sum()))
        elif isinstance(leaf, MeanMetric):
            expected.append(float(values.mean()))
        elif isinstance(leaf, MaxMetric):
            expected.append(float(values.max()))
        else:
            expected.append(float(values.min()))
    return expected


def test_collectives_per_sync_never_grow_with_metrics(dist_pool: RankPool) -> None:
    world = dist_pool.world_size
    result = dist_pool.run(_counts_by_size, uuid.uuid4().hex)
    for per_rank in result:
        for key, outcome in per_rank.items():
            if key == "histogram":
                continue
            first, steady, values = outcome
            path, name, count = key.split()
            # The first sync of a new structure adds exactly one structure check (an all_gather).
            assert first == [GATHER, *steady], key
            if path == "gather":
                assert steady == [GATHER], key
            elif name == "metric":
                assert steady == ["all_reduce"], key  # sum and count: one SUM buffer
            else:
                assert steady == ["all_reduce", "all_reduce"], key  # SUM and MAX (+MIN)
            builder = {"metric": lambda _: MeanMetric(), "nested": _nested}.get(
                name, lambda n: ComposeMetric(_aggregations(n))
            )
            assert values == pytest.approx(_expected_leaves(builder(int(count)), world)), key
        calls, picked = per_rank["histogram"]
        assert calls == ["all_reduce"]
        scale = world * (world + 1) // 2
        assert picked == [world * 2**55, scale + world * 2**55, 69_999 * scale + world * 2**55]


@on_rank_device
def _mesh_sync(seed: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(rank_device().type, (2, 2), mesh_dim_names=("dp", "tp"))
    data_parallel = mesh.get_coordinate()
    assert data_parallel is not None
    # Tensor-parallel replicas hold the same data; both data-parallel shards are non-empty.
    shard = make_shards(seed, 3)[data_parallel[0]]
    out: dict[str, Any] = {}
    for group_name, group in (("dp mesh", mesh["dp"]), ("dp group", mesh["dp"].get_group())):
        metrics = ComposeMetric({name: case.factory() for name, case in CASES.items()})
        for name in CASES:
            feed(name, metrics[name], shard)
        with count_collectives() as calls:
            metrics.sync(group=group)
            metrics.sync(group=group)
        out[group_name] = ({k: float(v) for k, v in metrics.compute().items()}, calls)
        saved = metrics.state_dict()  # reduced over the last sync's group
        out[f"{group_name} state_dict"] = {k: v.tolist() for k, v in states_only(saved).items()}
    refused = MeanMetric()
    refused.update(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        refused.sync(group=mesh)
    # Refused, so not kept: state_dict() reduces over the default group, as before the call.
    assert refused.sync_group is None
    refused.state_dict()
    whole_world = SumMetric()  # the mistake the mesh group avoids: replicas counted twice
    feed("sum", whole_world, shard)
    whole_world.sync()
    out["world sum"] = float(whole_world.compute())
    return out


def test_device_mesh_dimension_does_not_count_replicas_twice(
    pools: Pools,
) -> None:
    pool = pools.get(4)
    per_rank = pool.run(_mesh_sync, 11)
    everything = concat(make_shards(11, 3)[:2])
    for result in per_rank:
        for group_name in ("dp mesh", "dp group"):
            values, calls = result[group_name]
            for name, case in CASES.items():
                expected = case.reference(everything)
                if math.isnan(expected):
                    assert math.isnan(values[name])
                else:
                    assert values[name] == pytest.approx(expected, rel=1e-9, abs=1e-9), name
            # One structure check (the first sync of a new layout), then one gather per sync.
            assert calls == [GATHER] * 3, calls
        assert result["dp mesh state_dict"] == per_rank[0]["dp mesh state_dict"]
        assert result["world sum"] == pytest.approx(2 * CASES["sum"].reference(everything))


@on_rank_device
def _mesh_checkpoint(seed: int) -> dict[str, Any]:
    """Save and restore over the data-parallel dimension of a 2x2 mesh, with and without
    telling the restored metric its group first."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(rank_device().type, (2, 2), mesh_dim_names=("dp", "tp"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    shard = make_shards(seed, 3)[coordinate[0]]  # tensor-parallel replicas share a shard

    def fresh() -> ComposeMetric:
        return ComposeMetric({name: case.factory() for name, case in CASES.items()})

    metrics = fresh()
    for name in CASES:
        feed(name, metrics[name], shard)
    metrics.sync_group = mesh["dp"]
    saved = metrics.state_dict()  # a collective over dp only
    out: dict[str, Any] = {}
    for told, checkpointed in ((True, False), (False, False), (False, True)):
        key = f"told={told}" + (", state_dict first" if checkpointed else "")
        restored = fresh()
        if told:
            restored.sync_group = mesh["dp"]
        restored.load_state_dict(saved)
        try:
            if checkpointed:
                # Over the default group, the load's own: fine, and no pass for a later sync
                # over dp (it used to use the check up, and dp group {1, 3} lost the state).
                restored.state_dict()
            restored.sync(group=mesh["dp"])
        except RuntimeError as error:
            out[key] = str(error)
            restored.reset()  # drops the loaded state: syncing over dp is fine again
            restored.sync(group=mesh["dp"])
            out[f"{key}, after reset"] = float(restored["sum"].compute())
            continue
        out[key] = {k: float(v) for k, v in restored.compute().items()}
    return out


def test_checkpoint_over_a_mesh_dimension_restores_every_replica(pools: Pools) -> None:
    per_rank = pools.get(4).run(_mesh_checkpoint, 13)
    everything = concat(make_shards(13, 3)[:2])
    for rank, result in enumerate(per_rank):
        for name, case in CASES.items():
            expected = case.reference(everything)
            got = result["told=True"][name]
            assert got == pytest.approx(expected, rel=1e-9, abs=1e-9, nan_ok=True), (rank, name)
    # Not told, the state went to global rank 0 only, and the other dp group lost it with no
    # word. Now the sync over dp refuses, on every rank, before any collective.
    for result in per_rank:
        for key in ("told=False", "told=False, state_dict first"):
            assert "loaded for the group of global ranks [0, 1, 2, 3]" in result[key]
            assert "set metric.sync_group = group before load_state_dict" in result[key]
            assert result[f"{key}, after reset"] == 0.0


@on_rank_device
def _child_checkpoint() -> dict[str, Any]:
    """A child of a composition loads a checkpoint alone; the composition syncs over dp."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(rank_device().type, (2, 2), mesh_dim_names=("dp", "tp"))
    source = SumMetric()
    source.update(torch.tensor([25.0]))
    saved = source.state_dict()  # 100.0 over the 4 ranks
    metrics = ComposeMetric({"a": SumMetric(), "b": SumMetric()})
    metrics["a"].load_state_dict(saved)  # placed on global rank 0
    metrics["a"].update(torch.tensor([1.0]))
    out: dict[str, Any] = {}
    try:
        metrics.sync(group=mesh["dp"])
        out["loaded"] = float(metrics["a"].compute())
    except RuntimeError as error:
        out["loaded"] = str(error)
    metrics.reset()  # the whole tree: the child's loaded state too
    metrics["a"].update(torch.tensor([1.0]))
    metrics.sync(group=mesh["dp"])
    out["after reset"] = float(metrics["a"].compute())
    return out


def test_a_child_loaded_alone_is_checked_when_its_composition_syncs(pools: Pools) -> None:
    # Only the syncing metric's own load was checked: dp group {1, 3} reported 2.0 for 102.0.
    for result in pools.get(4).run(_child_checkpoint):
        assert "loaded for the group of global ranks [0, 1, 2, 3]" in result["loaded"], result
        assert result["after reset"] == 2.0


@on_rank_device
def _copy_pairs_calls(copied: bool) -> str:
    """Rank 0 syncs, rank 1 checkpoints: a metric synced once before, or its deep copy."""
    rank = dist.get_rank()
    metric = SumMetric()
    metric.update(torch.tensor([float(rank + 1)]))
    metric.sync()
    target = copy.deepcopy(metric) if copied else metric
    target.update(torch.tensor([100.0]))
    try:
        if rank == 0:
            target.sync()
        else:
            target.state_dict()
    except RankMismatchError as error:
        return str(error)
    return f"no error: {float(target.compute())}"


@pytest.mark.parametrize("copied", [False, True])
def test_a_deep_copy_still_tells_ranks_that_pair_different_calls(
    pools: Pools, copied: bool
) -> None:
    # The copy's sync wrote its fingerprint through a NumPy view that deepcopy had made an
    # array of its own: it sent its first call's fingerprint forever, and mixed these calls.
    for text in pools.get(2).run(_copy_pairs_calls, copied):
        assert "rank 0: sync #2" in text and "rank 1: state_dict #2" in text, text


class _Shaped(Metric[Tensor]):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, op: ReduceOp) -> None:
        self._state = MetricAccumulator(torch.zeros(shape, dtype=dtype), op)

    def update(self) -> None:
        self._state.accumulate(torch.ones((), dtype=self._state.local.dtype))

    def compute(self) -> Tensor:
        return self._state.value


@on_rank_device
def _mismatches(token: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = world - 1  # the rank that differs
    default = ((3,), torch.int64, ReduceOp.SUM)
    scenarios: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype, ReduceOp]]] = {
        "shape": {"counts": ((4,), torch.int64, ReduceOp.SUM)},
        "dtype": {"counts": ((3,), torch.float32, ReduceOp.SUM)},
        "op": {"counts": ((3,), torch.int64, ReduceOp.MAX)},
        "key": {"other": default},
        "missing": {"counts": default, "extra": default},
    }
    out: dict[str, Any] = {}
    for scenario, different in scenarios.items():
        layout = different if rank == odd else {"counts": default}
        metric = ComposeMetric(
            {
                f"{scenario}_{token}": ComposeMetric(
                    {name: _Shaped(*spec) for name, spec in layout.items()}
                )
            }
        )
        try:
            metric.sync()
            out[scenario] = "no error"
        except RankMismatchError as error:
            out[scenario] = str(error)
    # prepare_sync pays the structure check up front; the real sync then reduces with one gather.
    name = f"checked_{token}"
    checked = ComposeMetric({name: SumMetric()})
    checked[name].update(torch.tensor([1.0]))
    with count_collectives() as check_calls:
        checked.prepare_sync(None)
    out["check_only untouched"] = all(a.synced is None for _, a in checked.named_accumulators())
    with count_collectives() as real_calls:
        checked.sync()
    out["check_only calls"] = (check_calls, real_calls, float(checked.compute()[name]))
    layout = {"counts": ((4,), torch.int64, ReduceOp.SUM) if rank == odd else default}
    mismatched = ComposeMetric(
        {f"check_{token}": ComposeMetric({key: _Shaped(*spec) for key, spec in layout.items()})}
    )
    try:
        mismatched.prepare_sync(None)
        out["check_only mismatch"] = "no error"
    except RankMismatchError as error:
        out["check_only mismatch"] = str(error)
    # The group is still usable afterwards.
    healthy = SumMetric()
    healthy.update(torch.tensor([1.0]))
    healthy.sync()
    out["after"] = float(healthy.compute())
    return out


@on_rank_device
def _mismatch_after_an_earlier_check(token: str) -> dict[str, Any]:
    """Every rank checked a structure; then one rank syncs it again in a new metric, another not."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = ((3,), torch.int64, ReduceOp.SUM)
    first = ComposeMetric({f"seen_{token}": _Shaped(*spec)})
    first.sync()
    shape = ((4,), torch.int64, ReduceOp.SUM) if rank == world - 1 else spec
    second = ComposeMetric({f"seen_{token}": _Shaped(*shape)})
    out: dict[str, Any] = {}
    try:
        second.sync()
        out["second"] = "no error"
    except RankMismatchError as error:
        out["second"] = str(error)
    healthy = SumMetric()
    healthy.update(torch.tensor([float(rank + 1)]))
    healthy.sync()
    out["after"] = float(healthy.compute())
    return out


def test_a_structure_checked_before_is_checked_again_in_a_new_metric(dist_pool: RankPool) -> None:
    # A cache of verified structures let the ranks that had seen one skip the check while the
    # odd rank ran it: the check then met a data collective and both hung until the timeout.
    world = dist_pool.world_size
    token = uuid.uuid4().hex[:6]
    per_rank = dist_pool.run(_mismatch_after_an_earlier_check, token, timeout=60)
    for result in per_rank:
        assert f"has shape (4,) on rank {world - 1} but (3,) on rank 0" in result["second"]
        assert result["after"] == world * (world + 1) / 2


@on_rank_device
def _compute_settings_differ(token: str) -> dict[str, str]:
    """Equal states, but what compute reads (an average, the curve) differs on the last rank."""
    # Imported here: with them imported by this module, a worker of a pytest run kept the
    # destroyed default group of test_a_synced_metric_keeps_no_reference_... alive through a
    # cell no Python object refers to (not sidestream's; unexplained, not seen outside pytest).
    from sidestream.metrics.classification import (
        BinaryAUROCMetric,
        BinaryAveragePrecisionMetric,
        ConfusionCountMetric,
        Problem,
        ProblemKind,
        Recall,
        confusion_count_metric,
    )
    from sidestream.metrics.regression import MeanSquaredErrorMetric

    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    f1 = confusion_count_metric().multiclass(3).with_f1()
    cases: dict[str, Metric[Any]] = {
        "average": (f1.micro() if odd else f1.macro()).build(),
        "zero_division": ConfusionCountMetric(
            Problem(ProblemKind.MULTICLASS, 3), [Recall()], zero_division=1.0 if odd else 0.0
        ),
        "curve": BinaryAveragePrecisionMetric() if odd else BinaryAUROCMetric(),
        "multioutput": MeanSquaredErrorMetric(
            2, multioutput="raw_values" if odd else "uniform_average"
        ),
        "same max_fpr": BinaryAUROCMetric(max_fpr=1 if odd else 1.0),
        "same": ConfusionCountMetric(
            Problem(ProblemKind.MULTICLASS, 3), [Recall()], zero_division=1.0
        ),
    }
    out = {}
    for case, metric in cases.items():
        tree = ComposeMetric({f"{case}_{token}": metric})
        try:
            tree.sync()
            out[case] = "no error"
        except RankMismatchError as error:
            out[case] = str(error)
    return out


def test_ranks_whose_compute_settings_differ_raise_on_every_rank(dist_pool: RankPool) -> None:
    # Each rank would report its own number from the same global counts, without an error.
    odd = dist_pool.world_size - 1
    token = uuid.uuid4().hex[:6]
    for result in dist_pool.run(_compute_settings_differ, token, timeout=90):
        assert result["same"] == result["same max_fpr"] == "no error"
        for case, found, expected in (
            ("average", "average=micro", "average=macro"),
            ("zero_division", "zero_division=1.0", "zero_division=0.0"),
            ("curve", "BinaryAveragePrecisionMetric", "BinaryAUROCMetric"),
            ("multioutput", "multioutput=raw_values", "multioutput=uniform_average"),
        ):
            message = result[case]
            assert message.startswith("sync: ranks of the group hold different"), message
            assert f"metric '{case}_{token}' is '" in message
            on_odd, on_zero = message.split(f" on rank {odd} but ")
            assert found in on_odd and expected in on_zero, message


def test_rank_mismatch_raises_on_every_rank(dist_pool: RankPool) -> None:
    world = dist_pool.world_size
    odd = world - 1
    token = uuid.uuid4().hex[:6]
    per_rank = dist_pool.run(_mismatches, token, timeout=90)
    prefix = f"{{}}_{token}."
    for rank, result in enumerate(per_rank):
        shape = result["shape"]
        assert f"state '{prefix.format('shape')}counts.state' has shape (4,) on rank {odd}" in (
            shape
        )
        assert "but (3,) on rank 0" in shape
        assert f"has dtype float32 on rank {odd} but int64 on rank 0" in result["dtype"]
        assert f"has op MAX on rank {odd} but SUM on rank 0" in result["op"]
        key = result["key"]
        assert f"'{prefix.format('key')}other.state' exists on rank {odd} but not on rank 0" in key
        assert f"'{prefix.format('key')}counts.state' exists on rank 0 but not on rank {odd}" in (
            key
        )
        missing = result["missing"]
        assert f"'{prefix.format('missing')}extra.state' exists on rank {odd}" in missing
        assert f"seen from rank {rank}" in shape
        # A rank that skipped a collective call (dcp.load) reads as different metrics: said.
        assert "a rank skipped or reordered a call that meets the other ranks" in key
        assert result["after"] == world
        assert result["check_only untouched"]
        assert result["check_only calls"] == ([GATHER], [GATHER], world)
        assert f"has shape (4,) on rank {odd}" in result["check_only mismatch"]


@pytest.mark.parametrize(
    ("step", "error"),
    [(-1, ValueError), (2**63, ValueError), (1.0, TypeError), (True, TypeError)],
)
def test_a_sync_step_out_of_range_is_refused(step: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"^step: expected an int"):
        MeanMetric().sync(step=step)


def test_a_numpy_sync_step_is_taken() -> None:
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 3.0]))
    metric.sync(step=np.int64(4))
    assert metric.compute().item() == 2.0


def _constants_by_rank() -> dict[str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    other = rank == world - 1
    out = {}
    short = MetricAccumulator.constant(torch.tensor([1.0, 3.0 if other else 2.0]))
    long = MetricAccumulator.constant(torch.arange(100.0) + (0.5 if other else 0.0))
    same = MetricAccumulator.constant(torch.arange(100.0))
    for name, state in (("short", short), ("long", long), ("same", same)):
        try:
            state.sync()
            out[name] = f"no error: {state.value.tolist()[:2]}"
        except RankMismatchError as error:
            out[name] = str(error)
    return out


def test_a_constant_held_with_other_values_fails_every_rank(dist_pool: RankPool) -> None:
    # A constant is reduced as the MAX of equal values: unequal ones were reduced silently.
    odd = dist_pool.world_size - 1
    for outcome in dist_pool.run(_constants_by_rank, timeout=60):
        assert (
            f"'state' has configuration [1.0, 3.0] on rank {odd} but [1.0, 2.0] on rank 0"
            in (outcome["short"])
        )
        # Long values are named by their ends, count and a hash that differs with any value.
        long = outcome["long"]
        assert "has configuration 100 values [0.5, 1.5, ..., 99.5] (hash " in long
        assert "but 100 values [0.0, 1.0, ..., 99.0] (hash " in long
        assert outcome["same"] == "no error: [0.0, 1.0]"


def _sync_over_a_smaller_default_group(store_path: str) -> dict[str, Any] | None:
    """Sync over 3 ranks, make the default group again with ranks 0 and 1, sync again."""
    from datetime import timedelta

    rank = dist.get_rank()
    metric = MeanMetric()
    metric.update(torch.tensor([float(rank)]))
    metric.sync()
    first = metric.compute().item()
    dist.destroy_process_group()
    if rank == 2:
        return None  # this rank leaves the job
    # As an elastic agent restarting the job with two processes says (a default group smaller
    # than WORLD_SIZE is refused: a group per node would write each node's part as the job's).
    os.environ["WORLD_SIZE"] = "2"
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=30),
    )
    metric.update(torch.tensor([10.0]))
    metric.sync()
    second = metric.compute().item()
    saved = {name: value.item() for name, value in states_only(metric.state_dict()).items()}
    return {"first": first, "second": second, "saved": saved}


def test_a_default_group_made_again_with_fewer_ranks_gets_a_new_layout(tmp_path: Any) -> None:
    # An elastic restart in the same processes: the default group (group=None) is another
    # group now, with another world size. The layout kept for the old one had 3 ranks' buffers.
    from sidestream.testing import run_distributed

    results = run_distributed(
        _sync_over_a_smaller_default_group, 3, str(tmp_path / "store"), timeout=90
    )
    assert results[2] is None
    second_values = [0.0, 10.0, 1.0, 10.0]  # every value the two remaining ranks hold
    for result in results[:2]:
        assert result is not None
        assert result["first"] == pytest.approx(np.mean([0.0, 1.0, 2.0]))
        assert result["second"] == pytest.approx(np.mean(second_values))
        assert result["saved"] == {"total": sum(second_values), "count": len(second_values)}


def _default_group_freed_after_destroy() -> bool:
    """Whether the default group is freed once destroyed, while a synced metric lives on."""
    import gc
    import weakref

    metric = MeanMetric()
    metric.update(torch.tensor([float(dist.get_rank())]))
    metric.sync()
    metric.state_dict()
    default = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    freed = default() is None
    assert float(metric.compute()) == 0.5  # the metric is alive (and holds its result)
    return freed


def test_a_synced_metric_keeps_no_reference_to_a_destroyed_default_group() -> None:
    # A reference kept past destroy_process_group runs gloo's destructor at interpreter exit,
    # which aborts the process (SIGABRT, "terminate called without an active exception").
    from sidestream.testing import run_distributed

    assert run_distributed(_default_group_freed_after_destroy, 2, timeout=60) == [True, True]


def _synced_on_meta() -> tuple[list[str], list[str]]:
    metric = ComposeMetric({"mean": MeanMetric(), "max": MaxMetric()})
    metric.sync()  # laid out on the CPU: moving it makes a new layout
    metric.to("meta")
    outcomes = []
    with count_collectives() as started:
        for call in (metric.sync, metric.state_dict):
            try:
                call()
            except ValueError as error:
                outcomes.append(str(error))
    return outcomes, list(started)


def test_a_sync_on_the_meta_device_is_refused_before_any_collective(pools: Pools) -> None:
    # torch's "Cannot copy out of meta tensor" came after the structure check had started:
    # a rank alone on meta left the others waiting for the process group's timeout.
    for outcomes, started in [*pools.get(2).run(_synced_on_meta, timeout=60), _synced_on_meta()]:
        assert len(outcomes) == 2, outcomes
        assert all("on device 'meta', which holds no values" in text for text in outcomes)
        assert started == []


def test_the_group_new_group_returns_outside_it_is_named_as_such() -> None:
    # On a rank outside the group, new_group returns GroupMember.NON_GROUP_MEMBER (an int):
    # the error said "expected a ProcessGroup, got int", blaming what the user passed as told.
    outsider = dist.GroupMember.NON_GROUP_MEMBER
    metric = MeanMetric()
    with pytest.raises(ValueError, match="is not a member of this group"):
        metric.sync(outsider)
    from sidestream import AsyncMetricCollector

    with pytest.raises(ValueError, match="is not a member of this group"):
        AsyncMetricCollector(MeanMetric(), group=outsider)  # refused as it is made
    with pytest.raises(TypeError, match="got int"):
        metric.sync(3)  # type: ignore[arg-type]  # any other int is still the wrong type


def _sync_seeing_other_members() -> str:
    # What gloo did with groups made in different orders on different ranks (new_group([0, 1])
    # then new_group([2, 3]) on ranks 0 and 1, the other way round on 2 and 3): it connected
    # ranks of different groups, each rank seeing its own group's members. Made deterministic
    # here by showing rank 1 another member list.
    rank, world = dist.get_rank(), dist.get_world_size()
    real = sync_module.group_ranks
    if rank == 1:
        sync_module.group_ranks = lambda group: tuple(range(world, 2 * world))
    metric = SumMetric()
    metric.update(torch.tensor([1.0]))
    try:
        metric.sync()
    except RankMismatchError as error:
        return str(error)
    finally:
        sync_module.group_ranks = real
    return f"no error: {float(metric.compute())}"


def test_ranks_that_see_their_group_with_other_members_fail_every_rank(
    dist_pool: RankPool,
) -> None:
    # gloo's cross-wired groups reduced states of ranks of another group into wrong numbers on
    # every rank, without an error (1 run in 9 of tests/.../groups made in different orders;
    # the others hung or timed out in the backend).
    for rank, outcome in enumerate(dist_pool.run(_sync_seeing_other_members, timeout=60)):
        assert "each see it with other members" in outcome, (rank, outcome)
        assert "made in different orders" in outcome, (rank, outcome)
