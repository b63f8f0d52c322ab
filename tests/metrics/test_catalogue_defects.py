"""The defects of issue 13 (and NaN multiclass scores of issue 11), each against a reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import pearsonr
from sklearn.metrics import average_precision_score, cohen_kappa_score, roc_auc_score
from torchmetrics.functional.classification import multiclass_accuracy, multiclass_cohen_kappa

from sidestream.metric import DTYPES_KEY
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    MulticlassCohenKappaMetric,
    MulticlassConfusionMatrixMetric,
    _cpu_path,
    _inputs,
    confusion_count_metric,
)
from sidestream.metrics.regression import PearsonCorrelationMetric


@pytest.mark.parametrize("scale", [1e-100, 1.0, 1e100])
def test_pearson_holds_at_extreme_scales(scale: float) -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0]) * scale
    y = np.array([1.0, 3.0, 2.0, 4.0]) * scale
    metric = PearsonCorrelationMetric()
    metric.update(torch.tensor(x), torch.tensor(y))
    assert metric.compute().item() == pytest.approx(pearsonr(x, y).statistic, rel=1e-12)


def test_pearson_is_clamped_to_one() -> None:
    for seed in range(20):
        x = np.random.default_rng(seed).normal(size=37) * 1e3 + 0.1
        metric = PearsonCorrelationMetric()
        metric.update(torch.tensor(x), torch.tensor(x * 3.0))
        negative = PearsonCorrelationMetric()
        negative.update(torch.tensor(x), torch.tensor(-x))
        assert -1.0 <= negative.compute().item() <= metric.compute().item() <= 1.0
        assert metric.compute().item() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("cpu_path", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bins", [100, 101, 150, 1000])
def test_two_decimal_scores_are_exact_with_101_bins_or_more(
    monkeypatch: pytest.MonkeyPatch, cpu_path: bool, dtype: torch.dtype, bins: int
) -> None:
    """docs/ranking.md: distinct two-decimal scores get distinct bins once num_bins >= 101, or
    >= 100 when no score is exactly 1.0 (1.0 goes to the last bin)."""
    if not cpu_path:
        monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    rng = np.random.default_rng(bins)
    top = 100 if bins == 100 else 101
    decimals = np.round(rng.integers(0, top, size=4000) / 100, 2)
    target = (rng.random(4000) < decimals).astype(np.int64)
    target[:2] = [0, 1]
    scores = torch.tensor(decimals).to(dtype)
    auroc, ap = BinaryAUROCMetric(bins), BinaryAveragePrecisionMetric(bins)
    for metric in (auroc, ap):
        metric.update(scores, torch.tensor(target))
    # Every distinct score has a bin of its own (ties share one, and are scored as ties).
    negatives, positives = auroc.histograms()
    assert int(((negatives + positives)[0] > 0).sum()) == len(np.unique(decimals))
    seen = scores.double().numpy()
    assert auroc.compute().item() == pytest.approx(roc_auc_score(target, seen), abs=1e-12)
    assert ap.compute().item() == pytest.approx(average_precision_score(target, seen), abs=1e-12)
    edge = BinaryAUROCMetric(100)
    edge.update(torch.tensor([0.28, 0.29], dtype=dtype), torch.tensor([0, 1]))
    assert edge.compute().item() == 1.0


def test_top_k_macro_leaves_out_classes_seen_only_in_a_top_k_set() -> None:
    """A perfect top-5 classifier on one sample: torchmetrics' macro top-5 accuracy is 1.0."""
    preds = torch.tensor([[0.5, 0.2, 0.1, 0.08, 0.07, 0.05]])
    target = torch.tensor([0])
    metric = confusion_count_metric().multiclass(6, top_k=5).with_accuracy().macro().build()
    metric.update(preds, target)
    expected = multiclass_accuracy(preds, target, num_classes=6, top_k=5, average="macro")
    assert metric.compute().item() == pytest.approx(expected.item()) == 1.0
    generator = torch.Generator().manual_seed(3)
    for top_k in (2, 3):
        preds = torch.rand(40, 7, generator=generator)
        target = torch.randint(0, 5, (40,), generator=generator)  # classes 5 and 6 never true
        for average in ("macro", "weighted", "micro"):
            built = confusion_count_metric().multiclass(7, top_k=top_k).with_recall()
            metric = getattr(built, average)().build()
            metric.update(preds, target)
            expected = multiclass_accuracy(
                preds, target, num_classes=7, top_k=top_k, average=average
            )
            assert metric.compute().item() == pytest.approx(expected.item(), abs=1e-6), average


@pytest.mark.parametrize("weights", [None, "linear", "quadratic"])
def test_kappa_uses_class_indices_when_a_middle_class_is_absent(weights: str | None) -> None:
    """The documented convention: torchmetrics and scikit-learn with labels=range(C)."""
    preds = np.array([0, 2, 2, 0, 2, 3, 0, 3])
    target = np.array([0, 2, 0, 0, 3, 3, 2, 3])  # class 1 never occurs
    metric = MulticlassCohenKappaMetric(4, weights=weights)  # type: ignore[arg-type]
    metric.update(torch.tensor(preds), torch.tensor(target))
    value = metric.compute().item()
    labelled = cohen_kappa_score(target, preds, labels=[0, 1, 2, 3], weights=weights)
    functional = multiclass_cohen_kappa(
        torch.tensor(preds), torch.tensor(target), num_classes=4, weights=weights
    )
    assert value == pytest.approx(labelled, abs=1e-12)
    assert value == pytest.approx(functional.item(), abs=1e-6)
    present_only = cohen_kappa_score(target, preds, weights=weights)
    if weights is None:
        assert value == pytest.approx(present_only, abs=1e-12)
    else:  # scikit-learn without labels= numbers the present classes 0, 1, 2: docs say so
        assert value != pytest.approx(present_only, abs=1e-6)


def test_nan_multiclass_scores_are_not_counted_as_a_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU raises naming preds before the state changes; the device path drops and counts."""
    scores = torch.tensor([[0.1, 0.7, 0.2], [float("nan"), float("nan"), float("nan")]])
    target = torch.tensor([1, 2])
    for make in (
        lambda: MulticlassConfusionMatrixMetric(3),
        lambda: confusion_count_metric().multiclass(3).with_recall().per_class().build(),
        lambda: confusion_count_metric().multiclass(3, top_k=2).with_recall().build(),
    ):
        metric = make()
        with pytest.raises(ValueError, match=r"preds.*NaN"):
            metric.update(scores, target)
        saved = metric.state_dict()
        assert all(
            int(t.abs().sum()) == 0
            for k, t in saved.items()
            if k not in ("configuration", DTYPES_KEY)
        )

    def device_screen(checks: list, rejected):  # type: ignore[no-untyped-def]
        bad = torch.stack([torch.as_tensor(flag).any() for flag, *_ in checks]).any()
        rejected.accumulate(bad.to(torch.int64))
        return ~bad

    monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    monkeypatch.setattr(_inputs, "screen", device_screen)
    matrix = MulticlassConfusionMatrixMetric(3)
    matrix.update(scores, target)
    matrix.update(scores[:1], target[:1])
    assert matrix.rejected_updates.item() == 1
    assert matrix.compute().sum().item() == 1
    binary = confusion_count_metric().binary(logits=True).with_recall().build()
    binary.update(torch.tensor([float("nan"), 3.0]), torch.tensor([1, 1]))
    assert binary.rejected_updates.item() == 1
    assert int(binary.counts()["fn"].sum()) == 0
