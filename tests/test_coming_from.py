"""The differences docs/coming-from-torchmetrics.md states, checked against torchmetrics itself."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from sidestream import MaxMetric, MeanMetric, MinMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.classification import MulticlassAUROCMetric, confusion_count_metric

tm = pytest.importorskip("torchmetrics")
from torchmetrics import classification as tmc  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", module="torchmetrics")


def test_logits_are_declared_not_guessed() -> None:
    logits, target = torch.tensor([2.0, -1.0, 0.3, -0.2]), torch.tensor([1, 0, 0, 1])
    theirs = tmc.BinaryAccuracy()
    theirs.update(logits, target)  # sigmoid applied because values leave [0, 1]
    ours = confusion_count_metric().binary(0.5, logits=True).with_accuracy().build()
    ours.update(logits, target)
    assert float(ours.compute()) == pytest.approx(float(theirs.compute()))
    with pytest.raises(ValueError, match=r"pass logits=True"):
        confusion_count_metric().binary().with_accuracy().build().update(logits, target)


def test_class_dimension_is_last() -> None:
    scores, target = torch.randn(2, 4, 6), torch.randint(0, 4, (2, 6))
    theirs = tmc.MulticlassAccuracy(4, average="micro")
    theirs.update(scores, target)  # (N, C, L)
    ours = confusion_count_metric().multiclass(4).with_accuracy().micro().build()
    ours.update(scores.movedim(1, -1), target)
    assert float(ours.compute()) == pytest.approx(float(theirs.compute()))
    with pytest.raises(ValueError, match="num_classes"):
        confusion_count_metric().multiclass(4).with_accuracy().build().update(scores, target)


def test_undefined_auroc_is_nan_and_left_out_of_the_mean() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.7, 0.1], [0.6, 0.3, 0.1], [0.3, 0.6, 0.1]])
    target = torch.tensor([0, 1, 0, 1])
    theirs = tmc.MulticlassAUROC(3, average="none")
    theirs.update(probs, target)
    assert theirs.compute().tolist() == [1.0, 1.0, 0.0]
    ours = MulticlassAUROCMetric(3, num_bins=1000, average="none")
    ours.update(probs, target)
    assert ours.compute()[:2].tolist() == [1.0, 1.0]
    assert math.isnan(float(ours.compute()[2]))
    macro = MulticlassAUROCMetric(3, num_bins=1000)
    macro.update(probs, target)
    their_macro = tmc.MulticlassAUROC(3)
    their_macro.update(probs, target)
    assert float(macro.compute()) == 1.0
    assert float(their_macro.compute()) == pytest.approx(2 / 3)


def test_absent_class_left_out_of_macro_in_both() -> None:
    preds, target = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1, 1])
    theirs = tmc.MulticlassPrecision(3, average="macro")
    theirs.update(preds, target)
    ours = confusion_count_metric().multiclass(3).with_precision().macro().build()
    ours.update(preds, target)
    assert float(ours.compute()) == float(theirs.compute()) == 1.0


def _per_class_with_zero_division_1(statistic: str) -> tuple[list[float], list[float]]:
    """torchmetrics' and sidestream's per-class ``statistic`` with ``zero_division=1.0`` on
    two samples of class 1, both predicted 1 (classes 0 and 2: no sample, nothing predicted).
    """
    scores = torch.tensor([[0.1, 0.9, 0.0], [0.2, 0.8, 0.0]])
    target = torch.tensor([1, 1])
    theirs = getattr(tmc, f"Multiclass{statistic}")(3, average="none", zero_division=1.0)
    theirs.update(scores, target)
    builder = confusion_count_metric(zero_division=1.0).multiclass(3)
    ours = getattr(builder, f"with_{statistic.lower()}")().per_class().build()
    ours.update(scores, target)
    return theirs.compute().tolist(), ours.compute().tolist()


def test_zero_division_applies_to_accuracy_and_specificity_too() -> None:
    """torchmetrics' accuracy and specificity give 0 for a class's 0/0 whatever zero_division;
    sidestream gives zero_division, as scikit-learn's recall (per-class accuracy) does."""
    from sklearn.metrics import recall_score

    theirs, ours = _per_class_with_zero_division_1("Accuracy")
    assert theirs == [0.0, 1.0, 0.0]
    expected = recall_score([1, 1], [1, 1], labels=[0, 1, 2], average=None, zero_division=1.0)
    assert ours == expected.tolist() == [1.0, 1.0, 1.0]
    # Specificity of class 1: no negative sample, so tn + fp = 0.
    theirs, ours = _per_class_with_zero_division_1("Specificity")
    assert theirs == [1.0, 0.0, 1.0]
    assert ours == [1.0, 1.0, 1.0]


