"""Defects a differential probe found (against scikit-learn, torchmetrics and direct sums)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import pearsonr
from sklearn.metrics import confusion_matrix, r2_score

from sidestream.metrics import MaxMetric, MeanMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    MatthewsCorrCoefMetric,
    MulticlassConfusionMatrixMetric,
    confusion_count_metric,
)
from sidestream.metrics.language import PerplexityMetric
from sidestream.metrics.regression import PearsonCorrelationMetric, R2ScoreMetric


def test_confusion_results_are_snapshots_not_views_of_the_state() -> None:
    preds, target = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 2, 2, 1])
    matrix = MulticlassConfusionMatrixMetric(3)
    matrix.update(preds, target)
    first, counts_matrix = matrix.compute(), matrix.confusion_matrix()
    mcc = MatthewsCorrCoefMetric(3)
    mcc.update(preds, target)
    mcc_matrix = mcc.confusion_matrix()
    builder = confusion_count_metric().multiclass(3).with_f1().build()
    builder.update(torch.eye(3)[preds], target)
    counts = builder.counts()
    auroc = BinaryAUROCMetric(4)
    auroc.update(torch.tensor([0.1, 0.9]), torch.tensor([0, 1]))
    negatives, positives = auroc.histograms()
    expected = confusion_matrix(target, preds, labels=[0, 1, 2])
    for metric in (matrix, mcc):
        metric.update(preds, target)  # a later update leaves earlier results alone
    builder.update(torch.eye(3)[preds], target)
    auroc.update(torch.tensor([0.1, 0.9]), torch.tensor([0, 1]))
    for result in (first, counts_matrix, mcc_matrix):
        assert result.tolist() == expected.tolist()
    assert counts["tp"].tolist() == np.diag(expected).tolist()
    assert negatives.reshape(-1).tolist() == [1, 0, 0, 0]
    assert positives.reshape(-1).tolist() == [0, 0, 0, 1]
    first.zero_()  # and editing a result leaves the state alone
    assert matrix.compute().tolist() == (2 * expected).tolist()


def test_r2_of_a_constant_target_is_nan_and_weighs_nothing_in_variance_weighted() -> None:
    constant = R2ScoreMetric()
    constant.update(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 3.0]))
    assert torch.isnan(constant.compute())
    target = torch.tensor([[1.0, 5.0], [2.0, 5.0], [4.0, 5.0]])
    preds = torch.tensor([[1.5, 4.0], [2.0, 6.0], [3.0, 5.0]])
    weighted = R2ScoreMetric(2, "variance_weighted")
    weighted.update(preds, target)
    expected = r2_score(
        target.double().numpy(), preds.double().numpy(), multioutput="variance_weighted"
    )
    assert weighted.compute().item() == pytest.approx(expected, rel=1e-12)


def test_a_variance_lost_to_rounding_is_nan_not_noise() -> None:
    """0.1 is not exact in float64: the one-pass spread of a constant 0.1 leaves rounding noise,
    which made R2 about -9e15 and the correlation a tiny number instead of undefined."""
    generator = torch.Generator().manual_seed(0)
    preds = torch.rand(30, generator=generator, dtype=torch.float64)
    constant = torch.full((30,), 0.1, dtype=torch.float64)
    r2, pearson = R2ScoreMetric(), PearsonCorrelationMetric()
    r2.update(preds, constant)
    pearson.update(preds, constant)
    assert torch.isnan(r2.compute()) and torch.isnan(pearson.compute())
    # Data with a spread is untouched (scipy and scikit-learn as references).
    x = np.random.default_rng(1).normal(size=200) + 10.0
    y = x + np.random.default_rng(2).normal(size=200)
    r2, pearson = R2ScoreMetric(), PearsonCorrelationMetric()
    r2.update(torch.tensor(y), torch.tensor(x))
    pearson.update(torch.tensor(x), torch.tensor(y))
    assert r2.compute().item() == pytest.approx(r2_score(x, y), rel=1e-9)
    assert pearson.compute().item() == pytest.approx(pearsonr(x, y).statistic, rel=1e-9)


@pytest.mark.parametrize("compiled", [False, True])
def test_perplexity_refuses_logits_that_make_a_counted_loss_non_finite(compiled: bool) -> None:
    """Eager on CPU it raises; compiled (the device path, as on CUDA) it drops and counts."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 5, generator=generator)
    target = torch.randint(0, 5, (2, 4), generator=generator)
    bad = logits.clone()
    bad[0, 1, 2] = float("nan")
    ignored = target.clone()
    ignored[0, 1] = -100  # NaN logits at an ignored token do not count
    metric = PerplexityMetric()
    step = metric.update
    if compiled:
        torch._dynamo.reset()
        step = torch.compile(metric.update, fullgraph=True, backend="aot_eager")
    step(logits, target)
    if compiled:
        step(bad, target)  # dropped and counted
        assert int(metric.rejected_updates) == 1
    else:
        with pytest.raises(ValueError, match="logits: expected finite logits"):
            step(bad, target)
    step(bad, ignored)
    kept = torch.cat([target.reshape(-1), ignored.reshape(-1)])
    rows = torch.cat([logits.reshape(-1, 5), bad.reshape(-1, 5)])
    mask = kept != -100
    nll = F.cross_entropy(rows[mask].double(), kept[mask], reduction="mean")
    assert metric.compute().item() == pytest.approx(float(nll.exp()), rel=1e-6)


def test_num_bins_with_thresholds_is_refused() -> None:
    with pytest.raises(ValueError, match="num_bins"):
        BinaryAUROCMetric(num_bins=5, thresholds=[0.0, 0.5, 1.0])


