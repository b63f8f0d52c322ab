"""The collector on 2 and 4 gloo ranks: rank 0's JSONL equals numpy on every rank's data."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sidestream import MeanMetric, Metric, SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import JsonlSink
from sidestream.sync import RankMismatchError
from sidestream.testing import RankPool, rank_device
from tests.collector.helpers import (
    CountingHandler,
    RecordingSink,
    feed,
    make_metric,
    reference,
    window_data,
)

WINDOWS = 4
SEED = 7


def _steps() -> list[int]:
    return [10 * (k + 1) for k in range(WINDOWS)]


def _train(directory: str) -> dict[str, Any]:
    rank, device = dist.get_rank(), rank_device()
    handler = CountingHandler()
    logging.getLogger("sidestream").addHandler(handler)
    slow = RecordingSink(delay_s=1.0, name="slow")
    flaky = RecordingSink(failures=3, name="flaky")
    jsonl = JsonlSink(Path(directory) / f"rank{rank}.jsonl")
    metric = make_metric()
    collector = AsyncMetricCollector(metric, sinks=[slow, jsonl, flaky])
    collector.bind(device)
    durations = []
    try:
        for window, step in enumerate(_steps()):
            feed(metric, window_data(SEED, window, rank), device)
            started = time.perf_counter()
            collector.schedule_collection(step)
            durations.append(time.perf_counter() - started)
        latest = collector.collect_results()
        jsonl_done_first = None
        if collector.is_writer:
            runner = next(r for r in collector.sink_runners if r.key == "jsonl")
            deadline = time.monotonic() + 10
            while runner.delivered < WINDOWS and time.monotonic() < deadline:
                time.sleep(0.01)
            # The JSONL sink got every window while the slow one was still on its first ones.
            jsonl_done_first = runner.delivered == WINDOWS and len(slow.steps) < WINDOWS
        # A partial window, then a checkpoint: a collective on every rank.
        feed(metric, window_data(SEED, 99, rank), device)
        state = collector.state_dict()
    finally:
        closed = collector.close(timeout=60)
        logging.getLogger("sidestream").removeHandler(handler)
    return {
        "durations": durations,
        "latest": latest,
        "jsonl_done_first": jsonl_done_first,
        "closed": closed,
        "opened": len(slow.opened) + len(flaky.opened),
        "slow_steps": slow.steps,
        "flaky_steps": flaky.steps,
        "flaky_attempts": flaky.attempts,
        "messages": handler.messages,
        "weight_state": state["metric"]["loss.weight"].item(),
        "sink_states": state["sinks"],
    }


def _close(actual: float, expected: float) -> None:
    assert actual == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_rank0_jsonl_matches_numpy_and_sinks_are_isolated(
    dist_pool: RankPool, tmp_path: Path
) -> None:
    world = dist_pool.world_size
    per_rank = dist_pool.run(_train, str(tmp_path), timeout=120)
    expected = [reference([window_data(SEED, k, r) for r in range(world)]) for k in range(WINDOWS)]

    # Rank 0 wrote every window, in step order, with the values of all ranks' data.
    lines = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == _steps()
    for line, want in zip(lines, expected, strict=True):
        assert set(line["values"]) == set(want)
        for name, value in want.items():
            _close(line["values"][name], value)

    # Every rank computed the same numbers; only rank 0 opened or wrote anything.
    for rank, result in enumerate(per_rank):
        latest = result["latest"]
        _close(latest["loss"], expected[-1]["loss"])
        _close(latest["acc"], expected[-1]["acc"])
        for i, fraction in enumerate(latest["classes"]):
            _close(fraction, expected[-1][f"classes/class_{i}"])
        assert result["closed"] is True
        if rank == 0:
            assert result["opened"] == 2
        else:
            assert result["opened"] == 0
            assert not (tmp_path / f"rank{rank}.jsonl").exists()
            assert result["slow_steps"] == result["flaky_steps"] == []
            assert result["sink_states"] == {}

    # The checkpoint holds the partial window reduced over all ranks, identically everywhere.
    partial_weight = sum(window_data(SEED, 99, r)["weights"].sum() for r in range(world))
    for result in per_rank:
        _close(result["weight_state"], partial_weight)

    rank0 = per_rank[0]
    # A 1 s/write sink and a raising sink never slowed the training thread.
    assert max(rank0["durations"]) < 0.9, rank0["durations"]  # one slow write takes 1 s
    assert rank0["jsonl_done_first"] is True
    # Nothing lost at close: the slow sink got everything, and so did the flaky one, in order.
    assert rank0["slow_steps"] == _steps()
    assert rank0["flaky_steps"] == _steps()
    assert rank0["flaky_attempts"] == WINDOWS + 3
    failures = [m for m in rank0["messages"] if "'flaky'" in m and "retrying" in m]
    recoveries = [m for m in rank0["messages"] if "'flaky'" in m and "recovered" in m]
    assert len(failures) == 1 and "ConnectionError" in failures[0]
    assert len(recoveries) == 1
    assert dict(rank0["sink_states"]["jsonl"]["last_steps"])[""] == _steps()[-1]


def _mismatch_of(steps: Callable[[], object], *collectors: AsyncMetricCollector) -> str:
    """The text of the ``RankMismatchError`` that ``steps`` raised, else "no error"."""
    outcome = "no error"
    try:
        steps()
    except RankMismatchError as error:
        outcome = str(error)
    for collector in collectors:
        collector.close(timeout=60)
    return outcome


def _change_structure_on_rank0() -> str:
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    metric.update(torch.tensor([1.0, 2.0]))
    collector.schedule_collection(1)
    collector.collect_results()
    if dist.get_rank() == 0:
        # A new state arena (what moving to another device does): the layout bound is gone.
        metric._own_arena(torch.device("cpu"))

    def steps() -> None:
        collector.schedule_collection(2)
        collector.collect_results(timeout=60)

    return _mismatch_of(steps, collector)


def test_a_metric_changed_after_bind_fails_the_window_on_every_rank(dist_pool: RankPool) -> None:
    # The changed rank sends its old layout with a "changed" fingerprint, so no rank hangs and
    # every rank raises instead of logging numbers mixed from different calls.
    outcomes = dist_pool.run(_change_structure_on_rank0, timeout=120)
    assert all(outcome != "no error" for outcome in outcomes), outcomes
    assert "changed its states after bind" in outcomes[0] or "paired different" in outcomes[0]


@pytest.mark.parametrize("world_named", [False, True])
def test_two_collectors_of_one_prefix_scheduled_in_another_order_fail_every_rank(
    dist_pool: RankPool, world_named: bool
) -> None:
    # Paired by prefix and step alone, each rank's first window was reduced with the other's
    # second: both collectors reported 50.5 (not 1.0 and 100.0) with only a warning at bind.
    # The default group named as dist.group.WORLD by one of them is the same group.
    outcomes = dist_pool.run(
        _schedule_two_collectors_in_rank_order, ("", ""), world_named, timeout=120
    )
    for rank, outcome in enumerate(outcomes):
        assert "paired different calls" in outcome, (rank, outcome)
        assert "share its prefix" in outcome, (rank, outcome)


def _metrics_of_one_layout_by_rank() -> str:
    from sidestream import ComposeMetric
    from sidestream.metrics.regression import (
        MeanSquaredErrorMetric,
        RootMeanSquaredErrorMetric,
    )

    error = RootMeanSquaredErrorMetric() if dist.get_rank() == 1 else MeanSquaredErrorMetric()
    try:
        AsyncMetricCollector(ComposeMetric({"error": error, "loss": MeanMetric()})).bind("cpu")
    except RankMismatchError as mismatch:
        return str(mismatch)
    return "no error"


def _children_in_another_order_by_rank() -> str:
    from sidestream import ComposeMetric, MaxMetric

    # Of other ops: the state arena orders them by op, so the layout is the same either way.
    children: dict[str, Metric[Any]] = {"a": MeanMetric(), "b": MaxMetric()}
    if dist.get_rank() == 1:
        children = dict(reversed(children.items()))  # a dict made from a set, say
    collector = AsyncMetricCollector(ComposeMetric(children)).bind("cpu")
    collector.metric["a"].update(torch.tensor([1.0]))
    collector.metric["b"].update(torch.tensor([float(dist.get_rank())]))
    collector.schedule_collection(1)
    result = collector.collect_results(timeout=60)
    collector.close(timeout=30)
    return f"{float(result['a'])} {float(result['b'])}"


def test_children_in_another_order_still_bind_and_reduce_by_name(dist_pool: RankPool) -> None:
    # The structure check pairs children by name; the class check must not see an order.
    outcomes = dist_pool.run(_children_in_another_order_by_rank, timeout=120)
    largest = float(dist_pool.world_size - 1)
    assert outcomes == [f"1.0 {largest}"] * dist_pool.world_size, outcomes


def test_metrics_of_other_classes_with_one_state_layout_fail_at_bind(dist_pool: RankPool) -> None:
    # An MSE and an RMSE metric hold the same states: the structure check passed, windows were
    # reduced together and each rank computed its own kind of value.
    # Each metric's class is part of the structure the first slot checks at bind.
    outcomes = dist_pool.run(_metrics_of_one_layout_by_rank, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert "ranks of the group hold different metric state" in outcome, (rank, outcome)
        assert (
            "metric 'error' is 'RootMeanSquaredErrorMetric multioutput=uniform_average' on "
            "rank 1 but 'MeanSquaredErrorMetric multioutput=uniform_average' on rank 0"
        ) in outcome, outcome
        assert "metric 'loss'" not in outcome, outcome


def _skip_a_window_on_rank1() -> tuple[str, float]:
    """Rank 1 skips step 2's window in a fast loop; each rank times its error."""
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    outcome, start = "no error", time.monotonic()
    try:
        for step in range(1, 5):
            metric.update(torch.tensor([float(step)]))
            if not (dist.get_rank() == 1 and step == 2):
                collector.schedule_collection(step)
        collector.collect_results(timeout=60)
    except RankMismatchError as error:
        outcome = str(error)
    elapsed = time.monotonic() - start
    collector.close(timeout=30)  # rank 0's partnerless window ends at the collective timeout
    return outcome, elapsed


