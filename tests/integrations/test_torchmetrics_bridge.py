"""sidestream_torchmetrics.wrap against torchmetrics' own (distributed) computation."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchmetrics
from torchmetrics.classification import BinaryAccuracy, MulticlassF1Score

from sidestream.testing import RankPool, count_collectives, on_rank_device
from sidestream_torchmetrics import TorchmetricsMetric, UnsupportedStateError, wrap
from tests._checkpoints import states_only
from tests.conftest import Pools

CLASSES = 5


def _members() -> dict[str, torchmetrics.Metric]:
    return {
        "f1": MulticlassF1Score(CLASSES, average="macro", validate_args=False),
        "accuracy": BinaryAccuracy(validate_args=False),
        "mse": torchmetrics.MeanSquaredError(),
        "mean": torchmetrics.MeanMetric(nan_strategy="disable"),
        "max": torchmetrics.MaxMetric(nan_strategy="disable"),
    }


def _collection() -> torchmetrics.MetricCollection:
    return torchmetrics.MetricCollection(
        {
            "f1": MulticlassF1Score(CLASSES, average="micro", validate_args=False),
            "accuracy": BinaryAccuracy(validate_args=False),
        },
        prefix="val/",
    )


def _shard(seed: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Seeded uneven data; the last of several ranks has none."""
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    size = 0 if world > 1 and rank == world - 1 else 20 + 13 * rank + seed % 7
    return {
        "scores": torch.randn(size, CLASSES, generator=generator),
        "labels": torch.randint(0, CLASSES, (size,), generator=generator),
        "probs": torch.rand(size, generator=generator),
        "binary": torch.randint(0, 2, (size,), generator=generator),
        "values": torch.randn(size, generator=generator) * 3,
    }


def _feed(name: str, metric: Any, shard: dict[str, torch.Tensor]) -> None:
    if not len(shard["labels"]):
        return  # an empty rank never calls update
    if name == "f1":
        metric.update(shard["scores"], shard["labels"])
    elif name == "accuracy":
        metric.update(shard["probs"], shard["binary"])
    elif name == "mse":
        metric.update(shard["values"], shard["probs"])
    else:
        metric.update(shard["values"])


def _feed_collection(metric: Any, shard: dict[str, torch.Tensor]) -> None:
    if len(shard["labels"]):
        # Both members take (preds, target): binary scores of the argmax class vs its label.
        metric.update(shard["scores"].softmax(-1)[:, 0], (shard["labels"] == 0).long())


@on_rank_device
def _compare(seed: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = _shard(seed, rank, world)
    out: dict[str, Any] = {}
    plain, wrapped = _members(), {name: wrap(m) for name, m in _members().items()}
    for name in plain:
        _feed(name, plain[name], shard)
        _feed(name, wrapped[name], shard)
        wrapped[name].sync()  # the first sync of a structure also checks it across ranks
        with count_collectives() as calls:
            wrapped[name].sync()
        out[name] = (plain[name].compute().item(), wrapped[name].compute().item(), calls)
    collection, wrapped_collection = _collection(), wrap(_collection())
    _feed_collection(collection, shard)
    _feed_collection(wrapped_collection, shard)
    wrapped_collection.sync()
    with count_collectives() as calls:
        wrapped_collection.sync()
    expected = {key: value.item() for key, value in collection.compute().items()}
    actual = {key: value.item() for key, value in wrapped_collection.compute().items()}
    out["collection"] = (expected, actual, calls)
    return out


def test_wrapped_metrics_match_torchmetrics_distributed(dist_pool: RankPool) -> None:
    for per_rank in dist_pool.run(_compare, 3):
        for name, (expected, actual, calls) in per_rank.items():
            assert len(calls) == 1, (name, calls)  # one sync, one collective
            assert actual == pytest.approx(expected, rel=1e-6), name


def test_single_process_matches_torchmetrics() -> None:
    shard = _shard(5, 0, 1)
    plain, wrapped = _members(), {name: wrap(m) for name, m in _members().items()}
    for name in plain:
        _feed(name, plain[name], shard)
        _feed(name, wrapped[name], shard)
        assert wrapped[name].compute().item() == pytest.approx(plain[name].compute().item())
        wrapped[name].reset()
        _feed(name, wrapped[name], _shard(6, 0, 1))
        again = _members()[name]
        _feed(name, again, _shard(6, 0, 1))
        assert wrapped[name].compute().item() == pytest.approx(again.compute().item()), name


def _state(metric: Any) -> dict[str, Any]:
    return {key: value.tolist() for key, value in states_only(metric.state_dict()).items()}


def _all_members() -> Any:
    return wrap(torchmetrics.MetricCollection(_members()))


def _feed_all(metric: Any, shard: dict[str, torch.Tensor]) -> None:
    for name, child in metric.items():
        _feed(name, child, shard)


@on_rank_device
def _save(path: str, seed: int) -> dict[str, Any]:
    metric = _all_members()
    _feed_all(metric, _shard(seed, dist.get_rank(), dist.get_world_size()))
    dcp.save({"metric": metric}, checkpoint_id=path)
    return _state(metric)


@on_rank_device
def _resume(load: str, save: str, seed: int) -> None:
    metric = _all_members()
    dcp.load({"metric": metric}, checkpoint_id=load)
    _feed_all(metric, _shard(seed, dist.get_rank(), dist.get_world_size()))
    dcp.save({"metric": metric}, checkpoint_id=save)


def test_checkpoints_reshard_four_two_one(pools: Pools, tmp_path: Path) -> None:
    first, second = str(tmp_path / "four"), str(tmp_path / "two")
    saved = pools.get(4).run(_save, first, 11)
    assert all(state == saved[0] for state in saved)
    pools.get(2).run(_resume, first, second, 12)
    resumed = _all_members()
    dcp.load({"metric": resumed}, checkpoint_id=second)
    _feed_all(resumed, _shard(13, 0, 1))
    shards = [_shard(11, r, 4) for r in range(4)] + [_shard(12, r, 2) for r in range(2)]
    everything = {k: torch.cat([s[k] for s in [*shards, _shard(13, 0, 1)]]) for k in shards[0]}
    reference = _members()
    for name, metric in reference.items():
        _feed(name, metric, everything)
    values = resumed.compute()
    for name, metric in reference.items():
        assert values[name].item() == pytest.approx(metric.compute().item(), rel=1e-5), name


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        (
            torchmetrics.classification.BinaryAUROC(),
            r"BinaryAUROC: state 'preds' concatenates samples .*"
            r"use sidestream\.metrics\.classification\.BinaryAUROCMetric .*"
            r"BinaryAUROCMetric\(exact=True\) for the exact value",
        ),
        (torchmetrics.CatMetric(), r"CatMetric: state 'value' concatenates samples"),
        (
            torchmetrics.PearsonCorrCoef(),
            r"PearsonCorrCoef: state 'mean_x' has dist_reduce_fx=None.*PearsonCorrelationMetric",
        ),
    ],
)
def test_unsupported_states_are_refused_by_name(metric: Any, message: str) -> None:
    with pytest.raises(UnsupportedStateError, match=message):
        wrap(metric)
    with pytest.raises(UnsupportedStateError, match=message):
        wrap(torchmetrics.MetricCollection({"ok": BinaryAccuracy(), "bad": metric.clone()}))
    with pytest.raises(TypeError, match="torchmetrics"):
        wrap(np.zeros(3))  # type: ignore[arg-type]


