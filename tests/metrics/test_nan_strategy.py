"""nan_strategy of the aggregation metrics against torchmetrics' aggregators."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torchmetrics
from torch import Tensor

from sidestream.metrics import MaxMetric, MeanMetric, MinMetric, SumMetric, WeightedMeanMetric
from sidestream.testing import on_rank_device
from tests.conftest import Pools

PAIRS = {
    "sum": (SumMetric, torchmetrics.SumMetric),
    "mean": (MeanMetric, torchmetrics.MeanMetric),
    "max": (MaxMetric, torchmetrics.MaxMetric),
    "min": (MinMetric, torchmetrics.MinMetric),
}
STRATEGIES: list[Any] = ["ignore", 2.5, "disable"]


def _batches(seed: int, count: int = 3) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        values = torch.randn(20, generator=generator, dtype=torch.float64)
        values[torch.rand(20, generator=generator) < 0.2] = float("nan")
        out.append(values)
    return out


def _expected(name: str, strategy: Any, batches: list[Tensor]) -> float:
    reference = PAIRS[name][1](nan_strategy=strategy)
    for batch in batches:
        reference.update(batch.clone())  # torchmetrics fills NaN in place
    return float(reference.compute())


def _check(actual: float, expected: float) -> None:
    assert actual == pytest.approx(expected, rel=1e-6, nan_ok=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_torchmetrics_and_counts_nan(strategy: Any) -> None:
    batches = _batches(0)
    nans = int(sum(torch.isnan(b).sum() for b in batches))
    for name, (ours, _) in PAIRS.items():
        metric = ours(nan_strategy=strategy)
        for batch in batches:
            metric.update(batch)
        _check(float(metric.compute()), _expected(name, strategy, batches))
        counted = metric.nan_count
        assert (counted is None) == (strategy == "disable"), name
        if counted is not None:
            assert int(counted) == nans, name
    weighted = WeightedMeanMetric(nan_strategy=strategy)
    for batch in batches:
        weighted.update(batch, torch.ones_like(batch))
    mean = torchmetrics.MeanMetric(nan_strategy=strategy)
    for batch in batches:
        mean.update(batch.clone(), torch.ones_like(batch))
    _check(float(weighted.compute()), float(mean.compute()))


def test_error_raises_before_the_state_changes() -> None:
    batch = torch.tensor([1.0, float("nan")])
    for name, (ours, _) in PAIRS.items():
        metric = ours(nan_strategy="error")
        metric.update(torch.tensor([3.0]))
        with pytest.raises(ValueError, match="values"):
            metric.update(batch)
        assert float(metric.compute()) == 3.0, name
        assert int(metric.rejected_updates) == 0
    weighted = WeightedMeanMetric(nan_strategy="error")
    with pytest.raises(ValueError, match="values"):
        weighted.update(batch, torch.ones(2))
    assert torch.isnan(weighted.compute())
    for bad in ("warn", float("inf")):
        with pytest.raises(ValueError, match="nan_strategy"):
            MeanMetric(nan_strategy=bad)
    # torchmetrics' "warn" has no counterpart here: the message says what to use instead.
    with pytest.raises(ValueError, match=r'use "ignore" and read the metric\'s nan_count'):
        MeanMetric(nan_strategy="warn")


@on_rank_device
def _synced(strategy: Any) -> dict[str, tuple[float, int]]:
    rank = dist.get_rank()
    batches = _batches(rank) if rank == 0 else []  # rank 1 has no data
    out = {}
    for name, (ours, _) in PAIRS.items():
        metric = ours(nan_strategy=strategy)
        for batch in batches:
            metric.update(batch)
        metric.sync()
        out[name] = (float(metric.compute()), int(metric.nan_count))
    return out


def test_two_ranks_one_empty(pools: Pools) -> None:
    batches = _batches(0)
    nans = int(sum(torch.isnan(b).sum() for b in batches))
    for per_rank in pools.get(2).run(_synced, "ignore"):
        for name, (value, counted) in per_rank.items():
            _check(value, _expected(name, "ignore", batches))
            assert counted == nans


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_counts_and_drops_without_a_host_sync() -> None:
    batches = [b.cuda() for b in _batches(1)]
    nans = int(sum(torch.isnan(b).sum() for b in batches))
    clean = torch.randn(16, dtype=torch.float64, device="cuda")
    metrics = {
        "ignore": {
            name: ours(nan_strategy="ignore").to("cuda") for name, (ours, _) in PAIRS.items()
        },
        "error": {name: ours(nan_strategy="error").to("cuda") for name, (ours, _) in PAIRS.items()},
    }
    weighted = WeightedMeanMetric(nan_strategy="error").to("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            for metric in metrics["ignore"].values():
                metric.update(batch)
        for metric in metrics["error"].values():
            metric.update(clean)
            metric.update(batches[0])  # has NaN: dropped and counted
        weighted.update(clean, torch.ones_like(clean))
        weighted.update(batches[0], -torch.ones_like(batches[0]))  # bad twice: counted once
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu = [b.cpu() for b in batches]
    for name, metric in metrics["ignore"].items():
        _check(float(metric.compute()), _expected(name, "ignore", cpu))
        assert int(metric.nan_count) == nans
    for name, metric in metrics["error"].items():
        assert int(metric.rejected_updates) == 1, name
        _check(float(metric.compute()), _expected(name, "disable", [clean.cpu()]))
    assert int(weighted.rejected_updates) == 1
    _check(float(weighted.compute()), float(clean.mean()))


def test_rejected_updates_is_always_a_tensor() -> None:
    """The collector stacks every metric's rejected_updates: 0 unless nan_strategy="error"."""
    for strategy in STRATEGIES:
        for name, (ours, _) in PAIRS.items():
            value = ours(nan_strategy=strategy).rejected_updates
            assert isinstance(value, Tensor) and int(value) == 0, (name, strategy)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_fill_value_is_written_at_the_accumulation_width(
    dtype: torch.dtype, compiled: bool
) -> None:
    # The fill was written into the input's own dtype: 1e5 became inf in float16 (a finite
    # fill, as the policy insists, and an inf result) and 99840 in bfloat16; 0.1 lost digits.
    fill = 1e5 + 0.1
    values = torch.tensor([float("nan"), 1.0], dtype=dtype)
    one = float(values[1])
    filled = [fill, one]  # the definition, in float64
    metrics = {
        "sum": (SumMetric(nan_strategy=fill), sum(filled)),
        "mean": (MeanMetric(nan_strategy=fill), sum(filled) / 2),
        "max": (MaxMetric(nan_strategy=fill), max(filled)),
        "min": (MinMetric(nan_strategy=fill), min(filled)),
        "weighted": (WeightedMeanMetric(nan_strategy=fill), (fill * 3 + one) / 4),
    }
    for name, (metric, expected) in metrics.items():
        update = metric.update
        if compiled:
            update = torch.compile(update, backend="aot_eager", fullgraph=True)
        if name == "weighted":
            update(values, torch.tensor([3.0, 1.0]))
        else:
            update(values)
        assert metric.compute().item() == pytest.approx(expected, rel=1e-15), name
        assert metric.nan_count is not None and metric.nan_count.item() == 1, name


