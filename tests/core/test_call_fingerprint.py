"""Mis-paired collectives raise ``RankMismatchError`` on every rank, within a bounded time.

Each scenario runs on 2 gloo ranks of a pool of its own, over a fresh sub-group with a short
collective timeout: a scenario may leave a collective unmatched on one rank (the point of the
test), and that must not reach later tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sidestream import ComposeMetric, MaxMetric, MeanMetric, MetricAccumulator
from sidestream import sync as sync_module
from sidestream.collector import AsyncMetricCollector
from sidestream.sync import CallFingerprint, RankMismatchError, check_calls
from sidestream.testing import DistributedError, DistributedPool, RankPool

pytestmark = pytest.mark.distributed

BOUND_S = 30.0  # every rank must have raised within this


@pytest.fixture(scope="module")
def pair() -> Iterator[RankPool]:
    pool = DistributedPool(2, collective_timeout_s=10.0)
    try:
        yield pool
    finally:
        pool.close()


def _subgroup() -> Any:
    # 15 s: a rank starved on a loaded machine must still reach new_group in time.
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=15))


def _metric() -> ComposeMetric:
    return ComposeMetric({"loss": MeanMetric(), "top": MaxMetric()})


def _update(metric: ComposeMetric, value: float) -> None:
    metric["loss"].update(torch.tensor([value]))
    metric["top"].update(torch.tensor([value]))


def _outcome(action: Any) -> str:
    try:
        action()
    except RankMismatchError as error:
        return f"RankMismatchError: {error}"
    return "no error"


def _skipped_window() -> dict[str, Any]:
    rank = dist.get_rank()
    collector = AsyncMetricCollector(_metric(), group=_subgroup()).bind("cpu")
    start = time.monotonic()
    steps = [1, 2, 3] if rank == 0 else [1, 3]  # rank 1 skips step 2
    raised_at_schedule = []
    for step in steps:
        _update(collector.metric, float(step))
        try:
            collector.schedule_collection(step)
        except RankMismatchError:
            raised_at_schedule.append(step)
            break
    outcome = _outcome(lambda: collector.collect_results(timeout=BOUND_S))
    elapsed = time.monotonic() - start
    collector.close(timeout=10)
    return {"outcome": outcome, "at_schedule": raised_at_schedule, "elapsed": elapsed}


def test_a_skipped_window_raises_on_every_rank(pair: RankPool) -> None:
    per_rank = pair.run(_skipped_window, timeout=90)
    for rank, result in enumerate(per_rank):
        assert result["outcome"].startswith("RankMismatchError"), (rank, result)
        assert result["elapsed"] < BOUND_S, result
        # The windows that paired wrongly are named by step.
        assert "rank 0: window #2" in result["outcome"], result
        assert "rank 1: window #3" in result["outcome"], result


def _skipped_sync() -> dict[str, Any]:
    rank = dist.get_rank()
    metric, group = _metric(), _subgroup()
    steps = [1, 2, 3] if rank == 0 else [2, 3]  # rank 1 skips the sync of step 1
    values = []
    outcome = "no error"
    for step in steps:
        _update(metric, 10.0 * rank + step)
        try:
            metric.sync(group, step=step)
        except RankMismatchError as error:
            outcome = f"RankMismatchError: {error}"
            break
        values.append(float(metric["loss"].compute()))
    return {"outcome": outcome, "values": values}


def test_a_skipped_sync_with_steps_raises_at_that_sync_on_every_rank(pair: RankPool) -> None:
    for rank, result in enumerate(pair.run(_skipped_sync, timeout=90)):
        assert result["outcome"].startswith("RankMismatchError"), (rank, result)
        assert "rank 0: sync at step 1" in result["outcome"], result
        assert "rank 1: sync at step 2" in result["outcome"], result
        assert result["values"] == [], result  # no mixed value was ever returned


def _child(with_own_sync: bool) -> Any:
    from sidestream.metrics.classification import BinaryAUROCMetric

    if not with_own_sync:
        return MeanMetric()
    # Stored samples sync on their own, after the tree's other states.
    return ComposeMetric({"mean": MeanMetric(), "auroc": BinaryAUROCMetric(exact=True)})


def _mean_of(value: Any) -> float:
    return float(value["mean"] if isinstance(value, dict) else value)


def _children_in_other_orders(first_in_order: bool, with_own_sync: bool) -> dict[str, Any]:
    """Two children of one shape synced alone, in another order on rank 1 (after one round in
    the same order, when ``first_in_order``: the layouts are then checked and kept)."""
    rank = dist.get_rank()
    metric = ComposeMetric({"a": _child(with_own_sync), "b": _child(with_own_sync)})
    group = _subgroup()
    for name, value in (("a", float(rank)), ("b", 10.0 + 100.0 * rank)):
        child = metric[name]
        if with_own_sync:
            child["mean"].update(torch.tensor([value]))
            child["auroc"].update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]))
        else:
            child.update(torch.tensor([value]))
    if first_in_order:
        metric["a"].sync(group, step=0)
        metric["b"].sync(group, step=0)
    order = ["a", "b"] if rank == 0 else ["b", "a"]
    outcome = _outcome(lambda: [metric[name].sync(group, step=1) for name in order])
    return {"outcome": outcome, "values": {k: _mean_of(v) for k, v in metric.compute().items()}}


@pytest.mark.parametrize("with_own_sync", [False, True])
@pytest.mark.parametrize("first_in_order", [False, True])
def test_children_of_one_shape_synced_in_other_orders_raise(
    pair: RankPool, first_in_order: bool, with_own_sync: bool
) -> None:
    # Both are a MeanMetric: each rank got a = 5.5 and b = 55 (a mix of the two) with no error.
    outcomes = pair.run(_children_in_other_orders, first_in_order, with_own_sync, timeout=90)
    for rank, result in enumerate(outcomes):
        assert result["outcome"].startswith("RankMismatchError"), (rank, result)
        if not first_in_order:  # the first layout's check names the states
            assert "'a." in result["outcome"], result
        # After the error each child reads its own data or the true global value, never a mix
        # of a and b (the synced buffers hold one after the failed sync).
        assert result["values"]["a"] in (float(rank), 0.5), result
        assert result["values"]["b"] in (10.0 + 100.0 * rank, 60.0), result


def _step_against_count() -> str:
    """Rank 0 syncs at step 1, rank 1 with its count (also 1): they must not pair."""
    metric, group = _metric(), _subgroup()
    _update(metric, float(dist.get_rank()))
    step = 1 if dist.get_rank() == 0 else None
    return _outcome(lambda: metric.sync(group, step=step))


def test_a_sync_at_a_step_never_pairs_with_a_counted_sync(pair: RankPool) -> None:
    for rank, outcome in enumerate(pair.run(_step_against_count, timeout=90)):
        assert outcome.startswith("RankMismatchError"), (rank, outcome)
        assert "rank 0: sync at step 1" in outcome and "rank 1: sync #1" in outcome, outcome


def _state_dict_alone(limit: int) -> dict[str, Any]:
    rank = dist.get_rank()
    sync_module.GATHER_LIMIT_BYTES = limit  # this rank process only; restored below
    collector = AsyncMetricCollector(_metric(), group=_subgroup()).bind("cpu")
    _update(collector.metric, 1.0 + rank)
    start = time.monotonic()
    if rank == 0:
        outcome = _outcome(collector.state_dict)  # rank 1 schedules a window instead
    else:
        collector.schedule_collection(1)
        outcome = _outcome(lambda: collector.collect_results(timeout=BOUND_S))
    elapsed = time.monotonic() - start
    collector.close(timeout=10)
    sync_module.GATHER_LIMIT_BYTES = 1 << 20
    return {"outcome": outcome, "elapsed": elapsed}


@pytest.mark.parametrize("path", ["gather", "all_reduce"])
def test_state_dict_on_one_rank_alone_raises_on_every_rank(pair: RankPool, path: str) -> None:
    limit = 1 << 20 if path == "gather" else 0
    for rank, result in enumerate(pair.run(_state_dict_alone, limit, timeout=90)):
        assert result["outcome"].startswith("RankMismatchError"), (rank, result)
        assert result["elapsed"] < BOUND_S
        if rank == 0 and path == "all_reduce":
            assert "this rank is at state_dict" in result["outcome"]
        elif rank == 0:
            assert "rank 0: state_dict" in result["outcome"]
            assert "rank 1: window #1" in result["outcome"]


def _changed_structure(both: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    group = _subgroup()
    metric = _metric()
    _update(metric, 1.0 + rank)
    metric.sync(group)  # the first check passes: same structure everywhere
    if both or rank == 1:
        metric["loss"].extra = MetricAccumulator(torch.zeros(3, dtype=torch.int64))
    start = time.monotonic()
    outcome = _outcome(lambda: metric.sync(group))
    values = {k: float(v) for k, v in metric.compute().items()} if outcome == "no error" else {}
    return {"outcome": outcome, "elapsed": time.monotonic() - start, "values": values}


def test_a_structure_changed_on_one_rank_raises_on_every_rank(pair: RankPool) -> None:
    for rank, result in enumerate(pair.run(_changed_structure, False, timeout=90)):
        assert result["outcome"].startswith("RankMismatchError"), (rank, result)
        assert result["elapsed"] < BOUND_S


def test_a_structure_changed_on_every_rank_keeps_syncing(pair: RankPool) -> None:
    for result in pair.run(_changed_structure, True, timeout=90):
        assert result["outcome"] == "no error"
        assert result["values"] == {"loss": 1.5, "top": 2.0}  # ranks saw 1.0 and 2.0


def _collector_structure_changed() -> dict[str, Any]:
    rank = dist.get_rank()
    collector = AsyncMetricCollector(_metric(), group=_subgroup()).bind("cpu")
    _update(collector.metric, 1.0)
    if rank == 1:
        collector.metric["top"].extra = MetricAccumulator(torch.zeros(2))
    start = time.monotonic()

    def window() -> None:
        collector.schedule_collection(1)
        collector.collect_results(timeout=BOUND_S)

    outcome = _outcome(window)
    elapsed = time.monotonic() - start
    collector.close(timeout=10)
    return {"outcome": outcome, "elapsed": elapsed}


def test_a_collector_metric_changed_after_bind_raises_on_every_rank(pair: RankPool) -> None:
    for rank, result in enumerate(pair.run(_collector_structure_changed, timeout=90)):
        assert result["outcome"].startswith("RankMismatchError"), (rank, result)
        assert result["elapsed"] < BOUND_S


def _load_skipped_by(skipper: int) -> dict[str, Any]:
    # Only the group's first rank takes the saved numbers: rank 0 skipping the load lost the
    # checkpoint without a word (a sum of 2.0 instead of 12.0).
    rank = dist.get_rank()
    group = _subgroup()
    saved_from = ComposeMetric({"total": MeanMetric()})
    saved_from["total"].update(torch.tensor([5.0]))
    saved_from.sync(group)
    checkpoint = saved_from.state_dict()
    metric = ComposeMetric({"total": MeanMetric()})
    metric.sync(group)  # the group the load's first rank is taken from
    if rank != skipper:
        metric.load_state_dict(checkpoint)
    metric["total"].update(torch.tensor([1.0]))
    out = {"metric": _outcome(lambda: metric.sync(group))}
    # The same with sync(step=...), which sends the step instead of the call count: rank 0
    # skipping the load lost the checkpoint silently (2.0 on both ranks instead of 12.0).
    at_step = ComposeMetric({"total": MeanMetric()})
    at_step.sync(group)
    if rank != skipper:
        at_step.load_state_dict(checkpoint)
    at_step["total"].update(torch.tensor([1.0]))
    out["at step"] = _outcome(lambda: at_step.sync(group, step=10))
    saved_metric = _metric()
    _update(saved_metric, 4.0)
    metric_checkpoint = saved_metric.state_dict()  # every rank: a collective
    collector = AsyncMetricCollector(_metric(), group=_subgroup())
    if rank != skipper:
        collector.load_state_dict({"metric": metric_checkpoint, "sinks": {}})
    # Found at bind (it was at the first window, as a differing collector hash).
    out["collector"] = _outcome(lambda: collector.bind("cpu"))
    collector.close(timeout=10)
    return out


@pytest.mark.parametrize("skipper", [0, 1])
def test_a_load_skipped_by_one_rank_raises_on_every_rank(pair: RankPool, skipper: int) -> None:
    for rank, result in enumerate(pair.run(_load_skipped_by, skipper, timeout=90)):
        for where in ("metric", "at step", "collector"):
            assert result[where].startswith("RankMismatchError"), (rank, where, result)
        assert (
            "did a rank skip one, or the checkpoint's load, or load another" in result["at step"]
        ), result
        assert "hold different checkpoint loads" in result["collector"], result
        assert f"rank {skipper}: none loaded" in result["collector"], result


def _new_layout_against_a_laid_out_one() -> str:
    rank = dist.get_rank()
    laid_out = MeanMetric()
    laid_out.update(torch.ones(3))
    laid_out.sync()
    new = ComposeMetric({"mean": MeanMetric(), "max": MaxMetric()})
    (laid_out if rank == 0 else new).sync()  # rank 1 lays a new sync out: a structure check
    return "no error"


def test_a_structure_check_paired_with_a_data_collective_fails_at_once() -> None:
    # The check used to be an all_reduce: paired with rank 0's data all_gather, both ranks hung
    # until the process group's timeout. Now gloo refuses the sizes at once; one rank may die.
    with DistributedPool(2, collective_timeout_s=60.0) as pool:
        pool.run(dist.get_rank)  # started before the clock runs
        begin = time.monotonic()
        with pytest.raises(DistributedError) as raised:
            pool.run(_new_layout_against_a_laid_out_one, timeout=90)
        assert time.monotonic() - begin < 45
    # Which rank sees what depends on timing: the one gloo aborts, the other a fingerprint
    # mismatch or the lost connection. What matters is that no rank goes on as if synced.
    assert "no error" not in str(raised.value)
    assert len(raised.value.failures) == 2, raised.value


class _DeviceEvent:
    """A CUDA event stand-in: the "device" passes it when ``passed`` is set; ``synchronize``
    (a host wait) is logged."""

    passed = False
    waits = 0

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return _DeviceEvent.passed

    def synchronize(self) -> None:
        _DeviceEvent.waits += 1


def _cuda_syncs_checked_later() -> dict[str, Any]:
    """The CUDA branch of ``Metric.sync`` on gloo: fingerprints checked once the device passed
    them, without a host wait while it has not, each against its own sync's rows."""
    original = (sync_module._plan_device, sync_module.host_event)
    sync_module._plan_device = lambda plan: torch.device("cuda")  # type: ignore[assignment]
    sync_module.host_event = _DeviceEvent  # type: ignore[assignment]
    _DeviceEvent.passed, _DeviceEvent.waits = False, 0
    rank, out = dist.get_rank(), {}
    try:
        metric, group = _metric(), _subgroup()
        _update(metric, 1.0 + rank)
        metric.sync(group, step=10 + rank)  # mismatched: found only once the device passed it
        metric.sync(group, step=20)  # matched, started while the first is unchecked
        out["waits while behind"] = _DeviceEvent.waits
        _DeviceEvent.passed = True
        out["next sync"] = _outcome(lambda: metric.sync(group, step=30))
        # That mismatch may have left mixed numbers in the synced buffers: local state is read.
        out["loss after the mismatch"] = float(metric["loss"].compute())
        out["after"] = _outcome(lambda: metric.sync(group, step=40))
        metric.verify_sync()  # passed: checks the rest with no wait
        _DeviceEvent.passed = False
        for step in range(50, 55):  # a fifth unchecked sync waits for the oldest
            metric.sync(group, step=step)
        out["waits beyond the cap"] = _DeviceEvent.waits
        out["state_dict"] = _outcome(metric.state_dict)
        out["waits for state_dict"] = _DeviceEvent.waits
    finally:
        sync_module._plan_device, sync_module.host_event = original  # type: ignore[assignment]
    return out


