"""Defects a generated bad-input catalogue found (every public metric, wrong types, shapes and
values): each bad input raises naming its argument, before the state changes, or is counted and
dropped on the device path, as the rest of the metrics already do."""

from __future__ import annotations

import math

import pytest
import torch

from sidestream import ComposeMetric, MeanMetric, WeightedMeanMetric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryCalibrationErrorMetric,
    BinaryConfusionMatrixMetric,
    MulticlassAUROCMetric,
    MulticlassConfusionMatrixMetric,
    confusion_count_metric,
)
from sidestream.metrics.language import PerplexityMetric, TokenAccuracyMetric

WIDE_UNSIGNED = [
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)
]


def _states(metric: object) -> dict[str, torch.Tensor]:
    return {
        key: value.clone()
        for key, value in metric.state_dict().items()  # type: ignore[attr-defined]
        if isinstance(value, torch.Tensor)
    }


def _same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return before.keys() == after.keys() and all(
        torch.equal(before[key], after[key]) for key in before
    )


def test_perplexity_refuses_weights_whose_total_overflows() -> None:
    # Finite weights, a total past float64: the token count became inf and the perplexity
    # NaN for good (inf / inf), with no error and nothing counted.
    metric = PerplexityMetric()
    metric.update(losses=torch.tensor([1.0, 3.0]))
    before = _states(metric)
    huge = torch.tensor([1e308, 1e308], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weights: expected a total that torch\.float64 holds"):
        metric.update(losses=torch.tensor([1.0, 1.0]), weights=huge)
    assert _same(before, _states(metric))
    metric.update(losses=torch.tensor([2.0]))
    assert metric.compute().item() == pytest.approx(math.exp(2.0))


def test_perplexity_drops_an_overflowing_weight_total_when_compiled() -> None:
    eager, compiled = PerplexityMetric(), PerplexityMetric()
    update = torch.compile(compiled.update, fullgraph=True, backend="aot_eager")
    losses = torch.tensor([1.0, 3.0])
    eager.update(losses=losses)
    update(losses=losses, weights=torch.ones(2))
    update(losses=torch.tensor([1.0, 1.0]), weights=torch.full((2,), 1e308, dtype=torch.float64))
    assert int(compiled.rejected_updates) == 1
    assert torch.equal(compiled.compute(), eager.compute())


@pytest.mark.parametrize("dtype", WIDE_UNSIGNED, ids=str)
@pytest.mark.parametrize("kind", [PerplexityMetric, TokenAccuracyMetric])
def test_language_metrics_refuse_wide_unsigned_targets_naming_them(
    kind: type, dtype: torch.dtype
) -> None:
    # torch has no CPU aminmax / clamp for them: a NotImplementedError naming nothing leaked,
    # where the classification metrics refuse the same dtypes with a TypeError.
    metric = kind()
    target = torch.randint(0, 7, (2, 5))
    metric.update(torch.randn(2, 5, 7), target)
    before = _states(metric)
    with pytest.raises(TypeError, match=r"target: dtype torch\.uint.*convert it first"):
        metric.update(torch.randn(2, 5, 7), target.to(dtype))
    assert _same(before, _states(metric))


@pytest.mark.parametrize("dtype", WIDE_UNSIGNED, ids=str)
def test_weighted_mean_takes_wide_unsigned_weights_in_large_batches(dtype: torch.dtype) -> None:
    # A small batch took them (converted first); above one chunk (2**17 values) the CPU path
    # read their minimum with torch.amin, which has no kernel for them.
    values = torch.rand(300_000, dtype=torch.float64)
    weights = torch.randint(0, 4, (300_000,))
    metric = WeightedMeanMetric()
    metric.update(values, weights.to(dtype))
    expected = (values * weights).sum() / weights.sum()
    assert metric.compute().item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize(
    "make",
    [
        lambda: confusion_count_metric(ignore_index=2**70),
        lambda: MulticlassConfusionMatrixMetric(3, ignore_index=2**63),
        lambda: BinaryAUROCMetric(ignore_index=-(2**63) - 1),
        lambda: BinaryCalibrationErrorMetric(ignore_index=2**64),
        lambda: MulticlassAUROCMetric(3, ignore_index=-(2**64)),
    ],
)
def test_classification_ignore_index_past_int64_is_refused_at_construction(make) -> None:  # type: ignore[no-untyped-def]
    # It was taken, and the first update failed with torch's "int too big to convert".
    with pytest.raises(ValueError, match=r"ignore_index: expected an int64 value"):
        make()


def test_classification_ignore_index_at_the_int64_limits_still_works() -> None:
    for ignore_index in (2**63 - 1, -(2**63)):
        metric = MulticlassConfusionMatrixMetric(3, ignore_index=ignore_index)
        metric.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, ignore_index]))
        assert int(metric.compute().sum()) == 2