def test_a_rank_skipping_a_window_fails_both_ranks_before_the_collective_timeout() -> None:
    """Rank 0 is left with a window no rank pairs: collect_results raises the mismatch at once
    instead of waiting for that window's collective to time out."""
    from sidestream.testing import DistributedPool

    # Its own pool: a collective dangles. A timeout far above the bound: a loaded machine's
    # slow rank is not mistaken for the wait the test rules out.
    with DistributedPool(2, collective_timeout_s=60) as pool:
        outcomes = pool.run(_skip_a_window_on_rank1, timeout=120)
    for rank, (outcome, elapsed) in enumerate(outcomes):
        assert "paired different" in outcome or "mismatch" in outcome.lower(), (rank, outcome)
        assert elapsed < 30, (rank, elapsed)


def _skip_the_last_window_then_checkpoint() -> tuple[str, float]:
    """Rank 1 skips the last window, then every rank takes a checkpoint right away."""
    metric = SumMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    for step in (1, 2, 3):
        metric.update(torch.tensor([1.0]))
        if not (dist.get_rank() == 1 and step == 3):
            collector.schedule_collection(step)
    outcome, start = "no error", time.monotonic()
    try:
        collector.state_dict(timeout=1.0)
    except RankMismatchError as error:
        outcome = str(error)
    elapsed = time.monotonic() - start
    collector.close(timeout=30)
    return outcome, elapsed


