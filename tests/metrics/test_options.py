"""The options of issue 13 against scikit-learn and torchmetrics' functional API.

Inputs are made as torchmetrics' own tests make them: seeded, as probabilities or logits,
multidim ``(N, C, X)``, with ``ignore_index=-100`` padding. Every case runs in one process and
on 2 gloo ranks of which one has no data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torchmetrics.functional.classification as tmf
from sklearn.metrics import (
    average_precision_score,
    cohen_kappa_score,
    confusion_matrix,
    matthews_corrcoef,
    multilabel_confusion_matrix,
    r2_score,
    roc_auc_score,
)
from torchmetrics.functional.regression import r2_score as tm_r2_score

from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    BinaryCalibrationErrorMetric,
    BinaryCohenKappaMetric,
    BinaryConfusionMatrixMetric,
    BinaryMatthewsCorrCoefMetric,
    MulticlassAUROCMetric,
    MulticlassAveragePrecisionMetric,
    MulticlassCalibrationErrorMetric,
    MulticlassConfusionMatrixMetric,
    MultilabelAUROCMetric,
    MultilabelAveragePrecisionMetric,
    MultilabelConfusionMatrixMetric,
    MultilabelMatthewsCorrCoefMetric,
    confusion_count_metric,
)
from sidestream.metrics.regression import R2ScoreMetric
from sidestream.testing import on_rank_device
from tests.conftest import Pools

C = 4
X = 3  # the extra dimension of multidim inputs
IGNORE = -100
Arrays = dict[str, np.ndarray]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def make_data(seed: int, size: int) -> Arrays:
    """Logits with signal, 0/1 and class targets, and 10% of the targets set to IGNORE."""
    rng = np.random.default_rng(seed)
    binary = rng.integers(0, 2, size=(size, X))
    labels = rng.integers(0, C, size=(size, X))
    multilabel = rng.integers(0, 2, size=(size, C, X))
    onehot = np.moveaxis(np.eye(C)[labels], -1, 1)  # (N, C, X)
    data = {
        "b_logits": rng.normal(size=(size, X)) + 1.2 * binary,
        "b_target": binary,
        "mc_logits": rng.normal(size=(size, C, X)) + 1.5 * onehot,
        "mc_target": labels,
        "ml_logits": rng.normal(size=(size, C, X)) + multilabel,
        "ml_target": multilabel,
        "reg_target": rng.normal(size=(size, 2)) * [1.0, 3.0],
    }
    data["reg_preds"] = data["reg_target"] + rng.normal(size=(size, 2))
    for key in ("b_target", "mc_target", "ml_target"):
        drop = rng.random(data[key].shape) < 0.1
        data[f"{key}_ignored"] = np.where(drop, IGNORE, data[key])
    return data


def _probs(data: Arrays, kind: str) -> np.ndarray:
    logits = data[f"{kind}_logits"]
    return _softmax(logits, 1) if kind == "mc" else _sigmoid(logits)


@dataclass(frozen=True)
class Case:
    """A metric, how it is fed, and its reference on the concatenated data."""

    make: Callable[[], Any]
    feed: Callable[[Any, Arrays], None]
    reference: Callable[[Arrays], Any]
    tolerance: str = "exact"  # or "bound": within the metric's certified error bound


def _rows(data: Arrays, kind: str, ignored: bool, logits: bool) -> tuple[np.ndarray, np.ndarray]:
    """Flattened kept ``(scores, targets)`` the way sklearn wants them."""
    scores = data[f"{kind}_logits"] if logits else _probs(data, kind)
    target = data[f"{kind}_target_ignored" if ignored else f"{kind}_target"]
    if kind == "b":
        kept = target.reshape(-1) != IGNORE
        return scores.reshape(-1)[kept], target.reshape(-1)[kept]
    flat_scores = np.moveaxis(scores, 1, -1).reshape(-1, C)
    if kind == "mc":
        flat_target = target.reshape(-1)
        kept = flat_target != IGNORE
        return flat_scores[kept], flat_target[kept]
    return flat_scores, np.moveaxis(target, 1, -1).reshape(-1, C)


def _feed_scores(kind: str, ignored: bool, logits: bool) -> Callable[[Any, Arrays], None]:
    def feed(metric: Any, data: Arrays) -> None:
        scores = data[f"{kind}_logits"] if logits else _probs(data, kind)
        target = data[f"{kind}_target_ignored" if ignored else f"{kind}_target"]
        metric.update(torch.as_tensor(scores, dtype=torch.float32), torch.as_tensor(target))

    return feed


def _ranking_cases() -> dict[str, Case]:
    cases = {}
    for ignored, logits in ((False, False), (True, True), (True, False)):
        suffix = f"{'_ignore' if ignored else ''}{'_logits' if logits else ''}"
        ignore = IGNORE if ignored else None

        def binary_ref(data: Arrays, fn: Any = roc_auc_score, i: bool = ignored) -> float:
            return fn(*reversed(_rows(data, "b", i, False)))

        def multiclass_ref(data: Arrays, ap: bool, i: bool = ignored) -> float:
            scores, target = _rows(data, "mc", i, False)
            if ap:
                onehot = np.eye(C)[target]
                return float(
                    np.mean([average_precision_score(onehot[:, c], scores[:, c]) for c in range(C)])
                )
            return roc_auc_score(target, scores / scores.sum(1, keepdims=True), multi_class="ovr")

        cases[f"b_auroc{suffix}"] = Case(
            lambda lg=logits, ig=ignore: BinaryAUROCMetric(logits=lg, ignore_index=ig),
            _feed_scores("b", ignored, logits),
            binary_ref,
            "bound",
        )
        cases[f"b_ap{suffix}"] = Case(
            lambda lg=logits, ig=ignore: BinaryAveragePrecisionMetric(logits=lg, ignore_index=ig),
            _feed_scores("b", ignored, logits),
            lambda d, i=ignored: binary_ref(d, average_precision_score, i),
            "bound",
        )
        cases[f"mc_auroc{suffix}"] = Case(
            lambda lg=logits, ig=ignore: MulticlassAUROCMetric(C, logits=lg, ignore_index=ig),
            _feed_scores("mc", ignored, logits),
            lambda d, i=ignored: multiclass_ref(d, False, i),
            "bound",
        )
        cases[f"mc_ap{suffix}"] = Case(
            lambda lg=logits, ig=ignore: MulticlassAveragePrecisionMetric(
                C, logits=lg, ignore_index=ig
            ),
            _feed_scores("mc", ignored, logits),
            lambda d, i=ignored: multiclass_ref(d, True, i),
            "bound",
        )
    for average in ("micro", "macro"):
        cases[f"ml_auroc_{average}_logits"] = Case(
            lambda a=average: MultilabelAUROCMetric(C, average=a, logits=True),
            _feed_scores("ml", False, True),
            lambda d, a=average: roc_auc_score(*reversed(_rows(d, "ml", False, False)), average=a),
            "bound",
        )
        cases[f"ml_ap_{average}"] = Case(
            lambda a=average: MultilabelAveragePrecisionMetric(C, average=a),
            _feed_scores("ml", False, False),
            lambda d, a=average: average_precision_score(
                *reversed(_rows(d, "ml", False, False)), average=a
            ),
            "bound",
        )
    for max_fpr in (0.1, 0.5):
        cases[f"b_auroc_max_fpr{max_fpr}"] = Case(
            lambda m=max_fpr: BinaryAUROCMetric(max_fpr=m, logits=True),
            _feed_scores("b", False, True),
            lambda d, m=max_fpr: roc_auc_score(*reversed(_rows(d, "b", False, False)), max_fpr=m),
            "bound",
        )
    edges = [0.0, 0.1, 0.25, 0.4, 0.5, 0.55, 0.7, 0.9, 1.0]

    def thresholds_ref(data: Arrays, fn: Any) -> float:
        scores, target = _rows(data, "b", False, False)
        return float(
            fn(
                torch.as_tensor(scores, dtype=torch.float32),
                torch.as_tensor(target),
                thresholds=edges,
            )
        )

    cases["b_auroc_uniform_as_tm_int_thresholds"] = Case(
        lambda: BinaryAUROCMetric(num_bins=20),
        _feed_scores("b", False, False),
        lambda d: float(
            tmf.binary_auroc(
                *(torch.as_tensor(a) for a in _rows(d, "b", False, False)), thresholds=21
            )
        ),
    )
    cases["b_auroc_thresholds"] = Case(
        lambda: BinaryAUROCMetric(thresholds=edges),
        _feed_scores("b", False, False),
        lambda d: thresholds_ref(d, tmf.binary_auroc),
    )
    cases["b_ap_thresholds"] = Case(
        lambda: BinaryAveragePrecisionMetric(thresholds=edges),
        _feed_scores("b", False, False),
        lambda d: thresholds_ref(d, tmf.binary_average_precision),
    )
    return cases


def _calibration_cases() -> dict[str, Case]:
    cases = {}
    for norm in ("l1", "l2", "max"):
        cases[f"b_ece_{norm}_logits_ignore"] = Case(
            lambda n=norm: BinaryCalibrationErrorMetric(10, n, logits=True, ignore_index=IGNORE),
            _feed_scores("b", True, True),
            lambda d, n=norm: float(
                tmf.binary_calibration_error(
                    torch.as_tensor(d["b_logits"], dtype=torch.float32),
                    torch.as_tensor(d["b_target_ignored"]),
                    n_bins=10,
                    norm=n,
                    ignore_index=IGNORE,
                )
            ),
        )
        cases[f"mc_ece_{norm}_multidim"] = Case(
            lambda n=norm: MulticlassCalibrationErrorMetric(C, 10, n, ignore_index=IGNORE),
            _feed_scores("mc", True, False),
            lambda d, n=norm: float(
                tmf.multiclass_calibration_error(
                    torch.as_tensor(_probs(d, "mc"), dtype=torch.float32),
                    torch.as_tensor(d["mc_target_ignored"]),
                    num_classes=C,
                    n_bins=10,
                    norm=n,
                    ignore_index=IGNORE,
                )
            ),
        )
    return cases


def _predicted(data: Arrays, kind: str, threshold: float = 0.5) -> np.ndarray:
    return (_probs(data, kind) >= threshold).astype(np.int64)


def _matrix_cases() -> dict[str, Case]:
    def binary_flat(d: Arrays) -> tuple[np.ndarray, np.ndarray]:
        target = d["b_target_ignored"].reshape(-1)
        kept = target != IGNORE
        return target[kept], _predicted(d, "b", 0.3).reshape(-1)[kept]

    def multiclass_flat(d: Arrays) -> tuple[np.ndarray, np.ndarray]:
        target = d["mc_target_ignored"].reshape(-1)
        predicted = d["mc_logits"].argmax(1).reshape(-1)
        kept = target != IGNORE
        return target[kept], predicted[kept]

    def multiclass_feed(metric: Any, d: Arrays) -> None:
        # Class-last scores for the confusion family: (N, X, C).
        scores = torch.as_tensor(np.moveaxis(d["mc_logits"], 1, -1), dtype=torch.float32)
        metric.update(scores, torch.as_tensor(d["mc_target_ignored"]))

    def multilabel_feed(metric: Any, d: Arrays) -> None:
        metric.update(
            torch.as_tensor(np.moveaxis(d["ml_logits"], 1, -1), dtype=torch.float32),
            torch.as_tensor(np.moveaxis(d["ml_target"], 1, -1)),
        )

    def multilabel_flat(d: Arrays) -> tuple[np.ndarray, np.ndarray]:
        target = np.moveaxis(d["ml_target"], 1, -1).reshape(-1, C)
        return target, (np.moveaxis(d["ml_logits"], 1, -1).reshape(-1, C) >= 0).astype(np.int64)

    binary_feed = _feed_scores("b", True, True)
    cases = {}
    for normalize in (None, "true", "pred", "all"):
        cases[f"b_matrix_{normalize}"] = Case(
            lambda n=normalize: BinaryConfusionMatrixMetric(
                0.3, n, logits=True, ignore_index=IGNORE
            ),
            binary_feed,
            lambda d, n=normalize: confusion_matrix(*binary_flat(d), labels=[0, 1], normalize=n),
        )
        cases[f"mc_matrix_{normalize}"] = Case(
            lambda n=normalize: MulticlassConfusionMatrixMetric(C, n, ignore_index=IGNORE),
            multiclass_feed,
            lambda d, n=normalize: np.nan_to_num(
                confusion_matrix(*multiclass_flat(d), labels=list(range(C)), normalize=n)
            ),
        )
    cases["ml_matrix"] = Case(
        lambda: MultilabelConfusionMatrixMetric(C, logits=True),
        multilabel_feed,
        lambda d: multilabel_confusion_matrix(*multilabel_flat(d)),
    )
    cases["b_mcc"] = Case(
        lambda: BinaryMatthewsCorrCoefMetric(0.3, logits=True, ignore_index=IGNORE),
        binary_feed,
        lambda d: matthews_corrcoef(*binary_flat(d)),
    )
    cases["ml_mcc"] = Case(
        lambda: MultilabelMatthewsCorrCoefMetric(C, logits=True),
        multilabel_feed,
        lambda d: float(
            tmf.multilabel_matthews_corrcoef(
                torch.as_tensor(d["ml_logits"], dtype=torch.float32),
                torch.as_tensor(d["ml_target"]),
                num_labels=C,
            )
        ),
    )
    for weights in (None, "linear"):
        cases[f"b_kappa_{weights}"] = Case(
            lambda w=weights: BinaryCohenKappaMetric(0.3, w, logits=True, ignore_index=IGNORE),
            binary_feed,
            lambda d, w=weights: cohen_kappa_score(*binary_flat(d), labels=[0, 1], weights=w),
        )
    return cases


def _regression_cases() -> dict[str, Case]:
    def feed(metric: Any, d: Arrays) -> None:
        metric.update(torch.as_tensor(d["reg_preds"]), torch.as_tensor(d["reg_target"]))

    return {
        "r2_adjusted": Case(
            lambda: R2ScoreMetric(2, adjusted=3),
            feed,
            lambda d: float(
                tm_r2_score(
                    torch.as_tensor(d["reg_preds"]), torch.as_tensor(d["reg_target"]), adjusted=3
                )
            ),
        ),
        "r2_variance_weighted": Case(
            lambda: R2ScoreMetric(2, multioutput="variance_weighted"),
            feed,
            lambda d: r2_score(d["reg_target"], d["reg_preds"], multioutput="variance_weighted"),
        ),
    }


def _samplewise_cases() -> dict[str, Case]:
    """multidim_average="samplewise": the mean of torchmetrics' per-sample vector."""

    def multiclass_feed(metric: Any, d: Arrays) -> None:
        scores = torch.as_tensor(np.moveaxis(d["mc_logits"], 1, -1), dtype=torch.float32)
        metric.update(scores, torch.as_tensor(d["mc_target_ignored"]))

    def multilabel_feed(metric: Any, d: Arrays) -> None:
        scores = torch.as_tensor(np.moveaxis(d["ml_logits"], 1, -1), dtype=torch.float32)
        metric.update(scores, torch.as_tensor(np.moveaxis(d["ml_target"], 1, -1)))

    def tm(function: Any, d: Arrays, kind: str, **options: Any) -> float:
        target = d["mc_target_ignored"] if kind == "mc" else d[f"{kind}_target"]
        values = function(
            torch.as_tensor(d[f"{kind}_logits"], dtype=torch.float32),
            torch.as_tensor(target),
            multidim_average="samplewise",
            **options,
        )
        return float(values.double().mean())

    samplewise = confusion_count_metric(multidim_average="samplewise")
    cases = {}
    for average in ("micro", "macro", "weighted"):
        cases[f"samplewise_mc_f1_{average}"] = Case(
            lambda a=average: getattr(
                confusion_count_metric(ignore_index=IGNORE, multidim_average="samplewise")
                .multiclass(C)
                .with_f1(),
                a,
            )().build(),
            multiclass_feed,
            lambda d, a=average: tm(
                tmf.multiclass_f1_score, d, "mc", num_classes=C, average=a, ignore_index=IGNORE
            ),
        )
    cases["samplewise_ml_recall_macro"] = Case(
        lambda: samplewise.multilabel(C, logits=True).with_recall().macro().build(),
        multilabel_feed,
        lambda d: tm(tmf.multilabel_recall, d, "ml", num_labels=C, average="macro"),
    )
    cases["samplewise_b_precision"] = Case(
        lambda: samplewise.binary(logits=True).with_precision().build(),
        _feed_scores("b", False, True),
        lambda d: tm(tmf.binary_precision, d, "b"),
    )
    return cases


