"""Builder rules, result shapes, and bad input for the confusion-count metrics (CPU)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.metrics import confusion_matrix

from sidestream import ComposeMetric
from sidestream.metrics.classification import (
    ConfusionCountMetric,
    MulticlassConfusionMatrixMetric,
    Problem,
    ProblemKind,
    SamplewiseConfusionCountMetric,
    confusion_count_metric,
)
from tests._checkpoints import states_only


def _multiclass(**options: Any) -> ConfusionCountMetric:
    return confusion_count_metric(**options).multiclass(4).with_accuracy().with_f1().build()


def test_result_shapes_and_names() -> None:
    single = confusion_count_metric().multiclass(3).with_f1().micro().build()
    single.update(torch.randn(10, 3), torch.randint(0, 3, (10,)))
    value = single.compute()
    assert isinstance(value, torch.Tensor) and value.shape == () and value.dtype == torch.float64

    several = (
        confusion_count_metric()
        .multiclass(3)
        .with_f1()
        .with_fbeta(1.0)  # the same statistic: kept once
        .with_fbeta(0.5)
        .with_specificity()
        .per_class()
        .build()
    )
    several.update(torch.randn(10, 3), torch.randint(0, 3, (10,)))
    values = several.compute()
    assert isinstance(values, dict) and list(values) == ["f1", "f0.5", "specificity"]
    assert all(v.shape == (3,) for v in values.values())

    binary = confusion_count_metric().binary().with_recall().with_precision().build()
    binary.update(torch.rand(7), torch.randint(0, 2, (7,)))
    assert all(v.shape == () for v in binary.compute().values())


def test_builder_is_immutable() -> None:
    base = confusion_count_metric().multiclass(3).with_accuracy()
    micro, macro = base.micro().build(), base.macro().build()
    preds, target = torch.tensor([0, 1, 1, 1]), torch.tensor([0, 1, 2, 2])
    micro.update(preds, target)
    macro.update(preds, target)
    assert micro.compute().item() == pytest.approx(0.5)
    assert macro.compute().item() == pytest.approx((1 + 1 + 0) / 3)


class _Named:
    """A custom statistic (recall under any name) with no equality of its own."""

    def __init__(self, name: str, broadcast: bool = False) -> None:
        self.name, self._broadcast = name, broadcast

    def ratio(self, kind: Any, counts: Any) -> tuple[torch.Tensor, torch.Tensor]:
        numerator = counts.tp.sum().reshape(1) if self._broadcast else counts.tp
        return numerator, counts.tp + counts.fn


def test_statistic_names_are_exact_and_a_plain_custom_statistic_may_repeat() -> None:
    metric = (
        confusion_count_metric()
        .multiclass(3)
        .with_fbeta(2)
        .with_fbeta(2.0000001)
        .with_f1()
        .with_fbeta(1.0)
        .with_statistic(_Named("mine"))
        .with_statistic(_Named("mine"))
        .macro()
        .build()
    )
    preds, target = torch.tensor([0, 1, 1, 2]), torch.tensor([0, 1, 2, 2])
    metric.update(preds, target)
    values = metric.compute()
    assert isinstance(values, dict) and list(values) == ["f2", "f2.0000001", "f1", "mine"]
    assert values["mine"].item() == pytest.approx((1 + 1 + 0.5) / 3)


def test_a_plain_custom_statistic_with_other_attributes_is_not_dropped() -> None:
    with pytest.raises(ValueError, match=r"statistic: the name 'mine' is taken by"):
        confusion_count_metric().multiclass(3).with_statistic(_Named("mine")).with_statistic(
            _Named("mine", broadcast=True)
        )
    with pytest.raises(ValueError, match="statistics: select at least one"):
        SamplewiseConfusionCountMetric(Problem(ProblemKind.MULTICLASS, 3), ())


@pytest.mark.parametrize("metric_class", [ConfusionCountMetric, SamplewiseConfusionCountMetric])
def test_direct_construction_checks_problem_and_statistics(metric_class: type) -> None:
    # SamplewiseConfusionCountMetric took two statistics of one name (compute() returned one
    # value, of the other's sums) and a non-Problem (AttributeError 'kind'); both classes read
    # a string statistic's name before refusing it (AttributeError 'name').
    from sidestream.metrics.classification import Precision

    problem = Problem(ProblemKind.MULTICLASS, 3)
    with pytest.raises(ValueError, match=r"statistics: names must be unique"):
        metric_class(problem, [Precision(), Precision()])
    with pytest.raises(TypeError, match=r"statistics: expected Statistic objects, got 'f1'"):
        metric_class(problem, ["f1"])
    with pytest.raises(TypeError, match=r"problem: expected a sidestream Problem, got 3"):
        metric_class(3, [Precision()])


def test_one_hot_integer_preds_are_refused_naming_preds() -> None:
    # (N, C) integer predictions are class indices with positions; against (N,) targets the
    # error blamed the target ("expected class indices of shape (2, 3) or one-hot targets of
    # shape (2, 3, 3)") and never said what to do with the predictions.
    preds, target = torch.tensor([[0, 1, 0], [1, 0, 0]]), torch.tensor([1, 0])
    for metric in (
        confusion_count_metric().multiclass(3).with_accuracy().build(),
        MulticlassConfusionMatrixMetric(3),
    ):
        with pytest.raises(ValueError, match=r"preds: integer preds are class indices.*argmax"):
            metric.update(preds, target)
        metric.update(preds.argmax(-1), target)


def test_a_ratio_of_another_shape_is_refused_naming_the_statistic() -> None:
    preds, target = torch.tensor([0, 1]), torch.tensor([0, 2])
    odd = _Named("odd", broadcast=True)
    overall = confusion_count_metric().multiclass(3).with_statistic(odd).macro().build()
    overall.update(preds, target)
    with pytest.raises(
        ValueError, match=r"statistic 'odd': ratio must return .*; got \(\(1,\), \(3,\)\)"
    ):
        overall.compute()
    per_sample = (
        confusion_count_metric(multidim_average="samplewise")
        .multiclass(3)
        .with_statistic(odd)
        .macro()
        .build()
    )
    before = per_sample.state_dict()
    with pytest.raises(ValueError, match=r"statistic 'odd': ratio must return"):
        per_sample.update(preds.reshape(1, 2), target.reshape(1, 2))
    after = per_sample.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in states_only(before))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: confusion_count_metric().with_f1().build(), ValueError, "problem"),
        (lambda: confusion_count_metric().binary().build(), ValueError, "statistic"),
        (lambda: confusion_count_metric().binary().multiclass(3), ValueError, "problem"),
        (
            lambda: confusion_count_metric().binary().with_f1().macro().build(),
            ValueError,
            "binary",
        ),
        (
            lambda: confusion_count_metric().multiclass(3).micro().macro(),
            ValueError,
            "average",
        ),
        (lambda: confusion_count_metric().multiclass(3).with_fbeta(0), ValueError, "beta"),
        # True was taken as beta = 1 (F1), silently, where False was refused.
        (lambda: confusion_count_metric().multiclass(3).with_fbeta(True), TypeError, "beta"),
        (lambda: confusion_count_metric().multiclass(3, top_k=4), ValueError, "top_k"),
        (lambda: confusion_count_metric().multiclass(1), ValueError, "num_classes"),
        (lambda: confusion_count_metric().multiclass(2.0), TypeError, "num_classes"),
        (lambda: confusion_count_metric().binary(1.5), ValueError, "threshold"),
        (lambda: _multiclass(zero_division=0.5), ValueError, "zero_division"),
        (
            lambda: confusion_count_metric(zero_division="warn"),  # type: ignore[arg-type]
            ValueError,
            r"zero_division: expected 0.0, 1.0 or NaN, got 'warn' \(scikit-learn's 'warn'",
        ),
        (
            lambda: confusion_count_metric(zero_division=None),  # type: ignore[arg-type]
            ValueError,
            "zero_division: expected 0.0, 1.0 or NaN, got None",
        ),
        (
            lambda: (
                confusion_count_metric(multidim_average="samplewise", zero_division=2.0)
                .multiclass(3)
                .with_f1()
                .build()
            ),
            ValueError,
            "zero_division: expected 0.0, 1.0 or NaN, got 2.0",
        ),
        (lambda: confusion_count_metric().binary(True), TypeError, "threshold"),  # type: ignore[arg-type]
        (
            lambda: (
                confusion_count_metric().multiclass(3).with_fbeta(2).with_statistic(_Named("f2"))
            ),
            ValueError,
            r"statistic: the name 'f2' is taken by FBeta\(beta=2.0\)",
        ),
        (lambda: _multiclass(ignore_index=1.0), TypeError, "ignore_index"),
        (lambda: MulticlassConfusionMatrixMetric(1), ValueError, "num_classes"),
    ],
)
def test_builder_errors(make: Callable[[], object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


MULTICLASS_BAD = [
    # (preds, target, error, message fragment)
    (torch.randn(4, 5), torch.tensor([0, 1, 2, 3]), ValueError, r"preds: .*num_classes = 4"),
    (torch.randn(4, 4), torch.tensor([0, 1, 2]), ValueError, r"target: expected class indices"),
    (torch.randn(4, 4), torch.tensor([0, 1, 2, 4]), ValueError, r"target: .*\[0, 4\)"),
    (torch.randn(4, 4), torch.tensor([0, 1, 2, -1]), ValueError, r"target: .*\[0, 4\)"),
    (torch.tensor([0, 1, 5, 3]), torch.tensor([0, 1, 2, 3]), ValueError, r"preds: .*\[0, 4\)"),
    (torch.randn(4, 4), torch.tensor([0.0, 1, 2, 3]), TypeError, "target: expected integer"),
    (
        torch.randn(2, 4),
        torch.tensor([[1, 1, 0, 0], [0, 0, 1, 0]]),
        ValueError,
        r"one-hot rows.* \(found \[1, 1, 0, 0\]: 1 of 2 rows\)",  # the bad row shown
    ),
    (torch.randn(4, 4), [0, 1, 2, 3], TypeError, "target: expected a torch.Tensor"),
    (torch.randn(4, 4).bool(), torch.tensor([0, 1, 2, 3]), TypeError, "preds"),
]


@pytest.mark.parametrize(("preds", "target", "error", "match"), MULTICLASS_BAD)
def test_multiclass_bad_input_raises_before_state_changes(
    preds: Any, target: Any, error: type[Exception], match: str
) -> None:
    for metric in (_multiclass(), MulticlassConfusionMatrixMetric(4)):
        metric.update(torch.randn(6, 4), torch.randint(0, 4, (6,)))
        before = {name: acc.local.clone() for name, acc in metric.named_accumulators()}
        with pytest.raises(error, match=match):
            metric.update(preds, target)
        for name, accumulator in metric.named_accumulators():
            assert torch.equal(accumulator.local, before[name]), name


def test_ignore_index_is_not_out_of_range() -> None:
    metric = _multiclass(ignore_index=-100)
    metric.update(torch.tensor([0, 1, 2]), torch.tensor([0, -100, 2]))
    assert metric.counts()["tp"].tolist() == [1, 0, 1, 0]
    assert metric.counts()["tn"].tolist() == [1, 2, 1, 2]  # the ignored sample counts nowhere
    with pytest.raises(ValueError, match="ignore_index=-100"):
        metric.update(torch.tensor([0]), torch.tensor([-1]))
    assert metric.rejected_updates.item() == 0


def test_top_k_needs_scores() -> None:
    metric = confusion_count_metric().multiclass(4, top_k=2).with_recall().build()
    with pytest.raises(ValueError, match="top_k"):
        metric.update(torch.tensor([0, 1]), torch.tensor([0, 1]))


LABEL_BAD = [
    ("binary", torch.tensor([0.2, 1.2]), torch.tensor([0, 1]), ValueError, r"preds: .*\[0, 1\]"),
    ("binary", torch.tensor([0.2, -0.1]), torch.tensor([0, 1]), ValueError, "logits=True"),
    ("binary", torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]), ValueError, "preds"),
    ("binary", torch.tensor([0, 2]), torch.tensor([0, 1]), ValueError, "preds: expected 0/1"),
    ("binary", torch.tensor([0.2, 0.9]), torch.tensor([0, 2]), ValueError, "target: expected 0/1"),
    ("binary", torch.tensor([0.2, 0.9]), torch.tensor([0, 1, 1]), ValueError, "target: .*shape"),
    ("binary", torch.tensor([0.2, 0.9]), torch.tensor([0.5, 1.0]), ValueError, "target: .*0/1"),
    ("binary", torch.tensor([0.2, 0.9]), torch.tensor([float("nan"), 1.0]), ValueError, "target"),
    ("binary", torch.tensor([0.2, 0.9]), torch.tensor([0j, 1]), TypeError, "target"),
    # One score column per sample is not a one-class multiclass batch: the shapes differ.
    ("binary", torch.tensor([[0.9], [0.1]]), torch.tensor([0, 0]), ValueError, "target: .*shape"),
    ("multilabel", torch.rand(3, 4), torch.randint(0, 2, (3, 4)), ValueError, "num_labels = 3"),
    # A 1-D (L,) batch: far more likely L binary scores than one sample without its dimension.
    (
        "multilabel",
        torch.tensor([0.9, 0.2, 0.7]),
        torch.tensor([1, 0, 0]),
        ValueError,
        r"^preds: expected shape \(N, \.\.\., L\)",
    ),
]


@pytest.mark.parametrize(("kind", "preds", "target", "error", "match"), LABEL_BAD)
def test_binary_and_multilabel_bad_input(
    kind: str, preds: torch.Tensor, target: torch.Tensor, error: type[Exception], match: str
) -> None:
    builder = confusion_count_metric()
    builder = builder.binary() if kind == "binary" else builder.multilabel(3)
    metric = builder.with_accuracy().build()
    with pytest.raises(error, match=match):
        metric.update(preds, target)
    assert all(int(acc.local.sum()) == 0 for _, acc in metric.named_accumulators())


def test_logits_flag_accepts_any_real_score() -> None:
    metric = confusion_count_metric().binary(logits=True).with_accuracy().build()
    metric.update(torch.tensor([-3.0, 2.0, 0.1]), torch.tensor([0, 1, 0]))
    assert metric.compute().item() == pytest.approx(2 / 3)


def test_zero_division_policy() -> None:
    """No predicted positives: precision is 0/0, reported as the chosen value."""
    for zero_division in (0.0, 1.0):
        metric = (
            confusion_count_metric(zero_division=zero_division).binary().with_precision().build()
        )
        metric.update(torch.tensor([0.1, 0.2]), torch.tensor([1, 0]))
        assert metric.compute().item() == zero_division
    nan_metric = confusion_count_metric(zero_division=float("nan")).binary().with_recall().build()
    nan_metric.update(torch.tensor([0.1, 0.9]), torch.tensor([0, 0]))
    assert torch.isnan(nan_metric.compute())


def test_weighted_nan_zero_division_matches_sklearn_when_no_class_with_support_is_defined() -> None:
    """With zero_division=NaN scikit-learn leaves undefined classes out of a weighted mean; when
    that leaves only classes without support, it takes their plain mean instead of NaN."""
    from sklearn.metrics import f1_score, precision_score, recall_score

    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(300):
        size = int(rng.integers(1, 4))
        target, preds = rng.integers(0, 4, size), rng.integers(0, 4, size)
        scores = torch.nn.functional.one_hot(torch.as_tensor(preds), 4).double()
        for method, reference in (
            ("with_precision", precision_score),
            ("with_recall", recall_score),
            ("with_f1", f1_score),
        ):
            builder = confusion_count_metric(zero_division=float("nan")).multiclass(4)
            metric = getattr(builder, method)().weighted().build()
            metric.update(scores, torch.as_tensor(target))
            expected = reference(
                target, preds, labels=range(4), average="weighted", zero_division=np.nan
            )
            ours = float(metric.compute())
            assert (math.isnan(ours) and math.isnan(expected)) or ours == pytest.approx(expected), (
                method,
                target,
                preds,
                ours,
                expected,
            )
            checked += 1
    assert checked == 900


def test_reset_and_state_dict_round_trip() -> None:
    metric = _multiclass()
    metric.update(torch.randn(9, 4), torch.randint(0, 4, (9,)))
    expected = metric.compute()
    fresh = _multiclass()
    fresh.load_state_dict(metric.state_dict())
    assert all(torch.equal(fresh.compute()[k], expected[k]) for k in expected)
    metric.reset()
    assert all(int(acc.local.sum()) == 0 for _, acc in metric.named_accumulators())


def test_state_is_one_count_table_and_old_checkpoints_load() -> None:
    """The four counts are one ``(4, C)`` state; checkpoints with ``tp``/``fp``/``fn``/``tn``
    (the layout before it) still load, on their own and inside a tree."""
    metric = _multiclass()
    metric.update(torch.randn(9, 4), torch.randint(0, 4, (9,)))
    saved = metric.state_dict()
    assert sorted(saved) == ["configuration", "counts", "rejected", "sidestream/dtypes"] and saved[
        "counts"
    ].shape == (
        4,
        4,
    )
    counts = metric.counts()
    old = {name: counts[name].clone() for name in ("tp", "fp", "fn", "tn")}
    old["rejected"] = saved["rejected"]  # and no configuration: saved before there was one
    fresh = _multiclass()
    fresh.load_state_dict(old)
    assert torch.equal(fresh.state_dict()["counts"], saved["counts"])

    tree = ComposeMetric({"val": ComposeMetric({"acc": _multiclass()})})
    tree.load_state_dict({f"val.acc.{name}": value for name, value in old.items()})
    assert torch.equal(tree.state_dict()["val.acc.counts"], saved["counts"])
    with pytest.raises(KeyError, match="missing keys"):
        _multiclass().load_state_dict({"tp": old["tp"], "rejected": old["rejected"]})


def test_small_and_large_batches_count_alike() -> None:
    """A batch of at most C * C samples takes the map's columns, a larger one bincount."""
    scores, labels = torch.randn(300, 4), torch.randint(0, 4, (300,))
    whole, pieces = _multiclass(), _multiclass()
    whole.update(scores, labels)  # 300 > 16: bincount
    for start in range(0, 300, 10):  # 10 <= 16: the map's columns
        pieces.update(scores[start : start + 10], labels[start : start + 10])
    assert torch.equal(whole.counts()["tn"], pieces.counts()["tn"])
    assert all(torch.equal(whole.counts()[k], pieces.counts()[k]) for k in ("tp", "fp", "fn"))
    # Both paths against scikit-learn's confusion matrix, not only against each other.
    matrix = torch.from_numpy(
        confusion_matrix(labels.numpy(), scores.argmax(1).numpy(), labels=range(4))
    )
    tp = matrix.diagonal()
    fp, fn = matrix.sum(0) - tp, matrix.sum(1) - tp
    expected = {"tp": tp, "fp": fp, "fn": fn, "tn": 300 - tp - fp - fn}
    for name, value in expected.items():
        assert torch.equal(pieces.counts()[name], value.to(torch.int64)), name


