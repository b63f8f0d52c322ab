"""Properties of every reducible metric, on random data drawn by hypothesis.

- The data split over 1, 2 or 4 ranks, in any order and any batching, gives the result of one
  process on all of it: exactly for counts and extrema, within float64 rounding for sums.
- ``reset`` then replaying the same data gives the same result.
- A ``state_dict`` round trip at any point continues the same numbers, exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from sidestream import MaxMetric, MeanMetric, Metric, MinMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.classification import MulticlassConfusionMatrixMetric
from sidestream.metrics.regression import MeanSquaredErrorMetric
from tests.conftest import Pools

# The GPU machine's interpreter has no hypothesis: skip there instead of failing collection.
pytest.importorskip("hypothesis")
import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

Batch = dict[str, list[Any]]
CLASSES = 4


@dataclass(frozen=True)
class Case:
    factory: Callable[[], Metric[Any]]
    feed: Callable[[Metric[Any], Batch], None]
    batch: st.SearchStrategy[Batch]
    exact: bool  # counts and extrema: no rounding at all


_floats = st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False)


def _values(metric: Metric[Any], batch: Batch) -> None:
    metric.update(torch.tensor(batch["values"], dtype=torch.float64))


def _weighted(metric: Metric[Any], batch: Batch) -> None:
    metric.update(
        values=torch.tensor(batch["values"], dtype=torch.float64),
        weights=torch.tensor(batch["weights"], dtype=torch.float64),
    )


def _paired(metric: Metric[Any], batch: Batch) -> None:
    metric.update(
        torch.tensor(batch["preds"], dtype=torch.float64),
        torch.tensor(batch["target"], dtype=torch.float64),
    )


def _classes(metric: Metric[Any], batch: Batch) -> None:
    metric.update(
        torch.tensor(batch["preds"], dtype=torch.long),
        torch.tensor(batch["target"], dtype=torch.long),
    )


_value_batch = st.builds(dict, values=st.lists(_floats, max_size=12))
_weighted_batch = st.integers(0, 12).flatmap(
    lambda n: st.builds(
        dict,
        values=st.lists(_floats, min_size=n, max_size=n),
        weights=st.lists(st.integers(0, 1000).map(float), min_size=n, max_size=n),
    )
)
_pair_batch = st.integers(0, 12).flatmap(
    lambda n: st.builds(
        dict,
        preds=st.lists(_floats, min_size=n, max_size=n),
        target=st.lists(_floats, min_size=n, max_size=n),
    )
)
_class_batch = st.integers(0, 12).flatmap(
    lambda n: st.builds(
        dict,
        preds=st.lists(st.integers(0, CLASSES - 1), min_size=n, max_size=n),
        target=st.lists(st.integers(0, CLASSES - 1), min_size=n, max_size=n),
    )
)

CASES: dict[str, Case] = {
    "sum": Case(SumMetric, _values, _value_batch, exact=False),
    "mean": Case(MeanMetric, _values, _value_batch, exact=False),
    "weighted_mean": Case(WeightedMeanMetric, _weighted, _weighted_batch, exact=False),
    "max": Case(MaxMetric, _values, _value_batch, exact=True),
    "min": Case(MinMetric, _values, _value_batch, exact=True),
    "mse": Case(lambda: MeanSquaredErrorMetric(1), _paired, _pair_batch, exact=False),
    "confusion": Case(
        lambda: MulticlassConfusionMatrixMetric(CLASSES), _classes, _class_batch, exact=True
    ),
}


def _numbers(result: Any) -> list[float]:
    if isinstance(result, torch.Tensor):
        return [float(x) for x in result.reshape(-1).tolist()]
    if isinstance(result, dict):
        return [x for key in sorted(result) for x in _numbers(result[key])]
    return [float(result)]


def _run(name: str, batches: list[Batch]) -> list[float]:
    case = CASES[name]
    metric = case.factory()
    for batch in batches:
        case.feed(metric, batch)
    return _numbers(metric.compute())


def _magnitude(batches: list[Batch]) -> float:
    """Sum of |x| and |x|^2 over the batch numbers: scales the float64 rounding bound."""
    total = 0.0
    for batch in batches:
        for numbers in batch.values():
            total += sum(abs(x) + x * x for x in numbers)
    return total


def assert_same(actual: list[float], expected: list[float], exact: bool, scale: float) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        if math.isnan(e):
            assert math.isnan(a)
        elif exact:
            assert a == e
        else:
            # Float64 sums in another order differ by at most a few ulps of the magnitudes
            # summed; a mean or ratio divides that by its denominator, so compare relatively.
            assert math.isclose(a, e, rel_tol=1e-9, abs_tol=1e-12 * max(1.0, scale)), (a, e)


def _regroup(batches: list[Batch], cuts: list[int]) -> list[Batch]:
    """The same data, concatenated and cut at other places."""
    whole = {key: [x for b in batches for x in b[key]] for key in batches[0]}
    n = len(next(iter(whole.values())))
    points = sorted({0, n, *(c % (n + 1) for c in cuts)})
    return [{k: v[a:b] for k, v in whole.items()} for a, b in itertools.pairwise(points)]


@st.composite
def _split(draw: st.DrawFn) -> tuple[str, list[Batch], list[int], list[int]]:
    name = draw(st.sampled_from(sorted(CASES)))
    batches = draw(st.lists(CASES[name].batch, min_size=1, max_size=8))
    ranks = draw(st.lists(st.integers(0, 3), min_size=len(batches), max_size=len(batches)))
    order = draw(st.permutations(range(len(batches))))
    return name, batches, ranks, list(order)


def _rank_result(name: str, per_rank: list[list[Batch]]) -> list[float]:
    import torch.distributed as dist

    case = CASES[name]
    metric = case.factory()
    for batch in per_rank[dist.get_rank()]:
        case.feed(metric, batch)
    metric.sync()
    return _numbers(metric.compute())


@pytest.mark.parametrize("world_size", [1, 2, 4])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_split(), cuts=st.lists(st.integers(0, 100), max_size=5))
def test_any_split_over_ranks_order_and_batching_gives_one_process_result(
    pools: Pools,
    world_size: int,
    data: tuple[str, list[Batch], list[int], list[int]],
    cuts: list[int],
) -> None:
    name, batches, ranks, order = data
    expected = _run(name, batches)
    scale = _magnitude(batches)
    if world_size == 1:
        shuffled = [batches[i] for i in order]
        actual = _run(name, _regroup(shuffled, cuts))
        assert_same(actual, expected, CASES[name].exact, scale)
        return
    per_rank: list[list[Batch]] = [[] for _ in range(world_size)]
    for i in order:
        per_rank[ranks[i] % world_size].append(batches[i])
    results = pools.get(world_size).run(_rank_result, name, per_rank)
    assert all(repr(r) == repr(results[0]) for r in results), "every rank holds one result"
    assert_same(results[0], expected, CASES[name].exact, scale)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_split(), cut=st.integers(0, 8))
def test_reset_then_replay_and_state_dict_round_trip(
    data: tuple[str, list[Batch], list[int], list[int]], cut: int
) -> None:
    name, batches, _, _ = data
    case = CASES[name]
    expected = _run(name, batches)
    metric = case.factory()
    for batch in batches[: len(batches) // 2]:
        case.feed(metric, batch)
    metric.reset()
    for batch in batches:
        case.feed(metric, batch)
    assert repr(_numbers(metric.compute())) == repr(expected), "reset forgets what was before"
    # Checkpoint after any number of batches, load into a fresh metric, continue.
    cut = min(cut, len(batches))
    first = case.factory()
    for batch in batches[:cut]:
        case.feed(first, batch)
    saved = first.state_dict()
    resumed = case.factory()
    resumed.load_state_dict(saved)
    for batch in batches[cut:]:
        case.feed(resumed, batch)
    assert repr(_numbers(resumed.compute())) == repr(expected), "a round trip is exact"


def test_numpy_agrees_on_one_case() -> None:
    """The single-process result the properties compare against is itself right."""
    rng = np.random.default_rng(0)
    values, weights = rng.normal(size=50), rng.integers(0, 9, size=50).astype(float)
    batches = [{"values": values[:20].tolist(), "weights": weights[:20].tolist()}]
    batches.append({"values": values[20:].tolist(), "weights": weights[20:].tolist()})
    (got,) = _run("weighted_mean", batches)
    assert math.isclose(got, float(np.average(values, weights=weights)), rel_tol=1e-12)
