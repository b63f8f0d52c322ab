"""Random classification data, sharded across ranks, and scikit-learn references."""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.metrics import (
    accuracy_score,
    balanced_accuracy_score,
    cohen_kappa_score,
    confusion_matrix,
    fbeta_score,
    hamming_loss,
    matthews_corrcoef,
    precision_recall_fscore_support,
    precision_score,
    recall_score,
    top_k_accuracy_score,
)

from sidestream.metric import Metric
from sidestream.metrics.classification import (
    ConfusionCountMetricBuilder,
    MulticlassCohenKappaMetric,
    MulticlassConfusionMatrixMetric,
    MulticlassMatthewsCorrCoefMetric,
    confusion_count_metric,
)

IGNORE = -100
BALANCED_ACCURACY_CHECKS: list[int] = []  # how often balanced_accuracy_score was the reference
STATISTICS = ["accuracy", "precision", "recall", "f1", "f2", "f0.5", "specificity"]
AGGREGATIONS = ["micro", "macro", "weighted", "per_class"]
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class Case:
    """One metric configuration and how its random data looks."""

    kind: str  # binary | multiclass | multilabel
    classes: int = 1
    aggregation: str | None = None
    top_k: int = 1
    threshold: float = 0.5
    logits: bool = False
    ignore: bool = False
    zero_division: float = 0.0
    dtype: str = "float32"
    target_dtype: str = "int64"  # int64 | int32 | uint8 | bool | one_hot
    preds_format: str = "scores"  # scores | labels
    extra_dims: tuple[int, ...] = ()

    def builder(self) -> ConfusionCountMetricBuilder:
        builder = confusion_count_metric(
            ignore_index=IGNORE if self.ignore else None, zero_division=self.zero_division
        )
        if self.kind == "binary":
            builder = builder.binary(self.threshold, logits=self.logits)
        elif self.kind == "multiclass":
            builder = builder.multiclass(self.classes, top_k=self.top_k)
        else:
            builder = builder.multilabel(self.classes, self.threshold, logits=self.logits)
        builder = (
            builder.with_accuracy()
            .with_precision()
            .with_recall()
            .with_f1()
            .with_fbeta(2.0)
            .with_fbeta(0.5)
            .with_specificity()
        )
        if self.aggregation is not None:
            builder = getattr(builder, self.aggregation)()
        return builder


def make_batch(
    case: Case, rng: np.random.Generator, size: int, unseen_class: bool
) -> dict[str, np.ndarray]:
    """Raw numpy inputs of one batch (scores in float64; cast to the dtype in ``to_torch``).

    Multiclass with C >= 3: class 0 never occurs and is never predicted (absent: left out of
    macro means); with C >= 4 and ``unseen_class``, class 1 is never a target but is predicted
    (precision 0, recall 0/0).
    """
    shape = (size, *case.extra_dims)
    if case.kind == "multiclass":
        skew = rng.uniform(0.1, 3.0, size=case.classes)
        if case.classes >= 3:
            skew[0] = 0.0
        if case.classes >= 4 and unseen_class:
            skew[1] = 0.0
        target = rng.choice(case.classes, size=shape, p=skew / skew.sum())
        scores = rng.normal(size=(*shape, case.classes))
        if case.classes >= 3:
            scores[..., 0] = -1e4
        scores += 1.5 * np.eye(case.classes)[target] * rng.integers(0, 2, size=(*shape, 1))
    else:
        label_shape = shape if case.kind == "binary" else (*shape, case.classes)
        rate = rng.uniform(0.05, 0.6, size=label_shape[-1:] if case.kind != "binary" else ())
        target = (rng.uniform(size=label_shape) < rate).astype(np.int64)
        logits = rng.normal(size=label_shape) + 1.2 * (2 * target - 1) * rng.uniform(
            size=label_shape
        )
        scores = logits if case.logits else 1 / (1 + np.exp(-logits))
    target = target.astype(np.int64)
    if case.ignore:
        target = np.where(rng.uniform(size=target.shape) < 0.15, IGNORE, target)
    return {"scores": scores, "target": target}


def make_shards(case: Case, seed: int, world_size: int) -> list[list[dict[str, np.ndarray]]]:
    """Per rank a list of batches of uneven sizes (one empty); the last rank has no data."""
    rng = np.random.default_rng(seed)
    unseen_class = bool(rng.integers(0, 2))
    shards = []
    for rank in range(world_size):
        if world_size > 1 and rank == world_size - 1:
            shards.append([make_batch(case, rng, 0, unseen_class)])
            continue
        sizes = [int(rng.integers(1, 120)), 0, int(rng.integers(1, 60))]
        shards.append([make_batch(case, rng, size, unseen_class) for size in sizes])
    return shards