def test_states_sized_by_the_first_batch_are_refused_saying_why() -> None:
    # R2Score of (N, 2) inputs: torchmetrics sizes its scalar sums from the first batch. The
    # refusal spoke of 'cat' states and named no replacement.
    preds, target = torch.randn(8, 2), torch.randn(8, 2)
    metric = wrap(torchmetrics.R2Score(multioutput="raw_values"))
    with pytest.raises(
        UnsupportedStateError,
        match=r"from shape \(\) to \(2,\).*sized it from the first batch.*"
        r"R2ScoreMetric .*num_outputs=D",
    ):
        metric.update(preds, target)
    metric.update(preds[:, 0], target[:, 0])  # nothing was stored: one output still works
    expected = torchmetrics.R2Score()(preds[:, 0], target[:, 0])
    assert float(metric.compute()) == pytest.approx(float(expected), rel=1e-5)


def test_a_sum_state_with_a_default_other_than_zero_is_refused_by_name() -> None:
    # Each rank would add the default into the sum again; the core's message named neither
    # the metric nor the state.
    class Offset(torchmetrics.Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("total", torch.tensor(1.0), dist_reduce_fx="sum")

        def update(self, values: torch.Tensor) -> None:
            self.total += values.sum()

        def compute(self) -> torch.Tensor:
            return self.total

    with pytest.raises(UnsupportedStateError, match=r"Offset: state 'total' is summed .* not 0"):
        wrap(Offset())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torchmetrics.wrappers.Running(torchmetrics.SumMetric(), window=3),
        lambda: torchmetrics.wrappers.MultioutputWrapper(torchmetrics.MeanSquaredError(), 2),
        lambda: torchmetrics.wrappers.MinMaxMetric(BinaryAccuracy()),
        lambda: torchmetrics.wrappers.ClasswiseWrapper(
            torchmetrics.classification.MulticlassAccuracy(3, average=None)
        ),
        lambda: BinaryAccuracy() + torchmetrics.classification.BinaryRecall(),
    ],
)
def test_a_metric_whose_state_is_in_inner_metrics_is_refused(make: Any) -> None:
    # Its inner metrics synced through torchmetrics in compute (Running counted every rank
    # W times), its checkpoint was empty and the collector reported NaN: refuse instead.
    with pytest.raises(UnsupportedStateError, match="keeps its state in the torchmetrics"):
        wrap(make())


def test_torchmetrics_own_process_group_is_refused() -> None:
    # Ignored, it summed over every rank instead of the group's.
    metric = torchmetrics.SumMetric(process_group=object())
    with pytest.raises(ValueError, match=r"SumMetric\(process_group=\.\.\.\).*collector's group"):
        wrap(metric)


def test_collection_keys_with_slashes_and_dict_results() -> None:
    def collection() -> torchmetrics.MetricCollection:
        return torchmetrics.MetricCollection(
            {"val/acc": BinaryAccuracy(), "val/mean": torchmetrics.MeanMetric()}, prefix="x_"
        )

    preds, target = torch.tensor([0.9, 0.1, 0.8]), torch.tensor([1, 0, 0])
    plain, wrapped = collection(), wrap(collection())
    plain.update(preds=preds, target=target, value=preds)
    wrapped.update(preds=preds, target=target, value=preds)
    expected, got = plain.compute(), wrapped.compute()
    assert sorted(got) == sorted(expected) == ["x_val/acc", "x_val/mean"]
    for name, value in expected.items():
        assert got[name].item() == pytest.approx(value.item())
    assert wrapped["val/acc"] is wrapped["val_acc"]
    with pytest.raises(ValueError, match="collide"):
        wrap(torchmetrics.MetricCollection({"a/b": BinaryAccuracy(), "a_b": BinaryAccuracy()}))


def test_an_updated_metric_is_refused_not_emptied() -> None:
    """Wrapping drops torchmetrics' state: an updated metric raises instead of reading 0."""
    used = torchmetrics.SumMetric()
    used.update(torch.tensor(5.0))
    with pytest.raises(ValueError, match=r"metric: SumMetric was already updated.*reset\(\)"):
        wrap(used)
    member = BinaryAccuracy()
    member.update(torch.tensor([0.9]), torch.tensor([1]))
    with pytest.raises(ValueError, match="BinaryAccuracy was already updated"):
        wrap(torchmetrics.MetricCollection({"fresh": torchmetrics.MeanMetric(), "used": member}))
    used.reset()
    wrapped = wrap(used)  # reset first: accepted, and counts from zero
    wrapped.update(torch.tensor(2.0))
    assert wrapped.compute().item() == 2.0


def test_collection_update_gives_each_member_its_own_keywords() -> None:
    """As ``MetricCollection.update``: ``value=`` reaches the mean, not the classifier."""

    def collection() -> torchmetrics.MetricCollection:
        return torchmetrics.MetricCollection(
            {"acc": BinaryAccuracy(), "mean": torchmetrics.MeanMetric()}
        )

    preds, target = torch.tensor([0.9, 0.1, 0.8]), torch.tensor([1, 0, 0])
    plain, wrapped = collection(), wrap(collection())
    plain.update(preds=preds, target=target, value=preds)
    wrapped.update(preds=preds, target=target, value=preds)
    expected = plain.compute()
    got = wrapped.compute()
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].item() == pytest.approx(value.item())