def test_a_checkpoint_after_a_skipped_window_fails_every_rank_at_once() -> None:
    """Rank 0's last window pairs rank 1's checkpoint collective: rank 0 found the mismatch
    only then, after starting a checkpoint collective of its own, which waited the whole
    process-group timeout (30 min by default) and raised gloo's timeout instead. (Through a
    Run, the checkpoint's first collective is the check of its collectors, of another size:
    gloo ends rank 1's process, as docs/collector.md says.)"""
    from sidestream.testing import DistributedPool

    with DistributedPool(2, collective_timeout_s=60) as pool:  # its own: a collective dangles
        outcomes = pool.run(_skip_the_last_window_then_checkpoint, timeout=120)
    for rank, (outcome, elapsed) in enumerate(outcomes):
        assert "paired different calls" in outcome, (rank, outcome)
        assert elapsed < 30, (rank, elapsed)


def _schedule_two_collectors_in_rank_order(
    prefixes: tuple[str, str] = ("train", "val"), world_named: bool = False
) -> str:
    """Two same-shaped collectors; rank 1 schedules them the other way round at one step.

    ``world_named``: the second names the default group ``dist.group.WORLD`` (the first: None).
    """
    train_metric, val_metric = MeanMetric(), MeanMetric()
    train = AsyncMetricCollector(train_metric, prefix=prefixes[0]).bind("cpu")
    group = dist.group.WORLD if world_named else None
    val = AsyncMetricCollector(val_metric, prefix=prefixes[1], group=group).bind("cpu")
    train_metric.update(torch.tensor([1.0]))
    val_metric.update(torch.tensor([100.0]))
    order = [train, val] if dist.get_rank() == 0 else [val, train]

    def steps() -> None:
        for collector in order:
            collector.schedule_collection(10)
        train.collect_results(timeout=60)
        val.collect_results(timeout=60)

    return _mismatch_of(steps, train, val)


