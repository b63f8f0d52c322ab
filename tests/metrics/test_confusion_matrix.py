"""MulticlassConfusionMatrixMetric, MatthewsCorrCoefMetric and CohenKappaMetric vs sklearn."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import cohen_kappa_score, confusion_matrix, matthews_corrcoef

from sidestream.metrics.classification import (
    CohenKappaMetric,
    MatthewsCorrCoefMetric,
    MulticlassConfusionMatrixMetric,
)
from tests.metrics.confusion_cases import IGNORE, Case, make_shards, quantized_scores, to_torch

MATRIX_CASES = [
    Case("multiclass", 4),
    Case("multiclass", 2, dtype="bfloat16", ignore=True),
    Case("multiclass", 6, dtype="float16", target_dtype="one_hot", extra_dims=(3,)),
    Case("multiclass", 5, preds_format="labels", target_dtype="int32", ignore=True),
]


def matrix_metrics(case: Case) -> dict[str, MulticlassConfusionMatrixMetric]:
    ignore = IGNORE if case.ignore else None
    return {
        "matrix": MulticlassConfusionMatrixMetric(case.classes, ignore_index=ignore),
        "mcc": MatthewsCorrCoefMetric(case.classes, ignore_index=ignore),
        "kappa": CohenKappaMetric(case.classes, ignore_index=ignore),
        "kappa_linear": CohenKappaMetric(case.classes, ignore_index=ignore, weights="linear"),
        "kappa_quadratic": CohenKappaMetric(case.classes, ignore_index=ignore, weights="quadratic"),
    }


def run_matrix_case(
    case: Case, batches: list[dict[str, np.ndarray]], sync: bool
) -> dict[str, object]:
    metrics = matrix_metrics(case)
    out: dict[str, object] = {}
    for name, metric in metrics.items():
        for batch in batches:
            metric.update(*to_torch(case, batch))
        if sync:
            metric.sync()
        out[name] = metric.compute().tolist()
    return out


def matrix_reference(case: Case, batches: list[dict[str, np.ndarray]]) -> dict[str, object]:
    truth = np.concatenate([b["target"].reshape(-1) for b in batches])
    predicted = np.concatenate(
        [quantized_scores(case, b).argmax(-1).numpy().reshape(-1) for b in batches]
    )
    kept = truth != IGNORE
    truth, predicted = truth[kept], predicted[kept]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "matrix": confusion_matrix(truth, predicted, labels=list(range(case.classes))),
            "mcc": matthews_corrcoef(truth, predicted),
            "kappa": cohen_kappa_score(truth, predicted),
            "kappa_linear": cohen_kappa_score(truth, predicted, weights="linear"),
            "kappa_quadratic": cohen_kappa_score(truth, predicted, weights="quadratic"),
        }


def assert_matrix_matches(
    actual: dict[str, object], expected: dict[str, object], context: object
) -> None:
    assert np.array_equal(np.asarray(actual["matrix"]), expected["matrix"]), context
    for name in ("mcc", "kappa", "kappa_linear", "kappa_quadratic"):
        assert np.isclose(actual[name], expected[name], rtol=1e-12, atol=1e-12), (
            context,
            name,
            actual[name],
            expected[name],
        )


@pytest.mark.parametrize("case", MATRIX_CASES, ids=lambda c: f"C{c.classes}-{c.dtype}")
def test_matrix_mcc_kappa_match_sklearn(case: Case) -> None:
    for seed in range(4):
        batches = [batch for shard in make_shards(case, seed, 3) for batch in shard]
        assert_matrix_matches(
            run_matrix_case(case, batches, sync=False), matrix_reference(case, batches), seed
        )


def test_degenerate_values_follow_sklearn() -> None:
    """One class everywhere: MCC 0 like sklearn; kappa undefined (NaN) like sklearn."""
    mcc, kappa = MatthewsCorrCoefMetric(3), CohenKappaMetric(3)
    for metric in (mcc, kappa):
        metric.update(torch.tensor([2, 2, 2]), torch.tensor([2, 2, 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mcc.compute().item() == matthews_corrcoef([2, 2, 2], [2, 2, 2])
        assert np.isnan(cohen_kappa_score([2, 2, 2], [2, 2, 2]))
    assert torch.isnan(kappa.compute())
    empty = MatthewsCorrCoefMetric(3)
    assert empty.compute().item() == 0.0
    assert empty.confusion_matrix().sum().item() == 0


def test_cohen_kappa_rejects_unknown_weighting() -> None:
    with pytest.raises(ValueError, match="weights"):
        CohenKappaMetric(3, weights="cubic")
