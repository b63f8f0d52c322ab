"""Ranking curves and calibration error against scikit-learn and direct formulas."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.preprocessing import label_binarize

from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    BinaryCalibrationErrorMetric,
    MulticlassAUROCMetric,
    MulticlassAveragePrecisionMetric,
    MulticlassCalibrationErrorMetric,
    MultilabelAUROCMetric,
    MultilabelAveragePrecisionMetric,
)
from sidestream.testing import RankPool, on_rank_device
from tests._checkpoints import states_only

CLASSES = 4
BINS = 10_000


def _binary(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> dict[str, np.ndarray]:
    target = rng.integers(0, 2, size=shape)
    scores = 1.0 / (1.0 + np.exp(-(rng.normal(size=shape) + 1.2 * target)))
    return {"scores": scores.astype(dtype), "target": target.astype(np.int64)}


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _shard(seed: int, size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    binary = _binary(rng, (size,), np.float32)
    labels = rng.integers(0, CLASSES, size=size)
    logits = rng.normal(size=(size, CLASSES)) + 1.5 * np.eye(CLASSES)[labels]
    label_matrix = rng.integers(0, 2, size=(size, CLASSES))
    label_scores = 1.0 / (1.0 + np.exp(-(rng.normal(size=(size, CLASSES)) + label_matrix)))
    return {
        **binary,
        "probs": _softmax(logits),  # float64 so rows sum to 1 for scikit-learn's ovr check
        "labels": labels.astype(np.int64),
        "label_scores": label_scores.astype(np.float32),
        "label_matrix": label_matrix.astype(np.int64),
    }


def _shards(seed: int, world_size: int) -> list[dict[str, np.ndarray]]:
    """Uneven shards; the last of several ranks has none."""
    sizes = np.random.default_rng(seed + 1000).integers(500, 4000, size=world_size)
    if world_size > 1:
        sizes[-1] = 0
    return [_shard(seed * 10 + rank, int(size)) for rank, size in enumerate(sizes)]


def _concat(shards: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {key: np.concatenate([s[key] for s in shards]) for key in shards[0]}


def _metrics() -> dict[str, Any]:
    return {
        "auroc": BinaryAUROCMetric(BINS),
        "ap": BinaryAveragePrecisionMetric(BINS),
        "ece": BinaryCalibrationErrorMetric(15),
        **{
            f"mc_auroc_{avg}": MulticlassAUROCMetric(CLASSES, BINS, average=avg)
            for avg in ("macro", "weighted", "none")
        },
        **{
            f"mc_ap_{avg}": MulticlassAveragePrecisionMetric(CLASSES, BINS, average=avg)
            for avg in ("macro", "weighted", "none")
        },
        **{
            f"ml_auroc_{avg}": MultilabelAUROCMetric(CLASSES, BINS, average=avg)
            for avg in ("macro", "weighted", "none")
        },
        **{
            f"ml_ap_{avg}": MultilabelAveragePrecisionMetric(CLASSES, BINS, average=avg)
            for avg in ("macro", "weighted", "none")
        },
        "mc_ece": MulticlassCalibrationErrorMetric(CLASSES, 15),
    }


def _feed(metrics: dict[str, Any], data: dict[str, np.ndarray], pieces: int = 3) -> None:
    n = len(data["target"])
    cuts = np.linspace(0, n, pieces + 1).astype(int)
    for a, b in itertools.pairwise(cuts):
        part = {k: torch.as_tensor(v[a:b]) for k, v in data.items()}
        for name, metric in metrics.items():
            if name in ("auroc", "ap", "ece"):
                metric.update(part["scores"], part["target"])
            elif name.startswith("mc_"):
                metric.update(part["probs"], part["labels"])
            else:
                metric.update(part["label_scores"], part["label_matrix"])


def _results(metrics: dict[str, Any]) -> dict[str, tuple[list[float], list[float]]]:
    out = {}
    for name, metric in metrics.items():
        value = metric.compute()
        bound = metric.error_bound() if hasattr(metric, "error_bound") else value * 0
        out[name] = (value.reshape(-1).tolist(), bound.reshape(-1).tolist())
    return out


def _calibration_bin(confidence: np.ndarray, bins: int) -> np.ndarray:
    """The documented calibration bins: ``[b/n, (b+1)/n)`` with 1.0 in the last, where a score
    that is an edge up to its dtype's rounding (within 2**-23 relative below it for float32,
    2**-50 for float64) opens the bin above. Counted by comparison with each edge."""
    tolerance = 2.0**-50 if confidence.dtype == np.float64 else 2.0**-23
    wide = confidence.astype(np.float64).reshape(-1, 1)
    edges = np.arange(1, bins, dtype=np.float64) / bins
    return np.asarray((wide >= edges / (1 + tolerance)).sum(axis=1))


def _ece(confidence: np.ndarray, accuracy: np.ndarray, bins: int) -> float:
    index = _calibration_bin(confidence, bins)
    gaps = [
        abs(confidence[index == b].astype(np.float64).sum() - accuracy[index == b].sum())
        for b in range(bins)
    ]
    return float(np.sum(gaps) / len(confidence))


def _references(data: dict[str, np.ndarray]) -> dict[str, list[float]]:
    scores, target = data["scores"].reshape(-1), data["target"].reshape(-1)
    probs, labels = data["probs"], data["labels"]
    onehot = label_binarize(labels, classes=list(range(CLASSES)))
    ls, lm = data["label_scores"], data["label_matrix"]
    ref: dict[str, list[float]] = {
        "auroc": [roc_auc_score(target, scores)],
        "ap": [average_precision_score(target, scores)],
        "ece": [_ece(scores, target, 15)],
        "mc_ece": [_ece(probs.max(1), (probs.argmax(1) == labels).astype(float), 15)],
    }
    for avg in ("macro", "weighted"):
        ref[f"mc_auroc_{avg}"] = [roc_auc_score(labels, probs, multi_class="ovr", average=avg)]
        ref[f"mc_ap_{avg}"] = [average_precision_score(onehot, probs, average=avg)]
        ref[f"ml_auroc_{avg}"] = [roc_auc_score(lm, ls, average=avg)]
        ref[f"ml_ap_{avg}"] = [average_precision_score(lm, ls, average=avg)]
    ref["mc_auroc_none"] = [roc_auc_score(onehot[:, k], probs[:, k]) for k in range(CLASSES)]
    ref["mc_ap_none"] = list(average_precision_score(onehot, probs, average=None))
    ref["ml_auroc_none"] = list(roc_auc_score(lm, ls, average=None))
    ref["ml_ap_none"] = list(average_precision_score(lm, ls, average=None))
    return ref


def _check(results: dict[str, tuple[list[float], list[float]]], data: dict[str, Any]) -> None:
    for name, expected in _references(data).items():
        values, bounds = results[name]
        assert len(values) == len(expected), name
        for value, bound, exact in zip(values, bounds, expected, strict=True):
            # The certified bound holds, and with 10,000 bins the error is below 1e-3.
            assert abs(value - exact) <= bound + 1e-9, (name, value, exact, bound)
            assert abs(value - exact) < 1e-3, (name, value, exact)
            if "auroc" in name:
                assert bound < 1e-3, (name, bound)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_process_matches_sklearn(seed: int) -> None:
    data = _shard(seed, 3000 + 1000 * seed)
    metrics = _metrics()
    _feed(metrics, data)
    _check(_results(metrics), data)


@pytest.mark.parametrize("shape", [(2000,), (300, 7), (50, 4, 10)])
def test_binary_any_shape_and_float64(shape: tuple[int, ...]) -> None:
    data = _binary(np.random.default_rng(len(shape)), shape, np.float64)
    auroc, ap = BinaryAUROCMetric(BINS), BinaryAveragePrecisionMetric(BINS)
    for metric in (auroc, ap):
        metric.update(torch.as_tensor(data["scores"]), torch.as_tensor(data["target"]))
    flat_s, flat_t = data["scores"].reshape(-1), data["target"].reshape(-1)
    assert abs(auroc.compute().item() - roc_auc_score(flat_t, flat_s)) <= auroc.error_bound()
    assert abs(ap.compute().item() - average_precision_score(flat_t, flat_s)) <= ap.error_bound()


def test_scores_on_distinct_bins_are_exact() -> None:
    """Scores with two decimals (many ties) never share a bin with another score: exact."""
    rng = np.random.default_rng(3)
    target = rng.integers(0, 2, 5000)
    scores = np.round(np.clip(rng.normal(0.5, 0.2, 5000) + 0.1 * target, 0, 1), 2)
    auroc, ap = BinaryAUROCMetric(BINS), BinaryAveragePrecisionMetric(BINS)
    for metric in (auroc, ap):
        metric.update(torch.as_tensor(scores), torch.as_tensor(target))
    assert auroc.compute().item() == pytest.approx(roc_auc_score(target, scores), abs=1e-12)
    assert ap.compute().item() == pytest.approx(average_precision_score(target, scores), abs=1e-12)


def test_coarse_bins_err_but_stay_within_the_bound() -> None:
    data = _binary(np.random.default_rng(5), (4000,), np.float32)
    exact_auroc = roc_auc_score(data["target"], data["scores"])
    exact_ap = average_precision_score(data["target"], data["scores"])
    for bins in (4, 16, 100):
        auroc, ap = BinaryAUROCMetric(bins), BinaryAveragePrecisionMetric(bins)
        for metric in (auroc, ap):
            metric.update(torch.as_tensor(data["scores"]), torch.as_tensor(data["target"]))
        auroc_error = abs(auroc.compute().item() - exact_auroc)
        ap_error = abs(ap.compute().item() - exact_ap)
        assert auroc_error <= auroc.error_bound().item()
        assert ap_error <= ap.error_bound().item()
        if bins == 4:
            assert auroc_error > 1e-3  # the check above is not vacuous


@on_rank_device
def _synced(seeds: list[int]) -> list[dict[str, tuple[list[float], list[float]]]]:
    out = []
    for seed in seeds:
        shard = _shards(seed, dist.get_world_size())[dist.get_rank()]
        metrics = _metrics()
        _feed(metrics, shard)
        for metric in metrics.values():
            metric.sync()
        out.append(_results(metrics))
    return out


def test_distributed_matches_sklearn_on_all_shards(dist_pool: RankPool) -> None:
    seeds = [7, 8]
    per_rank = dist_pool.run(_synced, seeds)
    for i, seed in enumerate(seeds):
        everything = _concat(_shards(seed, dist_pool.world_size))
        for results in per_rank:
            _check(results[i], everything)


def test_state_is_constant_size_and_counts_are_exact() -> None:
    metric = MulticlassAUROCMetric(CLASSES, num_bins=64)
    sizes = []
    for seed in range(4):
        data = _shard(seed, 1000)
        metric.update(torch.as_tensor(data["probs"]), torch.as_tensor(data["labels"]))
        sizes.append(sum(t.numel() for t in states_only(metric.state_dict()).values()))
    assert len(set(sizes)) == 1
    negatives, positives = metric.histograms()
    # Every sample adds one count per class: one positive, CLASSES - 1 negatives.
    assert positives.sum().item() == 4000
    assert negatives.sum().item() == 4000 * (CLASSES - 1)


def test_bad_input_raises_naming_the_argument_before_state_changes() -> None:
    binary = BinaryAUROCMetric(100)
    with pytest.raises(ValueError, match="preds"):
        binary.update(torch.tensor([0.2, 1.5]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="preds"):
        binary.update(torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="target"):
        binary.update(torch.tensor([0.2, 0.5]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="target"):
        binary.update(torch.tensor([0.2, 0.5]), torch.tensor([0, 1, 1]))
    with pytest.raises(TypeError, match="preds"):
        binary.update(torch.tensor([0, 1]), torch.tensor([0, 1]))
    assert binary.histograms()[0].sum().item() == 0
    assert binary.histograms()[1].sum().item() == 0

    multiclass = MulticlassAveragePrecisionMetric(3, 100)
    with pytest.raises(ValueError, match=r"preds.*num_classes=3"):
        multiclass.update(torch.full((2, 4), 0.25), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="target"):
        multiclass.update(torch.full((2, 3), 0.3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="target"):
        multiclass.update(torch.full((2, 3), 0.3), torch.tensor([0, 1, 2]))
    assert multiclass.histograms()[1].sum().item() == 0

    ece = MulticlassCalibrationErrorMetric(3)
    with pytest.raises(ValueError, match="target"):
        ece.update(torch.full((2, 3), 0.3), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="num_bins"):
        BinaryAUROCMetric(1)
    with pytest.raises(ValueError, match="average"):
        MulticlassAUROCMetric(3, average="micro")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_scores_and_bool_targets(dtype: torch.dtype) -> None:
    data = _binary(np.random.default_rng(11), (3000,), np.float32)
    scores = torch.as_tensor(data["scores"]).to(dtype)
    target = torch.as_tensor(data["target"]).bool()
    auroc = BinaryAUROCMetric(BINS)
    auroc.update(scores, target)
    exact = roc_auc_score(data["target"], scores.float().numpy())  # the values the metric saw
    assert abs(auroc.compute().item() - exact) <= auroc.error_bound().item() + 1e-12


def test_state_dict_round_trip_continues_the_same_numbers() -> None:
    first, second = _shard(12, 800), _shard(13, 700)
    metrics, restored = _metrics(), _metrics()
    _feed(metrics, first)
    for name, metric in metrics.items():
        restored[name].load_state_dict(metric.state_dict())
    _feed(metrics, second)
    _feed(restored, second)
    assert _results(restored) == _results(metrics)
    _check(_results(restored), _concat([first, second]))


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ({"thresholds": [0.0, 0.5, 1.0]}, {"thresholds": [0.0, 0.05, 1.0]}),
        ({"thresholds": [0.0, 0.5, 1.0]}, {"num_bins": 4}),  # the same histogram shape
        ({"num_bins": 4}, {"thresholds": [0.25, 0.5, 0.75]}),
    ],
)
def test_a_checkpoint_of_other_bins_is_refused(
    saved: dict[str, Any], loaded: dict[str, Any]
) -> None:
    """Counts per bin added into other bins give a value of neither: refused, state unchanged."""
    scores, target = torch.rand(200), torch.randint(0, 2, (200,))
    for make in (BinaryAUROCMetric, BinaryAveragePrecisionMetric):
        source = make(**saved)
        source.update(scores, target)
        state = source.state_dict()
        metric = make(**loaded)
        metric.update(scores[:50], target[:50])
        before = metric.compute()
        with pytest.raises(ValueError, match=r"bin_layout.*saved with .*configured the same"):
            metric.load_state_dict(state)
        assert torch.equal(metric.compute(), before)
        twin = make(**saved)
        twin.load_state_dict(state)  # the same bins load
        assert torch.equal(twin.compute(), source.compute())
        older = {key: value for key, value in state.items() if key != "bin_layout"}
        twin = make(**saved)
        twin.load_state_dict(older)  # saved before the bins were: loads as is
        assert torch.equal(twin.compute(), source.compute())


def test_empty_thresholds_are_named_as_empty() -> None:
    with pytest.raises(ValueError, match="thresholds: expected at least one value"):
        BinaryAUROCMetric(thresholds=[])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_score_of_one_stays_in_its_row_with_a_million_bins(dtype: torch.dtype) -> None:
    """From about 2**20 bins the edge nudge is a whole bin: 1.0 must still land in the last
    bin of its own row on the CPU bincount path (a batch of at least 2 * (bins + 1) scores),
    not in the next row (negatives counted as positives) or past the end."""
    bins = 2**20
    rng = np.random.default_rng(0)
    size = 2 * (bins + 1)
    target = rng.integers(0, 2, size)
    scores = (rng.random(size) * 0.5 + 0.25 * target).astype(np.float64)
    scores[:1000], target[:1000] = 1.0, 0  # negatives at exactly 1.0
    scores[1000:1500], target[1000:1500] = 1.0, 1  # and positives
    auroc, ap = BinaryAUROCMetric(num_bins=bins), BinaryAveragePrecisionMetric(num_bins=bins)
    for metric in (auroc, ap):
        metric.update(torch.from_numpy(scores).to(dtype), torch.from_numpy(target))
    negatives, positives = auroc.histograms()
    assert int(negatives[0, -1]) >= 1000 and int(positives[0, -1]) >= 500
    assert int(negatives.sum()) + int(positives.sum()) == size
    stored = torch.from_numpy(scores).to(dtype).double().numpy()
    for metric, reference in ((auroc, roc_auc_score), (ap, average_precision_score)):
        error = abs(float(metric.compute()) - reference(target, stored))
        assert error <= float(metric.error_bound()) + 1e-12, metric


def test_a_confidence_of_one_is_binned_with_a_million_bins() -> None:
    bins = 1_015_808  # float32 rounding makes 1.0 spill from here on
    metric = BinaryCalibrationErrorMetric(num_bins=bins)
    metric.update(torch.tensor([1.0, 0.2]), torch.tensor([0, 0]))
    # Predicted classes 1 (confidence 1.0, wrong) and 0 (confidence 0.8, right): gaps 1 and 0.2.
    assert float(metric.compute()) == pytest.approx((1.0 + 0.2) / 2, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_decimal_score_on_a_threshold_edge_counts_at_the_edge_in_every_dtype(
    dtype: torch.dtype,
) -> None:
    """float32 0.7 is stored as 0.69999998: it counts at the edge 0.7, as float64 0.7 does.

    Every one-decimal score sits on its own edge, so the binned values are exact: scikit-learn's
    on the decimals. Counted below its edge, float32 0.7 shared 0.6's bin.
    """
    generator = torch.Generator().manual_seed(5)
    decimals = torch.randint(0, 11, (2000,), generator=generator).double() / 10
    target = (torch.rand(2000, generator=generator, dtype=torch.float64) < decimals).long()
    edges = [k / 10 for k in range(11)]
    reference = {
        BinaryAUROCMetric: roc_auc_score(target.numpy(), decimals.numpy()),
        BinaryAveragePrecisionMetric: average_precision_score(target.numpy(), decimals.numpy()),
    }
    for make, expected in reference.items():
        metric = make(thresholds=edges)
        metric.update(decimals.to(dtype), target)
        assert float(metric.compute()) == pytest.approx(expected, abs=1e-12), make.__name__
    # Only a hair below counts at the edge: 2**-18 relative below it is the bin below.
    metric = BinaryAUROCMetric(thresholds=[0.5, 0.7])
    below = 0.7 * (1 - 2.0**-18)
    metric.update(torch.tensor([below, 0.7, 0.5], dtype=dtype), torch.tensor([0, 0, 0]))
    negatives, _ = metric.histograms()
    assert negatives.tolist() == [[0, 2, 1]]