def test_windows_of_two_collectors_in_different_orders_fail_instead_of_mixing(
    dist_pool: RankPool,
) -> None:
    # Without the collector's prefix in the call fingerprint, the two windows paired across
    # ranks and both reported the mean of 1 and 100.
    outcomes = dist_pool.run(_schedule_two_collectors_in_rank_order, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert "paired different calls" in outcome, (rank, outcome)
        assert "collector hash" in outcome or "prefix 'train'" in outcome, outcome


def _skip_a_window_with_an_exact_metric() -> str:
    """A tree with an exact AUROC syncs on the slow path; rank 1 skips step 2's window."""
    from sidestream import ComposeMetric
    from sidestream.metrics.classification import BinaryAUROCMetric

    metric = ComposeMetric({"auroc": BinaryAUROCMetric(exact=True), "mean": MeanMetric()})
    collector = AsyncMetricCollector(metric).bind("cpu")
    generator = torch.Generator().manual_seed(dist.get_rank())

    def steps() -> None:
        for step in range(1, 5):
            scores = torch.rand(8, generator=generator)
            metric["auroc"].update(scores, (scores > 0.5).long())
            metric["mean"].update(scores)
            if not (dist.get_rank() == 1 and step == 2):
                collector.schedule_collection(step)
        collector.collect_results(timeout=60)

    return _mismatch_of(steps, collector)


def test_a_skipped_window_of_an_exact_metric_fails_every_rank(dist_pool: RankPool) -> None:
    # The slow path numbered its syncs per metric, so a skip shifted every rank's count alike
    # and the windows of different steps paired silently; they carry the window's step now.
    outcomes = dist_pool.run(_skip_a_window_with_an_exact_metric, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert "paired different calls" in outcome and "window #" in outcome, (rank, outcome)


class _MeanWithOwnSync(MeanMetric):
    """A metric overriding sync (as users do to gather data of their own): its collectives
    carry none of the collector's window fingerprints."""

    def sync(self, group: Any = None, *, step: int | None = None) -> None:
        super().sync(group, step=step)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self.compute().item(), group=group)


def _skip_a_window_of_a_metric_with_its_own_sync(layout: str) -> str:
    from sidestream import ComposeMetric

    own = _MeanWithOwnSync()
    metric = own if layout == "root" else ComposeMetric({"own": own})
    collector = AsyncMetricCollector(metric).bind("cpu")

    def steps() -> None:
        for step in range(1, 5):
            own.update(torch.tensor([float(100 * dist.get_rank() + step)]))
            if not (dist.get_rank() == 1 and step == 2):
                collector.schedule_collection(step)
            collector.collect_results(timeout=60)

    return _mismatch_of(steps, collector)


@pytest.mark.parametrize("layout", ["root", "alone in a composition"])
def test_a_skipped_window_of_a_metric_with_its_own_sync_fails_every_rank(
    dist_pool: RankPool, layout: str
) -> None:
    # Its sync sent fingerprints of its own (or none): ranks reduced windows 2 and 3 together
    # and reported mixed values with no error. The window's fingerprint now goes first.
    outcomes = dist_pool.run(_skip_a_window_of_a_metric_with_its_own_sync, layout, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert "paired different calls" in outcome and "window #2" in outcome, (rank, outcome)
        assert "(structure" not in outcome  # no layout travels with that check: none named


class _StoredRows(Metric[torch.Tensor]):
    """Rows of a width of its own, and nothing that says what they mean (no configuration)."""

    def __init__(self, width: int) -> None:
        from sidestream._samples import SampleStore

        self._samples = SampleStore(rows=torch.zeros((0, width)))

    def update(self, rows: torch.Tensor) -> None:
        self._samples.append(rows=rows)

    def compute(self) -> torch.Tensor:
        return torch.zeros(())


def _exact_metric_with_rank_dependent_classes(kind: str) -> str:
    from sidestream.metrics.classification import MulticlassAUROCMetric

    classes = 4 + dist.get_rank()
    if kind == "built-in":
        metric: Metric[Any] = MulticlassAUROCMetric(classes, exact=True)
        metric.update(torch.rand(6, classes).softmax(-1), torch.arange(6) % classes)
    else:
        metric = _StoredRows(classes)
        metric.update(torch.rand(6, classes))
    try:
        metric.sync()
    except RankMismatchError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("kind", ["built-in", "custom"])
def test_exact_rows_of_different_shapes_raise_instead_of_aborting(
    dist_pool: RankPool, kind: str
) -> None:
    # The rows' gather had no check: rows of 4 and 5 columns aborted the process inside gloo.
    outcomes = dist_pool.run(_exact_metric_with_rank_dependent_classes, kind, timeout=120)
    for rank, outcome in enumerate(outcomes):
        if kind == "built-in":  # its problem says so, at the structure check
            assert "multiclass num_classes=5 " in outcome, (rank, outcome)
        else:
            assert "sample rows of different shapes" in outcome, (rank, outcome)


def _configuration_by_rank(where: str) -> dict[str, str]:
    from sidestream.metrics.classification import BinaryAUROCMetric, confusion_count_metric
    from sidestream.metrics.language import PerplexityMetric
    from sidestream.metrics.regression import PearsonCorrelationMetric, R2ScoreMetric

    rank = dist.get_rank()
    other = rank == dist.get_world_size() - 1
    metrics = {
        # The same number of bins, other edges: counts per bin added into other bins.
        "bins": BinaryAUROCMetric(thresholds=[0.0, 0.2 if other else 0.5, 1.0]),
        # Stored scores of another scale: logits ranked among probabilities.
        "exact logits": BinaryAUROCMetric(exact=True, logits=other),
        "pearson shift": PearsonCorrelationMetric(shift=5.0 if other else 0.0),
        "r2 shift": R2ScoreMetric(shift=5.0 if other else 0.0),
        # Equal bins given as a float32 linspace and as Python floats are the same layout.
        "equal bins": BinaryAUROCMetric(
            thresholds=torch.linspace(0, 1, 11) if other else [i / 10 for i in range(11)]
        ),
        # The same threshold written as an int and as a float.
        "equal threshold": confusion_count_metric().binary(1 if other else 1.0).with_f1().build(),
        # Per-sample F-scores of another beta mean something else.
        "beta": confusion_count_metric(multidim_average="samplewise")
        .multiclass(3)
        .with_fbeta(2.0 if other else 0.5)
        .build(),
        # NaNs ignored on one rank and filled with 0 on another: a mean of neither policy.
        "nan policy": MeanMetric(nan_strategy=0.0 if other else "ignore"),
        # Tokens counted under another padding id.
        "ignore_index": PerplexityMetric(ignore_index=0 if other else -100),
        # Counts of another threshold (or kind) mean something else.
        "threshold": confusion_count_metric().binary(0.9 if other else 0.5).with_f1().build(),
        "kind": (
            confusion_count_metric().multilabel(3)
            if other
            else confusion_count_metric().multiclass(3)
        )
        .with_recall()
        .micro()
        .build(),
    }
    out = {}
    for name, metric in metrics.items():
        if name in ("bins", "exact logits", "equal bins", "threshold", "equal threshold"):
            metric.update(torch.tensor([0.1, 0.3, 0.7, 0.9]), torch.tensor([0, 1, 0, 1]))
        elif name == "beta":
            metric.update(torch.tensor([[[0.9, 0.1, 0.8]]]), torch.tensor([[0]]))
        elif name == "nan policy":
            metric.update(torch.tensor([1.0, float("nan"), 3.0]))
        elif name == "ignore_index":
            metric.update(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]]))
        elif name == "kind":
            target = torch.tensor([[1, 0, 1]]) if other else torch.tensor([0])
            metric.update(torch.tensor([[0.9, 0.1, 0.8]]), target)
        else:
            metric.update(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0]))
        if where == "sync":
            out[name] = _mismatch_of(metric.sync)
            continue
        collector = AsyncMetricCollector(metric)

        def steps(collector: AsyncMetricCollector = collector) -> None:
            collector.bind("cpu")  # lays the sync out: the structure check runs here
            collector.schedule_collection(1)
            collector.collect_results(timeout=60)

        out[name] = _mismatch_of(steps, collector)
    return out


