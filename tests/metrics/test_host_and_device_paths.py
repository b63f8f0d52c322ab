"""The CPU fast paths and the CUDA-style device paths, both on CPU, against scikit-learn.

``_cpu_path.enabled`` picks ``bincount`` and host-read checks on CPU. Turning it off runs the
fixed-size ``index_add_`` paths that CUDA takes, so both stay checked against the references
here, and their states must agree exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.metrics import confusion_matrix, f1_score, precision_score, roc_auc_score

from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryCalibrationErrorMetric,
    MulticlassAUROCMetric,
    MulticlassCalibrationErrorMetric,
    MulticlassConfusionMatrixMetric,
    MultilabelAveragePrecisionMetric,
    _cpu_path,
    confusion_count_metric,
)
from tests.metrics import test_ranking
from tests.metrics.confusion_cases import (
    CASES,
    MATRIX_CASES,
    assert_matches,
    assert_matrix_matches,
    make_shards,
    matrix_reference,
    reference,
    run_case,
    run_matrix_case,
)


@contextmanager
def _device_path(monkeypatch: pytest.MonkeyPatch, on: bool) -> Iterator[None]:
    with monkeypatch.context() as patch:
        if on:
            patch.setattr(_cpu_path, "enabled", lambda device: False)
        yield


def _states(metrics: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    return {
        name: [acc.local.clone() for _, acc in metric.named_accumulators()]
        for name, metric in metrics.items()
    }


def test_confusion_cases_on_the_device_path_match_sklearn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _device_path(monkeypatch, on=True):
        for case in CASES:
            batches = [batch for shard in make_shards(case, 0, 2) for batch in shard]
            assert_matches(run_case(case, batches, sync=False), reference(case, batches), case)
        for case in MATRIX_CASES:
            batches = [batch for shard in make_shards(case, 0, 2) for batch in shard]
            expected = matrix_reference(case, batches)
            assert_matrix_matches(run_matrix_case(case, batches, sync=False), expected, case)


@pytest.mark.parametrize("device_path", [False, True])
def test_many_classes_and_large_batches_match_sklearn(
    monkeypatch: pytest.MonkeyPatch, device_path: bool
) -> None:
    """Past 64 classes (stacked counts) and batches over C * C (bincount of the matrix)."""
    generator = torch.Generator().manual_seed(3)
    classes = 70
    logits = torch.randn(6000, classes, generator=generator)
    target = torch.randint(0, classes, (6000,), generator=generator)
    target[::7] = -100
    four_classes = torch.where(target < 0, target, target % 4)
    with _device_path(monkeypatch, on=device_path):
        f1 = (
            confusion_count_metric(ignore_index=-100)
            .multiclass(classes)
            .with_f1()
            .with_precision()
            .macro()
            .build()
        )
        small = MulticlassConfusionMatrixMetric(4, ignore_index=-100)
        large = MulticlassConfusionMatrixMetric(4, ignore_index=-100)
        for part in range(3):
            rows = slice(part * 2000, (part + 1) * 2000)
            f1.update(logits[rows], target[rows])
            large.update(logits[rows, :4], four_classes[rows])
            small.update(logits[rows, :4][:5], four_classes[rows][:5])
        values = f1.compute()
    kept = (target != -100).numpy()
    truth, predicted = target.numpy()[kept], logits.argmax(1).numpy()[kept]
    labels = list(range(classes))
    assert isinstance(values, dict)
    expected_f1 = f1_score(truth, predicted, labels=labels, average="macro", zero_division=0)
    expected_precision = precision_score(
        truth, predicted, labels=labels, average="macro", zero_division=0
    )
    assert np.isclose(values["f1"].item(), expected_f1, rtol=1e-12)
    assert np.isclose(values["precision"].item(), expected_precision, rtol=1e-12)
    four, truth_four = logits[:, :4].argmax(1).numpy(), four_classes.numpy()
    expected_large = confusion_matrix(truth_four[kept], four[kept], labels=range(4))
    assert np.array_equal(large.compute().numpy(), expected_large)
    first = np.concatenate([np.arange(k * 2000, k * 2000 + 5) for k in range(3)])
    first = first[kept[first]]
    assert len(first) < 15  # ignored samples among them
    expected_small = confusion_matrix(truth_four[first], four[first], labels=range(4))
    assert np.array_equal(small.compute().numpy(), expected_small)


def test_ranking_and_calibration_paths_agree_and_match_sklearn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One batch large enough for the host path's bincount, in two chunks (the last ragged)."""
    monkeypatch.setattr(_cpu_path, "CHUNK_ELEMENTS", 1)
    data = test_ranking._shard(5, 25_000)
    states = {}
    for device_path in (False, True):
        with _device_path(monkeypatch, on=device_path):
            metrics = test_ranking._metrics()
            test_ranking._feed(metrics, data, pieces=1)
            test_ranking._check(test_ranking._results(metrics), data)
            states[device_path] = _states(metrics)
    for name, host_state in states[False].items():
        for host, device in zip(host_state, states[True][name], strict=True):
            if host.dtype == torch.int64:
                assert torch.equal(host, device), name
            else:  # float64 sums, added in another order
                assert torch.allclose(host, device, rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize("device_path", [False, True])
def test_scores_on_bin_edges_land_where_the_bins_say(
    monkeypatch: pytest.MonkeyPatch, device_path: bool
) -> None:
    """0, 1, exact edges and values just below them, in float32, float64 and bfloat16.

    Chunks shrink to the histogram size (18 to 54 elements), so the host path adds up two
    chunks, the last one ragged.
    """
    monkeypatch.setattr(_cpu_path, "CHUNK_ELEMENTS", 1)
    bins = 8
    edges = np.arange(bins + 1) / bins
    base = np.concatenate([edges, np.nextafter(edges[1:], 0), [0.0, 1.0, 1.0]])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        scores = torch.tensor(base).to(dtype)
        target = torch.arange(len(base)) % 2
        labels = torch.arange(len(base)) % 3
        probs = torch.stack([scores, 1 - scores, torch.zeros_like(scores)], dim=1)
        wide = scores.double() if dtype == torch.float64 else scores.float()
        # The documented edge rule: scores within 2**-20 relative below an edge open its bin.
        index = np.minimum((wide * (bins * (1 + 2**-20))).to(torch.int64).numpy(), bins - 1)
        positive = target.numpy() == 1
        with _device_path(monkeypatch, on=device_path):
            auroc = BinaryAUROCMetric(bins)
            auroc.update(scores, target)
            multiclass = MulticlassAUROCMetric(3, bins)
            multiclass.update(probs, labels)
            multilabel = MultilabelAveragePrecisionMetric(2, bins)
            multilabel.update(
                torch.stack([scores, scores], dim=1), torch.stack([target, 1 - target], dim=1)
            )
            ece = BinaryCalibrationErrorMetric(bins)
            ece.update(scores, target.bool())
            top = MulticlassCalibrationErrorMetric(3, bins)
            top.update(probs, labels)
        negatives, positives = auroc.histograms()
        assert negatives[0].tolist() == np.bincount(index[~positive], minlength=bins).tolist()
        assert positives[0].tolist() == np.bincount(index[positive], minlength=bins).tolist()
        negatives, positives = multiclass.histograms()
        assert (
            positives[0].tolist()
            == np.bincount(index[labels.numpy() == 0], minlength=bins).tolist()
        )
        assert (
            negatives[0].tolist()
            == np.bincount(index[labels.numpy() != 0], minlength=bins).tolist()
        )
        negatives, positives = multilabel.histograms()
        assert positives[0].tolist() == np.bincount(index[positive], minlength=bins).tolist()
        assert negatives[1].tolist() == np.bincount(index[positive], minlength=bins).tolist()
        expected = test_ranking._ece(wide.numpy(), target.numpy(), bins)
        assert np.isclose(ece.compute().item(), expected, rtol=1e-12, atol=1e-15)
        confidence, predicted = probs.max(1)
        correct = (predicted == labels).double().numpy()
        wide_top = confidence.double() if dtype == torch.float64 else confidence.float()
        expected_top = test_ranking._ece(wide_top.numpy(), correct, bins)
        assert np.isclose(top.compute().item(), expected_top, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("device_path", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_confidence_a_hair_below_an_edge_stays_in_the_bin_below(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, device_path: bool
) -> None:
    """Only an edge's own rounding counts at the edge (float32 ``0.7`` with 10 bins).

    ``0.5 * (1 - 2**-21)`` (exact in both dtypes) is 2**-21 relative below the edge 0.5, far
    more than either dtype's rounding: it lies in ``[0, 0.5)``, as the definition, a direct
    computation and torchmetrics (whose float32 edges are exact here) say.
    """
    from torchmetrics.functional.classification import binary_calibration_error

    below = 0.5 * (1 - 2**-21)
    preds = torch.tensor([below, 0.9, 0.7], dtype=dtype)
    target = torch.tensor([0, 1, 1])
    # Bins [0, .5) and [.5, 1]: {below} with accuracy 0, {0.9, 0.7} with accuracy 1.
    wide = preds.double().tolist()
    gaps = [abs(wide[0] - 0.0), abs((wide[1] + wide[2]) / 2 - 1.0)]
    expected = {
        "l1": (gaps[0] * 1 + gaps[1] * 2) / 3,
        "l2": math.sqrt((gaps[0] ** 2 * 1 + gaps[1] ** 2 * 2) / 3),
        "max": max(gaps),
    }
    for norm, value in expected.items():
        with _device_path(monkeypatch, on=device_path):
            metric = BinaryCalibrationErrorMetric(2, norm=norm)  # type: ignore[arg-type]
            metric.update(preds, target)
        assert metric.compute().item() == pytest.approx(value, rel=1e-12), norm
        peer = binary_calibration_error(preds, target, n_bins=2, norm=norm)
        assert metric.compute().item() == pytest.approx(peer.item(), rel=1e-6), norm
    # And the decimal edge 0.7 (float32: 0.69999998) opens bin 7 of 10 in both dtypes.
    with _device_path(monkeypatch, on=device_path):
        tenths = BinaryCalibrationErrorMetric(10)
        tenths.update(torch.tensor([0.7, 0.3], dtype=dtype), torch.tensor([1, 0]))
    counts = dict(tenths.named_accumulators())["count"].local
    assert counts.tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]


def test_host_checks_raise_before_the_state_changes() -> None:
    """The host-read checks name the argument and leave the state untouched."""
    auroc = BinaryAUROCMetric(16)
    auroc.update(torch.tensor([0.2, 0.7]), torch.tensor([0, 1]))
    before = auroc.histograms()[0].clone(), auroc.histograms()[1].clone()
    for preds, target, argument in [
        (torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]), "preds"),
        (torch.tensor([0.2, 1.5]), torch.tensor([0, 1]), "preds"),
        (torch.tensor([0.2, 0.5]), torch.tensor([0, 2]), "target"),
    ]:
        with pytest.raises(ValueError, match=argument):
            auroc.update(preds, target)
    assert all(torch.equal(a, b) for a, b in zip(auroc.histograms(), before, strict=True))
    metric = confusion_count_metric(ignore_index=-100).multiclass(3).with_recall().build()
    for preds, target, argument in [
        (torch.tensor([0, 3]), torch.tensor([0, 1]), "preds"),
        (torch.tensor([0, 1]), torch.tensor([0, -1]), "target"),
        (torch.tensor([0, 1]), torch.tensor([0, 3]), "target"),
    ]:
        with pytest.raises(ValueError, match=argument):
            metric.update(preds, target)
    assert all(int(value.abs().sum()) == 0 for value in metric.counts().values())


