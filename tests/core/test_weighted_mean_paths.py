"""WeightedMeanMetric's CPU paths (scalar, broadcast, chunked large batches) against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sidestream import WeightedMeanMetric
from sidestream.metrics import weighted_mean


@pytest.mark.parametrize("size", [0, 5, weighted_mean._CHUNK * 3 + 17])
def test_paths_match_numpy(size: int) -> None:
    rng = np.random.default_rng(size)
    values = rng.normal(size=size).astype(np.float32)
    weights = rng.integers(0, 7, size=size)
    metric = WeightedMeanMetric()
    metric.update(torch.from_numpy(values), torch.from_numpy(weights))  # same shape, chunked
    metric.update(torch.from_numpy(values), 2.5)  # a Python scalar
    column = rng.random((3, 1))
    grid = rng.normal(size=(3, 4))
    metric.update(torch.from_numpy(grid), torch.from_numpy(column))  # broadcast
    expected_sum = (
        (values.astype(np.float64) * weights).sum()
        + 2.5 * values.astype(np.float64).sum()
        + (grid * column).sum()
    )
    expected_weight = weights.sum() + 2.5 * size + column.sum() * 4
    assert float(metric.compute()) == pytest.approx(expected_sum / expected_weight, rel=1e-12)


def test_a_bad_weight_in_a_later_chunk_raises_before_any_state_changes() -> None:
    size = weighted_mean._CHUNK * 2 + 5
    values, weights = torch.ones(size), torch.ones(size)
    metric = WeightedMeanMetric()
    metric.update(torch.tensor([3.0]), torch.tensor([1.0]))
    for bad in (-1.0, float("inf"), float("nan")):
        weights[-1] = bad
        with pytest.raises(ValueError, match="weights: expected finite values >= 0"):
            metric.update(values, weights)
        with pytest.raises(ValueError, match="weights"):
            metric.update(values, bad)
    assert float(metric._weighted_sum.local) == 3.0 and float(metric._weight.local) == 1.0


def test_chunked_batches_of_different_lengths_reuse_the_buffers_exactly() -> None:
    # The chunk buffers (and their all-ones row) are reused by every update: a short last
    # chunk must not leave stale elements that a later, longer batch would sum.
    rng = np.random.default_rng(7)
    metric = WeightedMeanMetric()
    expected_sum = expected_weight = 0.0
    for size in (weighted_mean._CHUNK + 3, weighted_mean._CHUNK * 2 + 1, weighted_mean._CHUNK + 9):
        values = rng.normal(size=size).astype(np.float32)
        weights = rng.random(size).astype(np.float32)
        metric.update(torch.from_numpy(values), torch.from_numpy(weights))
        # float32 products are exact in float64.
        expected_sum += float((values.astype(np.float64) * weights.astype(np.float64)).sum())
        expected_weight += float(weights.astype(np.float64).sum())
    assert float(metric._weighted_sum.local) == pytest.approx(expected_sum, rel=1e-12)
    assert float(metric._weight.local) == pytest.approx(expected_weight, rel=1e-13)


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_inputs_already_in_the_accumulation_dtype_are_summed_in_place(
    dtype: torch.dtype, rel: float
) -> None:
    # Inputs of the accumulation dtype skip the chunk buffers: the same sums, the same check.
    rng = np.random.default_rng(11)
    size = weighted_mean._CHUNK * 2 + 7
    values, weights = rng.normal(size=size) + 3.0, rng.random(size)
    metric = WeightedMeanMetric(dtype=dtype)
    metric.update(torch.from_numpy(values).to(dtype), torch.from_numpy(weights).to(dtype))
    expected = (values * weights).sum() / weights.sum()  # numpy, float64
    assert float(metric.compute()) == pytest.approx(expected, rel=rel)
    assert float(metric.accumulated_weight) == pytest.approx(weights.sum(), rel=rel)
    bad = torch.from_numpy(weights).to(dtype)
    bad[-1] = -1.0  # in the last chunk
    with pytest.raises(ValueError, match="weights: expected finite values >= 0"):
        metric.update(torch.from_numpy(values).to(dtype), bad)
    assert float(metric.compute()) == pytest.approx(expected, rel=rel)


@pytest.mark.parametrize("size", [5, weighted_mean._CHUNK * 2 + 5])
def test_nan_error_rides_on_the_sum_and_still_names_values_first(size: int) -> None:
    # CPU nan_strategy="error" checks NaN only when the weighted sum is NaN or a weight is
    # bad: the same errors, in the same order, before any state changes.
    metric = WeightedMeanMetric(nan_strategy="error")
    metric.update(torch.tensor([3.0]), torch.tensor([1.0]))
    values, weights = torch.ones(size), torch.ones(size)
    values[-1] = float("nan")
    for bad_weight in (1.0, 0.0, -1.0, float("inf")):  # a zero weight still makes NaN
        weights[-1] = bad_weight
        with pytest.raises(ValueError, match="values: expected values without NaN"):
            metric.update(values, weights)
        with pytest.raises(ValueError, match="values"):
            metric.update(values, bad_weight)
    values[-1] = float("inf")  # inf * 0 is NaN too: bad input under "error", state unchanged
    weights[-1] = 0.0
    with pytest.raises(ValueError, match="values: expected values whose weighted sum is not NaN"):
        metric.update(values, weights)
    assert float(metric._weight.local) == 1.0
    assert float(metric._weighted_sum.local) == 3.0
    weights[-1] = -1.0
    with pytest.raises(ValueError, match="weights"):
        metric.update(values, weights)


@pytest.mark.parametrize("strategy", ["ignore", 0.5])
@pytest.mark.parametrize("size", [2, weighted_mean._CHUNK * 2 + 5])
def test_a_refused_batch_leaves_nan_count_alone_eager_and_compiled(
    strategy: str | float, size: int
) -> None:
    # The NaN policy counted the batch's NaNs before the weights were checked: a refused batch
    # (CPU: raised; compiled: dropped) still moved nan_count.
    values, weights = torch.ones(size), torch.ones(size)
    values[0] = float("nan")
    weights[-1] = -1.0
    eager = WeightedMeanMetric(nan_strategy=strategy)  # type: ignore[arg-type]
    eager.update(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="weights"):
        eager.update(values, weights)
    assert int(eager.nan_count) == 1 and int(eager.rejected_updates) == 0
    compiled_metric = WeightedMeanMetric(nan_strategy=strategy)  # type: ignore[arg-type]
    update = torch.compile(compiled_metric.update, fullgraph=True, backend="aot_eager")
    update(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.0]))
    update(values, weights)  # dropped on the device path, and counted as rejected
    assert int(compiled_metric.nan_count) == 1 and int(compiled_metric.rejected_updates) == 1
    assert float(compiled_metric.compute()) == float(eager.compute())
    # By hand: only the first batch counts, its NaN ignored (weight 0) or filled with 0.5.
    expected = 1.0 if strategy == "ignore" else (1.0 + 0.5) / 2
    assert float(eager.compute()) == expected


@pytest.mark.parametrize("size", [2, weighted_mean._CHUNK * 2 + 5])
def test_finite_weights_whose_total_overflows_are_refused_naming_the_total(size: int) -> None:
    # The error said the weights were not finite, and named no value: they all were.
    metric = WeightedMeanMetric(dtype=torch.float32)
    metric.update(torch.tensor([2.0]), torch.tensor([1.0]))
    weights = torch.full((size,), 3e38)
    with pytest.raises(ValueError, match=r"weights: expected a total that torch.float32 holds"):
        metric.update(torch.ones(size), weights)
    assert metric.compute().item() == 2.0  # the refused batch changed nothing
    weights[-1] = -1.0  # a bad weight is still named as one
    with pytest.raises(ValueError, match=r"weights: expected finite values >= 0.*-1"):
        metric.update(torch.ones(size), weights)


def test_nan_error_names_an_overflow_beside_an_infinite_value_as_one() -> None:
    # +inf at weight 1 and a finite product past float64's range (-inf) were named "an
    # infinite value at weight 0, or +inf and -inf", neither of which the batch has.
    metric = WeightedMeanMetric(nan_strategy="error")
    values = torch.tensor([float("inf"), -1e308], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"values \* weights past what torch\.float64 holds"):
        metric.update(values, torch.tensor([1.0, 10.0], dtype=torch.float64))


def test_nan_error_on_the_device_path_drops_an_infinite_value_at_weight_zero() -> None:
    # The device path (compiled, or CUDA) tests the weighted sum for NaN now: an infinite value
    # at weight 0 (inf * 0 is NaN) is dropped and counted there, as the CPU path refuses it.
    # Reverting to isnan(values).any() kept it (mean NaN) and no test failed.
    import torch._dynamo

    # Its compiles of WeightedMeanMetric.update count against dynamo's recompile limit (8)
    # for every later test in the process: test_nan_strategy's compiled cases then failed.
    torch._dynamo.reset()
    try:
        metric = WeightedMeanMetric(nan_strategy="error")
        update = torch.compile(metric.update, fullgraph=True, backend="aot_eager")
        update(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]))
        update(torch.tensor([2.0, float("inf")]), torch.tensor([1.0, 0.0]))
        update(torch.tensor([float("inf"), -float("inf")]), torch.tensor([1.0, 1.0]))
        assert int(metric.rejected_updates) == 2
        assert float(metric.compute()) == 2.0
        update(torch.tensor([float("inf")]), torch.tensor([2.0]))  # +inf at a weight > 0
        assert int(metric.rejected_updates) == 2 and float(metric.compute()) == float("inf")
    finally:
        torch._dynamo.reset()