@pytest.mark.parametrize("kind", ["binary", "multilabel"])
def test_float_zero_one_targets_count_as_labels(kind: str) -> None:
    """d9d and torchmetrics users pass float 0/1 targets; they count as the integer ones do."""
    from sklearn.metrics import multilabel_confusion_matrix

    generator = torch.Generator().manual_seed(4)
    shape = (60,) if kind == "binary" else (20, 3)
    scores = torch.rand(shape, generator=generator)
    labels = torch.randint(0, 2, shape, generator=generator)
    labels.view(-1)[:4] = -1  # ignored positions
    counts = []
    for target in (labels, labels.float(), labels.double(), labels.half()):
        builder = confusion_count_metric(ignore_index=-1)
        builder = builder.binary() if kind == "binary" else builder.multilabel(3)
        metric = builder.with_accuracy().build()
        metric.update(scores, target)
        counts.append(metric.counts())
    kept = (labels != -1).reshape(-1, 1 if kind == "binary" else 3)
    flat_scores, flat_labels = scores.reshape(kept.shape), labels.reshape(kept.shape)
    for column in range(kept.shape[1]):
        rows = kept[:, column]
        matrix = multilabel_confusion_matrix(
            flat_labels[rows, column].numpy(), (flat_scores[rows, column] >= 0.5).int().numpy()
        )[1]  # [[tn, fp], [fn, tp]] of the positive class
        tn, fp, fn, tp = (int(v) for v in matrix.ravel())
        for got in counts:
            assert [int(got[k][column]) for k in ("tp", "fp", "fn", "tn")] == [tp, fp, fn, tn]


