"""Explicit state declaration, the freshness flag and the state arena.

The arena's promise is structural (every state of a metric tree is a view into one buffer per
dtype) and must survive everything that moves or copies state: ``to``, ``load_state_dict``,
DCP resharding (``tests/core/test_checkpoint_resharding.py`` checks it there) and
``clone_metric``. Values are checked against plain Python/numpy references.
"""

from __future__ import annotations

import collections
import copy
import io
import math
from types import MappingProxyType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import (
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    Metric,
    MetricAccumulator,
    MinMetric,
    ReduceOp,
    SumMetric,
    WeightedMeanMetric,
)
from sidestream.collector._slot import clone_metric
from sidestream.state import accumulate_sums
from sidestream.sync import CallFingerprint
from sidestream.testing import OpRecorder, RankPool, on_rank_device
from tests._checkpoints import states_only


def arena_views_intact(metric: Metric[Any]) -> bool:
    """Whether every state of ``metric``'s tree is a view into the tree's live arena."""
    arena = metric.__dict__.get("_state_arena")
    if arena is None or not arena.alive or arena.root is not metric:
        return False
    buffers = {
        "local": {b.untyped_storage().data_ptr() for b in arena.locals},
        "initial": {b.untyped_storage().data_ptr() for b in arena.initials},
        "synced": {b.untyped_storage().data_ptr() for b in arena.synceds},
    }
    for _, state in metric.named_accumulators():
        tensors = {"local": state.local, "initial": state.initial, "synced": state._synced}
        for kind, tensor in tensors.items():
            if tensor.untyped_storage().data_ptr() not in buffers[kind]:
                return False
        if state._arena is not arena:
            return False
    return True


class Pair(Metric[Tensor]):
    """Two SUM states and a MAX state in two dtypes: a small tree of every arena case."""

    def __init__(self) -> None:
        self._total = MetricAccumulator(0.0, dtype=torch.float64)
        self.count = self.add_state("count", 0, dtype=torch.int64)
        self._largest = MetricAccumulator(torch.full((2,), -torch.inf), ReduceOp.MAX)

    def update(self, values: Tensor) -> None:
        self._total.accumulate(values.sum(dtype=torch.float64))
        self.count.accumulate(torch.tensor(values.numel()))
        self._largest.accumulate(values.amax())

    def compute(self) -> Tensor:
        return torch.stack(
            [self._total.value, self.count.value.double(), self._largest.value[0].double()]
        )


def _tree() -> ComposeMetric:
    return ComposeMetric({"pair": Pair(), "inner": ComposeMetric({"mean": MeanMetric()})})


# ---------------------------------------------------------------- declaration


def test_states_are_named_by_declaration() -> None:
    assert [name for name, _ in Pair().named_accumulators()] == ["total", "count", "largest"]
    tree = _tree()
    assert sorted(states_only(tree.state_dict())) == [
        "inner.mean.count",
        "inner.mean.total",
        "pair.count",
        "pair.largest",
        "pair.total",
    ]


def test_duplicate_names_raise_at_declaration() -> None:
    class Colliding(Metric[Tensor]):
        def __init__(self) -> None:
            self._count = MetricAccumulator(0.0)
            self.count = MetricAccumulator(0.0)  # the same key "count"

        def update(self) -> None: ...

        def compute(self) -> Tensor:
            return torch.zeros(())

    with pytest.raises(ValueError, match="'count' is declared twice"):
        Colliding()

    metric = SumMetric()
    with pytest.raises(
        ValueError, match=r"'total' is declared twice \(attribute '_total', then add_state\)"
    ):
        metric.add_state("total", 0.0)


@pytest.mark.parametrize(
    ("attribute", "value"),
    [
        ("_sync_group", MetricAccumulator(0.0)),  # a state "sync_group": the first sync broke
        ("_call_counter", 0),  # "'int' object has no attribute 'next'" at the first sync
        ("_bound_prefix", "x"),  # "belongs to a bound collector" at load_state_dict
        ("_sync_layouts", {}),
    ],
)
def test_the_base_class_bookkeeping_names_are_refused_at_assignment(
    attribute: str, value: object
) -> None:
    class Shadowing(SumMetric):
        def __init__(self) -> None:
            super().__init__()
            setattr(self, attribute, value)

    with pytest.raises(TypeError, match=f"{attribute}: a name the Metric base class keeps"):
        Shadowing()
    plain = SumMetric()
    plain.sync_group = None  # the group itself is still the metric's to set


class _FillsAContainerLate(Metric[Tensor]):
    """Puts a state in a dict in its first update (declared states only are synced)."""

    def __init__(self) -> None:
        self._count = MetricAccumulator(0.0)
        self.extra: dict[str, MetricAccumulator] = {}

    def update(self, value: float) -> None:
        if not self.extra:
            self.extra["sum"] = MetricAccumulator(0.0)
        self.extra["sum"].accumulate(torch.tensor(value, dtype=torch.float64))
        self._count.accumulate(torch.ones((), dtype=torch.float64))

    def compute(self) -> Tensor:
        return self.extra["sum"].value / self._count.value


def test_a_container_filled_after_init_is_refused_by_the_first_sync() -> None:
    # Each rank reported its own sum as the global one (1.0 and 6.0 for 7.0): the check ran
    # at to() and state_dict() only, after the wrong numbers were logged.
    metric = _FillsAContainerLate()
    metric.update(1.0)
    with pytest.raises(TypeError, match="extra: a MetricAccumulator inside a dict"):
        metric.sync()


def test_a_container_filled_after_a_sync_is_refused_by_the_next_one() -> None:
    # The check ran when a sync was laid out only: a sync before the first update (an eval at
    # step 0) kept the layout, and later syncs left the new state out (0.5 and 1.0 on two
    # ranks for 1.5: each rank's own sum over the global count).
    metric = _FillsAContainerLate()
    metric.sync()
    metric.update(1.0)
    with pytest.raises(TypeError, match="extra: a MetricAccumulator inside a dict"):
        metric.sync()


def test_a_subclass_reusing_its_base_class_state_attribute_raises() -> None:
    # MeanMetric's own update fed the subclass's new _count (1.83 for a mean of 2.75), where a
    # base class declaring with add_state (MaxMetric) raised.
    class CountsUpdates(MeanMetric):
        def __init__(self) -> None:
            super().__init__()
            self._count = MetricAccumulator(torch.zeros((), dtype=torch.int64))

    with pytest.raises(
        ValueError, match=r"CountsUpdates\._count: already holds the declared state"
    ):
        CountsUpdates()