def test_binned_curves_wrap() -> None:
    """torchmetrics' binned AUROC keeps sum states: it goes through the bridge."""
    generator = torch.Generator().manual_seed(0)
    scores, target = torch.rand(300, generator=generator), torch.randint(0, 2, (300,))
    plain = torchmetrics.classification.BinaryAUROC(thresholds=50)
    wrapped = wrap(torchmetrics.classification.BinaryAUROC(thresholds=50))
    plain.update(scores, target)
    wrapped.update(scores, target)
    assert wrapped.compute().item() == pytest.approx(plain.compute().item())


def test_async_collector_reports_each_window_as_torchmetrics() -> None:
    """A wrapped collection in the collector: one report per window, each window from zero."""
    from sidestream.collector import AsyncMetricCollector

    metric = wrap(torchmetrics.MetricCollection(_members()))
    collector = AsyncMetricCollector(metric).bind(torch.device("cpu"))
    expected = []
    for step in range(3):
        shard = _shard(20 + step, 0, 1)
        reference = _members()
        for name, child in metric.items():
            _feed(name, child, shard)
            _feed(name, reference[name], shard)
        expected.append({name: m.compute().item() for name, m in reference.items()})
        collector.schedule_collection(step)
        reported = collector.collect_results()
        assert reported == pytest.approx(expected[-1], rel=1e-6), step
    assert collector.close()


def test_collection_dict_results_with_the_same_keys_are_named_as_torchmetrics_names_them() -> None:
    """Two members returning dicts with the same keys: torchmetrics puts each member's name in
    front of every dict entry; the bridge kept one value per key (the other one lost)."""
    from torchmetrics.classification import BinaryFairness

    def collections() -> list[torchmetrics.MetricCollection]:
        return [
            torchmetrics.MetricCollection(
                {"fair": BinaryFairness(2), "fair_low": BinaryFairness(2, threshold=0.2)}
            ),
            torchmetrics.MetricCollection(
                {
                    "inner": torchmetrics.MetricCollection(
                        {"fair": BinaryFairness(2)}, prefix="in_", postfix="_x"
                    ),
                    "acc": BinaryAccuracy(),
                },
                prefix="val_",
            ),
        ]

    generator = torch.Generator().manual_seed(4)
    preds = torch.rand(40, generator=generator)
    target = torch.randint(0, 2, (40,), generator=generator)
    groups = torch.randint(0, 2, (40,), generator=generator)
    for plain, source in zip(collections(), collections(), strict=True):
        wrapped = wrap(source)
        plain.update(preds=preds, target=target, groups=groups)
        wrapped.update(preds=preds, target=target, groups=groups)
        expected, got = plain.compute(), wrapped.compute()
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            assert got[name].item() == pytest.approx(value.item()), name


def test_set_dtype_after_wrap_is_refused_and_before_wrap_carried() -> None:
    """After wrap() the states are sidestream's: a later set_dtype was silently undone (float32
    results for float64 input)."""
    values = torch.tensor([1e8 + 1, 1e8 + 3], dtype=torch.float64)
    late = wrap(torchmetrics.MeanMetric())
    assert isinstance(late, TorchmetricsMetric)
    late.torchmetrics.set_dtype(torch.float64)
    with pytest.raises(RuntimeError, match=r"dtype changed from torch.float32 to torch.float64"):
        late.update(values)
    early = torchmetrics.MeanMetric()
    early.set_dtype(torch.float64)
    wrapped = wrap(early)
    wrapped.update(values)
    assert wrapped.compute().item() == 1e8 + 2
    # After an update the message blamed an update, call or reset outside the wrapper.
    used = wrap(torchmetrics.MeanMetric())
    used.update(torch.tensor([1.0]))
    used.torchmetrics.set_dtype(torch.float64)
    with pytest.raises(RuntimeError, match=r"dtype changed from torch.float32 to torch.float64"):
        used.update(values)


def test_a_batch_one_member_of_a_collection_refuses_is_kept_by_none() -> None:
    # The members before the one that refused kept the batch: MSE counted a batch R2Score
    # refused (21.7 where the accepted batch gives 2.18).
    from sklearn.metrics import mean_squared_error

    collection = wrap(
        torchmetrics.MetricCollection(
            {"mse": torchmetrics.MeanSquaredError(), "r2": torchmetrics.R2Score()}
        )
    )
    refused = torch.tensor([10.0, -10.0, 7.0], dtype=torch.float64)
    with pytest.raises(TypeError, match="set_dtype"):  # R2Score's own float64 refusal
        collection.update(refused, torch.zeros(3, dtype=torch.float64))
    preds, target = torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.5, 2.0, 3.0])
    collection.update(preds, target)
    assert collection.compute()["mse"].item() == pytest.approx(
        mean_squared_error(target.numpy(), preds.numpy())
    )


def test_state_names_are_torchmetrics_names_whatever_they_are() -> None:
    """States were attributes named "_<state>": "sync_group" or "state_arena" replaced the
    metric's own internals (AttributeError later), and "_hidden" was saved as "hidden"."""
    names = ["sync_group", "state_arena", "declarations", "torchmetrics", "_hidden"]

    class Custom(torchmetrics.Metric):
        def __init__(self) -> None:
            super().__init__()
            for name in names:
                self.add_state(name, torch.tensor(0.0), dist_reduce_fx="sum")

        def update(self, x: torch.Tensor) -> None:
            for index, name in enumerate(names):
                setattr(self, name, getattr(self, name) + (index + 1) * x.sum())

        def compute(self) -> torch.Tensor:
            return torch.stack([getattr(self, name) for name in names])

    wrapped = wrap(Custom())
    wrapped.update(torch.tensor([1.0, 2.0]))
    wrapped.sync()
    assert wrapped.compute().tolist() == [3.0, 6.0, 9.0, 12.0, 15.0]
    saved = wrapped.state_dict()
    assert sorted(saved) == sorted([*names, "configuration", "sidestream/dtypes"])  # + records
    again = wrap(Custom())
    again.load_state_dict(saved)
    assert again.compute().tolist() == [3.0, 6.0, 9.0, 12.0, 15.0]