def to_torch(case: Case, batch: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (preds, target) tensors the metric receives."""
    scores = torch.as_tensor(batch["scores"]).to(DTYPES[case.dtype])
    if case.preds_format == "labels":
        preds = (
            torch.as_tensor(quantized_scores(case, batch).argmax(-1))  # the rank's device
            if case.kind == "multiclass"
            else torch.as_tensor(predicted_positive(case, batch)).to(torch.int64)
        )
    else:
        preds = scores
    target_np = batch["target"]
    if case.target_dtype == "one_hot":
        target = torch.nn.functional.one_hot(torch.as_tensor(target_np), case.classes)
    elif case.target_dtype == "bool":
        target = torch.as_tensor(target_np).bool()
    else:
        target = torch.as_tensor(target_np).to(getattr(torch, case.target_dtype))
    return preds, target


def quantized_scores(case: Case, batch: dict[str, np.ndarray]) -> torch.Tensor:
    """Scores after the round trip through the input dtype, as float64 (what the metric sees).

    Always on the host: references read it with ``.numpy()``.
    """
    return torch.from_numpy(batch["scores"]).to(DTYPES[case.dtype]).to(torch.float64)


def predicted_positive(case: Case, batch: dict[str, np.ndarray]) -> np.ndarray:
    scores = quantized_scores(case, batch).numpy()
    probabilities = 1 / (1 + np.exp(-scores)) if case.logits else scores
    return (probabilities >= case.threshold).astype(np.int64)


def _specificity(tn: np.ndarray, fp: np.ndarray, zero_division: float) -> np.ndarray:
    denominator = tn + fp
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator == 0, zero_division, tn / np.maximum(denominator, 1))


def _average(
    values: np.ndarray, aggregation: str, support: np.ndarray, present: np.ndarray, zd: float
) -> Any:
    if aggregation == "per_class":
        return values
    weights = support.astype(np.float64) if aggregation == "weighted" else present * 1.0
    weights = np.where(np.isnan(values), 0.0, weights)
    if weights.sum() == 0:
        return zd
    return float(np.sum(np.where(weights > 0, values, 0.0) * weights) / weights.sum())


def _beta(statistic: str) -> float:
    return float(statistic[1:])


def reference(case: Case, batches: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """scikit-learn's values for every statistic of ``case`` on the concatenated batches."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.kind == "binary":
            return _binary_reference(case, batches)
        if case.kind == "multiclass" and case.top_k == 1:
            return _multiclass_reference(case, batches)
        return _indicator_reference(case, batches)


def _binary_reference(case: Case, batches: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    truth = np.concatenate([b["target"].reshape(-1) for b in batches])
    predicted = np.concatenate([predicted_positive(case, b).reshape(-1) for b in batches])
    kept = truth != IGNORE
    truth, predicted = truth[kept], predicted[kept]
    zd = case.zero_division
    out: dict[str, Any] = {
        "accuracy": accuracy_score(truth, predicted) if truth.size else zd,
        "precision": precision_score(truth, predicted, zero_division=zd),
        "recall": recall_score(truth, predicted, zero_division=zd),
        "specificity": recall_score(truth, predicted, pos_label=0, zero_division=zd),
    }
    for name in ("f1", "f2", "f0.5"):
        out[name] = fbeta_score(truth, predicted, beta=_beta(name), zero_division=zd)
    return out


def _multiclass_reference(case: Case, batches: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    classes = case.classes
    truth = np.concatenate([b["target"].reshape(-1) for b in batches])
    predicted = np.concatenate(
        [quantized_scores(case, b).argmax(-1).numpy().reshape(-1) for b in batches]
    )
    kept = truth != IGNORE
    truth, predicted = truth[kept], predicted[kept]
    zd = case.zero_division
    aggregation = case.aggregation or "macro"
    average = None if aggregation == "per_class" else aggregation
    labels = list(range(classes)) if average is None else None
    out: dict[str, Any] = {}
    if average == "micro":
        out["accuracy"] = accuracy_score(truth, predicted)
    else:
        out["accuracy"] = recall_score(
            truth, predicted, labels=labels, average=average, zero_division=zd
        )
        if average == "macro" and set(predicted) <= set(truth):
            # Macro accuracy is balanced accuracy when every predicted class is also a target.
            out["accuracy"] = balanced_accuracy_score(truth, predicted)
            BALANCED_ACCURACY_CHECKS.append(1)
    for name in ("f1", "f2", "f0.5"):
        precision, recall, fscore, _ = precision_recall_fscore_support(
            truth, predicted, beta=_beta(name), labels=labels, average=average, zero_division=zd
        )
        out[name] = fscore
        assert np.allclose(
            fscore,
            fbeta_score(
                truth,
                predicted,
                beta=_beta(name),
                labels=labels,
                average=average,
                zero_division=zd,
            ),
            equal_nan=True,
        )
    out["precision"], out["recall"] = precision, recall
    matrix = confusion_matrix(truth, predicted, labels=list(range(classes)))
    tp = np.diag(matrix)
    fp = matrix.sum(0) - tp
    fn = matrix.sum(1) - tp
    tn = matrix.sum() - tp - fp - fn
    if aggregation == "micro":
        out["specificity"] = float(_specificity(tn.sum(), fp.sum(), zd))
    else:
        out["specificity"] = _average(
            _specificity(tn, fp, zd), aggregation, tp + fn, (tp + fp + fn) > 0, zd
        )
    return out


def _indicator(case: Case, batches: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """(truth, predicted, kept) as (M, C) one-vs-rest indicator arrays."""
    classes = case.classes
    if case.kind == "multiclass":
        truth_labels = np.concatenate([b["target"].reshape(-1) for b in batches])
        scores = np.concatenate(
            [quantized_scores(case, b).numpy().reshape(-1, classes) for b in batches]
        )
        top = np.argsort(-scores, axis=1, kind="stable")[:, : case.top_k]
        predicted = np.zeros_like(scores, dtype=np.int64)
        np.put_along_axis(predicted, top, 1, axis=1)
        kept_rows = truth_labels != IGNORE
        truth = np.eye(classes, dtype=np.int64)[np.where(kept_rows, truth_labels, 0)]
        kept = np.repeat(kept_rows[:, None], classes, axis=1)
        return truth, predicted, kept, scores, truth_labels
    truth = np.concatenate([b["target"].reshape(-1, classes) for b in batches])
    predicted = np.concatenate([predicted_positive(case, b).reshape(-1, classes) for b in batches])
    return truth, predicted, truth != IGNORE, None, None


def _indicator_reference(case: Case, batches: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Multilabel, and multiclass top-k as a multilabel indicator problem."""
    truth, predicted, kept, scores, truth_labels = _indicator(case, batches)
    zd = case.zero_division
    aggregation = case.aggregation or "macro"
    average = None if aggregation == "per_class" else aggregation
    classes = case.classes
    multiclass = case.kind == "multiclass"
    out: dict[str, Any] = {}
    if not case.ignore or multiclass:
        rows = kept.all(1)
        truth_rows, predicted_rows = truth[rows], predicted[rows]
        if multiclass:
            # torchmetrics' top-k macro rule: only classes seen in the targets.
            seen = truth_rows.sum(0) > 0
            everything = average in (None, "micro")
            labels = list(range(classes)) if everything else list(np.flatnonzero(seen))
        else:
            labels = list(range(classes))
        for name in ("f1", "f2", "f0.5"):
            precision, recall, fscore, _ = precision_recall_fscore_support(
                truth_rows,
                predicted_rows,
                beta=_beta(name),
                labels=labels,
                average=average,
                zero_division=zd,
            )
            out[name] = fscore
        out["precision"], out["recall"] = precision, recall
    per_column: dict[str, list[float]] = {name: [] for name in STATISTICS}
    for column in range(classes):
        t = truth[kept[:, column], column]
        p = predicted[kept[:, column], column]
        per_column["accuracy"].append(
            recall_score(t, p, zero_division=zd)
            if multiclass
            else (accuracy_score(t, p) if t.size else zd)
        )
        per_column["specificity"].append(recall_score(t, p, pos_label=0, zero_division=zd))
        per_column["precision"].append(precision_score(t, p, zero_division=zd))
        per_column["recall"].append(recall_score(t, p, zero_division=zd))
        for name in ("f1", "f2", "f0.5"):
            per_column[name].append(fbeta_score(t, p, beta=_beta(name), zero_division=zd))
    masked_truth = np.where(kept, truth, 0)
    support = masked_truth.sum(0)
    # Top-k macro means take classes seen in the targets (torchmetrics' rule).
    present = masked_truth.sum(0) > 0 if multiclass else np.ones(classes, bool)
    flat_t, flat_p = truth[kept], predicted[kept]
    for name in STATISTICS:
        if name in out:
            continue
        if aggregation != "micro":
            out[name] = _average(np.array(per_column[name]), aggregation, support, present, zd)
        elif name == "accuracy":
            if multiclass:
                rows = truth_labels != IGNORE
                out[name] = top_k_accuracy_score(
                    truth_labels[rows], scores[rows], k=case.top_k, labels=list(range(classes))
                )
            else:
                out[name] = 1 - hamming_loss(flat_t, flat_p)
        elif name == "specificity":
            out[name] = recall_score(flat_t, flat_p, pos_label=0, zero_division=zd)
        elif name in ("precision", "recall"):
            function = precision_score if name == "precision" else recall_score
            out[name] = function(flat_t, flat_p, zero_division=zd)
        else:
            out[name] = fbeta_score(flat_t, flat_p, beta=_beta(name), zero_division=zd)
    return out


def run_case(case: Case, batches: list[dict[str, np.ndarray]], sync: bool) -> dict[str, Any]:
    """Feed the batches to a fresh metric, optionally sync, return ``compute()`` as lists."""
    metric = case.builder().build()
    for batch in batches:
        metric.update(*to_torch(case, batch))
    if sync:
        metric.sync()
    result = metric.compute()
    assert isinstance(result, dict)
    return {name: value.tolist() for name, value in result.items()}


def assert_matches(actual: dict[str, Any], expected: dict[str, Any], context: object) -> None:
    assert set(actual) == set(STATISTICS), context
    for name in STATISTICS:
        got = np.asarray(actual[name], dtype=np.float64)
        want = np.asarray(expected[name], dtype=np.float64)
        assert got.shape == want.shape, (context, name, got, want)
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True), (
            context,
            name,
            got,
            want,
        )


def binary_cases() -> list[Case]:
    variants = [
        {},
        {"threshold": 0.3, "dtype": "float16"},
        {"logits": True, "dtype": "bfloat16", "ignore": True},
        {"logits": True, "threshold": 0.7, "target_dtype": "bool", "extra_dims": (3,)},
        {"preds_format": "labels", "target_dtype": "uint8", "zero_division": 1.0},
        {"ignore": True, "target_dtype": "int32", "extra_dims": (2, 3), "dtype": "float64"},
    ]
    return [Case("binary", **variant) for variant in variants]


def multiclass_cases() -> list[Case]:
    variants = [
        {"classes": 5},
        {"classes": 4, "dtype": "bfloat16", "ignore": True},
        {"classes": 7, "dtype": "float16", "target_dtype": "one_hot"},
        {"classes": 3, "preds_format": "labels", "target_dtype": "int32", "zero_division": 1.0},
        {"classes": 6, "extra_dims": (4,), "ignore": True, "zero_division": float("nan")},
        {"classes": 6, "top_k": 2, "dtype": "float64"},
        {"classes": 8, "top_k": 3, "ignore": True, "zero_division": 1.0},
    ]
    return [
        Case("multiclass", aggregation=aggregation, **variant)
        for variant, aggregation in itertools.product(variants, AGGREGATIONS)
    ]


def multilabel_cases() -> list[Case]:
    variants = [
        {"classes": 4},
        {"classes": 5, "logits": True, "dtype": "bfloat16", "ignore": True},
        {"classes": 3, "threshold": 0.4, "extra_dims": (3,), "target_dtype": "bool"},
        {"classes": 6, "preds_format": "labels", "ignore": True, "zero_division": 1.0},
    ]
    return [
        Case("multilabel", aggregation=aggregation, **variant)
        for variant, aggregation in itertools.product(variants, AGGREGATIONS)
    ]


CASES = binary_cases() + multiclass_cases() + multilabel_cases()
"""Every problem x statistic x aggregation with varied dtypes, shapes, targets and options."""


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
        "mcc": MulticlassMatthewsCorrCoefMetric(case.classes, ignore_index=ignore),
        "kappa": MulticlassCohenKappaMetric(case.classes, ignore_index=ignore),
        "kappa_linear": MulticlassCohenKappaMetric(
            case.classes, ignore_index=ignore, weights="linear"
        ),
        "kappa_quadratic": MulticlassCohenKappaMetric(
            case.classes, ignore_index=ignore, weights="quadratic"
        ),
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


def device_metrics() -> list[tuple[Case, Metric[Any]]]:
    """Every confusion-family metric of ``CASES`` and ``MATRIX_CASES``, each with its case."""
    pairs: list[tuple[Case, Metric[Any]]] = [(case, case.builder().build()) for case in CASES]
    for case in MATRIX_CASES:
        pairs += [(case, metric) for metric in matrix_metrics(case).values()]
    return pairs


def bad_batch(case: Case) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch with one out-of-range value, or ``None`` when the inputs cannot be invalid."""
    preds, target = to_torch(case, make_shards(case, 99, 1)[0][0])
    if target.dtype != torch.bool:
        target = target.clone()
        target.view(-1)[0] = 2 if case.target_dtype == "one_hot" else 99
        return preds, target
    if preds.is_floating_point() and not case.logits:
        preds = preds.clone()
        preds.view(-1)[0] = 1.5
        return preds, target
    return None