def test_a_state_named_configuration_next_to_configured_states_is_refused() -> None:
    """A state named "configuration" was replaced in state_dict by the hash of the settings of
    the same metric's configured states, and its checkpoint did not load."""

    class Configured(Metric[Tensor]):
        def __init__(self, configured: bool) -> None:
            self._configuration = MetricAccumulator(0.0)
            self._hits = MetricAccumulator(0.0)
            if configured:
                self._hits.set_configuration("threshold=0.5")

        def update(self) -> None: ...

        def compute(self) -> Tensor:
            return torch.zeros(())

    metric = Configured(configured=True)
    with pytest.raises(ValueError, match="Configured: a state or child named 'configuration'"):
        metric.state_dict()
    # No settings of its own, or the name elsewhere in the tree: no collision, it round-trips.
    for tree in (
        Configured(configured=False),
        ComposeMetric({"configuration": SumMetric(), "other": Configured(configured=False)}),
    ):
        saved = tree.state_dict()
        assert any("configuration" in key for key in saved), sorted(saved)
        tree.load_state_dict(saved)


_AS_MAPPING = {
    dict: dict,
    collections.UserDict: collections.UserDict,
    collections.ChainMap: lambda states: collections.ChainMap({}, states),
    MappingProxyType: MappingProxyType,
}


@pytest.mark.parametrize(
    "container",
    [list, tuple, collections.deque, collections.UserList, *_AS_MAPPING],
    ids=lambda container: container.__name__,
)
def test_states_hidden_in_containers_raise(container: type) -> None:
    class Hidden(Metric[Tensor]):
        def __init__(self) -> None:
            states = [MetricAccumulator(0.0), MetricAccumulator(0.0)]
            if container in _AS_MAPPING:
                self._states = _AS_MAPPING[container](dict(enumerate(states)))
            else:
                self._states = container(states)

        def update(self) -> None: ...

        def compute(self) -> Tensor:
            return torch.zeros(())

    with pytest.raises(TypeError, match="_states: a MetricAccumulator inside a"):
        Hidden()


def test_states_added_to_a_container_after_its_assignment_raise() -> None:
    # An empty list passes __setattr__'s check; states appended to it later would be left out
    # of reset, sync and checkpoints.
    class PerHead(Metric[Tensor]):
        def __init__(self, lazy: bool) -> None:
            self.sums: list[MetricAccumulator] = []
            if not lazy:
                self._add_heads()

        def _add_heads(self) -> None:
            for _ in range(3):
                self.sums.append(MetricAccumulator(torch.zeros((), dtype=torch.float64)))

        def update(self, values: Tensor) -> None:
            if not self.sums:
                self._add_heads()
            for state, value in zip(self.sums, values, strict=True):
                state.accumulate(value)

        def compute(self) -> Tensor:
            return torch.stack([state.value for state in self.sums])

    hidden = "sums: a MetricAccumulator inside a list"
    with pytest.raises(TypeError, match=hidden):
        PerHead(lazy=False)  # filled in __init__: refused when it ends
    metric = PerHead(lazy=True)
    metric.update(torch.tensor([1.0, 2.0, 3.0]))  # filled by the first update
    for use in (metric.state_dict, lambda: metric.to("cpu")):
        with pytest.raises(TypeError, match=hidden):
            use()
    assert metric.compute().tolist() == [1.0, 2.0, 3.0]  # nothing was reset or moved


def test_containers_of_declared_states_are_allowed() -> None:
    # A list of states that are declared on their own is only a second way to reach them.
    class Pair(Metric[Tensor]):
        def __init__(self) -> None:
            self._low = MetricAccumulator(0.0)
            self._high = MetricAccumulator(0.0)
            self._both = [self._low, self._high]

        def update(self, values: Tensor) -> None:
            for state, value in zip(self._both, values, strict=True):
                state.accumulate(value)

        def compute(self) -> Tensor:
            return torch.stack([state.value for state in self._both])

    metric = Pair()
    metric.update(torch.tensor([1.0, 2.0]))
    assert sorted(states_only(metric.state_dict())) == ["high", "low"]
    metric.reset()
    assert metric.compute().tolist() == [0.0, 0.0]


def test_child_metrics_in_a_list_raise_and_attributes_work() -> None:
    class Parent(Metric[Tensor]):
        def __init__(self, in_list: bool) -> None:
            if in_list:
                self._children = [MeanMetric()]
            else:
                self._child = MeanMetric()

        def update(self, values: Tensor) -> None:
            self._child.update(values)

        def compute(self) -> Tensor:
            return self._child.compute()

    with pytest.raises(TypeError, match="a MeanMetric inside a list"):
        Parent(in_list=True)
    parent = Parent(in_list=False)
    parent.update(torch.tensor([1.0, 3.0]))
    assert sorted(states_only(parent.state_dict())) == ["child.count", "child.total"]
    parent.reset()
    assert float(parent._child._count.local) == 0.0


def test_accumulator_has_no_local_checkpoint_methods() -> None:
    # Local-only state in a checkpoint is the opposite of what Metric.state_dict means.
    assert not hasattr(MetricAccumulator(0.0), "state_dict")
    assert not hasattr(MetricAccumulator(0.0), "load_state_dict")


def test_complex_state_is_refused() -> None:
    with pytest.raises(TypeError, match="complex"):
        MetricAccumulator(torch.zeros(2, dtype=torch.complex64))


# ---------------------------------------------------------------- checkpoints


def test_max_state_does_not_load_into_min() -> None:
    largest = MaxMetric()
    largest.update(torch.tensor([3.0]))
    with pytest.raises(KeyError, match=r"missing keys \['min'\], unexpected keys \['max'\]"):
        MinMetric().load_state_dict(largest.state_dict())


def test_float64_state_does_not_load_into_float32() -> None:
    wide = MaxMetric(dtype=torch.float64)
    wide.update(torch.tensor([1.5]))
    narrow = MaxMetric(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"state_dict\['max'\]: expected dtype torch.float32"):
        narrow.load_state_dict(wide.state_dict())
    assert float(narrow.compute()) == -math.inf  # nothing was loaded


def test_complex_weights_are_refused() -> None:
    metric = WeightedMeanMetric()
    with pytest.raises(TypeError, match="weights: expected a real tensor"):
        metric.update(torch.ones(2), torch.ones(2, dtype=torch.complex64))
    assert float(metric._weight.local) == 0.0