def test_cuda_syncs_are_checked_once_the_device_passed_them(pair: RankPool) -> None:
    for rank, out in enumerate(pair.run(_cuda_syncs_checked_later, timeout=60)):
        assert out["waits while behind"] == 0
        assert out["next sync"].startswith("RankMismatchError"), out
        assert f"sync at step {10 + rank}" in out["next sync"]
        assert out["loss after the mismatch"] == 1.0 + rank  # its own, not the mean 1.5
        assert out["after"] == "no error"
        assert out["waits beyond the cap"] == 1
        assert out["state_dict"] == "no error"
        assert out["waits for state_dict"] == 6  # the four left, then state_dict's own


def test_a_slot_copy_starts_with_no_unchecked_syncs() -> None:
    """A copy must not share (or lose) the list of unchecked CUDA syncs of its source."""
    from sidestream.collector._slot import clone_metric

    metric = MeanMetric()
    metric.__dict__["_unverified_syncs"] = []  # what a CUDA sync leaves once checked
    copy = clone_metric(metric)
    pending = copy.__dict__["_unverified_syncs"]
    assert pending == [] and pending is not metric.__dict__["_unverified_syncs"]


def test_a_row_that_is_no_fingerprint_is_named_as_another_collective() -> None:
    # A rank whose collective was another (a user's all_gather, a payload gloo cut short) sent
    # bytes read as a fingerprint: they were described as "sync #177117687", a call never made.
    window = CallFingerprint("window", 3, "train").words(12345)
    with pytest.raises(RankMismatchError) as caught:
        check_calls([window, [99, 177117687, 5, 6]], rank=0)
    message = str(caught.value)
    assert "rank 1: no call of sidestream's (unknown kind 99)" in message
    assert "rank 0: window #3 (structure " in message
    assert "ran another collective at this point" in message
    with pytest.raises(RankMismatchError, match="ran another collective at this point"):
        check_calls([window, CallFingerprint("sync", 177117687).words(5)], rank=1)
    # Zeros (a zero-filled tensor of another collective) were read as kind 0, "sync #...".
    with pytest.raises(RankMismatchError) as caught:
        check_calls([window, [0, 6310622999, 0, 0]], rank=0)
    assert "rank 1: no call of sidestream's (unknown kind 0)" in str(caught.value)
    other_structure = CallFingerprint("window", 3, "train").words(999)
    with pytest.raises(RankMismatchError) as caught:
        check_calls([window, other_structure], rank=0)
    assert "synced different metrics here" in str(caught.value)
    assert "another collective" not in str(caught.value)


def test_a_changed_metric_or_a_skipped_call_is_named_instead_of_another_collective() -> None:
    # Both were told "a call your loop never makes means that rank ran another collective":
    # rank 1's metric had gained a state after its layout, or a rank was one sync behind.
    synced = CallFingerprint("sync", 2).words(7)
    with pytest.raises(RankMismatchError) as caught:
        check_calls([synced, CallFingerprint("changed", 3).words(7)], rank=0)
    assert "The metric of rank(s) [1] changed its states since its last sync" in str(caught.value)
    with pytest.raises(RankMismatchError) as caught:
        check_calls(
            [
                CallFingerprint("sync at step", 1).words(7),
                CallFingerprint("sync at step", 2).words(7),
            ],
            rank=0,
        )
    assert "a rank skipped one (or ran one more), or the ranks passed different steps" in str(
        caught.value
    )
    assert "ran another collective" not in str(caught.value)