def test_target_encodings_agree() -> None:
    """Class indices of any integer dtype and one-hot targets (int, float, bool) count alike."""
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(40, 5, generator=generator)
    labels = torch.randint(0, 5, (40,), generator=generator)
    one_hot = torch.nn.functional.one_hot(labels, 5)
    targets = [
        labels,
        labels.int(),
        labels.to(torch.uint8),
        one_hot,
        one_hot.float(),
        one_hot.bool(),
    ]
    results = []
    for target in targets:
        metric = confusion_count_metric().multiclass(5).with_f1().per_class().build()
        metric.update(scores, target)
        matrix = MulticlassConfusionMatrixMetric(5)
        matrix.update(scores, target)
        results.append((metric.counts(), matrix.compute()))
    for counts, matrix in results[1:]:
        assert all(torch.equal(counts[k], results[0][0][k]) for k in counts)
        assert torch.equal(matrix, results[0][1])


def test_empty_batches_change_nothing() -> None:
    for builder, preds, target in [
        (confusion_count_metric().binary(), torch.zeros(0), torch.zeros(0, dtype=torch.long)),
        (
            confusion_count_metric(ignore_index=-100).multiclass(3),
            torch.zeros(0, 3),
            torch.zeros(0, dtype=torch.long),
        ),
        (confusion_count_metric().multilabel(2), torch.zeros(0, 2), torch.zeros(0, 2).long()),
    ]:
        metric = builder.with_recall().build()
        metric.update(preds, target)
        assert all(int(acc.local.abs().sum()) == 0 for _, acc in metric.named_accumulators())
        assert metric.compute().item() == 0.0  # no data: the zero-division value