class _Growing(torchmetrics.Metric):
    """A summed buffer that grows by concatenation: no fixed-size state."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.add_state("buf", torch.zeros(start), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor) -> None:
        self.buf = torch.cat([self.buf, x])

    def compute(self) -> torch.Tensor:
        return self.buf.sum()


def test_a_state_that_changes_shape_in_update_is_named() -> None:
    wrapped = wrap(_Growing(start=1))
    with pytest.raises(UnsupportedStateError, match=r"_Growing.update changed state 'buf' from"):
        wrapped.update(torch.tensor([1.0]))


def test_a_state_that_starts_empty_is_refused_when_wrapped() -> None:
    empty = r"_Growing: state 'buf' starts empty \(shape \(0,\)\)"
    with pytest.raises(UnsupportedStateError, match=empty):
        wrap(_Growing(start=0))


@pytest.mark.parametrize("name", ["a.b", "a/b"])
def test_a_state_name_sidestream_cannot_key_is_refused_naming_it(name: str) -> None:
    class Dotted(torchmetrics.Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state(name, torch.tensor(0.0), dist_reduce_fx="sum")

        def update(self, x: torch.Tensor) -> None:
            pass

        def compute(self) -> torch.Tensor:
            return torch.tensor(0.0)

    with pytest.raises(UnsupportedStateError, match=rf"Dotted: state '{name}': a name with"):
        wrap(Dotted())


def test_float64_inputs_that_widen_a_state_are_refused_not_rounded() -> None:
    """R2Score rebinds its sums: float64 inputs made them float64, which the float32 states
    rounded (R² 0.0 where scikit-learn gives 0.91). Refused, naming set_dtype; with it, exact."""
    from sklearn.metrics import r2_score

    rng = np.random.default_rng(4)
    target = torch.from_numpy(1e4 + rng.normal(size=1000))
    preds = target + 0.3 * torch.from_numpy(rng.normal(size=1000))
    wrapped = wrap(torchmetrics.R2Score())
    with pytest.raises(TypeError, match=r"turned state .* into torch.float64 .*set_dtype"):
        wrapped.update(preds, target)
    assert all(
        float(value.abs().sum()) == 0
        for key, value in states_only(wrapped.state_dict()).items()
        if key != "configuration"
    )  # nothing stored
    double = wrap(torchmetrics.R2Score().set_dtype(torch.float64))
    for start in range(0, 1000, 100):
        double.update(preds[start : start + 100], target[start : start + 100])
    assert double.compute().item() == pytest.approx(r2_score(target, preds), rel=1e-6)


def test_a_refused_update_leaves_no_part_of_its_batch() -> None:
    """KLDivergence adds to ``total`` in place, then widens ``measures``: the refusal came
    after ``total`` already held the batch, so every later value was half the right one."""
    from torchmetrics.regression import KLDivergence

    p64 = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)
    q64 = torch.tensor([[0.3, 0.3, 0.4]], dtype=torch.float64)
    wrapped = wrap(KLDivergence())
    with pytest.raises(TypeError, match="set_dtype"):
        wrapped.update(p64, q64)
    saved = wrapped.state_dict()
    assert float(saved["total"]) == 0 and float(saved["measures"]) == 0, saved
    wrapped.update(p64.float(), q64.float())
    # Independent reference: KL(p || q) of the accepted batch alone.
    expected = float((p64 * (p64 / q64).log()).sum())
    assert float(wrapped.compute()) == pytest.approx(expected, rel=1e-6)


def test_a_direct_update_of_the_torchmetrics_object_fails_the_window_and_checkpoints() -> None:
    """Under a collector the wrapper's own update and compute never ran, so a torchmetrics
    habit (updating the torchmetrics object) logged the default state without an error."""
    from sidestream.collector import AsyncMetricCollector

    inner = MulticlassF1Score(2, average="micro")
    collector = AsyncMetricCollector(wrap(inner))
    with collector.bind("cpu"):
        inner.update(torch.tensor([0, 1]), torch.tensor([0, 1]))
        with pytest.raises(RuntimeError, match=r"^schedule_collection: .*updated, called or reset"):
            collector.schedule_collection(1)
        with pytest.raises(RuntimeError, match=r"^state_dict: .*updated, called or reset"):
            collector.state_dict()
        collector.metric.reset()  # starts both over
        collector.metric.update(torch.tensor([0, 1]), torch.tensor([0, 0]))
        collector.schedule_collection(1)  # the refused call counted nothing: step 1 again
        assert float(collector.collect_results(timeout=30)) == 0.5


@pytest.mark.parametrize("misuse", ["setting", "forward"])
def test_a_collection_checks_its_members_before_a_checkpoint(misuse: str) -> None:
    collection = wrap(torchmetrics.MetricCollection({"acc": BinaryAccuracy()}))
    collection.update(torch.tensor([0.7]), torch.tensor([1]))
    member = collection["acc"]
    assert isinstance(member, TorchmetricsMetric)
    if misuse == "setting":
        member.torchmetrics.threshold = 0.9
        expected: type[Exception] = ValueError
    else:
        member.torchmetrics(torch.tensor([0.2]), torch.tensor([1]))
        expected = RuntimeError
    with pytest.raises(expected, match=r"^state_dict: the wrapped BinaryAccuracy"):
        collection.state_dict()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torchmetrics.classification.BinaryEER(),
        lambda: torchmetrics.classification.BinaryPrecisionAtFixedRecall(0.5),
        lambda: torchmetrics.classification.MulticlassRecallAtFixedPrecision(3, 0.5),
        lambda: torchmetrics.classification.BinaryROC(),
    ],
)
def test_an_exact_curve_is_refused_with_the_thresholds_that_make_it_wrap(make: Any) -> None:
    exact = make()
    with pytest.raises(UnsupportedStateError) as refused:
        wrap(exact)
    hint = str(refused.value).split("; ", 1)[1]
    assert hint.startswith(f"pass thresholds=<int or list> to {type(exact).__name__}"), hint
    wrap(type(exact)(*_curve_arguments(exact), thresholds=11))  # as the hint says


def _curve_arguments(metric: Any) -> tuple[Any, ...]:
    name = type(metric).__name__
    if name == "BinaryPrecisionAtFixedRecall":
        return (0.5,)
    if name == "MulticlassRecallAtFixedPrecision":
        return (3, 0.5)
    return ()


def test_a_collection_member_that_cannot_be_wrapped_is_named_by_its_key() -> None:
    collection = torchmetrics.MetricCollection(
        {"val/acc": BinaryAccuracy(), "val/cat": torchmetrics.CatMetric()}
    )
    with pytest.raises(UnsupportedStateError, match=r"^collection\['val/cat'\]: CatMetric"):
        wrap(collection)


def test_an_empty_collection_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^collection: expected at least one metric"):
        wrap(torchmetrics.MetricCollection([]))


def _thresholds_differ() -> str:
    metric = wrap(BinaryAccuracy(threshold=0.5 if dist.get_rank() == 0 else 0.9))
    metric.update(torch.tensor([0.7, 0.2]), torch.tensor([1, 0]))
    try:
        metric.sync()
    except Exception as error:  # the test reads the type and the text
        return f"{type(error).__name__}: {error}"
    return f"no error: {metric.compute().item()}"


def test_ranks_of_other_settings_are_refused(dist_pool: RankPool) -> None:
    """Rank 0 at threshold 0.5 and rank 1 at 0.9 reported 0.5556, a value of neither."""
    for outcome in dist_pool.run(_thresholds_differ):
        assert outcome.startswith("RankMismatchError") and "threshold=0.9" in outcome, outcome


def test_a_checkpoint_of_other_settings_is_refused() -> None:
    saved_from = wrap(BinaryAccuracy(threshold=0.5))
    saved_from.update(torch.tensor([0.7, 0.2, 0.6]), torch.tensor([1, 0, 0]))
    saved = saved_from.state_dict()
    for other in (BinaryAccuracy(threshold=0.9), torchmetrics.classification.BinaryF1Score()):
        with pytest.raises(ValueError, match=r"state_dict\['configuration'\]: saved by a metric"):
            wrap(other).load_state_dict(saved)
    same = wrap(BinaryAccuracy(threshold=0.5))
    same.load_state_dict(saved)
    assert same.compute().item() == pytest.approx(saved_from.compute().item())


def test_settings_kept_in_a_tokenizer_are_part_of_the_configuration() -> None:
    """SacreBLEU's lowercase/tokenize and TER's options live in a tokenizer object: a
    checkpoint of lowercase=False loaded silently into lowercase=True."""
    from torchmetrics.text import SacreBLEUScore, TranslationEditRate

    pairs = [
        (lambda **o: SacreBLEUScore(**o), {"lowercase": False}, {"lowercase": True}),
        (lambda **o: SacreBLEUScore(**o), {"tokenize": "13a"}, {"tokenize": "char"}),
        (lambda **o: TranslationEditRate(**o), {"lowercase": True}, {"lowercase": False}),
        (lambda **o: TranslationEditRate(**o), {}, {"asian_support": True}),
    ]
    for make, saved_with, loaded_with in pairs:
        saved_from = wrap(make(**saved_with))
        saved_from.update(["The Cat sat"], [["the cat sat"]])
        saved = saved_from.state_dict()
        with pytest.raises(ValueError, match=r"state_dict\['configuration'\]: saved by a metric"):
            wrap(make(**loaded_with)).load_state_dict(saved)
        same = wrap(make(**saved_with))
        same.load_state_dict(saved)
        assert same.compute().item() == pytest.approx(saved_from.compute().item())


def test_a_setting_changed_after_wrap_is_refused_before_the_state_changes() -> None:
    # The sync's fingerprint and the checkpoint's configuration describe the settings of wrap():
    # a threshold changed afterwards mixed two problems without a word.
    metric = wrap(BinaryAccuracy(threshold=0.5))
    metric.update(torch.tensor([0.9, 0.2]), torch.tensor([1, 0]))
    metric.torchmetrics.threshold = 0.95
    for call in (
        lambda: metric.update(torch.tensor([0.9]), torch.tensor([1])),
        metric.compute,
        metric.state_dict,
    ):
        with pytest.raises(ValueError, match=r"'threshold' changed from 0\.5 to 0\.95 after wrap"):
            call()
    metric.torchmetrics.threshold = 0.5  # put back: the state is as before the refusals
    assert float(metric.compute()) == 1.0
    assert metric.state_dict()["tp"].item() == 1


def test_a_counter_update_keeps_outside_its_states_is_refused() -> None:
    class Counting(torchmetrics.Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
            self.n_seen = 0  # not a state: never synced, never saved

        def update(self, values: torch.Tensor) -> None:
            self.total += values.sum()
            self.n_seen += values.numel()

        def compute(self) -> torch.Tensor:
            return self.total / self.n_seen

    metric = wrap(Counting())
    with pytest.raises(UnsupportedStateError, match=r"'n_seen' changed from 0 to 3.*add_state"):
        metric.update(torch.ones(3))


@pytest.mark.parametrize("direct", ["update", "forward", "reset"])
def test_torchmetrics_own_calls_on_the_wrapped_metric_are_refused(direct: str) -> None:
    # forward() and reset() rebind the states: the wrapper's next call dropped what they did.
    metric = wrap(torchmetrics.SumMetric())
    metric.update(torch.tensor([1.0]))
    inner = metric.torchmetrics
    {
        "update": lambda: inner.update(torch.tensor([10.0])),
        "forward": lambda: inner(torch.tensor([10.0])),
        "reset": inner.reset,
    }[direct]()
    for call in (lambda: metric.update(torch.tensor([100.0])), metric.compute):
        with pytest.raises(RuntimeError, match="updated, called or reset directly"):
            call()
    metric.reset()  # the wrapper's reset starts both over
    metric.update(torch.tensor([100.0]))
    assert float(metric.compute()) == 100.0


def test_an_update_torchmetrics_refused_leaves_the_wrapper_usable() -> None:
    # torchmetrics counts an update before running it: one that raised must not look like a
    # call behind the wrapper's back.
    metric = wrap(BinaryAccuracy())
    metric.update(torch.tensor([0.9]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="target"):
        metric.update(torch.tensor([0.9]), torch.tensor([2]))  # not 0/1
    metric.update(torch.tensor([0.1]), torch.tensor([0]))
    assert float(metric.compute()) == 1.0


def test_a_nan_setting_survives_pickling() -> None:
    import pickle

    metric = pickle.loads(pickle.dumps(wrap(torchmetrics.MeanMetric(nan_strategy=float("nan")))))
    metric.update(torch.tensor([1.0, 3.0]))
    assert float(metric.compute()) == 2.0


def test_a_refused_collection_leaves_its_members_syncing_on_their_own() -> None:
    # The members wrapped before the refused one lost torchmetrics' own sync: the collection,
    # used as it is after the refusal (as the message says), reported each rank's own accuracy.
    collection = torchmetrics.MetricCollection(
        {"acc": BinaryAccuracy(), "auroc": torchmetrics.classification.BinaryAUROC()}
    )
    with pytest.raises(UnsupportedStateError, match=r"collection\['auroc'\]"):
        wrap(collection)
    for member in collection.values():
        assert member.sync_on_compute and member._to_sync


class _CountsBatches(torchmetrics.Metric):
    """Keeps a batch counter outside its states, made on the first update."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.batches = getattr(self, "batches", 0) + 1
        self.total += values.sum()

    def compute(self) -> torch.Tensor:
        return self.total / self.batches