# ---------------------------------------------------------------- the arena


def test_views_survive_to_reset_load_and_clone() -> None:
    tree = _tree().to("cpu")
    assert arena_views_intact(tree)
    # float64, int64 and float32 states: three dtype buffers in one block of the device.
    assert len(tree.__dict__["_state_arena"].locals) == 1
    assert {state.local.dtype for _, state in tree.named_accumulators()} == {
        torch.float64,
        torch.int64,
        torch.float32,
    }
    tree["pair"].update(torch.tensor([1.0, 5.0]))
    tree["inner"]["mean"].update(torch.tensor([2.0]))
    saved = tree.state_dict()

    copy = clone_metric(tree)
    assert arena_views_intact(copy)
    assert copy.compute()["pair"].tolist() == [6.0, 2.0, 5.0]
    copy["pair"].update(torch.tensor([10.0]))  # the copy's arena is its own
    assert tree.compute()["pair"].tolist() == [6.0, 2.0, 5.0]

    tree.reset()
    assert arena_views_intact(tree)
    assert tree.compute()["pair"].tolist() == [0.0, 0.0, -float("inf")]
    tree.load_state_dict(saved)
    assert arena_views_intact(tree)
    assert tree.compute()["pair"].tolist() == [6.0, 2.0, 5.0]
    tree.to(torch.device("cpu"))
    assert arena_views_intact(tree)
    assert tree.compute()["inner"]["mean"].item() == 2.0


def test_reset_and_staging_are_one_copy_whatever_the_dtypes() -> None:
    # 100 float64, 50 int64 and 50 float32 states (the Pair's three dtypes, 50 times).
    tree = ComposeMetric({f"m{i}": _tree() for i in range(50)}).to("cpu")
    twin = clone_metric(tree)
    for index in range(50):
        tree[f"m{index}"]["pair"].update(torch.tensor([float(index), 2.0]))
    with OpRecorder() as staging:
        twin._own_arena().copy_from(tree._own_arena())  # type: ignore[union-attr]
    with OpRecorder() as resetting:
        tree.reset()
    assert staging.ops == ["copy_"]
    assert resetting.ops == ["copy_"]
    assert twin["m7"].compute()["pair"].tolist() == [9.0, 2.0, 7.0]  # 7 + 2, 2 values, max 7
    assert tree["m7"].compute()["pair"].tolist() == [0.0, 0.0, -float("inf")]


def test_a_new_state_after_the_arena_rebuilds_it() -> None:
    metric = MeanMetric().to("cpu")
    metric.update(torch.tensor([4.0]))
    metric.extra = MetricAccumulator(torch.zeros(3, dtype=torch.int32))
    assert not arena_views_intact(metric)
    metric.reset()
    assert arena_views_intact(metric)
    assert [name for name, _ in metric.named_accumulators()] == ["total", "count", "extra"]


def test_one_flag_per_metric_cleared_by_any_update() -> None:
    tree = _tree()
    tree.sync()  # one process: the synced copy is the local state
    pair, mean = tree["pair"], tree["inner"]["mean"]
    assert all(state.synced is not None for _, state in tree.named_accumulators())
    pair.update(torch.tensor([2.0]))
    # Every state of the updated metric is stale; the other child's sync is still current.
    assert all(state.synced is None for _, state in pair.named_accumulators())
    assert all(state.synced is not None for _, state in mean.named_accumulators())


def _raise_by(tree: ComposeMetric, how: str) -> None:
    if how == "sync of the tree":
        tree.sync()
    elif how == "sync of a child":
        tree["inner"]["mean"].sync()
    else:  # an async sync: pending at its start, current once waited on
        tree.start_sync(None, CallFingerprint("sync", 1)).wait()


@pytest.mark.parametrize("how", ["sync of the tree", "sync of a child", "async sync"])
def test_reset_clears_every_flag_set_since_the_last_reset(how: str) -> None:
    # A reset skips its loop over the tree's flags while none of the process was set since it
    # last cleared them (the collector's reset per window): every way of setting one must
    # bring the loop back.
    tree = _tree()
    tree["pair"].update(torch.tensor([3.0]))
    tree.reset()
    tree.reset()  # cleared with nothing set since: the fast path from here on
    tree["pair"].update(torch.tensor([1.0]))
    tree["inner"]["mean"].update(torch.tensor([5.0]))
    _raise_by(tree, how)
    assert any(state.synced is not None for _, state in tree.named_accumulators())
    tree.reset()
    assert all(state.synced is None for _, state in tree.named_accumulators())
    # Computed from the reset local state, not the synced copy of before the reset.
    assert tree["inner"]["mean"].compute().isnan()


@on_rank_device
def _partial_update_after_sync() -> dict[str, list[float]]:
    rank = dist.get_rank()
    metric = Pair()
    metric.update(torch.tensor([float(rank + 1)]))
    metric.sync()
    synced = metric.compute().tolist()
    # Only one of the three states changes: compute must use local state for all of them.
    metric._total.accumulate(torch.tensor(100.0, dtype=torch.float64))
    return {"synced": synced, "after": metric.compute().tolist()}


def test_partial_update_after_sync_uses_local_state(dist_pool: RankPool) -> None:
    world = dist_pool.world_size
    for rank, result in enumerate(dist_pool.run(_partial_update_after_sync)):
        values = [float(r + 1) for r in range(world)]
        assert result["synced"] == [sum(values), float(world), max(values)]
        # Local: this rank's own value plus the 100, its own count and max (never the global).
        assert result["after"] == [rank + 1 + 100.0, 1.0, float(rank + 1)]


class _Total(Metric[Tensor]):
    def __init__(self) -> None:
        self._total = MetricAccumulator(0.0)
        self.inner = SumMetric()

    def update(self, values: Tensor) -> None:
        self._total = self._total.value + values.sum()  # torchmetrics' style: refused

    def compute(self) -> Tensor:
        return self._total.value


def test_replacing_a_declared_state_or_child_raises_and_keeps_it() -> None:
    metric = _Total()
    with pytest.raises(TypeError, match=r"^_total: holds the declared state 'total'; assigning"):
        metric.update(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"^inner: holds the declared child metric 'inner'"):
        metric.inner = None
    assert isinstance(metric._total, MetricAccumulator) and isinstance(metric.inner, SumMetric)
    assert [name for name, _ in metric.named_accumulators()] == ["total", "inner.total"]
    metric._total = MetricAccumulator(0.0)  # a new state in its place is still fine
    metric._total.accumulate(2.0)
    assert metric.state_dict()["total"].item() == 2.0