def test_device_policy_drops_bad_ranking_batches_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA policy on the device path, on CPU: bad batches (NaN too) leave no trace."""
    from sidestream.metrics.classification import _scores

    def device_screen(checks: list[tuple[Any, str, str]], rejected: Any) -> torch.Tensor:
        bad = torch.stack([torch.as_tensor(flag).any() for flag, *_ in checks]).any()
        rejected.accumulate(bad.to(torch.int64))
        return ~bad

    generator = torch.Generator().manual_seed(4)
    scores = torch.rand(50, 3, generator=generator)
    probs = scores / scores.sum(1, keepdim=True)
    labels = torch.randint(0, 3, (50,), generator=generator)
    matrix = torch.randint(0, 2, (50, 3), generator=generator)
    nan = probs.clone()
    nan[3, 1] = float("nan")
    feeds: dict[str, tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]] = {
        "auroc": (
            lambda: BinaryAUROCMetric(32),
            [(nan[:, 1], matrix[:, 0]), (scores[:, 0] + 1, matrix[:, 0]), (scores[:, 0], labels)],
        ),
        "exact": (
            lambda: BinaryAUROCMetric(exact=True),
            [(nan[:, 1], matrix[:, 0]), (scores[:, 0] + 1, matrix[:, 0]), (scores[:, 0], labels)],
        ),
        "multiclass": (
            lambda: MulticlassAUROCMetric(3, 32),
            [(nan, labels), (probs, labels + 1), (probs * 2, labels)],
        ),
        "multilabel": (
            lambda: MultilabelAveragePrecisionMetric(3, 32),
            [(nan, matrix), (scores, matrix * 2), (scores, matrix - 1)],
        ),
        "ece": (
            lambda: BinaryCalibrationErrorMetric(7),
            [(nan[:, 1], matrix[:, 0]), (scores[:, 0], matrix[:, 0] + 1)],
        ),
        "top_ece": (
            lambda: MulticlassCalibrationErrorMetric(3, 7),
            [(nan, labels), (probs, labels + 1), (-probs, labels)],
        ),
    }
    good = {
        "auroc": (scores[:, 0], matrix[:, 0]),
        "exact": (scores[:, 0], matrix[:, 0]),
        "multiclass": (probs, labels),
        "multilabel": (scores, matrix),
        "ece": (scores[:, 0], matrix[:, 0]),
        "top_ece": (probs, labels),
    }
    for name, (make, bad_batches) in feeds.items():
        reference = make()
        reference.update(*good[name])
        reference.update(*good[name])
        with monkeypatch.context() as patch:
            patch.setattr(_cpu_path, "enabled", lambda device: False)
            patch.setattr(_scores, "screen", device_screen)
            metric = make()
            metric.update(*good[name])
            for preds, target in bad_batches:
                metric.update(preds, target)
            metric.update(*good[name])
        assert metric.rejected_updates.item() == len(bad_batches), name
        for (_, expected), (_, actual) in zip(
            reference.named_accumulators(), metric.named_accumulators(), strict=True
        ):
            if expected.local.ndim:  # the state, not the rejected counter
                assert torch.allclose(actual.local, expected.local, rtol=1e-12, atol=0), name
        # The exact metric's samples are not accumulators: its value shows what it kept.
        assert torch.allclose(metric.compute(), reference.compute(), rtol=1e-12, atol=0), name


@pytest.mark.parametrize("classes", [2, 10, 16, 17])
def test_small_multiclass_host_counts_equal_the_device_path(
    monkeypatch: pytest.MonkeyPatch, classes: int
) -> None:
    """The CPU shortcut for scores and class indices (``count_map``) counts as the device path."""
    generator = torch.Generator().manual_seed(classes)
    rows = (1 << 14) // classes + 1  # integer-valued scores: many ties
    batches = [
        (torch.randn(5, 3, classes, generator=generator), torch.randint(0, classes, (5, 3))),
        (torch.randn(64, classes, generator=generator).half(), torch.randint(0, classes, (64,))),
        (torch.randn(0, classes), torch.zeros(0, dtype=torch.int64)),
        (torch.randn(7, classes, dtype=torch.float64), torch.randint(0, classes, (7,)).int()),
        # Past _FUSED_MAX_ELEMENTS: predictions and the NaN check from one max(-1) pass.
        (torch.randint(0, 3, (rows, classes)).float(), torch.randint(0, classes, (rows,))),
    ]
    counts = {}
    for device_path in (False, True):
        metric = confusion_count_metric().multiclass(classes).with_f1().macro().build()
        if not device_path:
            metric.to("cpu")  # states as views into the arena, as after any move
        with _device_path(monkeypatch, on=device_path):
            for preds, target in batches:
                metric.update(preds, target)
        counts[device_path] = metric.counts()
    for name, value in counts[False].items():
        assert torch.equal(value, counts[True][name]), name
    assert int(counts[False]["tp"].sum() + counts[False]["fn"].sum()) == 5 * 3 + 64 + 7 + rows


@pytest.mark.parametrize("rows", [6, (1 << 14) // 10 + 1])
def test_small_multiclass_host_path_raises_before_counting(rows: int) -> None:
    metric = confusion_count_metric().multiclass(10).with_f1().macro().build().to("cpu")
    scores, labels = torch.randn(rows, 10), torch.randint(0, 10, (rows,))
    metric.update(scores, labels)
    before = {name: value.clone() for name, value in metric.counts().items()}
    bad_scores = scores.clone()
    bad_scores[rows // 2, 3] = float("nan")
    with pytest.raises(ValueError, match="preds: expected scores without NaN"):
        metric.update(bad_scores, labels)
    bad_labels = labels.clone()
    bad_labels[-1] = 10
    with pytest.raises(ValueError, match=r"target: expected class indices in \[0, 10\)"):
        metric.update(scores, bad_labels)
    for name, value in metric.counts().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("device_path", [False, True])
def test_large_batches_with_ignore_index_count_only_kept_samples(
    monkeypatch: pytest.MonkeyPatch, device_path: bool
) -> None:
    """With ``ignore_index`` the CPU path counts by bincount, the device path by index_add_."""
    generator = torch.Generator().manual_seed(11)
    scores = torch.rand(3, 600, generator=generator)
    labels = torch.randint(0, 3, (600,), generator=generator)
    target = torch.randint(0, 2, (600,), generator=generator)
    target[::7] = -1
    with _device_path(monkeypatch, on=device_path):
        binary = BinaryAUROCMetric(8, ignore_index=-1)
        binary.update(scores[0], target)
        multiclass = MulticlassAUROCMetric(3, 8, ignore_index=-1)
        multiclass.update(scores.T, torch.where(target < 0, -1, labels))
    kept = target >= 0
    bins = np.minimum((scores[0][kept].numpy() * 8).astype(np.int64), 7)
    expected = np.stack([np.bincount(bins[target[kept].numpy() == k], minlength=8) for k in (0, 1)])
    negatives, positives = binary.histograms()
    assert negatives.reshape(-1).tolist() == expected[0].tolist()
    assert positives.reshape(-1).tolist() == expected[1].tolist()
    negatives, positives = multiclass.histograms()
    for k in range(3):
        class_bins = np.minimum((scores[k][kept].numpy() * 8).astype(np.int64), 7)
        is_k = labels[kept].numpy() == k
        assert positives[k].tolist() == np.bincount(class_bins[is_k], minlength=8).tolist()
        assert negatives[k].tolist() == np.bincount(class_bins[~is_k], minlength=8).tolist()


def _float32_around(centre: float, ulps: int) -> list[np.float32]:
    """The float32 values within ``ulps`` ulps of ``centre``'s float32 rounding, in [0, 1]."""
    values = [np.float32(centre)]
    for _ in range(ulps):
        values = [np.nextafter(values[0], np.float32(0)), *values]
        values = [*values, np.nextafter(values[-1], np.float32(1))]
    return [value for value in values if 0 <= value <= 1]