@pytest.mark.parametrize("where", ["sync", "collector"])
def test_ranks_configured_with_other_bins_or_shifts_fail_every_rank(
    dist_pool: RankPool, where: str
) -> None:
    # Bins and shifts were reduced as the MAX of (supposedly) equal values: ranks with other
    # edges of the same count, or another shift, gave a value of neither (AUROC 0.625, a
    # correlation of 0.9867 where the pooled data give 0.9820) with no error.
    odd = dist_pool.world_size - 1
    outcomes = dist_pool.run(_configuration_by_rank, where, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert (
            f"'bin_layout' has configuration [0.0, 0.2, 1.0] on rank {odd} but [0.0, 0.5, 1.0]"
            in (outcome["bins"])
        ), (rank, outcome)
        assert (
            f"'shift' has configuration [5.0] on rank {odd} but [0.0] on rank 0"
            in (outcome["pearson shift"])
        )
        assert f"'target_shift' has configuration [5.0] on rank {odd}" in outcome["pearson shift"]
        assert f"'shift' has configuration [5.0] on rank {odd}" in outcome["r2 shift"]
        assert (
            "'rejected' has configuration binary num_classes=1 threshold=0.5 logits=True "
            in outcome["exact logits"]
        ), (rank, outcome)
        assert (
            f"'nan_count' has configuration nan_strategy=0.0 on rank {odd}"
            in (outcome["nan policy"])
        ), (rank, outcome)
        assert "but nan_strategy=ignore on rank 0" in outcome["nan policy"]
        assert f"configuration ignore_index=0 on rank {odd}" in outcome["ignore_index"]
        assert outcome["equal bins"] == "no error"
        assert outcome["equal threshold"] == "no error"
        assert "statistics=f2" in outcome["beta"] and "statistics=f0.5" in outcome["beta"]
        assert (
            "'counts' has configuration binary num_classes=1 threshold=0.9 "
            in (outcome["threshold"])
        )
        assert "but binary num_classes=1 threshold=0.5 " in outcome["threshold"]
        assert (
            "multilabel num_labels=3 threshold=0.5 logits=False top_k=1 ignore_index=None on "
            f"rank {odd}" in outcome["kind"]
        )


def _sinks_by_rank(tmp: str, layout: str) -> str:
    from sidestream import Run

    rank = dist.get_rank()
    last = rank == dist.get_world_size() - 1
    sinks: list[Any] = []
    if layout == "only on the last rank" and last:
        sinks = [JsonlSink(f"{tmp}/only.jsonl")]
    elif layout == "an extra sink on the last rank":
        sinks = [JsonlSink(f"{tmp}/all.jsonl")]
        if last:
            sinks.append(JsonlSink(f"{tmp}/extra.jsonl"))
    elif layout == "the same":
        sinks = [JsonlSink(f"{tmp}/same.jsonl")]
    run = Run(sinks, spool_dir=tmp)
    collector = run.collector(MeanMetric(), prefix="train")
    collector.metric.update(torch.tensor([1.0]))

    def steps() -> None:
        collector.bind("cpu")
        collector.schedule_collection(1)
        collector.collect_results(timeout=60)

    outcome = _mismatch_of(steps)
    run.close(timeout=30)
    return outcome


@pytest.mark.parametrize(
    "layout", ["only on the last rank", "an extra sink on the last rank", "the same"]
)
def test_sinks_configured_differently_by_rank_fail_at_bind(
    dist_pool: RankPool, tmp_path: Path, layout: str
) -> None:
    # Only rank 0 writes: a sink built on another rank alone was dropped, its status
    # "healthy" and close() True, with no message.
    odd = dist_pool.world_size - 1
    outcomes = dist_pool.run(_sinks_by_rank, str(tmp_path), layout, timeout=120)
    for rank, outcome in enumerate(outcomes):
        if layout == "the same":
            assert outcome == "no error", (rank, outcome)
            continue
        assert "ranks of the group hold different sinks" in outcome, (rank, outcome)
        expected = "[jsonl]" if layout == "only on the last rank" else "[jsonl, jsonl-2]"
        assert f"rank 0: [{'none' if layout == 'only on the last rank' else 'jsonl'}]" in outcome
        assert f"rank {odd}: {expected}" in outcome
    assert not (tmp_path / "only.jsonl").exists()


def _checkpoint_of_collectors_made_in_another_order(tmp: str, extra: bool) -> Any:
    from sidestream import Run

    rank = dist.get_rank()
    run = Run([JsonlSink(f"{tmp}/run.jsonl")], spool_dir=tmp)
    names = ["train", "val"] if rank == 0 else ["val", "train"]
    if extra and rank == 0:
        names.append("test")  # made on rank 0 alone, never bound
    collectors = {name: run.collector(MeanMetric(), prefix=name) for name in names}
    for name in ("train", "val"):
        collectors[name].bind("cpu")
    collectors["train"].metric.update(torch.tensor([100.0 + rank]))
    collectors["val"].metric.update(torch.tensor([float(rank)]))
    try:
        saved = run.state_dict(timeout=30)
        outcome: Any = {
            name: (float(state["total"]), float(state["count"]))
            for name, state in saved["collectors"].items()
        }
    except RankMismatchError as error:
        outcome = str(error)
    run.close(timeout=30)
    return outcome


@pytest.mark.parametrize("extra", [False, True], ids=["other order", "an extra collector"])
def test_a_checkpoint_of_collectors_made_in_another_order_by_rank(
    dist_pool: RankPool, tmp_path: Path, extra: bool
) -> None:
    # run.state_dict reduced the collectors in the order each rank made them: train's state
    # against val's (both ranks saved train=(101, 2) and val=(101, 2)); an extra collector on
    # one rank paired with the other rank's next collective and aborted the process in gloo.
    world = dist_pool.world_size
    outcomes = dist_pool.run(
        _checkpoint_of_collectors_made_in_another_order, str(tmp_path), extra, timeout=120
    )
    for rank, outcome in enumerate(outcomes):
        if extra:
            assert "ranks of the group hold different collectors" in outcome, (rank, outcome)
            assert "rank 0: ['test', 'train', 'val']; rank 1: ['train', 'val']" in outcome
            continue
        train = sum(100.0 + r for r in range(world))
        val = sum(float(r) for r in range(world))
        assert outcome == {"train": (train, world), "val": (val, world)}, (rank, outcome)


def _window_mode_by_rank() -> str:
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric, reset_each_window=dist.get_rank() == 0).bind("cpu")
    metric.update(torch.tensor([1.0]))

    def steps() -> None:
        collector.schedule_collection(1)
        collector.collect_results(timeout=60)

    return _mismatch_of(steps, collector)


def test_window_and_cumulative_collectors_paired_across_ranks_fail(dist_pool: RankPool) -> None:
    # One rank resetting each window and another accumulating would mix window values with
    # running totals: the mode is part of the window's fingerprint.
    for rank, outcome in enumerate(dist_pool.run(_window_mode_by_rank, timeout=120)):
        assert "paired different calls" in outcome, (rank, outcome)