class _Holder(Metric[Tensor]):
    def __init__(self, state: MetricAccumulator) -> None:
        self._held = state

    def update(self, values: Tensor) -> None:
        self._held.accumulate(values.sum())

    def compute(self) -> Tensor:
        return self._held.value


def test_a_state_of_one_metric_cannot_be_declared_by_another() -> None:
    # It was declared twice: saved under two keys, or moved between two arenas.
    first = _Holder(MetricAccumulator(0.0))
    with pytest.raises(ValueError, match=r"^held: this MetricAccumulator is already a state"):
        _Holder(first._held)

    class Alias(Metric[Tensor]):
        def __init__(self) -> None:
            self.inner = SumMetric()
            self._total = self.inner._total  # a child's state again, under another key

        def update(self, values: Tensor) -> None:
            self.inner.update(values)

        def compute(self) -> Tensor:
            return self.inner.compute()

    with pytest.raises(ValueError, match=r"^total: this MetricAccumulator is already a state"):
        Alias()
    first.update(torch.tensor([2.0]))
    assert list(states_only(first.state_dict())) == ["held"] and float(first.compute()) == 2.0


class _Slotted(Metric[Tensor]):
    __slots__ = ("_acc",)

    def __init__(self) -> None:
        self._acc = MetricAccumulator(0.0)

    def update(self, values: Tensor) -> None:
        self._acc.accumulate(values.sum())

    def compute(self) -> Tensor:
        return self._acc.value


def test_a_state_in_a_slot_is_declared() -> None:
    # A slot is a data descriptor of the class, not a property: not a name the metric uses.
    metric = _Slotted()
    metric.update(torch.tensor([1.0, 2.0]))
    assert float(metric.compute()) == 3.0 and list(states_only(metric.state_dict())) == ["acc"]


class _OnAName(Metric[Tensor]):
    """Declares a state, then tries another on ``taken``, a name the metric's class uses."""

    taken = ""

    def __init__(self) -> None:
        self._count = MetricAccumulator(0.0)
        with pytest.raises(TypeError, match=rf"^{self.taken}: _OnAName.{self.taken} is a method"):
            setattr(self, self.taken, MetricAccumulator(torch.zeros(2)))

    def update(self, values: Tensor) -> None:
        self._count.accumulate(float(values.numel()))

    def compute(self) -> Tensor:
        return self._count.value


@pytest.mark.parametrize("taken", ["device", "sync_group", "call_counter", "update"])
def test_a_state_on_a_method_or_property_of_the_metric_is_refused_before_declaring(
    taken: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_OnAName, "taken", taken)
    metric = _OnAName()
    assert [name for name, _ in metric.named_accumulators()] == ["count"]
    assert list(states_only(metric.state_dict())) == ["count"]


class _TokensPerSample(Metric[Tensor]):
    """Its own state next to a composition it reads in compute."""

    def __init__(self) -> None:
        self._samples = MetricAccumulator(0.0)
        self._parts = ComposeMetric({"tokens": SumMetric()})

    def update(self, samples: float, tokens: Tensor) -> None:
        self._samples.accumulate(samples)
        self._parts["tokens"].update(tokens)

    def compute(self) -> Tensor:
        return torch.stack([self._samples.value, self._parts["tokens"].compute()])


@on_rank_device
def _composition_under_a_metric() -> dict[str, list[float]]:
    rank = dist.get_rank()
    results = {}
    for which in ("own", "child"):
        metric = _TokensPerSample()
        metric.update(float(rank + 1), torch.tensor(10.0 * (rank + 1)))
        metric.sync()
        results[f"{which} synced"] = metric.compute().tolist()
        if which == "own":
            metric._samples.accumulate(1.0)
        else:
            metric._parts["tokens"].update(torch.tensor(1.0))
        results[which] = metric.compute().tolist()
    return results


def test_a_composition_under_a_metric_shares_its_flag(dist_pool: RankPool) -> None:
    world = dist_pool.world_size
    samples = float(sum(range(1, world + 1)))
    for rank, result in enumerate(dist_pool.run(_composition_under_a_metric)):
        assert result["own synced"] == result["child synced"] == [samples, 10.0 * samples]
        # Either update leaves every state local: never this rank's samples over all tokens.
        assert result["own"] == [rank + 2.0, 10.0 * (rank + 1)]
        assert result["child"] == [rank + 1.0, 10.0 * (rank + 1) + 1.0]


@on_rank_device
def _async_start_sync() -> dict[str, list[float]]:
    rank = dist.get_rank()
    metric = Pair()
    metric.update(torch.tensor([float(rank + 1)]))
    results = {"local": metric.compute().tolist()}
    handle = metric.start_sync(None, CallFingerprint("sync", 1), async_op=True)
    results["before wait"] = metric.compute().tolist()
    handle.wait()
    results["after wait"] = metric.compute().tolist()
    metric.update(torch.tensor([100.0]))
    handle = metric.start_sync(None, CallFingerprint("sync", 2), async_op=True)
    metric.update(torch.tensor([1000.0]))  # after the start: not in what the sync sent
    handle.wait()
    results["updated before wait"] = metric.compute().tolist()
    return results


def test_an_async_start_sync_is_current_once_waited_and_not_after_an_update(
    dist_pool: RankPool,
) -> None:
    world = dist_pool.world_size
    values = [float(r + 1) for r in range(world)]
    for rank, result in enumerate(dist_pool.run(_async_start_sync)):
        local = [rank + 1.0, 1.0, rank + 1.0]
        assert result["local"] == result["before wait"] == local
        assert result["after wait"] == [sum(values), float(world), max(values)]
        assert result["updated before wait"] == [rank + 1101.0, 3.0, 1000.0]