CASES = {
    **_ranking_cases(),
    **_calibration_cases(),
    **_matrix_cases(),
    **_regression_cases(),
    **_samplewise_cases(),
}


def _value(metric: Any) -> tuple[np.ndarray, np.ndarray]:
    value = metric.compute().double().numpy()
    bound = metric.error_bound().double().numpy() if hasattr(metric, "error_bound") else 0 * value
    return value, bound


def _check(name: str, value: np.ndarray, bound: np.ndarray, expected: Any) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    if CASES[name].tolerance == "bound":
        assert np.all(np.abs(value - expected) <= bound + 1e-9), (name, value, expected, bound)
        assert np.all(np.abs(value - expected) <= 1e-3), (name, value, expected)
    else:
        assert np.allclose(value, expected, rtol=1e-5, atol=1e-6), (name, value, expected)


def _shards(seed: int, world: int) -> list[Arrays]:
    """Uneven shards; the last of several ranks has none."""
    sizes = [300 + 97 * rank for rank in range(world)]
    if world > 1:
        sizes[-1] = 0
    return [make_data(seed * 10 + rank, size) for rank, size in enumerate(sizes)]


def _concat(shards: list[Arrays]) -> Arrays:
    return {key: np.concatenate([s[key] for s in shards]) for key in shards[0]}


