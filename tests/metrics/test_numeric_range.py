"""Range edges of the aggregation metrics, against exact sums of the values (``Fraction``).

Each case's true result is finite and representable in the metric's dtype: an inf or NaN there
is a silent wrong answer, not an overflow of the result.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sidestream import MeanMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics import weighted_mean
from sidestream.sync import RankMismatchError

F32_MAX = torch.finfo(torch.float32).max


def _rounded(value: Fraction, dtype: torch.dtype) -> float:
    """``value`` rounded into ``dtype`` (through float64, exact for these cases)."""
    return torch.tensor(float(value), dtype=torch.float64).to(dtype).item()


def test_float32_mean_and_sum_hold_running_totals_past_float32() -> None:
    # Ten batches of 1e38: the sum (1e39) is past float32, the mean (1e38) is not. A float32
    # sum made the mean inf, and the sum stayed inf after the negative batches brought it back.
    big = torch.tensor([1e38], dtype=torch.float32)
    exact = Fraction(big.item())
    mean, total = MeanMetric(dtype=torch.float32), SumMetric(dtype=torch.float32)
    for _ in range(10):
        mean.update(big)
        total.update(big)
    assert mean.compute().item() == _rounded(exact, torch.float32)
    assert mean.compute().dtype == torch.float32
    for _ in range(10):
        total.update(-big)
    assert total.compute().item() == 0.0
    assert total.compute().dtype == torch.float32


def test_float32_mean_of_a_batch_whose_sum_passes_float32() -> None:
    values = torch.tensor([F32_MAX, F32_MAX, F32_MAX / 2], dtype=torch.float32)
    metric = MeanMetric(dtype=torch.float32)
    metric.update(values)
    exact = sum((Fraction(v) for v in values.tolist()), Fraction(0)) / 3
    assert metric.compute().item() == _rounded(exact, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weight", [0.5, "tensor"])
def test_a_scalar_weight_below_one_sums_the_products(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, weight: Any
) -> None:
    # sum(values * weights) of [0.9 max, 0.9 max] at 0.5 is 0.9 max: the CPU path computed
    # sum(values) * 0.5, whose sum overflowed (inf), while the device path gave 0.9 max.
    largest = torch.finfo(dtype).max
    values = torch.tensor([largest * 0.9, largest * 0.9], dtype=dtype)
    weights = 0.5 if weight == 0.5 else torch.tensor(0.5, dtype=dtype)
    exact = Fraction(values[0].item())  # both values equal: the weighted mean is either
    host = WeightedMeanMetric(dtype=dtype)
    host.update(values, weights)
    assert host.compute().item() == _rounded(exact, dtype)
    monkeypatch.setattr(weighted_mean, "checks_stay_on_device", lambda device: True)
    device = WeightedMeanMetric(dtype=dtype)
    device.update(values, weights)
    assert device.compute().item() == host.compute().item()


def _sync_with_other_result_dtypes(name: str) -> str:
    kind = {"sum": SumMetric, "mean": MeanMetric, "weighted": WeightedMeanMetric}[name]
    # float16 and float64 both keep float64 sums: the states alone looked the same.
    metric = kind(dtype=torch.float16 if dist.get_rank() else torch.float64)
    metric.update(torch.tensor([0.1, 0.2], dtype=torch.float64))
    try:
        metric.sync()
    except RankMismatchError:
        return "refused"
    return repr(metric.compute())


@pytest.mark.parametrize("name", ["sum", "mean", "weighted"])
def test_ranks_with_other_result_dtypes_are_refused(pools: Any, name: str) -> None:
    # Each rank reported its own rounding of the same sum (0.6001 in float16, 0.6 in float64).
    assert pools.get(2).run(_sync_with_other_result_dtypes, name) == ["refused", "refused"]
