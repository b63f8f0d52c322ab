"""Confusion matrices, MCC and Cohen kappa vs sklearn."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import cohen_kappa_score, matthews_corrcoef

from sidestream.metrics.classification import (
    MulticlassCohenKappaMetric,
    MulticlassMatthewsCorrCoefMetric,
)
from tests.metrics.confusion_cases import (
    MATRIX_CASES,
    Case,
    assert_matrix_matches,
    make_shards,
    matrix_reference,
    run_matrix_case,
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
    mcc, kappa = MulticlassMatthewsCorrCoefMetric(3), MulticlassCohenKappaMetric(3)
    for metric in (mcc, kappa):
        metric.update(torch.tensor([2, 2, 2]), torch.tensor([2, 2, 2]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mcc.compute().item() == matthews_corrcoef([2, 2, 2], [2, 2, 2])
        assert np.isnan(cohen_kappa_score([2, 2, 2], [2, 2, 2]))
    assert torch.isnan(kappa.compute())
    empty = MulticlassMatthewsCorrCoefMetric(3)
    assert empty.compute().item() == 0.0
    assert empty.confusion_matrix().sum().item() == 0


def test_cohen_kappa_rejects_unknown_weighting() -> None:
    with pytest.raises(ValueError, match="weights"):
        MulticlassCohenKappaMetric(3, weights="cubic")


@pytest.mark.parametrize("seed", range(40))
def test_a_perfect_prediction_gives_exactly_one(seed: int) -> None:
    # The two square roots round separately: 1.0000000000000002 came out of a perfect prediction.
    generator = torch.Generator().manual_seed(seed)
    classes = int(torch.randint(2, 9, (1,), generator=generator))
    labels = torch.randint(0, classes, (int(torch.randint(2, 300, (1,), generator=generator)),))
    metric = MulticlassMatthewsCorrCoefMetric(classes)
    metric.update(labels, labels)
    expected = matthews_corrcoef(labels.numpy(), labels.numpy())
    assert float(metric.compute()) == expected
    inverted = MulticlassMatthewsCorrCoefMetric(2)
    binary = labels % 2
    inverted.update(1 - binary, binary)
    assert -1.0 <= float(inverted.compute()) <= 1.0
