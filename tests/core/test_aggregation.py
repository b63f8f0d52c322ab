"""Single-process behaviour of the aggregation metrics against direct numpy computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sidestream import (
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    MinMetric,
    SumMetric,
    WeightedMeanMetric,
)
from tests._checkpoints import states_only
from tests.core.cases import CASES, concat, feed, make_shards

SEEDS = range(5)


def _assert_close(actual: float, expected: float) -> None:
    if math.isnan(expected):
        assert math.isnan(actual)
    else:
        assert actual == pytest.approx(expected, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", SEEDS)
def test_matches_direct_computation(name: str, seed: int) -> None:
    shards = make_shards(seed, 3)
    metric = CASES[name].factory()
    for shard in shards:
        feed(name, metric, shard)
    metric.sync()  # torch.distributed not initialized: a no-op
    _assert_close(metric.compute().item(), CASES[name].reference(concat(shards)))


@pytest.mark.parametrize("name", list(CASES))
def test_reset_then_reuse_gives_same_numbers(name: str) -> None:
    shard = make_shards(7, 1)[0]
    metric = CASES[name].factory()
    feed(name, metric, shard)
    first = metric.compute().item()
    metric.reset()
    feed(name, metric, shard)
    assert metric.compute().item() == first
    _assert_close(first, CASES[name].reference(shard))


@pytest.mark.parametrize("name", list(CASES))
def test_no_data(name: str) -> None:
    metric = CASES[name].factory()
    feed(name, metric, {"values": np.zeros(0, np.float32), "weights": np.zeros(0, np.int64)})
    _assert_close(
        metric.compute().item(),
        CASES[name].reference({"values": np.zeros(0), "weights": np.zeros(0)}),
    )


def test_mean_over_no_data_is_nan() -> None:
    assert math.isnan(MeanMetric().compute().item())
    assert math.isnan(WeightedMeanMetric().compute().item())


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_mid_window_continues(name: str) -> None:
    shards = make_shards(11, 2)
    metric = CASES[name].factory()
    feed(name, metric, shards[0])
    restored = CASES[name].factory()
    restored.load_state_dict(metric.state_dict())
    feed(name, restored, shards[1])
    _assert_close(restored.compute().item(), CASES[name].reference(concat(shards)))


def test_weighted_mean_seed_usage() -> None:
    metric = WeightedMeanMetric()
    metric.to("cpu")
    losses = [torch.tensor(2.0), torch.tensor(4.0)]
    tokens = [torch.tensor(3), torch.tensor(1)]
    for loss, num_tokens in zip(losses, tokens, strict=True):
        metric.update(values=loss, weights=num_tokens)
    metric.sync()
    assert metric.compute().item() == pytest.approx((2 * 3 + 4 * 1) / 4)
    weight = metric.accumulated_weight  # d9d's name for the total weight
    assert weight.item() == 4.0
    weight.add_(1.0)  # a copy: the metric keeps its state
    assert metric.accumulated_weight.item() == 4.0
    metric.reset()
    assert math.isnan(metric.compute().item())
    assert metric.accumulated_weight.item() == 0.0


def test_nan_values_propagate() -> None:
    for metric in (MeanMetric(), MaxMetric(), MinMetric(), SumMetric()):
        metric.update(torch.tensor([1.0, float("nan")]))
        assert math.isnan(metric.compute().item())


def _weighted_state(metric: WeightedMeanMetric) -> dict[str, float]:
    return {k: float(v) for k, v in states_only(metric.state_dict()).items()}


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"values": torch.tensor([1, 2]), "weights": 1.0}, TypeError, "values"),
        ({"values": torch.ones(3), "weights": torch.ones(2)}, ValueError, "weights"),
        ({"values": torch.ones(3), "weights": torch.ones(2, 3)}, ValueError, "weights"),
        (
            {"values": torch.ones(3), "weights": torch.tensor([1.0, -1.0, 1.0])},
            ValueError,
            "weights",
        ),
        (
            {"values": torch.ones(2), "weights": torch.tensor([1.0, float("inf")])},
            ValueError,
            "weights",
        ),
        ({"values": torch.ones(2, device="meta"), "weights": 1.0}, ValueError, "values"),
        ({"values": "1.0", "weights": 1.0}, TypeError, "values"),
    ],
)
def test_bad_input_names_argument_and_leaves_state(
    kwargs: dict, error: type, argument: str
) -> None:
    metric = WeightedMeanMetric()
    metric.update(values=torch.tensor([1.0, 2.0]), weights=torch.tensor([1.0, 3.0]))
    before = _weighted_state(metric)
    with pytest.raises(error, match=argument):
        metric.update(**kwargs)
    assert _weighted_state(metric) == before


@pytest.mark.parametrize("cls", [SumMetric, MeanMetric, MaxMetric, MinMetric])
def test_integer_values_rejected(cls: type) -> None:
    metric = cls()
    with pytest.raises(TypeError, match="values: expected a floating-point tensor"):
        metric.update(torch.tensor([1, 2]))


def test_compose_computes_syncs_and_checkpoints_children() -> None:
    shards = make_shards(3, 2)
    compose = ComposeMetric({name: case.factory() for name, case in CASES.items()})
    for name in CASES:
        feed(name, compose[name], shards[0])
    restored = ComposeMetric({name: case.factory() for name, case in CASES.items()})
    restored.load_state_dict(compose.state_dict())
    for name in CASES:
        feed(name, restored[name], shards[1])
    restored.sync()
    values = restored.compute()
    assert set(values) == set(CASES)
    for name, case in CASES.items():
        _assert_close(values[name].item(), case.reference(concat(shards)))
    restored.reset()
    assert math.isnan(restored.compute()["mean"].item())


def test_compose_refuses_update_and_bad_children() -> None:
    compose = ComposeMetric({"loss": MeanMetric()})
    with pytest.raises(TypeError, match=r"compose\['loss'\]\.update"):
        compose.update(torch.ones(1))
    with pytest.raises(TypeError, match="metrics\\['x'\\]"):
        ComposeMetric({"x": object()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="names"):
        ComposeMetric({"a.b": MeanMetric()})
    # A new user's trial: a collector of an empty one wrote '"values": {}' every window.
    with pytest.raises(ValueError, match="metrics: expected at least one metric, got none"):
        ComposeMetric({})


def test_nested_compose_state_names() -> None:
    inner = ComposeMetric({"loss": MeanMetric()})
    outer = ComposeMetric({"train": inner, "max": MaxMetric()})
    assert sorted(states_only(outer.state_dict())) == [
        "max.max",
        "train.loss.count",
        "train.loss.total",
    ]


def test_load_state_dict_rejects_wrong_keys_and_shapes() -> None:
    metric = MeanMetric()
    with pytest.raises(KeyError, match="missing keys"):
        metric.load_state_dict({"total": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="shape"):
        metric.load_state_dict({"total": torch.zeros(2), "count": torch.tensor(1.0)})


def test_to_moves_state() -> None:
    metric = ComposeMetric({"a": MeanMetric(), "b": MaxMetric()}).to("meta")
    assert all(acc.device.type == "meta" for _, acc in metric.named_accumulators())


@pytest.mark.parametrize("make", [SumMetric, MeanMetric, WeightedMeanMetric, MaxMetric, MinMetric])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, "float64"])
def test_an_accumulation_dtype_that_is_not_floating_point_is_refused(
    make: type, dtype: object
) -> None:
    # An integer sum truncated each value: Sum of [0.5, 0.7, 1.9] gave 1, Mean 0.33 for 1.03.
    with pytest.raises(TypeError, match=r"dtype: expected a floating-point torch.dtype"):
        make(dtype=dtype)


def test_numpy_and_other_real_scalars_are_numbers() -> None:
    # numpy.float32 was refused as "not a number" (only numpy.float64, a float subclass, passed).
    from fractions import Fraction

    values = [np.float32(1.5), np.int64(2), np.float16(0.25), Fraction(1, 2)]
    metric = MeanMetric()
    for value in values:
        metric.update(value)
    assert float(metric.compute()) == pytest.approx(np.mean([float(v) for v in values]))
    weighted = WeightedMeanMetric()
    weighted.update(np.float32(3.0), weights=np.float32(2.0))
    weighted.update(1.0, weights=np.int64(2))
    assert float(weighted.compute()) == pytest.approx(2.0)
    with pytest.raises(TypeError, match=r"values: expected a torch\.Tensor or a number"):
        MeanMetric().update(np.bool_(True))


@pytest.mark.parametrize("make", [MeanMetric, SumMetric, MaxMetric, WeightedMeanMetric])
def test_python_ints_out_of_range_are_refused_naming_the_argument(make: type) -> None:
    # Python's OverflowError ("int too large to convert to float") named no argument, and an
    # int weight past int64 raised torch's own RuntimeError.
    metric = make()
    metric.update(1.0)
    before = {key: value.clone() for key, value in states_only(metric.state_dict()).items()}
    with pytest.raises(ValueError, match=r"values: expected a number within float64's range"):
        metric.update(-(10**400))
    if make is WeightedMeanMetric:
        with pytest.raises(ValueError, match=r"weights: expected an integer in \[-2\*\*63"):
            metric.update(1.0, weights=2**63)
    after = states_only(metric.state_dict())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)
    metric.update(2**70)  # within float64's range: taken as 2.0**70
    expected = {"mean": (1 + 2**70) / 2, "sum": 1 + 2**70, "max": 2**70, "weighted": None}
    if make is not WeightedMeanMetric:
        name = {MeanMetric: "mean", SumMetric: "sum", MaxMetric: "max"}[make]
        assert float(metric.compute()) == float(expected[name])


def test_python_numbers_keep_double_precision() -> None:
    # They became float32 tensors (torch's default dtype) before reaching the float64 state.
    from sidestream.metrics.language import PerplexityMetric
    from sidestream.metrics.regression import MeanAbsoluteErrorMetric

    total = SumMetric()
    total.update(0.1)
    total.update(2**53)
    assert float(total.compute()) == 0.1 + 2**53  # numpy float64 gives the same
    small = SumMetric()  # 0.1 vanishes next to 2**53 in float32 too: this sum shows it
    small.update(0.1)
    small.update(0.2)
    assert float(small.compute()) == 0.1 + 0.2  # float32 gave 0.3000000045
    big = SumMetric()
    big.update(2**53 + 2)
    assert int(big.compute()) == 2**53 + 2
    mean = MeanMetric()
    for value in (0.1, 0.2, 0.3):
        mean.update(value)
    assert float(mean.compute()) == float(np.mean(np.array([0.1, 0.2, 0.3])))
    weighted = WeightedMeanMetric()
    weighted.update(1.0, weights=0.1)
    weighted.update(0.0, weights=0.3)
    assert float(weighted.compute()) == 0.1 / (0.1 + 0.3)
    largest = MaxMetric()
    largest.update(1e300)  # overflowed float32 with a RuntimeError
    assert float(largest.compute()) == 1e300
    exact_int = MaxMetric()
    exact_int.update(16777217)  # 2**24 + 1: float32 has no such number
    assert float(exact_int.compute()) == 16777217
    perplexity = PerplexityMetric()
    perplexity.update(losses=0.1)
    # torch's exp and libm's may differ in the last bit; float32 was off by 1.5e-9.
    assert float(perplexity.compute()) == pytest.approx(math.exp(0.1), rel=1e-12, abs=0)
    error = MeanAbsoluteErrorMetric()
    error.update(0.1, 0.0)
    assert float(error.compute()) == 0.1