def test_one_dimensional_float_multiclass_preds_are_refused_not_read_as_one_sample() -> None:
    """A float (C,) vector is one sample's scores or float class indices: refused, naming both
    layouts, instead of counted as one sample with a one-hot target."""
    for metric in (
        MulticlassConfusionMatrixMetric(3),
        confusion_count_metric().multiclass(3).with_accuracy().build(),
    ):
        with pytest.raises(ValueError, match=r"preds: expected scores of shape \(N, \.\.\., C\)"):
            metric.update(torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0, 1, 0]))


def test_python_ints_are_values_like_floats() -> None:
    mean, total, largest = MeanMetric(), SumMetric(), MaxMetric()
    weighted = WeightedMeanMetric()
    for metric in (mean, total, largest):
        metric.update(3)
        metric.update(4.0)
    weighted.update(3, 2)
    weighted.update(6.0, 1)
    assert (mean.compute().item(), total.compute().item(), largest.compute().item()) == (
        3.5,
        7.0,
        4.0,
    )
    assert weighted.compute().item() == 4.0
    with pytest.raises(TypeError, match="values: expected a floating-point tensor"):
        mean.update(torch.tensor([3]))  # an integer tensor is still refused


def test_nan_messages_do_not_say_outside() -> None:
    with pytest.raises(
        ValueError, match=r"preds: expected probabilities in \[0, 1\].*that are not"
    ):
        BinaryAUROCMetric(4).update(torch.tensor([0.5, float("nan")]), torch.tensor([0, 1]))


def test_pearson_target_shift_handles_inputs_with_different_means() -> None:
    """One shift cannot serve preds near 5e3 and targets near 1e8; a second one can."""
    rng = np.random.default_rng(0)
    y = rng.normal(size=1000) + 1e8
    x = (y - 1e8) * 2 + rng.normal(size=1000) + 5e3
    metric = PearsonCorrelationMetric(shift=5e3, target_shift=1e8)
    metric.update(torch.tensor(x[:400]), torch.tensor(y[:400]))
    metric.update(torch.tensor(x[400:]), torch.tensor(y[400:]))
    assert metric.compute().item() == pytest.approx(pearsonr(x, y).statistic, rel=1e-9)
    with pytest.raises(ValueError, match="target_shift"):
        PearsonCorrelationMetric(target_shift=[1.0, 2.0])


@pytest.mark.parametrize("num_classes", [4, 5, 50])
@pytest.mark.parametrize("device_path", [False, True])
def test_weighted_specificity_without_usable_support_averages_present_classes_only(
    num_classes: int, device_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every class with targets is undefined (0/0 with zero_division=nan): the fallback is the
    # plain mean of the classes left, and scikit-learn's labels are the classes in the targets
    # or predictions; a class that never occurs (specificity 1) made the value grow with C.
    from sklearn.metrics import multilabel_confusion_matrix

    from sidestream.metrics.classification import _cpu_path

    if device_path:
        monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    preds, target = torch.tensor([1, 3, 0, 0]), torch.tensor([1, 1, 2, 2])
    keep = torch.tensor([True, True, False, False])  # samples 2 and 3: ignored below
    metric = (
        confusion_count_metric(zero_division=float("nan"), ignore_index=-1)
        .multiclass(num_classes)
        .with_specificity()
        .weighted()
        .build()
    )
    metric.update(preds, torch.where(keep, target, -1))
    labels = sorted(set(preds[keep].tolist()) | set(target[keep].tolist()))
    counts = multilabel_confusion_matrix(target[keep], preds[keep], labels=labels)
    tn, fp = counts[:, 0, 0].astype(float), counts[:, 0, 1].astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        expected = np.nanmean(tn / (tn + fp))
    assert float(metric.compute()) == pytest.approx(expected)


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logits_are_compared_with_the_logit_of_the_threshold(
    dtype: torch.dtype, device_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sigmoid(x) >= t exactly when x >= log(t / (1 - t)). Through a float32 sigmoid, every
    # logit above about 17 was 1.0 (positive at threshold 1.0, though sigmoid(x) < 1 for every
    # finite x), and a logit of -1e-7 was 0.5 (positive at threshold 0.5).
    from sidestream.metrics.classification import (
        BinaryConfusionMatrixMetric,
        MultilabelConfusionMatrixMetric,
        _cpu_path,
    )

    if device_path:
        monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    logits = torch.tensor([17.0, 40.0, 10.0, -1e-7, 0.0, -40.0, float("inf")], dtype=dtype)
    expected = {
        1.0: [0, 0, 0, 0, 0, 0, 1],
        0.5: [1, 1, 1, 0, 1, 0, 1],
        0.0: [1, 1, 1, 1, 1, 1, 1],
        0.9999999: [1, 1, 0, 0, 0, 0, 1],  # logit(0.9999999) = 16.1
    }
    if dtype == torch.bfloat16:  # -1e-7 is a bfloat16 too, but 17.0 and 40.0 stay as given
        assert logits.to(torch.float64)[3] < 0
    for threshold, positive in expected.items():
        matrix = BinaryConfusionMatrixMetric(threshold, logits=True)
        matrix.update(logits, torch.ones(len(positive), dtype=torch.long))
        assert matrix.compute()[1].tolist() == [positive.count(0), positive.count(1)], threshold
        per_label = MultilabelConfusionMatrixMetric(1, threshold, logits=True)
        per_label.update(logits.unsqueeze(-1), torch.ones(len(positive), 1, dtype=torch.long))
        assert per_label.compute()[0, 1].tolist() == [positive.count(0), positive.count(1)]
        recall = confusion_count_metric().binary(threshold, logits=True).with_recall().build()
        recall.update(logits, torch.ones(len(positive), dtype=torch.long))
        assert float(recall.compute()) == pytest.approx(sum(positive) / len(positive))