def _doubles_between(low: np.float32, high: np.float32) -> list[float]:
    """float64 values strictly between two neighbouring float32 values: next to each end and
    halfway."""
    return [
        float(np.nextafter(float(low), 1.0)),
        (float(low) + float(high)) / 2,
        float(np.nextafter(float(high), 0.0)),
    ]


def _scores_near_edges(num_bins: int) -> list[torch.Tensor]:
    """One-element score tensors of every dtype around some bin edges ``k / num_bins``.

    float32 values around each edge and around the score the edge nudge maps onto it
    (``edge / (1 + 2**-20)``), the float64 values between neighbours, and the edge in
    float64, float16 and bfloat16: where one dtype's product rounds up to an edge and
    another's stays below it.
    """
    values: list[torch.Tensor] = []
    for k in sorted({1, 3, num_bins // 3, num_bins // 2, num_bins - 1, num_bins}):
        edge = k / num_bins
        for centre in (edge, edge / (1 + 2**-20)):
            singles = _float32_around(centre, 16)
            for low, high in itertools.pairwise(singles):
                values.append(torch.tensor([float(low)], dtype=torch.float32))
                for between in _doubles_between(low, high):
                    values.append(torch.tensor([between], dtype=torch.float64))
            values.append(torch.tensor([float(singles[-1])], dtype=torch.float32))
        for dtype in (torch.float64, torch.float16, torch.bfloat16):
            values.append(torch.tensor([edge], dtype=dtype))
        values.append(torch.tensor([float(np.nextafter(edge, 0.0))], dtype=torch.float64))
    return values


def _bin_of(metric: BinaryAUROCMetric, score: torch.Tensor, path: str) -> int:
    """The bin ``metric`` counts ``score`` in (as a negative) on the given update path."""
    before = metric.histograms()[0][0].clone()
    if path == "cpu bulk":  # at least 2 * (bins + 1) scores: the chunked bincount path
        repeats = 2 * (metric.num_bins + 1)
        metric.update(score.expand(repeats), torch.zeros(repeats, dtype=torch.int64))
    elif path == "torch small":  # float targets are not the numpy path's
        metric.update(score, torch.zeros(1))
    else:  # "numpy small" (float32/float64 only: others fall through to the torch path)
        metric.update(score, torch.zeros(1, dtype=torch.int64))
    (changed,) = torch.nonzero(metric.histograms()[0][0] - before).reshape(-1).tolist()
    return changed


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "thresholds"])
@pytest.mark.parametrize("num_bins", [10, 1000, 10000])
def test_a_higher_score_never_lands_in_a_lower_bin_across_dtypes_and_paths(
    monkeypatch: pytest.MonkeyPatch, num_bins: int, uniform: bool
) -> None:
    """Batches of several dtypes may meet in one histogram (or across ranks): the error bound
    holds only if one monotone map bins them all. Binning each dtype in its own precision put
    a float32 score just below an edge above a higher float64 score (AUROC 0 where it is 1,
    with a bound of 0)."""
    scores = _scores_near_edges(num_bins)
    edges = [k / num_bins for k in range(1, num_bins)]
    paths = ["numpy small", "torch small", "device"] + (["cpu bulk"] if uniform else [])
    binned: dict[str, list[int]] = {}
    for path in paths:
        with _device_path(monkeypatch, path == "device"):
            metric = (
                BinaryAUROCMetric(num_bins=num_bins)
                if uniform
                else BinaryAUROCMetric(thresholds=edges)
            )
            binned[path] = [
                _bin_of(metric, s, "numpy small" if path == "device" else path) for s in scores
            ]
    # Every path bins every score alike.
    for path in paths[1:]:
        assert binned[path] == binned[paths[0]], path
    # Ordered by exact value, the bins never go down (equal values share a bin).
    exact = [float(s.double()) for s in scores]
    order = sorted(range(len(scores)), key=lambda i: exact[i])
    for before, after in itertools.pairwise(order):
        low, high = binned[paths[0]][before], binned[paths[0]][after]
        assert low <= high, (scores[before], scores[after], low, high)
        if exact[before] == exact[after]:
            assert low == high, (scores[before], scores[after])