@pytest.mark.parametrize(
    ("threshold", "error", "match"),
    [
        ("0.5", TypeError, r"threshold: expected a probability in \[0, 1\], got '0.5'"),
        (None, TypeError, r"threshold: expected a probability in \[0, 1\], got None"),
        (b"0.5", TypeError, r"threshold: expected a probability"),
        ([0.5], TypeError, r"threshold: expected a probability"),
        (torch.tensor([0.5, 0.6]), ValueError, r"threshold: expected one probability.*\(2,\)"),
    ],
)
def test_threshold_of_another_type_is_refused_naming_it(threshold, error, match) -> None:  # type: ignore[no-untyped-def]
    # A string was taken (float("0.5")) and failed the first update with torch's "'>=' not
    # supported between instances of 'Tensor' and 'str'"; None and a tensor of several
    # thresholds raised Python's own errors, naming nothing.
    with pytest.raises(error, match=match):
        BinaryConfusionMatrixMetric(threshold=threshold)
    with pytest.raises(error, match=match):
        confusion_count_metric().binary(threshold)


def test_threshold_numbers_and_one_element_tensors_still_work() -> None:
    import numpy as np

    for threshold in (0.5, 1, np.float64(0.5), torch.tensor(0.5), torch.tensor([0.5])):
        metric = BinaryConfusionMatrixMetric(threshold=threshold)
        metric.update(torch.tensor([0.2, 0.7]), torch.tensor([0, 1]))


@pytest.mark.parametrize("thresholds", ["0.5", ["a", "b"], [None, 0.5], [[0.1, 0.2], [0.3]]])
def test_ranking_thresholds_that_are_not_numbers_are_refused_naming_them(thresholds) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError, match=r"thresholds: expected a sequence of numbers"):
        BinaryAUROCMetric(thresholds=thresholds)


def test_compose_metric_refuses_a_list_and_names_that_are_not_strings() -> None:
    with pytest.raises(TypeError, match=r"metrics: expected a mapping of names to metrics"):
        ComposeMetric([MeanMetric()])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"metrics: names must be strings, got 1"):
        ComposeMetric({1: MeanMetric()})  # type: ignore[dict-item]


@pytest.mark.parametrize("kind", [PerplexityMetric, TokenAccuracyMetric])
def test_language_metrics_take_tensors_only_for_logits_and_target(kind: type) -> None:
    # A Python number was made a 0-dim tensor and failed on shape ("expected shape
    # target.shape + (vocab,)"), where the classification metrics say it is no tensor.
    metric = kind()
    with pytest.raises(TypeError, match=r"logits: expected a torch\.Tensor, got <class 'float'>"):
        metric.update(0.5, torch.tensor([1]))
    with pytest.raises(TypeError, match=r"target: expected a torch\.Tensor, got <class 'list'>"):
        metric.update(torch.randn(2, 4), [1, 2])
    metric.update(torch.randn(2, 4), torch.tensor([1, 2]))  # tensors as before