class _OwnSync(MeanMetric):
    """A metric with its own sync (the slow path), counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def sync(self, group: Any = None) -> None:
        self.calls += 1
        super().sync(group)


def test_own_sync_child_takes_the_slow_path_and_sees_new_states() -> None:
    child = _OwnSync()
    tree = ComposeMetric({"own": child, "plain": SumMetric()})
    child.update(torch.tensor([1.0, 3.0]))
    tree["plain"].update(torch.tensor([5.0]))
    tree.sync()
    assert child.calls == 1
    assert float(child.compute()) == 2.0 and float(tree["plain"].compute()) == 5.0
    child.extra = MetricAccumulator(torch.zeros(2))  # the tree changes: layouts are redone
    child.update(torch.tensor([5.0]))
    tree.sync()
    assert child.calls == 2
    assert float(child.compute()) == 3.0
    assert all(s.synced is not None for _, s in tree.named_accumulators())
    assert len(list(tree.named_accumulators())) == 4


class _Parent(Metric[Tensor]):
    """A metric of one's own holding two library metrics and a state of its own."""

    def __init__(self, own_sync_child: bool = False) -> None:
        self.mean = _OwnSync() if own_sync_child else MeanMetric()
        self.top = MaxMetric()
        self._batches = MetricAccumulator(0, dtype=torch.int64)

    def update(self, values: Tensor) -> None:
        self.mean.update(values)
        self.top.update(values)
        self._batches.accumulate(1)

    def compute(self) -> Tensor:
        return torch.stack([self.mean.compute(), self.top.compute(), self._batches.value.double()])


class _SyncsChildFirst(_Parent):
    """A metric whose own sync syncs a child first, then the whole tree."""

    def sync(self, group: Any = None, *, step: int | None = None) -> None:
        self.mean.sync(group)
        super().sync(group, step=step)


@on_rank_device
def _sync_a_child_alone(kind: str) -> dict[str, list[float]]:
    rank = dist.get_rank()
    parent = _SyncsChildFirst() if kind == "child first" else _Parent(kind == "own sync child")
    parent.update(torch.tensor([1.0 + rank, 3.0 + rank]))
    if kind != "child first":
        parent.mean.sync()  # a part alone
    after_part = parent.compute().tolist()
    parent.sync()
    return {"after_part": after_part, "after_tree": parent.compute().tolist()}


@pytest.mark.parametrize("kind", ["plain child", "own sync child", "child first"])
def test_a_child_synced_alone_leaves_its_tree_local(dist_pool: RankPool, kind: str) -> None:
    # The child's sync set the freshness flag it shares with its parent, whose compute then
    # read synchronized buffers no sync had written (garbage for its own counter, a stale
    # value for the other child). Now the tree reads local state until it syncs as a whole,
    # and a parent whose own sync syncs a child first works.
    world = dist_pool.world_size
    values = [v + r for r in range(world) for v in (1.0, 3.0)]
    for rank, result in enumerate(dist_pool.run(_sync_a_child_alone, kind)):
        local = [2.0 + rank, 3.0 + rank, 1.0]
        if kind != "child first":
            assert result["after_part"] == local, (rank, result)
        assert result["after_tree"] == [sum(values) / len(values), max(values), world]


def test_a_composition_moves_its_childrens_constants() -> None:
    """``to`` on a root moves the non-state tensors of every child (bin edges, shifts)."""
    from sidestream.metrics import ComposeMetric
    from sidestream.metrics.classification import BinaryAUROCMetric
    from sidestream.metrics.regression import PearsonCorrelationMetric, R2ScoreMetric

    auroc = BinaryAUROCMetric(thresholds=[0.2, 0.5])
    pearson, r2 = PearsonCorrelationMetric(), R2ScoreMetric()
    ComposeMetric({"auroc": auroc, "pearson": pearson, "r2": r2}).to("meta")
    moved = [auroc._bins._edges, pearson._shift, r2._shift]
    assert [tensor.device.type for tensor in moved] == ["meta"] * 3


def test_add_product_adds_a_matrix_vector_product_in_place() -> None:
    counts = MetricAccumulator(torch.zeros(2, dtype=torch.int64))
    matrix = torch.tensor([[1, 0, 2], [0, 1, 1]])
    counts.add_product(matrix, torch.tensor([3, 4, 5]))
    counts.add_product(matrix, torch.tensor([1, 1, 1]))
    assert counts.local.tolist() == [16, 11]
    with pytest.raises(ValueError, match="SUM"):
        MetricAccumulator(0.0, ReduceOp.MAX).add_product(matrix, torch.ones(3))


class _Buffered(Metric[Tensor]):
    """A metric with data of its own besides its state, cleared by its reset override."""

    def __init__(self) -> None:
        self._count = MetricAccumulator(torch.zeros((), dtype=torch.int64))
        self.buffer: list[float] = []
        self.resets = 0

    def update(self, values: Tensor) -> None:
        self.buffer.extend(values.tolist())
        self._count.accumulate(torch.tensor(values.numel()))

    def reset(self) -> None:
        super().reset()
        self.buffer = []
        self.resets += 1

    def compute(self) -> Tensor:
        return torch.tensor(float(len(self.buffer)))


class _BufferedParent(_Buffered):
    def __init__(self) -> None:
        super().__init__()
        self._inner = _Buffered()


def test_reset_calls_each_child_override_once() -> None:
    # Parents reset their tree's states in one copy; a child that clears data of its own in
    # reset must still have it called, once, or its data outlives the window.
    plain = _Buffered()
    nested = _BufferedParent()
    compose = ComposeMetric({"plain": plain, "nested": nested, "mean": MeanMetric()})
    compose.to("cpu")
    for metric in (plain, nested, nested._inner):
        metric.update(torch.tensor([1.0, 2.0]))
    compose.reset()
    for metric in (plain, nested, nested._inner):
        assert metric.buffer == [] and metric.resets == 1
        assert int(metric._count.local) == 0
    compose.reset()
    assert [m.resets for m in (plain, nested, nested._inner)] == [2, 2, 2]


def test_reset_then_save_a_tree_with_a_deep_reset_override() -> None:
    # The reset's cache of overriding children is bookkeeping, not a hidden container.
    inner = ComposeMetric({"buffered": _Buffered(), "mean": MeanMetric()})
    outer = ComposeMetric({"inner": inner})
    inner["buffered"].update(torch.tensor([1.0]))
    outer.reset()
    assert sorted(states_only(outer.state_dict())) == [
        "inner.buffered.count",
        "inner.mean.count",
        "inner.mean.total",
    ]
    outer.to("cpu")


def test_a_list_of_a_childs_states_is_allowed() -> None:
    class Watching(Metric[Tensor]):
        def __init__(self) -> None:
            self._child = SumMetric()
            self.watched = [self._child._total]  # a state of the tree, listed again

        def update(self, values: Tensor) -> None:
            self._child.update(values)

        def compute(self) -> Tensor:
            return self.watched[0].value

    metric = Watching()
    metric.update(torch.tensor([2.0, 3.0]))
    assert float(metric.compute()) == 5.0
    assert list(states_only(metric.state_dict())) == ["child.total"]