def test_single_process_matches_references() -> None:
    data = make_data(0, 800)
    halves = [{k: v[:300] for k, v in data.items()}, {k: v[300:] for k, v in data.items()}]
    for name, case in CASES.items():
        metric = case.make()
        for half in halves:
            case.feed(metric, half)
        _check(name, *_value(metric), case.reference(data))


@on_rank_device
def _synced(seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    shard = _shards(seed, dist.get_world_size())[dist.get_rank()]
    out = {}
    for name, case in CASES.items():
        metric = case.make().to(torch.get_default_device())
        if len(shard["b_target"]):
            case.feed(metric, shard)
        metric.sync()
        out[name] = _value(metric)
    return out


def test_two_ranks_one_empty_match_references(pools: Pools) -> None:
    everything = _concat(_shards(1, 2))
    for per_rank in pools.get(2).run(_synced, 1):
        for name, case in CASES.items():
            _check(name, *per_rank[name], case.reference(everything))


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: BinaryAUROCMetric(thresholds=[0.5, 0.2]), ValueError, "thresholds"),
        (lambda: BinaryAUROCMetric(thresholds=[0.5, 1.5]), ValueError, "thresholds"),
        (lambda: BinaryAUROCMetric(max_fpr=0.0), ValueError, "max_fpr"),
        # float() took these: True computed the whole area, as max_fpr=1.0.
        (lambda: BinaryAUROCMetric(max_fpr=True), TypeError, r"max_fpr: .* got True \(bool\)"),
        (lambda: BinaryAUROCMetric(max_fpr="0.5"), TypeError, "max_fpr"),  # type: ignore[arg-type]
        (lambda: MulticlassAUROCMetric(3, average="micro"), ValueError, "average"),  # type: ignore[arg-type]
        (lambda: BinaryCalibrationErrorMetric(norm="l3"), ValueError, "norm"),  # type: ignore[arg-type]
        (lambda: BinaryConfusionMatrixMetric(normalize="rows"), ValueError, "normalize"),  # type: ignore[arg-type]
        (lambda: R2ScoreMetric(adjusted=-1), ValueError, "adjusted"),
        (lambda: R2ScoreMetric(multioutput="mean"), ValueError, "multioutput"),  # type: ignore[arg-type]
        (lambda: BinaryAUROCMetric(ignore_index=1.5), TypeError, "ignore_index"),  # type: ignore[arg-type]
    ],
)
def test_bad_options_raise_naming_the_argument(make: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_bad_values_raise_before_the_state_changes() -> None:
    auroc = MulticlassAUROCMetric(C, logits=True, ignore_index=IGNORE)
    logits = torch.randn(5, C, X)
    logits[2, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="preds"):
        auroc.update(logits, torch.zeros(5, X, dtype=torch.long))
    with pytest.raises(ValueError, match="target"):
        auroc.update(torch.randn(5, C, X), torch.full((5, X), C))
    with pytest.raises(ValueError, match=r"target: expected shape"):
        auroc.update(torch.randn(5, C, X), torch.zeros(5, dtype=torch.long))
    assert int(auroc.histograms()[0].sum() + auroc.histograms()[1].sum()) == 0
    auroc.update(torch.randn(5, C, X), torch.full((5, X), IGNORE))  # all ignored: nothing counted
    assert int(auroc.histograms()[0].sum() + auroc.histograms()[1].sum()) == 0


def _macro_f1() -> Any:
    return confusion_count_metric().multiclass(C).with_f1().macro().build()


@pytest.mark.parametrize(
    "update, match",
    [
        # The multiclass host path (logits), and integer class indices through the checks list.
        (
            lambda: _macro_f1().update(torch.rand(5, C), torch.tensor([0, 1, 9, 2, -3])),
            r"^target: expected class indices in \[0, 4\);.* \(found 9, -3: 2 of 5 elements\)$",
        ),
        (
            lambda: _macro_f1().update(torch.tensor([0, 7, 1]), torch.tensor([0, 1, 1])),
            r"^preds: expected class indices in \[0, 4\);.* \(found 7: 1 of 3 elements\)$",
        ),
        (
            lambda: (
                confusion_count_metric()
                .binary()
                .with_f1()
                .build()
                .update(torch.rand(4), torch.tensor([0.0, 1.0, 0.5, 1.0]))
            ),
            r"^target: expected 0/1 targets;.* \(found 0\.5: 1 of 4 elements\)$",
        ),
        (
            lambda: BinaryAUROCMetric().update(
                torch.tensor([0.1, 1.5, 2.0, 3.0, 4.0]), torch.ones(5, dtype=torch.long)
            ),
            r"^preds: expected probabilities.* \(found 1\.5, 2, 3, \.\.\.: 4 of 5 elements\)$",
        ),
        (
            # Just past 1 (rounding upstream): shown as it is, not rounded back to "1".
            lambda: BinaryAUROCMetric().update(torch.tensor([0.5, 1.0000001]), torch.ones(2)),
            r"^preds: expected probabilities.* \(found 1\.0000001: 1 of 2 elements\)$",
        ),
        (
            lambda: _macro_f1().update(torch.tensor([0, 1234567]), torch.tensor([0, 1])),
            r"^preds: expected class indices.* \(found 1234567: 1 of 2 elements\)$",
        ),
        (
            lambda: MulticlassAUROCMetric(C, ignore_index=IGNORE).update(
                torch.rand(3, C), torch.tensor([IGNORE, 4, 0])
            ),
            r"^target: expected class indices in \[0, 4\) or ignore_index=-100;.* "
            r"\(found 4: 1 of 3 elements\)$",
        ),
        (
            # The logits passed, not every element of the softmax rows one NaN makes NaN.
            lambda: MulticlassAUROCMetric(C, logits=True).update(
                torch.tensor([[0.1, float("nan"), 0.3, 0.0], [1.0, float("inf"), 3.0, 0.0]]),
                torch.tensor([0, 1]),
            ),
            r"^preds: expected logits without NaN or \+inf.* \(found nan, inf: 2 of 8 elements\)$",
        ),
        (
            # No NaN and no +inf: a row of only -inf has a NaN softmax all the same.
            lambda: MulticlassCalibrationErrorMetric(3, logits=True).update(
                torch.tensor([[0.0, 1.0, 0.0], [-float("inf")] * 3, [0.0, -float("inf"), 1.0]]),
                torch.tensor([0, 1, 2]),
            ),
            r"^preds: expected logits without NaN or \+inf, and no row of only -inf.*; this "
            r"batch has values that are not \(found -inf, -inf, -inf: 3 of 9 elements\)$",
        ),
    ],
    ids=[
        "target index",
        "predicted index",
        "binary target",
        "probabilities",
        "just past 1",
        "large index",
        "ignore_index",
        "multiclass logits",
        "a row of only -inf",
    ],
)
def test_bad_values_are_shown_in_the_error(update: Any, match: str) -> None:
    # The message says which values broke the check, not only that some did (ignored
    # elements are not among them).
    with pytest.raises(ValueError, match=match):
        update()


def test_scores_in_the_other_layout_say_how_to_move_the_class_axis() -> None:
    # The confusion-count metrics take the class axis last, the ranking ones second (as
    # torchmetrics does): each refusal names the movedim that fits, and that call then works.
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(6, C, X, generator=generator)  # torchmetrics' (N, C, X)
    target = torch.randint(0, C, (6, X), generator=generator)
    f1 = _macro_f1()
    with pytest.raises(ValueError, match=r"\(N, C, \.\.\.\), as torchmetrics.*\.movedim\(1, -1\)"):
        f1.update(scores, target)
    f1.update(scores.movedim(1, -1), target)
    expected = tmf.multiclass_f1_score(scores, target, num_classes=C, average="macro")
    assert float(f1.compute()) == pytest.approx(float(expected))
    auroc = MulticlassAUROCMetric(C, exact=True)
    with pytest.raises(ValueError, match=r"C-last scores \(N, \.\.\., C\).*\.movedim\(-1, 1\)"):
        auroc.update(scores.movedim(1, -1), target)
    auroc.update(scores.movedim(1, -1).movedim(-1, 1), target)
    expected = tmf.multiclass_auroc(scores, target, num_classes=C, average="macro")
    assert float(auroc.compute()) == pytest.approx(float(expected))
    labels = torch.randint(0, 2, (6, C, X), generator=generator)
    multilabel = confusion_count_metric().multilabel(C).with_f1().macro().build()
    with pytest.raises(ValueError, match=r"scores and 0/1 targets laid out \(N, L, \.\.\.\)"):
        multilabel.update(scores, labels)
    multilabel.update(scores.movedim(1, -1), labels.movedim(1, -1))
    expected = tmf.multilabel_f1_score(scores, labels, num_labels=C, average="macro")
    assert float(multilabel.compute()) == pytest.approx(float(expected))
    # A shape of neither layout gets no hint.
    with pytest.raises(ValueError, match=r"got \(6, 7, 9\)$"):
        auroc.update(torch.rand(6, 7, 9), target)


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: BinaryConfusionMatrixMetric(ignore_index=IGNORE), (3,)),
        (lambda: BinaryAUROCMetric(ignore_index=IGNORE), (3,)),
        (lambda: MulticlassConfusionMatrixMetric(C, ignore_index=IGNORE), (3, C)),
        (
            lambda: confusion_count_metric(ignore_index=IGNORE).multilabel(1).with_f1().build(),
            (3, 1),
        ),
    ],
    ids=["binary matrix", "binary auroc", "multiclass matrix", "multilabel"],
)
def test_uint8_targets_are_never_taken_for_a_negative_ignore_index(
    make: Any, shape: tuple[int, ...]
) -> None:
    # -100 compared in uint8 is 156: a target 156 was skipped as ignored instead of refused.
    preds = torch.rand(shape)
    target = torch.tensor([156, 0, 1], dtype=torch.uint8)
    if len(shape) == 2 and shape[1] == 1:
        target = target.reshape(shape)  # multilabel: one label per sample
    with pytest.raises(ValueError, match=r"^target: .*\(found 156: 1 of 3 elements\)$"):
        make().update(preds, target)
    compiled = make()
    torch.compile(compiled.update, fullgraph=True, backend="aot_eager")(preds, target)
    assert int(compiled.rejected_updates) == 1  # dropped and counted, not half counted


