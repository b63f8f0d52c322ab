"""CPU error messages of the aggregation, regression and language metrics show what was found:
up to three of the bad values and how many of the batch's elements are bad."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from sidestream import MeanMetric, WeightedMeanMetric
from sidestream.metrics.language import PerplexityMetric, TokenAccuracyMetric
from sidestream.metrics.regression import MeanSquaredErrorMetric

NAN, INF = float("nan"), float("inf")
t = torch.tensor

CASES: list[tuple[str, Callable[[], None], str]] = [
    (
        "nan weight, ignore strategy",
        lambda: WeightedMeanMetric(nan_strategy="ignore").update(t([1.0, 2.0]), t([1.0, NAN])),
        "weights: expected finite values >= 0; this batch has values that are not "
        "(found nan: 1 of 2 elements)",
    ),
    (
        "negative and inf float32 weights",
        lambda: WeightedMeanMetric().update(t([1.0, 2.0, 3.0]), t([1.0, -2.0, INF])),
        "(found -2, inf: 2 of 3 elements)",
    ),
    (
        "negative integer weight",
        lambda: WeightedMeanMetric().update(t([1.0, 2.0, 3.0]), t([1, -2, 3])),
        "(found -2: 1 of 3 elements)",
    ),
    (
        "nan value, error strategy",
        lambda: MeanMetric(nan_strategy="error").update(t([1.0, NAN, NAN, 4.0])),
        "values: expected values without NaN (nan_strategy); this batch has values that are "
        "not (found nan, nan: 2 of 4 elements)",
    ),
    (
        "inf prediction",
        lambda: MeanSquaredErrorMetric().update(t([1.0, INF]), t([1.0, 2.0])),
        "preds: expected finite values; this batch has values that are not "
        "(found inf: 1 of 2 elements)",
    ),
    (
        "nan target",
        lambda: MeanSquaredErrorMetric().update(t([1.0, 2.0]), t([-INF, NAN])),
        "target: expected finite values; this batch has values that are not "
        "(found -inf, nan: 2 of 2 elements)",
    ),
    (
        "token id out of the vocabulary",
        lambda: PerplexityMetric(vocab_size=4).update(
            torch.zeros(2, 3, 4), t([[0, 1, 7], [0, 9, 2]])
        ),
        "(found 7, 9: 2 of 6 elements)",
    ),
    (
        "negative loss",
        lambda: PerplexityMetric(vocab_size=4).update(losses=t([0.5, -1.0])),
        "losses: expected finite values >= 0 (per-token NLL); this batch has values that are "
        "not (found -1: 1 of 2 elements)",
    ),
    (
        "token accuracy target",
        lambda: TokenAccuracyMetric(vocab_size=4).update(torch.zeros(1, 3, 4), t([[0, 5, 2]])),
        "(found 5: 1 of 3 elements)",
    ),
]


@pytest.mark.parametrize(("update", "message"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_message_shows_the_bad_values_and_their_count(
    update: Callable[[], None], message: str
) -> None:
    with pytest.raises(ValueError) as error:
        update()
    assert str(error.value).endswith(message)


@pytest.mark.parametrize(
    ("preds", "target", "hint"),
    [((4, 1), (4,), "pass preds.squeeze(-1)"), ((4,), (4, 1), "pass target.squeeze(-1)")],
)
def test_a_column_against_a_vector_says_which_to_squeeze(
    preds: tuple[int, ...], target: tuple[int, ...], hint: str
) -> None:
    """d9d took binary scores (N, 1) with labels (N,); the error gave no way out."""
    from sidestream.metrics.classification import BinaryAUROCMetric

    metric = BinaryAUROCMetric()
    with pytest.raises(ValueError, match=r"^target: expected the shape of preds") as raised:
        metric.update(torch.rand(preds), torch.randint(0, 2, target))
    assert hint in str(raised.value)