class _MaybeCounts(_CountsBatches):
    """Adds its attribute as None first (as TranslationEditRate's sentence_ter), then counts."""

    def update(self, values: torch.Tensor) -> None:
        previous = getattr(self, "batches", "absent")
        self.batches = None if previous == "absent" else (previous or 0) + 1
        self.total += values.sum()


def test_a_counter_an_update_adds_is_refused_before_the_state_changes() -> None:
    # Accepted before: each rank divided its own total by its own count (2.5 and 5.0 where
    # all ranks' data give 1.67), and no checkpoint carried it.
    metric = wrap(_CountsBatches())
    with pytest.raises(UnsupportedStateError, match="'batches' was added \\(1\\)"):
        metric.update(torch.tensor([1.0, 2.0]))
    assert metric._bridged[0][1].local.item() == 0.0  # none of the refused batch
    with pytest.raises(ValueError, match="'batches' was added"):  # and it stays refused
        metric.state_dict()
    maybe = wrap(_MaybeCounts())
    maybe.update(torch.tensor([1.0]))  # None carries nothing: taken as a setting
    assert maybe.state_dict()["total"].item() == 1.0
    with pytest.raises(UnsupportedStateError, match="'batches' changed from None to 1"):
        maybe.update(torch.tensor([2.0]))
    assert maybe._bridged[0][1].local.item() == 1.0