def test_mixed_dtype_batches_stay_within_the_bound_against_sklearn() -> None:
    """A negative's float32 score and a positive's slightly higher float64 score, batch after
    batch in one metric, around where the bin edge 0.3 falls: AUROC is 1 (sklearn), and the
    metric must be within its bound of it for every such pair."""
    singles = _float32_around(0.3 / (1 + 2**-20), 16)
    for low, high in itertools.pairwise(singles):
        for between in _doubles_between(low, high):
            metric = BinaryAUROCMetric(num_bins=10)
            metric.update(torch.tensor([low]), torch.tensor([0]))
            metric.update(torch.tensor([between], dtype=torch.float64), torch.tensor([1]))
            expected = roc_auc_score([0, 1], [float(low), between])
            error = abs(float(metric.compute()) - expected)
            assert error <= float(metric.error_bound()) + 1e-12, (low, between)


@pytest.mark.parametrize("device_path", [False, True])
def test_narrow_integer_class_indices_with_more_classes_than_they_hold(
    monkeypatch: pytest.MonkeyPatch, device_path: bool
) -> None:
    # int8 ids with 130 classes: the index clamp's bound 129 does not fit int8, and torch
    # refused it ("value cannot be converted to type int8_t without overflow") on one path
    # or the other, where the docs take class indices of any integer dtype.
    classes = 130
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, classes, generator=generator)
    target = torch.tensor([5, -100, 127, 3, 0, 64], dtype=torch.int8)
    kept = (target != -100).numpy()
    truth, predicted = target.long().numpy()[kept], logits.argmax(1).numpy()[kept]
    with _device_path(monkeypatch, on=device_path):
        counts = confusion_count_metric(ignore_index=-100).multiclass(classes)
        accuracy = counts.with_accuracy().micro().build()
        accuracy.update(logits, target)
        matrix = MulticlassConfusionMatrixMetric(classes, ignore_index=-100)
        matrix.update(logits, target)
        auroc = MulticlassAUROCMetric(classes, ignore_index=-100, exact=True, average="none")
        auroc.update(logits.softmax(1), target)
        ids = confusion_count_metric().multiclass(classes).with_accuracy().micro().build()
        ids.update(torch.tensor([5, 9, 127, 3], dtype=torch.int8), torch.tensor([5, 1, 127, 3]))
    assert accuracy.compute().item() == pytest.approx(float(np.mean(truth == predicted)))
    expected = confusion_matrix(truth, predicted, labels=range(classes))
    assert np.array_equal(matrix.compute().numpy(), expected)
    assert auroc.compute().shape == (classes,)
    assert ids.compute().item() == 0.75


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_wide_unsigned_inputs_are_refused_naming_the_argument(dtype: str) -> None:
    # torch has no CPU aminmax or clamp for them: updates died in a kernel, naming nothing.
    wide = getattr(torch, dtype, None)
    if wide is None:
        pytest.skip(f"torch {torch.__version__} has no {dtype}")
    metric = confusion_count_metric().multiclass(3).with_accuracy().micro().build()
    with pytest.raises(TypeError, match=rf"^target: dtype torch.{dtype} .*\(target\.long\(\)"):
        metric.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 1]).to(wide))
    binary = confusion_count_metric().binary().with_accuracy().build()
    with pytest.raises(TypeError, match=rf"^preds: dtype torch.{dtype}"):
        binary.update(torch.tensor([0, 1]).to(wide), torch.tensor([0, 1]))