def test_a_column_of_class_indices_says_to_squeeze_it() -> None:
    # d9d takes (N, 1) class indices; here they are (N,), and the refusal says how to get them.
    scores, column = torch.rand(4, C), torch.tensor([[0], [1], [2], [1]])
    f1 = _macro_f1()
    with pytest.raises(ValueError, match=r"got \(4, 1\); for a column of class indices pass"):
        f1.update(scores, column)
    with pytest.raises(ValueError, match=r"got \(4, 1\); for a column of class indices pass"):
        MulticlassAUROCMetric(C).update(scores, column)
    f1.update(scores, column.squeeze(-1))
    expected = tmf.multiclass_f1_score(scores, column.squeeze(-1), num_classes=C, average="macro")
    assert float(f1.compute()) == pytest.approx(float(expected))


def test_samplewise_per_class_and_several_statistics() -> None:
    data = make_data(4, 50)
    logits = torch.as_tensor(data["mc_logits"], dtype=torch.float32)
    target = torch.as_tensor(data["mc_target"])
    metric = (
        confusion_count_metric(multidim_average="samplewise")
        .multiclass(C)
        .with_f1()
        .with_recall()
        .per_class()
        .build()
    )
    metric.update(logits[:20].movedim(1, -1), target[:20])
    metric.update(logits[20:].movedim(1, -1), target[20:])
    values = metric.compute()
    assert isinstance(values, dict)
    for name, function in (("f1", tmf.multiclass_f1_score), ("recall", tmf.multiclass_recall)):
        expected = function(
            logits, target, num_classes=C, average="none", multidim_average="samplewise"
        ).double()
        assert values[name].shape == (C,)
        assert torch.allclose(values[name], expected.mean(0), atol=1e-6), name