def _checkpoint_with_a_collector_over_a_subgroup(tmp: str) -> Any:
    from sidestream import Run

    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, 1]) if world > 2 else None  # every rank makes the group
    run = Run([JsonlSink(f"{tmp}/run.jsonl")], spool_dir=tmp)
    train = run.collector(MeanMetric(), prefix="train").bind("cpu")
    train.metric.update(torch.tensor([float(rank)]))
    if rank in (0, 1):  # "val" exists on the pair alone
        val = run.collector(MeanMetric(), prefix="val", group=pair).bind("cpu")
        val.metric.update(torch.tensor([10.0 + rank]))
    saved = run.state_dict(timeout=30)
    run.close(timeout=30)
    totals = {name: float(state["total"]) for name, state in saved["collectors"].items()}
    # Every rank resumes from rank 0's checkpoint (torch.save on rank 0, torch.load on each).
    shared = [saved if rank == 0 else None]
    dist.broadcast_object_list(shared)
    handler = CountingHandler()
    logging.getLogger("sidestream").addHandler(handler)
    try:
        resumed = Run([JsonlSink(f"{tmp}/run.jsonl")], spool_dir=tmp)
        resumed.load_state_dict(shared[0])
        resumed.collector(MeanMetric(), prefix="train").bind("cpu")
        if rank in (0, 1):
            resumed.collector(MeanMetric(), prefix="val", group=pair).bind("cpu")
        resumed.close(timeout=30)
    finally:
        logging.getLogger("sidestream").removeHandler(handler)
    unclaimed = [m for m in handler.messages if "no collector of this run has claimed" in m]
    return totals, unclaimed


def test_a_checkpoint_with_a_collector_over_a_subgroup(dist_pool: RankPool, tmp_path: Path) -> None:
    # The check that every rank holds the same collectors ran over the whole world: a
    # collector over a subgroup (on its ranks alone) made every checkpoint fail.
    world = dist_pool.world_size
    outcomes = dist_pool.run(
        _checkpoint_with_a_collector_over_a_subgroup, str(tmp_path), timeout=120
    )
    train = sum(float(r) for r in range(world))
    assert outcomes[0][0] == {"train": train, "val": 21.0}, outcomes  # val: 10 + 11 over the pair
    # Ranks outside the pair warned on resume that "val" was claimed by no collector (a
    # renamed prefix?), though it is the pair's.
    assert [unclaimed for _, unclaimed in outcomes] == [[]] * world


def _checkpoint_loaded_on_rank0_only(tmp: str, everywhere: bool | str) -> str:
    from sidestream import Run

    rank = dist.get_rank()
    first = Run([JsonlSink(f"{tmp}/first.jsonl")], spool_dir=tmp)
    train = first.collector(MeanMetric(), prefix="train").bind("cpu")
    train.metric.update(torch.tensor([float(rank + 1)]))
    train.schedule_collection(1)
    saved = first.state_dict(timeout=60)
    train.metric.update(torch.tensor([5.0]))  # not yet in a window: in the next checkpoint
    later = first.state_dict(timeout=60)
    first.close(timeout=30)
    resumed = Run([JsonlSink(f"{tmp}/resumed.jsonl")], spool_dir=tmp)
    if everywhere == "another on rank 1":
        # Each rank its own file (the step-1 one on rank 0, the step-2 one elsewhere): only
        # rank 0's numbers were taken, without a word.
        resumed.load_state_dict(later if rank else saved)
    elif everywhere or rank == 0:
        resumed.load_state_dict(saved)
    collector = resumed.collector(MeanMetric(), prefix="train")
    outcome = _mismatch_of(lambda: collector.bind("cpu"))
    resumed.close(timeout=30)
    return outcome


@pytest.mark.parametrize("everywhere", [True, False, "another on rank 1"])
def test_a_checkpoint_loaded_on_some_ranks_only_fails_at_bind(
    dist_pool: RankPool, tmp_path: Path, everywhere: bool | str
) -> None:
    # Found at the first window instead, as a state hash that differs between ranks.
    outcomes = dist_pool.run(_checkpoint_loaded_on_rank0_only, str(tmp_path), everywhere)
    for rank, outcome in enumerate(outcomes):
        if everywhere is True:
            assert outcome == "no error", (rank, outcome)
            continue
        assert "ranks of the group hold different checkpoint loads" in outcome, (rank, outcome)
        if everywhere:
            assert re.search(r"rank 0: a checkpoint loaded \(digest \w+\); rank 1: a", outcome)
        else:
            assert re.search(r"rank 0: a checkpoint loaded \(digest \w+\); rank 1: none", outcome)
        assert "with the same checkpoint on every rank before bind" in outcome


def _checkpoint_after_a_refused_collector() -> tuple[bool, float]:
    everyone = dist.new_group(list(range(dist.get_world_size())))
    metric = SumMetric()
    first = AsyncMetricCollector(metric, group=everyone).bind("cpu")
    metric.update(torch.tensor([float(dist.get_rank() + 1)]))
    with contextlib.suppress(ValueError):
        AsyncMetricCollector(metric)  # the default group: refused, the metric is first's
    kept = metric.sync_group is everyone
    total = float(first.state_dict(timeout=30)["metric"]["total"])
    first.close(timeout=30)
    return kept, total


def test_a_refused_collector_leaves_the_metrics_group_as_it_was(dist_pool: RankPool) -> None:
    """The constructor set the metric's group before it was refused: the first collector's
    checkpoint then reduced over another group, which hung where that group differs."""
    world = dist_pool.world_size
    expected = world * (world + 1) / 2
    assert dist_pool.run(_checkpoint_after_a_refused_collector) == [(True, expected)] * world