def test_ignore_index_applies_to_bool_binary_targets_too() -> None:
    # The docs say every dtype; a bool target's False was counted although ignore_index=0.
    preds = torch.tensor([0.9, 0.8, 0.7, 0.2])
    target = torch.tensor([1, 1, 0, 0])
    results = []
    for labels in (target, target.bool()):
        metric = confusion_count_metric(ignore_index=0).binary().with_precision().build()
        metric.update(preds, labels)
        results.append(metric.counts())
    assert results[0].keys() == results[1].keys()
    for name, int_counts in results[0].items():
        assert torch.equal(int_counts, results[1][name]), name
    assert results[1]["fp"].sum().item() == 0  # no false positive: the negatives are ignored


def test_updates_after_a_validation_pass_in_inference_mode_still_work() -> None:
    """A scratch tensor first made under torch.inference_mode() is an inference tensor: every
    later CPU update outside it that wrote into it raised, for every metric of that kind in
    the process (calibration; weighted means past one chunk)."""
    import threading

    from sidestream import WeightedMeanMetric
    from sidestream.metrics.classification import MulticlassCalibrationErrorMetric

    def run() -> None:  # a thread of its own: its scratch tensors are made here, fresh
        generator = torch.Generator().manual_seed(0)
        calibration = MulticlassCalibrationErrorMetric(4, 7)
        weighted = WeightedMeanMetric()
        big = torch.rand(2**18, generator=generator)
        for inference in (True, False, True, False):
            with torch.inference_mode(inference):
                scores = torch.randn(8, 4, generator=generator).softmax(-1)
                calibration.update(scores, torch.randint(0, 4, (8,), generator=generator))
                weighted.update(big, big)
        assert torch.isfinite(calibration.compute()) and torch.isfinite(weighted.compute())

    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _record(run, errors))
    thread.start()
    thread.join()
    assert not errors, errors


def _record(function: Any, errors: list[BaseException]) -> None:
    try:
        function()
    except BaseException as error:
        errors.append(error)