def _accuracy(name: str, builder: Any) -> ConfusionCountMetric:
    chosen = builder.with_accuracy()
    return (chosen if name == "binary" else chosen.per_class()).build()


def test_device_policy_drops_bad_batches_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA policy (drop the batch on the device, count it), exercised on CPU.

    ``screen`` is replaced by its device branch and the CPU fast path is off, so the weight-0
    ``index_add_`` path that CUDA takes runs here: the bad batches must leave the counts exactly
    as if they had never been fed.
    """
    from sidestream.metrics.classification import _cpu_path, _inputs

    def device_screen(
        checks: list[tuple[torch.Tensor, str, str]], rejected: Any
    ) -> torch.Tensor | None:
        if not checks:
            return None
        any_invalid = torch.stack([invalid.any() for invalid, *_ in checks]).any()
        rejected.accumulate(any_invalid.to(torch.int64))
        return ~any_invalid

    generator = torch.Generator().manual_seed(0)
    good = [
        (torch.randn(9, 4, generator=generator), torch.randint(0, 4, (9,), generator=generator))
        for _ in range(3)
    ]
    bad_multiclass = [
        (torch.randn(5, 4), torch.tensor([0, 1, 9, 2, -100])),  # 9 is out of range
        (torch.tensor([0, 1, 4, 2, 3]), torch.tensor([0, 1, 2, 3, 3])),  # predicted class 4
        (torch.randn(2, 4), torch.tensor([[1, 1, 0, 0], [0, 0, 1, 0]])),  # not one-hot
    ]
    probabilities = [torch.rand(6, 3, generator=generator) for _ in range(2)]
    labels = [torch.randint(0, 2, (6, 3), generator=generator) for _ in range(2)]
    bad_multilabel = [
        (torch.full((2, 3), 1.5), torch.zeros(2, 3, dtype=torch.long)),  # not probabilities
        (torch.rand(2, 3), torch.full((2, 3), 2)),  # target 2
    ]
    builders = {
        "multiclass": confusion_count_metric(ignore_index=-100).multiclass(4),
        "top2": confusion_count_metric(ignore_index=-100).multiclass(4, top_k=2),
        "multilabel": confusion_count_metric(ignore_index=-100).multilabel(3),
        "binary": confusion_count_metric().binary(),
    }
    for name, builder in builders.items():
        if name in ("multiclass", "top2"):
            clean, bad = good, bad_multiclass if name == "multiclass" else bad_multiclass[:1]
        else:
            clean = list(zip(probabilities, labels, strict=True))
            bad = bad_multilabel
            if name == "binary":
                clean = [(p.reshape(-1), t.reshape(-1)) for p, t in clean]
                bad = [(p.reshape(-1), t.reshape(-1)) for p, t in bad]
        reference = _accuracy(name, builder)
        for preds, target in clean:
            reference.update(preds, target)
        with monkeypatch.context() as patch:
            patch.setattr(_inputs, "screen", device_screen)
            patch.setattr(_cpu_path, "enabled", lambda device: False)
            metric = _accuracy(name, builder)
            for (preds, target), dropped in zip(clean, bad, strict=False):
                metric.update(preds, target)
                metric.update(*dropped)
            for preds, target in clean[len(bad) :]:
                metric.update(preds, target)
        expected_counts, counts = reference.counts(), metric.counts()
        assert all(torch.equal(counts[k], expected_counts[k]) for k in counts), name
        assert metric.rejected_updates.item() == min(len(bad), len(clean)), name
    matrix, expected_matrix = MulticlassConfusionMatrixMetric(4), MulticlassConfusionMatrixMetric(4)
    with monkeypatch.context() as patch:
        patch.setattr(_inputs, "screen", device_screen)
        patch.setattr(_cpu_path, "enabled", lambda device: False)
        for (preds, target), dropped in zip(good, bad_multiclass, strict=True):
            matrix.update(preds, target)
            matrix.update(*dropped)
    for preds, target in good:
        expected_matrix.update(preds, target)
    assert torch.equal(matrix.compute(), expected_matrix.compute())
    assert matrix.rejected_updates.item() == 3


def test_old_names_point_to_the_new_ones() -> None:
    """The renamed builder warns and still works; generic classes refuse a class count."""
    from sidestream.metrics.classification import (
        CohenKappaMetric,
        MatthewsCorrCoefMetric,
        MulticlassCohenKappaMetric,
        MulticlassMatthewsCorrCoefMetric,
        confusion_matrix_metric,
    )

    with pytest.warns(DeprecationWarning, match="confusion_count_metric") as warned:
        builder = confusion_matrix_metric(ignore_index=-100)
    # d9d's name, with d9d's numbers changed: the warning says how.
    assert "per-class accuracy is recall" in str(warned[0].message)
    assert warned[0].filename == __file__  # the caller's line, not sidestream's
    # PEP 702: mypy and pyright flag each use, not only the run that reaches it.
    assert "confusion_count_metric" in confusion_matrix_metric.__deprecated__
    assert builder == confusion_count_metric(ignore_index=-100)
    generator = torch.Generator().manual_seed(2)
    preds, target = torch.randint(0, 3, (40,), generator=generator), torch.randint(0, 3, (40,))
    for generic, thin in (
        (MatthewsCorrCoefMetric, MulticlassMatthewsCorrCoefMetric),
        (CohenKappaMetric, MulticlassCohenKappaMetric),
    ):
        short, full = generic(3), thin(3)  # an int is short for a multiclass problem
        short.update(preds, target)
        full.update(preds, target)
        assert torch.equal(short.compute(), full.compute())
        with pytest.raises(TypeError, match=thin.__name__):
            generic("three")  # type: ignore[arg-type]


@pytest.mark.parametrize("zero_division", [0.0, 1.0, float("nan")])
def test_weighted_multilabel_mean_with_no_positive_target_matches_sklearn(
    zero_division: float,
) -> None:
    """No label has a positive target (zero total support): scikit-learn's weighted mean is the
    plain mean of the per-label values, for every zero_division."""
    from sklearn.metrics import f1_score, precision_score, recall_score

    rng = np.random.default_rng(5)
    for _ in range(40):
        rows = int(rng.integers(1, 5))
        preds = rng.integers(0, 2, (rows, 4))
        target = np.zeros((rows, 4), dtype=np.int64)
        for method, reference in (
            ("with_precision", precision_score),
            ("with_recall", recall_score),
            ("with_f1", f1_score),
        ):
            builder = confusion_count_metric(zero_division=zero_division).multilabel(4)
            metric = getattr(builder, method)().weighted().build()
            metric.update(torch.as_tensor(preds).double(), torch.as_tensor(target))
            expected = reference(target, preds, average="weighted", zero_division=zero_division)
            ours = float(metric.compute())
            assert (math.isnan(ours) and math.isnan(expected)) or ours == pytest.approx(expected), (
                method,
                preds.tolist(),
                ours,
                expected,
            )


@pytest.mark.parametrize(
    ("kind", "preds", "target", "says"),
    [
        # A 0-dim multilabel batch raised a bare IndexError.
        ("multilabel", torch.tensor(0.5), torch.tensor(1), "preds: expected"),
        # Empty batches skipped every shape and dtype check the global metric makes.
        ("multilabel", torch.rand(0, 5), torch.zeros(0, 5, dtype=torch.int64), "preds"),
        ("multiclass", torch.rand(0, 4, 7), torch.zeros(0, 4), "preds"),
    ],
)
def test_samplewise_checks_batches_as_the_global_metric_does(
    kind: str, preds: torch.Tensor, target: torch.Tensor, says: str
) -> None:
    builder = confusion_count_metric(multidim_average="samplewise")
    chosen = builder.multilabel(3) if kind == "multilabel" else builder.multiclass(3)
    metric = chosen.with_accuracy().macro().build()
    with pytest.raises(ValueError, match=says):
        metric.update(preds, target)