def test_samplewise_refuses_samples_without_positions_and_takes_multilabel_rows() -> None:
    """One element per sample (binary (N,), multiclass (N, C) scores or (N,) indices) is refused,
    as torchmetrics does; multilabel (N, L) is scikit-learn's average="samples"."""
    from sklearn.metrics import f1_score

    def samplewise() -> Any:
        return confusion_count_metric(multidim_average="samplewise")

    cases = [
        (samplewise().binary(), torch.rand(6), torch.randint(0, 2, (6,)), r"\(N, X, \.\.\.\)"),
        (samplewise().multiclass(C), torch.rand(6, C), torch.randint(0, C, (6,)), "scores"),
        (samplewise().multiclass(C), torch.randint(0, C, (6,)), torch.randint(0, C, (6,)), "ind"),
    ]
    for builder, preds, target, what in cases:
        metric = builder.with_f1().build()
        with pytest.raises(ValueError, match=rf"^preds: expected .*{what}.*got \(6"):
            metric.update(preds, target)
    rows = np.random.default_rng(2).integers(0, 2, (2, 6, 4))
    metric = samplewise().multilabel(4).with_f1().micro().build()
    metric.update(torch.as_tensor(rows[0]).double(), torch.as_tensor(rows[1]))
    expected = f1_score(rows[1], rows[0], average="samples", zero_division=0)
    assert metric.compute().item() == pytest.approx(expected)


def test_the_multilabel_matrix_refuses_a_one_dimensional_batch() -> None:
    """As the confusion builder's multilabel (test_confusion_api's LABEL_BAD)."""
    metric = MultilabelConfusionMatrixMetric(3)
    with pytest.raises(ValueError, match=r"^preds: expected shape \(N, \.\.\., L\)"):
        metric.update(torch.tensor([0.9, 0.2, 0.7]), torch.tensor([1, 0, 0]))
    assert int(metric.compute().sum()) == 0  # nothing counted