def _schedule_late_on_rank1() -> list[str]:
    from sidestream.collector import _dispatcher

    _dispatcher.SLOW_WINDOW_S, _dispatcher._WATCH_EVERY_S = 0.5, 0.05
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("sidestream.collector").addHandler(handler)
    try:
        collector = AsyncMetricCollector(SumMetric(), prefix="val").bind("cpu")
        collector.metric.update(torch.tensor([1.0]))
        if dist.get_rank() == 1:
            time.sleep(2.0)  # a rank that reaches the window late (or never: a rank-0 branch)
        collector.schedule_collection(7)
        assert collector.collect_results(timeout=60) is not None
        assert collector.close(timeout=60)
    finally:
        logging.getLogger("sidestream.collector").removeHandler(handler)
    return [m for m in messages if "waited" in m]


def test_a_window_that_waits_long_for_its_reduction_is_named(dist_pool: RankPool) -> None:
    """A window one rank skipped next to DDP's collectives hung for the process group's
    timeout (30 minutes with gloo) without a word: it is named once it waited long."""
    warned = dist_pool.run(_schedule_late_on_rank1, timeout=120)
    assert len(warned[0]) == 1, warned
    assert "window at step 7 of stream 'val' has waited" in warned[0][0]
    assert "schedule_collection" in warned[0][0]
    assert warned[1] == []  # the late rank's own window did not wait


def _dp_batch(step: int, data_parallel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + data_parallel)
    return torch.rand(3 + data_parallel, generator=generator, dtype=torch.float64)


