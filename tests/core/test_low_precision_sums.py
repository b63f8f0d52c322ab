"""Sums of a half-precision dtype, and totals past float64, against float64 references."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sidestream import MeanMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.language import PerplexityMetric
from sidestream.testing import RankPool

HALF = [torch.float16, torch.bfloat16]
# One rounding of the float64 result into the dtype (half a unit in the last place), with room.
ROUNDING = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _batches(seed: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """200 batches of 500 values in [0.5, 1.5) (a sum near 1e5) and integer weights 0 to 3."""
    generator = torch.Generator().manual_seed(seed)
    values = [(torch.rand(500, generator=generator) + 0.5).to(dtype) for _ in range(200)]
    weights = [torch.randint(0, 4, (500,), generator=generator) for _ in range(200)]
    return values, weights


def _references(values: list[torch.Tensor], weights: list[torch.Tensor]) -> dict[str, float]:
    flat = np.concatenate([batch.double().numpy() for batch in values])
    flat_weights = np.concatenate([batch.double().numpy() for batch in weights])
    return {
        "sum": float(flat.sum()),
        "mean": float(flat.mean()),
        "weighted": float((flat * flat_weights).sum() / flat_weights.sum()),
    }


def _in_dtype(reference: float, dtype: torch.dtype) -> float:
    """The float64 reference rounded once into ``dtype`` (inf past its range)."""
    return torch.tensor(reference, dtype=torch.float64).to(dtype).item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_precision_sum_neither_overflows_nor_stops_growing(
    dtype: torch.dtype, compiled: bool
) -> None:
    # The sums were kept in dtype: in float16 the sum of 1e5 values overflowed past 65504, so
    # SumMetric and MeanMetric gave inf and WeightedMeanMetric NaN (inf / inf); in bfloat16
    # each batch's sum of ~500 was rounded into a running sum whose step is 512, so the mean of
    # values near 1 came out 1.5% to 5% off, where the mean itself fits the dtype to 0.4%.
    values, weights = _batches(0, dtype)
    expected = _references(values, weights)
    metrics = {"sum": SumMetric(dtype=dtype), "mean": MeanMetric(dtype=dtype)}
    weighted = WeightedMeanMetric(dtype=dtype)
    updates = {name: metric.update for name, metric in metrics.items()}
    weighted_update = weighted.update
    if compiled:  # the device path of WeightedMeanMetric, as on CUDA
        compile_ = torch.compile
        updates = {
            name: compile_(update, backend="aot_eager", fullgraph=True)
            for name, update in updates.items()
        }
        weighted_update = compile_(weighted_update, backend="aot_eager", fullgraph=True)
    for batch, batch_weights in zip(values, weights, strict=True):
        for update in updates.values():
            update(batch)
        weighted_update(batch, batch_weights)
    results = {name: metric.compute() for name, metric in metrics.items()}
    results["weighted"] = weighted.compute()
    for name, result in results.items():
        assert result.dtype == dtype, name  # the result still takes dtype
        # sum: about 1e5, past float16's range: inf is its float16 value, as a cast gives.
        if name == "sum" and dtype == torch.float16:
            assert result.item() == _in_dtype(expected[name], dtype) == float("inf")
        else:
            assert result.item() == pytest.approx(expected[name], rel=ROUNDING[dtype]), name


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_precision_mean_of_one_value_per_step(dtype: torch.dtype) -> None:
    # A scalar per step (a loss): the float16 sum stopped growing at 2048 when adding 1 (1024
    # for 0.5), the bfloat16 one at 256 (128), so the mean of 5000 halves was 0.2 or 0.026.
    total, mean = SumMetric(dtype=dtype), MeanMetric(dtype=dtype)
    weighted = WeightedMeanMetric(dtype=dtype)
    for step in range(5000):
        value = torch.tensor(0.5 if step % 2 else 1.5, dtype=dtype)
        total.update(value)
        mean.update(value)
        weighted.update(value, 3)
    assert total.compute().item() == _in_dtype(5000.0, dtype)
    assert mean.compute().item() == 1.0
    assert weighted.compute().item() == 1.0
    assert weighted.accumulated_weight.item() == 15000.0  # not the dtype's saturated total


def test_a_half_precision_checkpoint_saved_before_the_wider_sums_loads() -> None:
    # Checkpoints of the float16 sums load into the float64 ones exactly (a widening load).
    metric = MeanMetric(dtype=torch.float16)
    saved = {
        "total": torch.tensor(300.0, dtype=torch.float16),
        "count": torch.tensor(400.0, dtype=torch.float64),
        "sidestream/dtypes": json.dumps({"total": "float16", "count": "float64"}),
    }
    metric.load_state_dict(saved)
    metric.update(torch.full((100,), 2.0, dtype=torch.float16))
    assert metric.compute().item() == 1.0
    assert metric.compute().dtype == torch.float16


def _half_sums(dtype: torch.dtype) -> dict[str, float]:
    values, weights = _batches(dist.get_rank(), dtype)
    metrics = {
        "sum": SumMetric(dtype=dtype),
        "mean": MeanMetric(dtype=dtype),
        "weighted": WeightedMeanMetric(dtype=dtype),
    }
    for batch, batch_weights in zip(values, weights, strict=True):
        metrics["sum"].update(batch)
        metrics["mean"].update(batch)
        metrics["weighted"].update(batch, batch_weights)
    results = {}
    for name, metric in metrics.items():
        metric.sync()
        results[name] = metric.compute().item()
    return results


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_sums_over_ranks(dist_pool: RankPool, dtype: torch.dtype) -> None:
    # Each rank's float16 sum (about 1e5) had overflowed before the sync: inf, and NaN for the
    # weighted mean, on every rank.
    world = dist_pool.world_size
    shards = [_batches(rank, dtype) for rank in range(world)]
    expected = _references(
        [batch for values, _ in shards for batch in values],
        [batch for _, weights in shards for batch in weights],
    )
    for result in dist_pool.run(_half_sums, dtype):
        if dtype == torch.float16:  # about 1e5 over the ranks: inf is its float16 value
            assert result["sum"] == _in_dtype(expected["sum"], dtype) == float("inf")
        else:
            assert result["sum"] == pytest.approx(expected["sum"], rel=ROUNDING[dtype])
        assert result["mean"] == pytest.approx(expected["mean"], rel=ROUNDING[dtype])
        assert result["weighted"] == pytest.approx(expected["weighted"], rel=ROUNDING[dtype])


def test_a_float16_weighted_mean_of_products_past_65504() -> None:
    # A loss of 1000 at a weight of 100 tokens: each product (1e5) overflowed the float16
    # weighted sum, so the mean was inf where it is 1000, well inside float16.
    metric = WeightedMeanMetric(dtype=torch.float16)
    metric.update(torch.full((10,), 1000.0, dtype=torch.float16), torch.full((10,), 100))
    result = metric.compute()
    assert result.dtype == torch.float16
    assert result.item() == 1000.0


def _perplexity_states(metric: PerplexityMetric) -> dict[str, torch.Tensor]:
    return {
        key: value.clone()
        for key, value in metric.state_dict().items()
        if isinstance(value, torch.Tensor)
    }


def test_perplexity_refuses_losses_whose_weighted_total_overflows() -> None:
    # A loss of 2 at weight 1e308: the token total (1e308) passed its check, the NLL total
    # (2e308) became inf, and the perplexity inf for good where it is exp(2).
    metric = PerplexityMetric()
    metric.update(losses=torch.tensor([2.0]))
    before = _perplexity_states(metric)
    huge = torch.tensor([1e308], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weights: expected losses \* weights to total"):
        metric.update(losses=torch.tensor([2.0], dtype=torch.float64), weights=huge)
    after = _perplexity_states(metric)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert metric.compute().item() == pytest.approx(math.exp(2.0), rel=1e-15)


def test_perplexity_drops_an_overflowing_weighted_loss_total_when_compiled() -> None:
    eager, compiled = PerplexityMetric(), PerplexityMetric()
    update = torch.compile(compiled.update, fullgraph=True, backend="aot_eager")
    eager.update(losses=torch.tensor([2.0, 3.0]))
    update(losses=torch.tensor([2.0, 3.0]), weights=torch.ones(2))
    update(
        losses=torch.tensor([2.0], dtype=torch.float64),
        weights=torch.tensor([1e308], dtype=torch.float64),
    )
    assert int(compiled.rejected_updates) == 1
    assert torch.equal(compiled.compute(), eager.compute())