def test_weighted_mean_without_support_is_the_plain_mean_as_in_scikit_learn() -> None:
    """Multilabel, no positive target: every label's support (the weight) is 0. torchmetrics
    returns 0; sidestream, like scikit-learn's weighted averages, the plain mean."""
    from sklearn.metrics import precision_score

    preds, target = torch.tensor([[0.9, 0.8, 0.1]]), torch.tensor([[0, 0, 0]])
    theirs = tmc.MultilabelAccuracy(3, average="weighted")
    theirs.update(preds, target)
    assert float(theirs.compute()) == 0.0
    ours = confusion_count_metric().multilabel(3).with_accuracy().weighted().build()
    ours.update(preds, target)
    assert float(ours.compute()) == pytest.approx(1 / 3)  # labels right: 0, 0, 1
    # scikit-learn's rule on a statistic it has: precision 0, 0 and (zero_division) 1.
    predicted = (preds >= 0.5).int().numpy()
    sk = precision_score(target.numpy(), predicted, average="weighted", zero_division=1.0)
    precision = confusion_count_metric(zero_division=1.0).multilabel(3).with_precision()
    our_precision = precision.weighted().build()
    our_precision.update(preds, target)
    assert float(our_precision.compute()) == pytest.approx(sk) == pytest.approx(1 / 3)


def test_top_k_micro_accuracy_agrees_and_precision_differs() -> None:
    scores = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.5, 0.4, 0.0]])
    target = torch.tensor([1, 2])
    theirs = tmc.MulticlassAccuracy(4, top_k=2, average="micro")
    theirs.update(scores, target)
    ours = confusion_count_metric().multiclass(4, top_k=2).with_accuracy().micro().build()
    ours.update(scores, target)
    assert float(ours.compute()) == float(theirs.compute()) == 1.0
    their_precision = tmc.MulticlassPrecision(4, top_k=2, average="micro")
    their_precision.update(scores, target)
    our_precision = confusion_count_metric().multiclass(4, top_k=2).with_precision().micro()
    metric = our_precision.build()
    metric.update(scores, target)
    assert float(their_precision.compute()) == 1.0  # equals its top-k accuracy
    assert float(metric.compute()) == 0.5  # 2 hits among 4 predicted (sample, class) pairs


AGGREGATIONS = {
    "SumMetric": (SumMetric, 4.0),
    "MeanMetric": (MeanMetric, 2.0),
    "MaxMetric": (MaxMetric, 3.0),
    "MinMetric": (MinMetric, 1.0),
}


@pytest.mark.parametrize("name", list(AGGREGATIONS))
def test_nan_propagates_where_torchmetrics_drops_it(name: str) -> None:
    ours_class, dropped = AGGREGATIONS[name]
    values = torch.tensor([1.0, float("nan"), 3.0])
    theirs = getattr(tm, name)()
    theirs.update(values)
    assert float(theirs.compute()) == dropped  # the NaN left out, by default
    ours = ours_class()
    ours.update(values)
    assert math.isnan(float(ours.compute()))
    ignoring = ours_class(nan_strategy="ignore")
    ignoring.update(values)
    assert float(ignoring.compute()) == dropped
    assert ignoring.nan_count is not None and int(ignoring.nan_count) == 1


@pytest.mark.parametrize("name", list(AGGREGATIONS))
def test_nan_strategy_error_and_warn(name: str) -> None:
    ours_class, _ = AGGREGATIONS[name]
    values = torch.tensor([1.0, float("nan")])
    with pytest.raises(RuntimeError, match="nan"):
        getattr(tm, name)(nan_strategy="error").update(values)
    ours = ours_class(nan_strategy="error")
    with pytest.raises(ValueError, match="values"):
        ours.update(values)
    # Raised before the state changed: still the result over no data.
    torch.testing.assert_close(ours.compute(), ours_class().compute(), equal_nan=True)
    getattr(tm, name)(nan_strategy="warn")
    with pytest.raises(ValueError, match=r'nan_strategy: .*"ignore"'):
        ours_class(nan_strategy="warn")


@pytest.mark.parametrize("name", list(AGGREGATIONS))
def test_integer_values_refused_where_torchmetrics_casts_them(name: str) -> None:
    ours_class, _ = AGGREGATIONS[name]
    values = torch.tensor([1, 3])
    theirs = getattr(tm, name)()
    theirs.update(values)
    ours = ours_class()
    with pytest.raises(TypeError, match="values: expected a floating-point tensor"):
        ours.update(values)
    ours.update(values.double())
    assert float(ours.compute()) == float(theirs.compute())
    weighted = WeightedMeanMetric()
    weighted.update(torch.tensor([1.0, 3.0]), weights=torch.tensor([1, 3]))  # int weights
    assert float(weighted.compute()) == 2.5


def test_result_dtype_is_float64_where_torchmetrics_uses_the_default_dtype() -> None:
    values = torch.tensor([1.0, 2.0], dtype=torch.float64)
    theirs = tm.SumMetric()
    theirs.update(values)
    assert theirs.compute().dtype == torch.get_default_dtype() == torch.float32
    ours = SumMetric()
    ours.update(values.float())
    assert ours.compute().dtype == torch.float64
    assert SumMetric(dtype=torch.float32).compute().dtype == torch.float32


def test_state_dict_holds_the_state() -> None:
    theirs = tm.MeanMetric()
    theirs.update(torch.tensor([1.0, 2.0]))
    assert dict(theirs.state_dict()) == {}  # states are not persistent by default
    ours = MeanMetric()
    ours.update(torch.tensor([1.0, 2.0]))
    restored = MeanMetric()
    restored.load_state_dict(ours.state_dict())
    assert float(restored.compute()) == 1.5