def _run_over_a_mesh_dimension(tmp: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from sidestream import Run

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data_parallel = mesh["dp"].get_local_rank()
    outcome = "bound"
    if 0 not in dist.get_process_group_ranks(mesh["dp"].get_group()):
        # The slice's process group, not the mesh: no window of it reaches rank 0's sinks.
        sinks = [JsonlSink(Path(tmp) / "refused.jsonl")]
        refused = AsyncMetricCollector(MeanMetric(), sinks, group=mesh["dp"].get_group())
        try:
            refused.bind("cpu")
        except ValueError as error:
            outcome = f"refused: {error}"
        refused.close(timeout=10)
    run = Run([JsonlSink(Path(tmp) / "run.jsonl")])
    train = run.collector(MeanMetric(), prefix="train", group=mesh["dp"]).bind("cpu")
    for step in range(1, 5):
        train.metric.update(_dp_batch(step, data_parallel))
        if step % 2 == 0:
            train.schedule_collection(step)
    assert run.close(timeout=30)
    return outcome


def test_a_run_collector_over_a_mesh_dimension_writes_each_window_once(
    pools: Any, tmp_path: Path
) -> None:
    # dp=2 x tp=2: the tensor-parallel ranks' slice of mesh["dp"] holds no rank 0, and bind
    # refused it ("no window would reach them"), though rank 0's slice writes the stream.
    outcomes = pools.get(4).run(_run_over_a_mesh_dimension, str(tmp_path))
    assert outcomes[0] == outcomes[2] == "bound"
    for outcome in (outcomes[1], outcomes[3]):
        assert "written by global rank 0" in outcome and "mesh['dp']" in outcome, outcome
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [2, 4]
    for record in records:
        step = record["step"]
        batches = [_dp_batch(s, dp) for s in (step - 1, step) for dp in (0, 1)]
        expected = torch.cat(batches).mean().item()  # each replica's batch once
        assert record["values"]["train"] == pytest.approx(expected, rel=1e-12)


def _mesh_resume_from_rank_0(tmp: str) -> tuple[float, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    from sidestream import Run

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank, data_parallel = dist.get_rank(), mesh["dp"].get_local_rank()
    run = Run([JsonlSink(Path(tmp) / "first.jsonl")])
    train = run.collector(MeanMetric(), prefix="train", group=mesh["dp"]).bind("cpu")
    train.metric.update(torch.tensor([1.0 + data_parallel]))  # one value per replica
    saved = run.state_dict(timeout=30)
    run.close(timeout=30)
    shared = [saved if rank == 0 else None]
    dist.broadcast_object_list(shared)
    handler = CountingHandler()
    logging.getLogger("sidestream").addHandler(handler)
    try:
        resumed = Run([JsonlSink(Path(tmp) / "resumed.jsonl")])
        resumed.load_state_dict(shared[0])
        # Made after the load: it takes the saved state by prefix, on every slice.
        again = resumed.collector(MeanMetric(), prefix="train", group=mesh["dp"]).bind("cpu")
        count = float(again.metric.state_dict()["count"])
        resumed.close(timeout=30)
    finally:
        logging.getLogger("sidestream").removeHandler(handler)
    return count, [m for m in handler.messages if "starts from zero" in m]


def test_a_mesh_dimension_collector_resumes_its_state_on_every_slice(
    pools: Any, tmp_path: Path
) -> None:
    # Rank 0's checkpoint named its own slice's ranks ([0, 2]) for "train": ranks 1 and 3,
    # whose slice holds the same replicas, dropped the state and started from zero.
    for count, warned in pools.get(4).run(_mesh_resume_from_rank_0, str(tmp_path)):
        assert (count, warned) == (2.0, []), (count, warned)  # both replicas' values, once


def _mesh_checkpoint_on_two_ranks(tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from sidestream import Run

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    run = Run([JsonlSink(Path(tmp) / "run.jsonl")])
    train = run.collector(MeanMetric(), prefix="train", group=mesh["dp"]).bind("cpu")
    train.metric.update(torch.tensor([1.0 + dist.get_rank()]))  # mid-window: 1.0 and 2.0
    saved = run.state_dict(timeout=30)
    if dist.get_rank() == 0:
        torch.save(saved, Path(tmp) / "checkpoint.pt")
    assert run.close(timeout=30)


def _mesh_resume_on_four_ranks(tmp: str) -> tuple[float, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    from sidestream import Run

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    handler = CountingHandler()
    logging.getLogger("sidestream").addHandler(handler)
    try:
        run = Run([JsonlSink(Path(tmp) / "run.jsonl")])
        run.load_state_dict(torch.load(Path(tmp) / "checkpoint.pt", weights_only=False))
        train = run.collector(MeanMetric(), prefix="train", group=mesh["dp"]).bind("cpu")
        train.metric.update(torch.tensor([3.0]))  # each data-parallel replica: 3.0
        train.schedule_collection(1)
        value = train.collect_results(timeout=30)
        assert run.close(timeout=30)
    finally:
        logging.getLogger("sidestream").removeHandler(handler)
    return value, [m for m in handler.messages if "starts from zero" in m]


def test_a_mesh_dimension_checkpoint_resumes_on_more_ranks(pools: Any, tmp_path: Path) -> None:
    # Saved on 2 ranks, the checkpoint named ranks [0, 1] for "train": on 4 ranks, ranks 2
    # and 3 dropped its state at load ("starts from zero"), and bind failed on every rank with
    # "ranks of the group hold different checkpoint loads". Checkpoints are world-size
    # independent (DESIGN.md invariant 7), in both directions.
    pools.get(2).run(_mesh_checkpoint_on_two_ranks, str(tmp_path))
    outcomes = pools.get(4).run(_mesh_resume_on_four_ranks, str(tmp_path), timeout=120)
    assert outcomes == [(pytest.approx(2.25, rel=1e-12), [])] * 4  # mean(1, 2, 3, 3)


def _subgroup_checkpoint(tmp: str) -> None:
    from sidestream import Run

    group, _ = dist.new_subgroups(2)
    run = Run([])  # no sinks: a subgroup without rank 0 may reduce on its own
    val = run.collector(SumMetric(), prefix="val", group=group).bind("cpu")
    val.metric.update(torch.tensor([10.0 ** (dist.get_rank() // 2)]))  # [0, 1]: 1s, [2, 3]: 10s
    saved = run.state_dict(timeout=30)
    if dist.get_rank() == 0:
        torch.save(saved, Path(tmp) / "checkpoint.pt")
    assert run.close(timeout=30)


def _subgroup_resume_from_rank_0(tmp: str) -> float:
    from sidestream import Run

    group, _ = dist.new_subgroups(2)
    run = Run([])
    run.load_state_dict(torch.load(Path(tmp) / "checkpoint.pt", weights_only=False))
    val = run.collector(SumMetric(), prefix="val", group=group).bind("cpu")
    val.metric.update(torch.tensor([100.0]))
    val.schedule_collection(1)
    value = val.collect_results(timeout=30)
    assert run.close(timeout=30)
    return float(value)


def _subgroup_resume_made_before_load(tmp: str) -> float:
    from sidestream import Run

    group, _ = dist.new_subgroups(2)
    run = Run([])
    val = run.collector(SumMetric(), prefix="val", group=group)  # made, then loaded (DCP's order)
    run.load_state_dict(torch.load(Path(tmp) / "checkpoint.pt", weights_only=False))
    val.bind("cpu")
    val.metric.update(torch.tensor([100.0]))
    val.schedule_collection(1)
    value = val.collect_results(timeout=30)
    assert run.close(timeout=30)
    return float(value)


def test_another_subgroups_state_is_not_taken_by_a_collector_made_before_load(
    pools: Any, tmp_path: Path
) -> None:
    # As below, with the collectors made before run.load_state_dict: ranks 2 and 3 took
    # subgroup [0, 1]'s 2.0 and reported 202.0, as if their subgroup had counted it.
    pools.get(4).run(_subgroup_checkpoint, str(tmp_path))
    values = pools.get(4).run(_subgroup_resume_made_before_load, str(tmp_path), timeout=120)
    assert values == [202.0, 202.0, 200.0, 200.0]


def test_another_subgroups_checkpoint_state_is_not_taken(pools: Any, tmp_path: Path) -> None:
    # Rank 0's file holds subgroup [0, 1]'s state (2.0). Ranks 2 and 3, whose subgroup counted
    # other data, must not continue from it (they start from zero, as their state is not in
    # that file): only a collector whose group holds a saving rank takes a state saved by
    # ranks this one was not among (a job resumed on more ranks).
    pools.get(4).run(_subgroup_checkpoint, str(tmp_path))
    values = pools.get(4).run(_subgroup_resume_from_rank_0, str(tmp_path), timeout=120)
    assert values == [202.0, 202.0, 200.0, 200.0]


def _fresh_run_state_keys(tmp: str) -> tuple[list[str], list[str]]:
    from sidestream import Run

    run = Run([JsonlSink(Path(tmp) / "run.jsonl")])
    everyone = dist.new_group(list(range(dist.get_world_size())))  # a group of its own
    run.collector(MeanMetric(), prefix="train", group=everyone)
    fresh = sorted(run.state_dict(timeout=30))  # what torch.distributed.checkpoint loads into
    run._collectors[0].bind("cpu")
    started = sorted(run.state_dict(timeout=30))
    run.close(timeout=30)
    return fresh, started


def test_a_fresh_runs_state_dict_keeps_the_keys_older_checkpoints_have(
    dist_pool: RankPool, tmp_path: Path
) -> None:
    # dcp.load of a checkpoint saved before "collector_ranks" failed ("Missing key in
    # checkpoint state_dict: run.collector_ranks.train"): the template had the new key.
    for fresh, started in dist_pool.run(_fresh_run_state_keys, str(tmp_path)):
        assert fresh == ["collectors", "sinks", "undelivered"]
        assert started == ["collector_ranks", "collectors", "sinks", "undelivered"]