class _KeepsCountIn(torchmetrics.Metric):
    """Counts values outside its states, in an attribute made in ``__init__`` (``kind``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        self.kind = kind
        if kind == "dict":
            self.seen = {"n": 0}
        elif kind == "tensor":
            self.seen = torch.zeros(())
        elif kind == "buffer":
            self.register_buffer("seen", torch.zeros(()))
        else:
            self.seen = [torch.zeros(())]

    def update(self, values: torch.Tensor) -> None:
        self.total += values.sum()
        if self.kind == "dict":
            self.seen["n"] += values.numel()
        elif self.kind == "list":
            self.seen[0] += values.numel()
        else:
            self.seen += values.numel()

    def compute(self) -> torch.Tensor:
        return self.total


@pytest.mark.parametrize("kind", ["dict", "tensor", "buffer", "list"])
def test_a_counter_kept_in_an_attribute_made_before_wrap_is_refused(kind: str) -> None:
    # Only attributes an update added were looked at: a count kept in a dict, tensor, buffer or
    # list made in __init__ passed, and after a sync each rank divided all ranks' total by its
    # own count (32.5 and 10.83 where the data give 8.125).
    metric = wrap(_KeepsCountIn(kind))
    with pytest.raises(UnsupportedStateError, match=r"'seen' (\(a buffer\) )?was changed"):
        metric.update(torch.tensor([1.0, 2.0]))
    assert metric._bridged[0][1].local.item() == 0.0  # none of the refused batch


def _replaced_behind_the_wrappers_back() -> tuple[Any, TorchmetricsMetric]:
    """A wrapped SumMetric whose own update then reset ran directly (its count put back)."""
    plain = torchmetrics.SumMetric()
    metric = wrap(plain)
    metric.compute()
    plain.update(torch.tensor([5.0]))
    plain.reset()
    assert isinstance(metric, TorchmetricsMetric)
    return plain, metric


def test_states_replaced_behind_the_wrappers_back_are_refused() -> None:
    # torchmetrics' own update then reset put its update count back: the wrapper read 6.0 where
    # its one batch gave 1.0. merge_state rebinds the states without counting an update.
    plain, metric = _replaced_behind_the_wrappers_back()
    with pytest.raises(RuntimeError, match="its states were replaced"):
        metric.update(torch.tensor([1.0]))
    metric.reset()  # the wrapper's reset starts both over
    metric.update(torch.tensor([1.0]))
    assert metric.compute().item() == 1.0
    other = torchmetrics.SumMetric()
    other.update(torch.tensor([10.0]))
    plain.merge_state(other)
    with pytest.raises(RuntimeError, match="its states were replaced"):
        metric.compute()
    moved = wrap(torchmetrics.SumMetric())
    moved.update(torch.tensor([2.0]))
    moved.to("cpu")  # the wrapper's own rebinding (torchmetrics' to()) is not refused
    moved.update(torch.tensor([3.0]))
    assert moved.compute().item() == 5.0


class _NotesItsDtype(torchmetrics.Metric):
    """Notes its input dtype on the first update, as FrechetInceptionDistance's orig_dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.orig_dtype = values.dtype
        self.total += values.sum()

    def compute(self) -> torch.Tensor:
        return self.total.to(self.orig_dtype)


def test_an_attribute_that_carries_no_data_may_appear_in_an_update() -> None:
    # The new-attribute check refused FID, whose update notes its input dtype.
    metric = wrap(_NotesItsDtype())
    metric.update(torch.tensor([1.0, 2.0]))
    metric.update(torch.tensor([3.0]))
    assert metric.compute().item() == 6.0


