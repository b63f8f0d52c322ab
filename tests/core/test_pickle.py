"""Metrics through pickle (multiprocessing arguments, Ray, a file) keep working.

Pickle copies each tensor on its own, so the views that tie a state to its metric tree's arena
must be made again on load; checked against sums computed here, not by the metric.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from sidestream import ComposeMetric, MaxMetric, MeanMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.classification import BinaryAUROCMetric
from sidestream.testing import RankPool


def _tree() -> ComposeMetric:
    return ComposeMetric(
        {
            "mean": MeanMetric(),
            "weighted": WeightedMeanMetric(),
            "max": MaxMetric(),
            "auroc": BinaryAUROCMetric(exact=True),
        }
    )


def _feed(metric: ComposeMetric, values: torch.Tensor, labels: torch.Tensor) -> None:
    metric["mean"].update(values)
    metric["weighted"].update(values, torch.full_like(values, 2.0))
    metric["max"].update(values)
    metric["auroc"].update(values, labels)


@pytest.mark.parametrize("built", [False, True], ids=["fresh", "arena"])
def test_pickled_tree_keeps_updating_resetting_and_saving(built: bool) -> None:
    rng = np.random.default_rng(3)
    first, second = rng.random(50), rng.random(30)
    first_labels, second_labels = rng.integers(0, 2, 50), rng.integers(0, 2, 30)
    metric = _tree()
    if built:
        metric.to("cpu")  # the arena: every state a view into one buffer per dtype
    _feed(metric, torch.from_numpy(first), torch.from_numpy(first_labels))

    loaded = pickle.loads(pickle.dumps(metric))
    _feed(loaded, torch.from_numpy(second), torch.from_numpy(second_labels))
    both = np.concatenate([first, second])
    labels = np.concatenate([first_labels, second_labels])
    result = loaded.compute()
    assert float(result["mean"]) == pytest.approx(both.mean(), rel=1e-12)
    assert float(result["weighted"]) == pytest.approx(both.mean(), rel=1e-12)
    assert float(result["max"]) == both.max()
    assert float(result["auroc"]) == pytest.approx(roc_auc_score(labels, both), abs=1e-12)
    saved = loaded.state_dict()
    assert float(saved["mean.total"]) == pytest.approx(both.sum(), rel=1e-12)
    assert float(saved["mean.count"]) == both.size

    loaded.reset()
    assert float(loaded.state_dict()["mean.count"]) == 0
    assert bool(loaded["max"].compute().isneginf()) or bool(loaded["max"].compute().isnan())
    # The original is untouched by its copy.
    assert float(metric.compute()["mean"]) == pytest.approx(first.mean(), rel=1e-12)


def test_deepcopy_keeps_the_arena_views() -> None:
    metric = _tree().to("cpu")
    copied = copy.deepcopy(metric)
    states = [state for _, state in copied.named_accumulators()]
    arena = copied.__dict__["_state_arena"]
    assert arena is not metric.__dict__["_state_arena"]
    buffers = {segment.local.untyped_storage().data_ptr() for segment in arena.segments}
    assert all(s.local.untyped_storage().data_ptr() in buffers for s in states)


def test_pickling_an_exact_metric_whose_input_changed_raises() -> None:
    # Exact metrics keep their inputs without a copy; a copy made after the caller changed one
    # in place must not carry the changed rows on as if they were the data.
    metric = BinaryAUROCMetric(exact=True)
    scores = torch.tensor([0.2, 0.8, 0.4])
    metric.update(scores, torch.tensor([0, 1, 1]))
    scores.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified in place"):
        pickle.dumps(metric)


def _synced_then_copied() -> dict[str, float]:
    import torch.distributed as dist

    metric = ComposeMetric({"sum": SumMetric(), "auroc": BinaryAUROCMetric(exact=True)})
    rank = dist.get_rank()
    metric["sum"].update(torch.tensor([float(rank + 1)]))
    metric["auroc"].update(torch.tensor([0.2, 0.9]) + 0.02 * rank, torch.tensor([rank % 2, 1]))
    metric.sync()
    out = {}
    loaded = pickle.loads(pickle.dumps(metric))
    loaded.state_dict()  # builds the arena the pickle left out
    out["pickled sum"] = float(loaded.compute()["sum"])
    out["pickled auroc"] = float(loaded.compute()["auroc"])
    metric.to("cpu")  # a new arena on the same device
    out["moved sum"] = float(metric.compute()["sum"])
    return out


def test_synced_state_survives_a_pickle_and_a_move(dist_pool: RankPool) -> None:
    # A rebuilt arena used to start with zeroed synced buffers and stale flags, so compute
    # fell back to this rank's local values after a pickle (or to()) of a synced metric.
    world = dist_pool.world_size
    scores = np.concatenate([np.array([0.2, 0.9]) + 0.02 * rank for rank in range(world)])
    labels = np.concatenate([np.array([rank % 2, 1]) for rank in range(world)])
    expected_auroc = roc_auc_score(labels, scores.astype(np.float32).astype(np.float64))
    for out in dist_pool.run(_synced_then_copied, timeout=120):
        assert out["pickled sum"] == out["moved sum"] == sum(range(1, world + 1))
        assert out["pickled auroc"] == pytest.approx(expected_auroc, abs=1e-12)


class _KeepsItsDict(MeanMetric):
    """A subclass with the usual __getstate__ idiom (a copy of __dict__, arena included)."""

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()


def test_a_pickled_arena_comes_back_dead_and_is_rebuilt() -> None:
    metric = _KeepsItsDict()
    metric.update(torch.tensor([5.0]))
    loaded = pickle.loads(pickle.dumps(metric))
    loaded.reset()
    loaded.update(torch.tensor([1.0]))
    assert float(loaded.compute()) == 1.0


def test_an_unpickled_metric_has_its_arena_and_compiles_across_a_reset() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    metric = pickle.loads(pickle.dumps(ComposeMetric({"max": MaxMetric(), "sum": SumMetric()})))
    assert metric.__dict__.get("_state_arena") is not None
    step = torch.compile(metric["sum"].update, fullgraph=True, backend="aot_eager")
    step(torch.arange(5.0))
    metric.reset()
    step(torch.arange(7.0))
    assert float(metric["sum"].compute()) == 21.0


def _pickled_after_a_group_sync() -> float:
    import torch.distributed as dist

    metric = MeanMetric()
    metric.update(torch.tensor([float(dist.get_rank())]))
    metric.sync(dist.new_group(list(range(dist.get_world_size()))))
    return float(pickle.loads(pickle.dumps(metric)).compute())


def test_a_metric_synced_over_a_group_pickles(dist_pool: RankPool) -> None:
    # A process group cannot be pickled: the copy leaves it out (and syncs over the default).
    world = dist_pool.world_size
    for value in dist_pool.run(_pickled_after_a_group_sync, timeout=120):
        assert value == pytest.approx(sum(range(world)) / world)


class _Slotted(SumMetric):
    __slots__ = ("factor",)

    def __init__(self) -> None:
        super().__init__()
        self.factor = 5


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_copies_keep_a_subclass_slots(how: str) -> None:
    metric = _Slotted()
    metric.update(torch.tensor([2.0]))
    copies = {
        "pickle": lambda: pickle.loads(pickle.dumps(metric)),
        "copy": lambda: copy.copy(metric),
        "deepcopy": lambda: copy.deepcopy(metric),
    }
    copied = copies[how]()
    assert copied.factor == 5 and float(copied.compute()) == 2.0


def test_a_state_added_after_a_sync_is_not_read_from_the_synced_buffers() -> None:
    metric = SumMetric()
    metric.update(torch.tensor([3.0]))
    metric.sync()  # single process: the synced copy is the local state, and current
    added = metric.add_state("extra", torch.zeros(3))
    added.accumulate(torch.full((3,), 7.0))
    assert added.value.tolist() == [7.0, 7.0, 7.0]
    metric.to("cpu")
    assert added.value.tolist() == [7.0, 7.0, 7.0] and float(metric.compute()) == 3.0


def _shallow_and_deep_copies_keep_the_group() -> list[bool]:
    import torch.distributed as dist

    group = dist.new_group(list(range(dist.get_world_size())))
    metric = MeanMetric()
    metric.update(torch.tensor([1.0]))
    metric.sync(group)
    return [copy.copy(metric).sync_group is group, copy.deepcopy(metric).sync_group is group]


def test_copies_keep_the_process_group(dist_pool: RankPool) -> None:
    for kept in dist_pool.run(_shallow_and_deep_copies_keep_the_group, timeout=120):
        assert kept == [True, True]


def test_a_constant_pickled_before_constants_were_compared_is_still_one() -> None:
    """An earlier version's pickle has no ``_compared_as``: its constant (a MAX state with a
    configuration text) must not turn into a classification configuration."""
    from sidestream import MetricAccumulator

    constant = MetricAccumulator.constant(torch.tensor([0.0, 0.5, 1.0]))
    older = constant.__getstate__()
    del older["_compared_as"]
    restored = object.__new__(MetricAccumulator)
    restored.__setstate__(older)
    assert restored._compared_as == torch.float32
    counts = MetricAccumulator(torch.zeros(3))
    older = counts.__getstate__()
    del older["_compared_as"]
    restored = object.__new__(MetricAccumulator)
    restored.__setstate__(older)
    assert restored._compared_as is None