class _Named:
    """A plain mixin first in the bases: the inherited __init__ is its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.label = "named"
        super().__init__(*args, **kwargs)


def test_the_arena_is_built_at_init_behind_a_mixin() -> None:
    class NamedSum(_Named, SumMetric):
        pass

    metric = NamedSum()
    assert metric.__dict__.get("_state_arena") is not None and metric.label == "named"
    metric.update(torch.tensor([1.0, 2.0]))
    assert float(metric.compute()) == 3.0


def test_a_float32_checkpoint_loads_into_a_float64_state() -> None:
    # Python-float states are float64 now; checkpoints saved with the float32 ones still load.
    metric = SumMetric(dtype=torch.float64)
    metric.load_state_dict({"total": torch.tensor(2.5, dtype=torch.float32)})
    assert metric.compute().dtype == torch.float64 and float(metric.compute()) == 2.5
    with pytest.raises(ValueError, match=r"expected dtype torch\.float64"):
        metric.load_state_dict({"total": torch.tensor(2, dtype=torch.int64)})


def test_a_saved_tensor_that_requires_grad_leaves_the_tree_usable() -> None:
    # A loaded tensor with autograd history had pulled the shared buffer into the graph: every
    # later update, reset or copy of any metric of the tree raised.
    composed = ComposeMetric({"mean": MeanMetric(), "sum": SumMetric()})
    composed.load_state_dict(
        {
            "mean.total": torch.tensor(6.0, dtype=torch.float64, requires_grad=True),
            "mean.count": torch.tensor(2.0, dtype=torch.float64),
            "sum.total": torch.tensor(1.0, dtype=torch.float64),
        }
    )
    assert composed["sum"].compute().grad_fn is None
    composed["mean"].update(torch.tensor([3.0]))
    assert float(composed["mean"].compute()) == 3.0
    assert all(t.grad_fn is None for t in states_only(composed.state_dict()).values())
    assert float(copy.deepcopy(composed)["mean"].compute()) == 3.0


def test_narrower_integers_and_python_numbers_load_exactly() -> None:
    class Counts(Metric[Tensor]):
        def __init__(self) -> None:
            self.hits = MetricAccumulator(0, dtype=torch.int32)
            self.share = MetricAccumulator(0.0, dtype=torch.float32)

        def update(self, values: Tensor) -> None:
            self.hits.accumulate(values.numel())

        def compute(self) -> Tensor:
            return self.hits.value

    metric = Counts()
    metric.load_state_dict({"hits": torch.tensor(7, dtype=torch.int16), "share": 0.1})
    assert metric.hits.value.dtype == torch.int32 and int(metric.compute()) == 7
    assert float(metric.share.value) == float(torch.tensor(0.1, dtype=torch.float32))
    metric.load_state_dict({"hits": 5, "share": 0.0})
    assert int(metric.compute()) == 5
    # The Python value is named, not the int64 / float32 tensor torch would make of it.
    not_held = r"state_dict\['hits'\]: expected dtype torch\.int32, got {}, which torch\.int32"
    with pytest.raises(ValueError, match=not_held.format(2**40)):
        metric.load_state_dict({"hits": 2**40, "share": 0.0})
    with pytest.raises(ValueError, match=not_held.format(r"2\.5")):
        metric.load_state_dict({"hits": 2.5, "share": 0.0})
    with pytest.raises(ValueError, match=r"state_dict\['hits'\]: expected dtype torch\.int32"):
        metric.load_state_dict({"hits": torch.tensor(7, dtype=torch.int64), "share": 0.0})
    with pytest.raises(ValueError, match=r"state_dict\['hits'\]: a meta tensor"):
        metric.load_state_dict(
            {"hits": torch.empty((), dtype=torch.int32, device="meta"), "share": 0.0}
        )
    assert int(metric.compute()) == 5  # each refused load left the state as it was


def test_a_dataclass_metric_keeps_its_generated_init() -> None:
    import dataclasses

    @dataclasses.dataclass(eq=False)
    class Scaled(Metric[Tensor]):
        scale: float = 1.0

        def __post_init__(self) -> None:
            self.total = MetricAccumulator(0.0)

        def update(self, values: Tensor) -> None:
            self.total.accumulate((values * self.scale).sum())

        def compute(self) -> Tensor:
            return self.total.value

    metric = Scaled(scale=3.0)
    metric.update(torch.tensor([1.0, 2.0]))
    assert metric.scale == 3.0 and float(metric.compute()) == 9.0
    assert list(states_only(metric.state_dict())) == ["total"]


def test_a_child_of_one_tree_cannot_join_another() -> None:
    # Its states live in the first tree's arena: a second tree would take them over (on one
    # rank, that desynchronizes the first tree's syncs across ranks).
    tree = ComposeMetric({"mean": MeanMetric(), "sum": SumMetric()})
    with pytest.raises(ValueError, match="already part of the metric tree of a ComposeMetric"):
        ComposeMetric({"loss": tree["mean"]})
    outer = ComposeMetric({"tree": tree})  # a whole tree joins another: fine
    assert sorted(states_only(outer.state_dict())) == [
        "tree.mean.count",
        "tree.mean.total",
        "tree.sum.total",
    ]


def test_a_deep_copy_of_a_child_is_a_metric_of_its_own() -> None:
    tree = ComposeMetric({"mean": MeanMetric(), "sum": SumMetric()})
    tree["mean"].update(torch.tensor([1.0, 3.0]))
    copied = copy.deepcopy(tree["mean"])
    assert copied.__dict__["_state_arena"].root is copied
    copied.update(torch.tensor([5.0]))
    assert float(copied.compute()) == 3.0 and float(tree["mean"].compute()) == 2.0


@pytest.mark.parametrize("device", [torch.float32, None, True, 1.5])
def test_to_names_its_argument_for_anything_but_a_device(device: Any) -> None:
    """``to(torch.float32)`` failed in torch.device with a message naming no argument."""
    from sidestream.metrics import MeanMetric

    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 3.0]))
    with pytest.raises(TypeError, match=r"^to: device: expected a torch.device, a str .*CUDA"):
        metric.to(device)
    assert metric.to("cpu").compute().item() == 2.0  # unchanged, and a str still works


class _Scalars(Metric[Tensor]):
    """Scalar SUM states ``s0``, ``s1``, ... of the given dtypes, declared in that order."""

    def __init__(self, *dtypes: torch.dtype) -> None:
        for index, dtype in enumerate(dtypes):
            self.add_state(f"s{index}", 0.0, ReduceOp.SUM, dtype=dtype)

    def states(self) -> list[MetricAccumulator]:
        return [state for _, state in self.named_accumulators()]

    def update(self, values: Tensor) -> None:
        raise NotImplementedError

    def compute(self) -> Tensor:
        return torch.stack([state.value.double() for state in self.states()])


def test_accumulate_sums_adds_adjacent_states_at_once_and_others_one_by_one() -> None:
    metric = _Scalars(torch.float64, torch.float64, torch.float64)
    a, b, c = metric.states()
    metric.sync()  # one process: now current, so an update must clear the flag
    sums = torch.tensor([1.5, 2.0], dtype=torch.float64)
    with OpRecorder() as adjacent:
        accumulate_sums((a, b), sums)
    assert [name for name in adjacent.ops if name != "slice"] == ["add_"]
    assert a.synced is None  # stale: compute reads the local state
    accumulate_sums((a, c), torch.tensor([10.0, 3.0], dtype=torch.float64))
    accumulate_sums((a, b), torch.tensor([1, 1]))  # int64: each on its own
    # In the buffer's order but not in the states' order: each its own element.
    accumulate_sums((b, a), torch.tensor([0.25, 0.5], dtype=torch.float64))
    assert metric.compute().tolist() == [13.0, 3.25, 3.0]


def test_blocks_of_mixed_dtypes_compile_and_save() -> None:
    # float64 and float32 states: 8 + 4 bytes, a block no whole number of float64s long unless
    # padded (aot_eager's functionalized add_ and torch.save both refuse such a storage).
    tree = ComposeMetric({"loss": MeanMetric(), "grad_max": MaxMetric(dtype=torch.float32)})
    eager = copy.deepcopy(tree)

    def step(values: Tensor) -> None:
        tree["loss"].update(values)
        tree["grad_max"].update(values.float())

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for values in (torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([4.0])):
        compiled(values.double())
        eager["loss"].update(values.double())
        eager["grad_max"].update(values.float())
    assert tree.compute() == eager.compute() == {"loss": 7.0 / 3.0, "grad_max": 4.0}
    buffer = io.BytesIO()
    torch.save(tree["loss"]._total.local, buffer)
    buffer.seek(0)
    assert torch.load(buffer).item() == 7.0


def test_accumulate_sums_of_states_in_two_dtypes_goes_state_by_state() -> None:
    # float64 a, c, x at offsets 0, 1, 2; float32 pad, b at 0, 1 of their own buffer.
    f32, f64 = torch.float32, torch.float64
    metric = _Scalars(f64, f32, f32, f64, f64)
    a, _, b, _, x = metric.states()
    # a, b and x sit at offsets 0, 1 and 2, but b in the other buffer: not one range.
    sums = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    accumulate_sums((a, b, x), sums)
    assert metric.compute().tolist() == [1.0, 0.0, 2.0, 0.0, 3.0]


def test_a_state_refused_by_add_state_is_named_with_its_metric() -> None:
    class Phases(Metric[Tensor]):
        def __init__(self) -> None:
            self.add_state("phase", torch.zeros(2, dtype=torch.complex64))

        def update(self) -> None: ...

        def compute(self) -> Tensor:
            return torch.zeros(())

    with pytest.raises((TypeError, ValueError), match=r"^Phases\.add_state\('phase'\): initial"):
        Phases()


def test_a_state_named_by_an_underscore_alone_names_its_attribute() -> None:
    class Underscore(Metric[Tensor]):
        def __init__(self) -> None:
            self._ = MetricAccumulator(0.0)

        def update(self) -> None: ...

        def compute(self) -> Tensor:
            return self._.value

    with pytest.raises(ValueError, match=r"^Underscore\._: state name: expected a non-empty"):
        Underscore()


def test_one_child_at_two_places_of_one_tree_raises() -> None:
    # Laid out twice and saved under two keys (a.total and sub.child.total) without a word.
    class Holder(Metric[Tensor]):
        def __init__(self, child: SumMetric) -> None:
            self.child = child

        def update(self) -> None: ...

        def compute(self) -> Tensor:
            return self.child.compute()

    class Top(Metric[Tensor]):
        def __init__(self) -> None:
            shared = SumMetric()
            self.a = shared
            self.sub = Holder(shared)

        def update(self) -> None: ...

        def compute(self) -> Tensor:
            return self.a.compute()

    with pytest.raises(ValueError, match=r"'sub\.child\.total' is state 'a\.total' again"):
        Top()
    twice = SumMetric()
    with pytest.raises(ValueError, match="one child metric"):
        ComposeMetric({"first": twice, "second": twice})


def test_deleting_a_declared_state_or_child_raises() -> None:
    # It stayed declared and in checkpoints; compute then failed with an AttributeError.
    metric = _Total()
    with pytest.raises(TypeError, match=r"^_total: holds a declared state"):
        del metric._total
    with pytest.raises(TypeError, match=r"^inner: holds a declared child metric"):
        del metric.inner
    metric.note = "plain"
    del metric.note  # anything else goes as usual
    assert [name for name, _ in metric.named_accumulators()] == ["total", "inner.total"]


def test_each_sync_walks_only_containers_that_may_hide_a_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every sync walked every item of every container: 76 ms per sync of a metric keeping
    # 100k plain values in a list.
    from sidestream import metric as metric_module

    metric = _FillsAContainerLate()
    metric.history = [0.5] * 1000  # type: ignore[attr-defined]  # plain data, no state
    walked: list[int] = []
    walk = metric_module._tree_objects

    def counting(value: Any) -> Any:
        walked.append(len(value))
        return walk(value)

    monkeypatch.setattr(metric_module, "_tree_objects", counting)
    metric.sync()
    metric.sync()
    assert walked == [], walked  # plain data and an empty dict: no item walked
    metric.update(1.0)  # puts a state in the dict
    with pytest.raises(TypeError, match="extra: a MetricAccumulator inside a dict"):
        metric.sync()


class _HidesInPlace(Metric[Tensor]):
    """Hides a state where the container's id and length stay: a replaced item, a nested list."""

    def __init__(self, nested: bool) -> None:
        self._count = MetricAccumulator(0.0)
        self.nested = nested
        self.slots: Any = {"a": []} if nested else [None]

    def update(self, value: float) -> None:
        state = MetricAccumulator(0.0)
        state.accumulate(value)
        if self.nested:
            self.slots["a"].append(state)
        else:
            self.slots[0] = state
        self._count.accumulate(1.0)

    def compute(self) -> Tensor:
        return self._count.value