def test_a_move_does_not_launder_states_replaced_behind_the_wrappers_back() -> None:
    # to() (and a collector's bind, which calls it) took whatever the attributes held as the
    # wrapper's own: the replaced states of a direct update and reset came back as 6.0.
    _, metric = _replaced_behind_the_wrappers_back()
    metric.to("cpu")
    with pytest.raises(RuntimeError, match="its states were replaced"):
        metric.update(torch.tensor([1.0]))


class _ComplexState(torchmetrics.Metric):
    def __init__(self) -> None:
        super().__init__()
        self.add_state("z", torch.zeros((), dtype=torch.complex64), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.z += values.sum()

    def compute(self) -> torch.Tensor:
        return self.z


def test_a_metric_refused_after_its_sync_was_switched_off_gets_it_back() -> None:
    # The options were switched off before add_state refused a complex state: used as it is
    # after the refusal, the metric reported each rank's own value.
    alone = _ComplexState()
    with pytest.raises(TypeError, match="complex states are not supported"):
        wrap(alone)
    collection = torchmetrics.MetricCollection({"acc": BinaryAccuracy(), "z": _ComplexState()})
    with pytest.raises(TypeError, match=r"collection\['z'\]"):
        wrap(collection)
    for metric in (alone, *collection.values()):
        assert metric.sync_on_compute and metric._to_sync


def test_importing_the_bridge_without_torchmetrics_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It raised a bare "No module named 'torchmetrics'", naming no install command.
    import importlib
    import sys

    for name in [name for name in sys.modules if name.startswith("sidestream_torchmetrics")]:
        monkeypatch.delitem(sys.modules, name)  # restored afterwards, as the other tests use them
    monkeypatch.setitem(sys.modules, "torchmetrics", None)  # "import torchmetrics" fails
    message = r"needs torchmetrics .*pip install \"sidestream\[torchmetrics\]\""
    with pytest.raises(ModuleNotFoundError, match=message) as raised:
        importlib.import_module("sidestream_torchmetrics")
    assert raised.value.name == "torchmetrics"  # pytest.importorskip and the like still skip


_COMPUTING = threading.Event()  # module-level: the collector's slot is a deep copy of the metric
_FINISH = threading.Event()


class _GatedSum(torchmetrics.Metric):
    """A sum whose compute, off the main thread, waits until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.total += values.sum()

    def compute(self) -> torch.Tensor:
        if threading.current_thread() is not threading.main_thread():
            _COMPUTING.set()
            _FINISH.wait(30)
        return self.total


class _FilterProbeWarning(UserWarning):
    pass


def test_a_compute_on_the_dispatcher_thread_leaves_the_warning_filters_alone() -> None:
    # compute silenced torchmetrics' "called before update" warning with
    # warnings.catch_warnings(), which swaps the process-wide filter list: a collector computes
    # on its dispatcher thread, so a filter the training thread added meanwhile was lost.
    from sidestream.collector import AsyncMetricCollector

    _COMPUTING.clear()
    _FINISH.clear()
    metric = wrap(_GatedSum())
    collector = AsyncMetricCollector(metric).bind(torch.device("cpu"))
    with warnings.catch_warnings():  # this test's own filter ends with it
        try:
            metric.update(torch.tensor([1.0, 2.0]))
            collector.schedule_collection(1)
            assert _COMPUTING.wait(30)
            warnings.simplefilter("error", _FilterProbeWarning)
        finally:
            _FINISH.set()
        assert collector.collect_results() == pytest.approx(3.0)
        collector.close()
        with pytest.raises(_FilterProbeWarning):
            warnings.warn("kept", _FilterProbeWarning, stacklevel=1)


def test_compute_after_a_reset_does_not_warn_and_keeps_torchmetrics_update_count() -> None:
    metric = wrap(torchmetrics.MeanMetric())
    metric.update(torch.tensor([1.0, 3.0]))
    metric.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torchmetrics' "called before update" would raise
        metric.compute()
    assert metric.torchmetrics._update_count == 0
    metric.update(torch.tensor([2.0]))  # the wrapper's bookkeeping still agrees
    assert metric.compute() == pytest.approx(2.0)


class _CachingSum(torchmetrics.Metric):
    """A sum whose compute caches its result in an attribute it adds (self.last)."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        self.total += values.sum()

    def compute(self) -> torch.Tensor:
        self.last = self.total.clone()
        return self.total


def test_an_attribute_compute_adds_is_not_taken_for_data_kept_outside_the_states() -> None:
    # The next call took compute's cache for a setting added after wrap() and raised; in a
    # collector only once a staging copy was reused (the fourth window), on the dispatcher
    # thread: a refusal far from its cause, of a metric that keeps nothing outside its states.
    from sidestream.collector import AsyncMetricCollector

    metric = wrap(_CachingSum())
    metric.update(torch.tensor([1.0]))
    assert metric.compute() == pytest.approx(1.0)
    metric.update(torch.tensor([2.0]))
    assert metric.compute() == pytest.approx(3.0)
    assert not hasattr(metric.torchmetrics, "last")

    metric = wrap(_CachingSum())
    collector = AsyncMetricCollector(metric).bind(torch.device("cpu"))
    try:
        for step in range(6):
            metric.update(torch.tensor([float(step)]))
            collector.schedule_collection(step)
            assert collector.collect_results(timeout=30) == pytest.approx(float(step)), step
    finally:
        assert collector.close()


def test_one_metric_under_two_keys_of_a_collection_is_refused_when_wrapped() -> None:
    # Both members' wrappers pointed their states at the one object: the first update raised
    # that the metric was "updated, called or reset directly", naming neither key.
    shared = BinaryAccuracy(validate_args=False)
    collection = torchmetrics.MetricCollection({"a": shared, "b": shared})
    with pytest.raises(ValueError, match=r"^collection: keys 'a' and 'b' hold the same "):
        wrap(collection)
    assert shared.sync_on_compute  # refused before any member's own sync was switched off


def _empty_batches(world: int, rank: int) -> list[dict[str, torch.Tensor]]:
    """An uneven split: rank 0 has rows and an empty last batch, rank 1 only an empty batch
    (DistributedSampler with drop_last=False), the last of four ranks no batch at all."""
    sizes = {0: [9, 6, 0], 1: [0]}.get(rank, [] if rank == world - 1 else [5, 0])
    generator = torch.Generator().manual_seed(31 + rank)
    return [
        {
            "scores": torch.randn(size, CLASSES, generator=generator),
            "labels": torch.randint(0, CLASSES, (size,), generator=generator),
            "label_scores": torch.rand(size, 3, generator=generator),
            "label_targets": torch.randint(0, 2, (size, 3), generator=generator),
        }
        for size in sizes
    ]


def _with_empty_batches() -> dict[str, Any]:
    from torchmetrics.classification import (
        MultilabelCoverageError,
        MultilabelF1Score,
        MultilabelRankingLoss,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    multiclass = wrap(
        torchmetrics.MetricCollection(
            {
                "f1": MulticlassF1Score(CLASSES, average="macro", validate_args=False),
                "cm": torchmetrics.classification.MulticlassConfusionMatrix(CLASSES),
            }
        )
    )
    multilabel = {
        "label_f1": wrap(MultilabelF1Score(3, average="micro")),
        "ranking": wrap(MultilabelRankingLoss(3)),
        "coverage": wrap(MultilabelCoverageError(3)),
    }
    for batch in _empty_batches(world, rank):
        multiclass.update(batch["scores"], batch["labels"])
        for metric in multilabel.values():
            metric.update(batch["label_scores"], batch["label_targets"])
    multiclass.sync()
    out = {key: value.double().numpy() for key, value in multiclass.compute().items()}
    for name, metric in multilabel.items():
        metric.sync()
        out[name] = float(metric.compute())
    return out


def test_an_empty_batch_on_some_ranks_matches_the_concatenated_data(dist_pool: RankPool) -> None:
    """An empty last batch made torchmetrics' stat scores raise on that rank (the others then
    waited in sync), and its ranking loss counted it as a sample (0.357, not 0.417)."""
    from sklearn.metrics import (
        confusion_matrix,
        coverage_error,
        f1_score,
        label_ranking_loss,
    )

    world = dist_pool.world_size
    batches = [batch for rank in range(world) for batch in _empty_batches(world, rank)]
    data = {key: torch.cat([batch[key] for batch in batches]).numpy() for key in batches[0]}
    predicted = data["scores"].argmax(1)
    for out in dist_pool.run(_with_empty_batches, timeout=60):
        assert out["f1"] == pytest.approx(
            f1_score(data["labels"], predicted, average="macro", labels=range(CLASSES)), rel=1e-5
        )
        np.testing.assert_array_equal(
            out["cm"], confusion_matrix(data["labels"], predicted, labels=range(CLASSES))
        )
        targets, scores = data["label_targets"], data["label_scores"]
        micro = f1_score(targets, scores > 0.5, average="micro")
        assert out["label_f1"] == pytest.approx(micro, rel=1e-5)
        assert out["ranking"] == pytest.approx(label_ranking_loss(targets, scores), rel=1e-5)
        assert out["coverage"] == pytest.approx(coverage_error(targets, scores), rel=1e-5)


@pytest.mark.parametrize("validate_args", [True, False])
def test_an_empty_batch_adds_nothing_to_any_wrappable_family(validate_args: bool) -> None:
    """Stat scores raised on a batch of no rows (torchmetrics' reshape(0, -1)); the ranking
    loss counted it as one sample. Every family: an empty batch leaves the state as it was."""
    from torchmetrics import classification as tc

    scores, labels = torch.randn(6, CLASSES), torch.randint(0, CLASSES, (6,))
    probs, binary = torch.rand(6, 3), torch.randint(0, 2, (6, 3))
    check = {"validate_args": validate_args}
    cases: list[tuple[torchmetrics.Metric, tuple[torch.Tensor, ...]]] = [
        (tc.BinaryF1Score(**check), (probs[:, 0], binary[:, 0])),
        (tc.MulticlassAccuracy(CLASSES, top_k=2, **check), (scores, labels)),
        (tc.MulticlassStatScores(CLASSES, average=None, **check), (scores, labels)),
        (tc.MultilabelF1Score(3, average=None, **check), (probs, binary)),
        (tc.MultilabelRankingLoss(3, **check), (probs, binary)),
        (tc.MultilabelCoverageError(3, **check), (probs, binary)),
        (tc.BinaryAUROC(thresholds=20, **check), (probs[:, 0], binary[:, 0])),
        (torchmetrics.R2Score(), (scores[:, 0], scores[:, 1])),
        (torchmetrics.MaxMetric(), (scores[:, 0],)),
        (torchmetrics.text.Perplexity(), (scores[:, None], labels[:, None])),
    ]
    for metric, batch in cases:
        wrapped = wrap(metric)
        wrapped.update(*batch)
        before = states_only(wrapped.state_dict())
        wrapped.update(*(value[:0] for value in batch))
        after = states_only(wrapped.state_dict())
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), (type(metric).__name__, key)


def test_an_empty_batch_of_wrong_shapes_is_refused_naming_the_argument() -> None:
    """Checked as one row of each shape: refused as a batch with rows is, state untouched."""
    from torchmetrics.classification import MultilabelF1Score

    refusals: list[tuple[Any, tuple[torch.Tensor, ...], type, str]] = [
        (  # preds of 3 classes, not 5
            MulticlassF1Score(CLASSES),
            (torch.randn(0, 3), torch.randint(0, CLASSES, (0,))),
            ValueError,
            r"empty batch \(shapes \(0, 3\), \(0,\)\).*`preds`",
        ),
        (
            MultilabelF1Score(3),
            (torch.rand(0, 2), torch.randint(0, 2, (0, 2))),
            ValueError,
            r"empty batch.*number of labels",
        ),
        (  # float token ids
            torchmetrics.text.Perplexity(),
            (torch.randn(0, 4, 7), torch.rand(0, 4)),
            TypeError,
            r"empty batch.*`target`",
        ),
    ]
    for metric, batch, error, message in refusals:
        wrapped = wrap(metric)
        before = states_only(wrapped.state_dict())
        with pytest.raises(error, match=message):
            wrapped.update(*batch)
        after = states_only(wrapped.state_dict())
        assert all(torch.equal(before[key], after[key]) for key in before), metric