AGGREGATIONS = [SumMetric, MeanMetric, MaxMetric, MinMetric, WeightedMeanMetric]
# Each dtype's largest finite value, from outside torch: numpy's finfo, and bfloat16's bits
# (8 exponent bits as float32, 7 mantissa bits).
LARGEST = {
    torch.float16: float(np.finfo(np.float16).max),
    torch.bfloat16: float.fromhex("0x1.fep127"),
    torch.float32: float(np.finfo(np.float32).max),
}


@pytest.mark.parametrize("cls", AGGREGATIONS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize(
    ("dtype", "fill"),
    [(torch.float16, 1e5), (torch.float16, -7e4), (torch.bfloat16, 1e39), (torch.float32, 1e300)],
)
def test_a_fill_value_the_accumulation_dtype_cannot_hold_is_refused(
    cls: type, dtype: torch.dtype, fill: float
) -> None:
    # The fill was written as inf (every filled NaN made the result inf), or torch raised its
    # own RuntimeError at the first update, naming no argument.
    assert abs(fill) > LARGEST[dtype]
    with pytest.raises(ValueError, match=rf"nan_strategy: .*{dtype}"):
        cls(dtype=dtype, nan_strategy=fill)
    # The largest finite value itself is a fill like any other.
    metric = cls(dtype=dtype, nan_strategy=LARGEST[dtype])
    metric.update(torch.tensor([float("nan")], dtype=dtype))
    assert metric.compute().item() == LARGEST[dtype]
    assert metric.nan_count is not None and metric.nan_count.item() == 1


def test_an_int_fill_too_large_for_a_float_names_nan_strategy() -> None:
    with pytest.raises(ValueError, match="nan_strategy: a fill value must be finite"):
        SumMetric(nan_strategy=10**400)  # was OverflowError from math.isfinite


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    "weights",
    [
        torch.tensor([-1.0, 1.0]),
        torch.tensor([float("inf"), 1.0]),
        torch.tensor([float("nan"), 1.0]),
    ],
    ids=["negative", "inf", "nan"],
)
def test_ignore_still_refuses_a_bad_weight_of_a_nan_value(weights: Tensor, compiled: bool) -> None:
    # "ignore" zeroed the weight of a NaN value before the weight checks, so a negative or
    # non-finite weight there was accepted, unlike the same weight of any other value.
    metric = WeightedMeanMetric(nan_strategy="ignore")
    metric.update(torch.tensor([4.0]), 1.0)
    values = torch.tensor([float("nan"), 1.0])
    if compiled:  # the device path: dropped and counted, as on CUDA
        torch.compile(metric.update, backend="aot_eager", fullgraph=True)(values, weights)
        assert int(metric.rejected_updates) == 1
    else:
        with pytest.raises(ValueError, match="weights: expected finite values >= 0"):
            metric.update(values, weights)
    assert metric.compute().item() == 4.0
    assert metric.accumulated_weight.item() == 1.0
    assert metric.nan_count is not None and int(metric.nan_count) == 0
    # A good weight of a NaN value is left out with it, as before.
    metric.update(values, torch.tensor([5.0, 3.0]))
    assert metric.compute().item() == (4.0 + 3.0) / 4.0
    assert int(metric.nan_count) == 1


@pytest.mark.parametrize(("saved", "loading"), [("ignore", "disable"), ("disable", "error")])
def test_a_checkpoint_of_another_nan_strategy_says_so(saved: str, loading: str) -> None:
    """Only "missing keys ['rejected']" was said: it read as a damaged checkpoint."""
    from sidestream import ComposeMetric, MaxMetric, MeanMetric

    checkpoint = ComposeMetric({"m": MeanMetric(nan_strategy=saved), "x": MaxMetric()})
    target = ComposeMetric({"m": MeanMetric(nan_strategy=loading), "x": MaxMetric()})
    with pytest.raises(KeyError, match=rf"by nan_strategy \(now '{loading}'\)"):
        target.load_state_dict(checkpoint.state_dict())
    # Keys of another metric altogether get no such hint.
    with pytest.raises(KeyError) as other:
        MaxMetric().load_state_dict(MeanMetric().state_dict())
    assert "nan_strategy" not in str(other.value)