@pytest.mark.parametrize("nested", [False, True])
def test_a_state_hidden_in_place_after_a_sync_is_refused_by_the_next(nested: bool) -> None:
    # Each sync skipped every container of the same id and length as at the last one: a state
    # put in place of an item, or in a list inside a dict, was left out of every later sync.
    metric = _HidesInPlace(nested)
    metric.sync()
    metric.update(1.0)
    with pytest.raises(TypeError, match="slots: a MetricAccumulator inside a list"):
        metric.sync()


def test_syncs_look_again_at_containers_assigned_after_an_earlier_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Which attributes hold containers is scanned once and kept until an assignment (a walk
    # over every attribute of a 256-metric composition cost each sync 300 µs; a scan per
    # declared child made it quadratic). A container assigned later, anywhere in the tree, is
    # looked at by the next sync; with no assignment, no sync walks the attributes again.
    from sidestream import metric as metric_module

    scans: list[int] = []
    scan = Metric._container_attributes

    def counting(self: Metric[Any]) -> Any:
        scans.append(id(self))
        return scan(self)

    monkeypatch.setattr(Metric, "_container_attributes", counting)
    children = {f"m{i}": SumMetric() for i in range(64)}
    tree = ComposeMetric(children)
    for child in children.values():
        child.update(torch.ones(2))
    scans.clear()
    for _ in range(3):
        tree.sync()
    assert scans == []  # scanned when the composition was made
    children["m7"].late = []  # type: ignore[attr-defined]  # empty: passes __setattr__
    tree.sync()
    tree.sync()
    assert scans == [id(tree)], scans
    children["m7"].late.append(MetricAccumulator(0.0))  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="late: a MetricAccumulator inside a list"):
        tree.sync()
    assert "_container_scan" in metric_module._NOT_PICKLED


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "clone_metric"])
def test_a_copy_scans_its_own_containers(how: str) -> None:
    # The scan names the original's objects: a copy that kept it would look at the original's
    # containers and miss a state put into its own.
    metric = _HidesInPlace(nested=True)
    metric.sync()  # the original's scan is made
    if how == "deepcopy":
        twin = copy.deepcopy(metric)
    elif how == "clone_metric":
        twin = clone_metric(metric)
    else:
        buffer = io.BytesIO()
        torch.save(metric, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    twin.update(1.0)
    with pytest.raises(TypeError, match="slots: a MetricAccumulator inside a list"):
        twin.sync()
    metric.sync()  # the original's own list is still empty


def test_a_shallow_copy_scans_its_own_containers() -> None:
    # copy.copy shares every attribute: a shared scan names the original's attributes, so
    # the copy's list went unchecked once the original let its own go.
    metric = _HidesInPlace(nested=True)
    metric.sync()
    twin = copy.copy(metric)
    metric.slots = None  # not a container: no assignment counted
    twin.update(1.0)  # into the list the copy still holds
    with pytest.raises(TypeError, match="slots: a MetricAccumulator inside a list"):
        twin.sync()


class _KeepsALastBatch(Metric[Tensor]):
    """Assigns a fresh list in every update (a custom metric keeping its last batch's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self._total = self.add_state("total", 0.0)
        self.last_shape: list[int] = []

    def update(self, value: Tensor) -> None:
        self._total.accumulate(value.sum())
        self.last_shape = [value.shape[0]]

    def compute(self) -> Tensor:
        return self._total.value


def test_a_compiled_update_that_assigns_a_container_compiles_once() -> None:
    # Each container assignment bumped a global count of assignments, which Dynamo guards on:
    # every call recompiled, and fullgraph=True failed at the recompile limit (8 calls).
    import torch._dynamo
    import torch._dynamo.testing

    torch._dynamo.reset()
    try:
        metric = _KeepsALastBatch()
        metric.sync()  # the container scan is made
        counter = torch._dynamo.testing.CompileCounter()
        update = torch.compile(metric.update, backend=counter, fullgraph=True)
        for _ in range(12):
            update(torch.ones(4))
        assert counter.frame_count <= 2, counter.frame_count
        assert float(metric.compute()) == 48.0
        metric.last_shape.append(MetricAccumulator(0.0))  # the replaced list is still looked at
        with pytest.raises(TypeError, match="last_shape: a MetricAccumulator inside a list"):
            metric.sync()
    finally:
        torch._dynamo.reset()


def test_a_container_attribute_replaced_by_a_container_is_still_checked() -> None:
    metric = _HidesInPlace(nested=True)
    metric.sync()
    metric.slots = {"a": []}  # a container in place of a container: not counted
    metric.slots["a"].append(MetricAccumulator(0.0))
    with pytest.raises(TypeError, match="slots: a MetricAccumulator inside a list"):
        metric.sync()


def test_a_metric_on_the_meta_device_refuses_a_load_and_a_move_plainly() -> None:
    # A load into meta tensors kept nothing without a word; a move off meta raised torch's
    # "Cannot copy out of meta tensor" from inside the arena.
    saved = MeanMetric().state_dict()
    with pytest.raises(ValueError, match="load_state_dict: this MeanMetric is on the meta"):
        MeanMetric().to("meta").load_state_dict(saved)
    with pytest.raises(NotImplementedError, match="to: this MeanMetric is on the meta device"):
        MeanMetric().to("meta").to("cpu")


def test_a_fullgraph_compiled_update_may_delete_an_attribute_of_its_own() -> None:
    # Metric.__delattr__ called object.__delattr__, which dynamo cannot trace ("Dynamo does
    # not know how to trace method `__delattr__` of class `type`").
    class Scratch(Metric[Tensor]):
        def __init__(self) -> None:
            self._total = MetricAccumulator(0.0)
            self.note = 1

        def update(self, x: Tensor) -> None:
            self._total.accumulate(x.sum())
            if hasattr(self, "note"):
                del self.note

        def compute(self) -> Tensor:
            return self._total.value

    metric = Scratch()
    torch.compile(metric.update, fullgraph=True, backend="eager")(torch.ones(3))
    assert float(metric.compute()) == 3.0 and not hasattr(metric, "note")
