"""Exact-mode AUROC and average precision (``exact=True``) against scikit-learn.

Scores are rounded to a few levels so ties are common; every test feeds several batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sklearn.metrics import average_precision_score, roc_auc_score
from sklearn.preprocessing import label_binarize

from sidestream import _validation
from sidestream._samples import SampleStore
from sidestream.collector import AsyncMetricCollector
from sidestream.metric import has_own_sync
from sidestream.metrics import ComposeMetric, SumMetric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    MulticlassAUROCMetric,
    MulticlassAveragePrecisionMetric,
    MultilabelAUROCMetric,
    MultilabelAveragePrecisionMetric,
    RankingMetric,
    _cpu_path,
    _inputs,
)
from tests._checkpoints import states_only
from tests.conftest import Pools

CLASSES = 4
IGNORE = -100


def _data(seed: int, size: int) -> dict[str, np.ndarray]:
    """Tied binary, multiclass and multilabel scores with targets (some ignored)."""
    rng = np.random.default_rng(seed)
    target = rng.integers(0, 2, size=size)
    binary = np.round(1 / (1 + np.exp(-(rng.normal(size=size) + target))), 1)
    labels = rng.integers(0, CLASSES, size=size)
    logits = np.round(rng.normal(size=(size, CLASSES)) + np.eye(CLASSES)[labels], 1)
    matrix = rng.integers(0, 2, size=(size, CLASSES))
    label_scores = np.round(rng.uniform(size=(size, CLASSES)) * 0.5 + 0.5 * matrix, 1)
    ignored = rng.uniform(size=size) < 0.2
    return {
        "binary": binary,
        "target": target,
        "binary_ignored": np.where(ignored, IGNORE, target),
        "logits": logits,
        "labels": labels,
        "labels_ignored": np.where(ignored, IGNORE, labels),
        "label_scores": label_scores,
        "matrix": matrix,
    }


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _feed(metric: RankingMetric, preds: np.ndarray, target: np.ndarray, batches: int = 3) -> None:
    for p, t in zip(np.array_split(preds, batches), np.array_split(target, batches), strict=True):
        metric.update(torch.from_numpy(p), torch.from_numpy(t))


def _close(actual: torch.Tensor, expected: Any) -> None:
    np.testing.assert_allclose(actual.numpy(), np.asarray(expected, dtype=np.float64), rtol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_fpr", [None, 0.1, 0.35, 1.0])
def test_binary_auroc_matches_sklearn(seed: int, max_fpr: float | None) -> None:
    data = _data(seed, 700)
    metric = BinaryAUROCMetric(exact=True, max_fpr=max_fpr)
    _feed(metric, data["binary"], data["target"])
    _close(metric.compute(), roc_auc_score(data["target"], data["binary"], max_fpr=max_fpr))
    assert float(metric.error_bound()) == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_binary_average_precision_logits_and_ignore_index(seed: int) -> None:
    data = _data(seed, 700)
    logits = np.round(np.log(data["binary"] + 0.05) * 3, 0)  # tied logits
    kept = data["binary_ignored"] != IGNORE
    metric = BinaryAveragePrecisionMetric(exact=True, logits=True, ignore_index=IGNORE)
    _feed(metric, logits, data["binary_ignored"])
    probs = 1 / (1 + np.exp(-logits))
    _close(metric.compute(), average_precision_score(data["target"][kept], probs[kept]))


@pytest.mark.parametrize("average", ["macro", "weighted", "none"])
def test_multiclass_matches_sklearn_one_vs_rest(average: str) -> None:
    data = _data(3, 800)
    kept = data["labels_ignored"] != IGNORE
    logits = torch.from_numpy(data["logits"])
    probs = logits.softmax(-1).numpy()[kept]
    labels = data["labels"][kept]
    onehot = label_binarize(labels, classes=list(range(CLASSES)))
    sk_average = None if average == "none" else average
    auroc = MulticlassAUROCMetric(
        CLASSES, average=average, logits=True, ignore_index=IGNORE, exact=True
    )
    _feed(auroc, data["logits"], data["labels_ignored"])
    _close(auroc.compute(), roc_auc_score(onehot, probs, average=sk_average))
    precision = MulticlassAveragePrecisionMetric(CLASSES, average=average, exact=True)
    _feed(precision, _softmax(data["logits"]), data["labels"])
    expected = average_precision_score(
        label_binarize(data["labels"], classes=list(range(CLASSES))),
        _softmax(data["logits"]),
        average=sk_average,
    )
    _close(precision.compute(), expected)


def test_multiclass_ovr_equals_sklearn_multi_class_ovr() -> None:
    data = _data(4, 600)
    probs = _softmax(data["logits"])
    for average in ("macro", "weighted"):
        metric = MulticlassAUROCMetric(CLASSES, average=average, exact=True)  # type: ignore[arg-type]
        _feed(metric, probs, data["labels"])
        expected = roc_auc_score(data["labels"], probs, multi_class="ovr", average=average)
        _close(metric.compute(), expected)


@pytest.mark.parametrize("average", ["micro", "macro", "weighted", "none"])
def test_multilabel_matches_sklearn(average: str) -> None:
    data = _data(5, 600)
    scores, matrix = data["label_scores"], data["matrix"]
    sk_average = None if average == "none" else average
    for cls, reference in (
        (MultilabelAUROCMetric, roc_auc_score),
        (MultilabelAveragePrecisionMetric, average_precision_score),
    ):
        metric = cls(CLASSES, average=average, exact=True)  # type: ignore[arg-type]
        _feed(metric, scores.astype(np.float32), matrix)
        _close(metric.compute(), reference(matrix, scores.astype(np.float32), average=sk_average))


def test_multidim_inputs_with_ignore_index() -> None:
    rng = np.random.default_rng(6)
    scores = np.round(rng.uniform(size=(20, CLASSES, 3, 2)), 1)
    target = rng.integers(0, 2, size=scores.shape)
    target[rng.uniform(size=target.shape) < 0.2] = IGNORE
    metric = MultilabelAUROCMetric(CLASSES, average="micro", ignore_index=IGNORE, exact=True)
    _feed(metric, scores, target)
    flat_scores = np.moveaxis(scores, 1, -1).reshape(-1)
    flat_target = np.moveaxis(target, 1, -1).reshape(-1)
    kept = flat_target != IGNORE
    _close(metric.compute(), roc_auc_score(flat_target[kept], flat_scores[kept]))
    binary = BinaryAveragePrecisionMetric(exact=True, ignore_index=IGNORE)
    _feed(binary, scores, target)
    _close(binary.compute(), average_precision_score(flat_target[kept], flat_scores[kept]))


def test_large_logits_rank_as_the_logits_not_a_saturated_sigmoid() -> None:
    """float32 ``sigmoid`` is 1.0 above about 17: exact mode ranks by the logits themselves."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, 2, (2000,), generator=generator)
    logits = torch.randn(2000, generator=generator) * 3 + 20 + target  # float32, mostly > 17
    for cls, reference in (
        (BinaryAUROCMetric, roc_auc_score),
        (BinaryAveragePrecisionMetric, average_precision_score),
    ):
        metric = cls(exact=True, logits=True)
        metric.update(logits[:700], target[:700])
        metric.update(logits[700:], target[700:])
        assert float(metric.compute()) == pytest.approx(reference(target, logits), abs=1e-12)
    partial = BinaryAUROCMetric(exact=True, logits=True, max_fpr=0.2)
    partial.update(logits, target)
    expected = roc_auc_score(target, logits, max_fpr=0.2)
    assert float(partial.compute()) == pytest.approx(expected, abs=1e-12)
    labels = target.reshape(1000, 2)
    multilabel = MultilabelAUROCMetric(2, exact=True, logits=True, average="micro")
    multilabel.update(logits.reshape(1000, 2), labels)
    expected = roc_auc_score(labels.reshape(-1), logits)
    assert float(multilabel.compute()) == pytest.approx(expected, abs=1e-12)


def test_undefined_and_empty_are_nan() -> None:
    metric = BinaryAUROCMetric(exact=True)
    assert metric.compute().isnan()
    metric.update(torch.tensor([0.2, 0.4]), torch.tensor([1, 1]))
    assert metric.compute().isnan()  # no negatives
    per_class = MulticlassAUROCMetric(3, average="none", exact=True)
    per_class.update(torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]]), torch.tensor([0, 1]))
    assert per_class.compute()[:2].tolist() == [1.0, 1.0] and per_class.compute()[2].isnan()


def test_options_without_meaning_in_exact_mode_raise_at_construction() -> None:
    with pytest.raises(ValueError, match="thresholds"):
        BinaryAUROCMetric(exact=True, thresholds=[0.2, 0.5])
    with pytest.raises(ValueError, match="num_bins"):
        MulticlassAUROCMetric(3, 100, exact=True)
    with pytest.raises(TypeError, match="exact"):
        BinaryAUROCMetric(exact=1)  # type: ignore[arg-type]
    metric = BinaryAUROCMetric(exact=True)
    assert metric.exact and not BinaryAUROCMetric().exact
    with pytest.raises(ValueError, match="num_bins"):
        _ = metric.num_bins
    with pytest.raises(ValueError, match="histograms"):
        metric.histograms()


def _stored_rows(metric: RankingMetric) -> int:
    return int(metric.state_dict()["scores"].rows.shape[0])


def test_bad_input_raises_before_state_changes() -> None:
    for exact in (False, True):
        metric = MulticlassAUROCMetric(3, exact=exact)
        good = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]])
        metric.update(good, torch.tensor([0, 1]))
        before = metric.state_dict()
        bad_calls: list[tuple[Any, Any, type[Exception], str]] = [
            (good * 2, torch.tensor([0, 1]), ValueError, "preds"),
            (good, torch.tensor([0, 3]), ValueError, "target"),
            (good.long(), torch.tensor([0, 1]), TypeError, "preds"),
            (good, torch.tensor([0.0, 1.0]), TypeError, "target"),
            (good[:, :2], torch.tensor([0, 1]), ValueError, "preds"),
            (good.tolist(), torch.tensor([0, 1]), TypeError, "preds"),
            (good.to(torch.complex64), torch.tensor([0, 1]), TypeError, "preds"),
        ]
        for preds, target, error, name in bad_calls:
            with pytest.raises(error, match=name):
                metric.update(preds, target)
        after = metric.state_dict()
        assert after.keys() == before.keys()
        assert all(
            torch.equal(_tensor(after[k]), _tensor(before[k])) for k in states_only(before)
        ), exact
    binary = BinaryAUROCMetric(exact=True)
    binary.update(torch.tensor([0.3, 0.7]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="preds"):
        binary.update(torch.tensor([0.3, float("nan")]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="target"):
        binary.update(torch.tensor([0.3, 0.5]), torch.tensor([0, 2]))
    assert _stored_rows(binary) == 2


def test_binned_mode_is_unchanged() -> None:
    binned = BinaryAUROCMetric(num_bins=1000)
    assert binned.num_bins == 1000 and not has_own_sync(binned)
    assert set(binned.state_dict()) == {
        "histogram",
        "bin_layout",
        "configuration",
        "rejected",
        "sidestream/dtypes",
    }
    exact = BinaryAUROCMetric(exact=True)
    assert has_own_sync(exact)  # its samples are gathered: the slow sync path
    assert set(exact.state_dict()) == {
        "configuration",
        "rejected",
        "scores",
        "labels",
        "sidestream/dtypes",
    }
    preds, target = torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])
    binned.update(preds, target)
    exact.update(preds, target)
    assert float(binned.compute()) == float(exact.compute()) == 0.75
    assert float(binned.error_bound()) == 0.0 and float(exact.error_bound()) == 0.0


def test_state_dict_reset_sync_and_to() -> None:
    data = _data(7, 300)
    metric = BinaryAveragePrecisionMetric(exact=True)
    _feed(metric, data["binary"], data["target"])
    expected = average_precision_score(data["target"], data["binary"])
    saved = metric.state_dict()
    assert saved["scores"].rows.shape == (300, 1) and saved["labels"].rows.dtype == torch.int8
    restored = BinaryAveragePrecisionMetric(exact=True)
    restored.load_state_dict(saved)
    _close(restored.compute(), expected)
    saved_scores = saved["scores"].rows.clone()
    saved["scores"].rows.fill_(0.5)  # the caller reuses its state_dict: the metric's own rows
    _close(restored.compute(), expected)
    saved["scores"].rows.copy_(saved_scores)
    restored.sync()  # a single process: the gathered rows are the local ones
    _close(restored.compute(), expected)
    restored.to("cpu")
    _close(restored.compute(), expected)
    restored.update(torch.tensor([0.9]), torch.tensor([0]))  # the sync goes stale
    assert float(restored.compute()) != pytest.approx(expected)
    restored.reset()
    assert restored.compute().isnan() and _stored_rows(restored) == 0
    with pytest.raises(ValueError, match="dtype"):
        restored.load_state_dict({**saved, "scores": saved["scores"].rows.float()})
    with pytest.raises(KeyError, match="labels"):
        restored.load_state_dict({"rejected": saved["rejected"], "scores": saved["scores"]})


def test_start_sync_refuses_a_tree_whose_rows_it_would_not_gather() -> None:
    # It marked the tree synced without gathering the rows: each rank computed its own AUROC.
    from sidestream.sync import CallFingerprint

    tree = ComposeMetric({"auroc": BinaryAUROCMetric(exact=True), "count": SumMetric()})
    for metric in (tree, BinaryAUROCMetric(exact=True)):
        with pytest.raises(TypeError, match=r"start_sync: .* call sync\(\) instead"):
            metric.start_sync(None, CallFingerprint("sync", 1))
    tree["count"].start_sync(None, CallFingerprint("sync", 1)).wait()  # its states only: fine


def test_inside_a_compose_metric() -> None:
    data = _data(8, 200)
    tree = ComposeMetric({"auroc": BinaryAUROCMetric(exact=True), "count": SumMetric()})
    tree.to("cpu")
    halves = zip(np.array_split(data["binary"], 2), np.array_split(data["target"], 2), strict=True)
    for p, t in halves:
        tree["auroc"].update(torch.from_numpy(p), torch.from_numpy(t))
        tree["count"].update(torch.tensor([float(len(p))]))
    expected = roc_auc_score(data["target"], data["binary"])
    tree.sync()
    _close(tree.compute()["auroc"], expected)
    saved = tree.state_dict()
    assert {"auroc.scores", "auroc.labels", "count.total"} <= set(saved)
    tree.reset()
    assert tree.compute()["auroc"].isnan()
    tree.load_state_dict(saved)
    _close(tree.compute()["auroc"], expected)


@pytest.mark.parametrize("reset_each_window", [True, False])
def test_collector_stages_the_samples(reset_each_window: bool) -> None:
    data = _data(9, 600)
    metric = MultilabelAUROCMetric(CLASSES, average="micro", exact=True)
    collector = AsyncMetricCollector(metric, reset_each_window=reset_each_window).bind("cpu")
    shards = list(
        zip(np.array_split(data["label_scores"], 3), np.array_split(data["matrix"], 3), strict=True)
    )
    try:
        for window, (scores, matrix) in enumerate(shards):
            metric.update(torch.from_numpy(scores), torch.from_numpy(matrix))
            collector.schedule_collection(window + 1)
            seen = shards[window : window + 1] if reset_each_window else shards[: window + 1]
            expected = roc_auc_score(
                np.concatenate([m for _, m in seen]).reshape(-1),
                np.concatenate([s for s, _ in seen]).reshape(-1),
            )
            assert collector.collect_results() == pytest.approx(expected, rel=1e-12)
    finally:
        assert collector.close()


def _on_rank(seed: int) -> dict[str, Any]:
    """Rank 0 holds two uneven batches, rank 1 nothing; sync, checkpoint, collector."""
    rank = dist.get_rank()
    data = _data(seed, 500)
    metrics: dict[str, Callable[[], RankingMetric]] = {
        "binary": lambda: BinaryAUROCMetric(exact=True, max_fpr=0.5),
        "multiclass": lambda: MulticlassAveragePrecisionMetric(
            CLASSES, average="weighted", logits=True, ignore_index=IGNORE, exact=True
        ),
        "multilabel": lambda: MultilabelAUROCMetric(CLASSES, average="micro", exact=True),
    }
    inputs = {
        "binary": (data["binary"], data["target"]),
        "multiclass": (data["logits"], data["labels_ignored"]),
        "multilabel": (data["label_scores"], data["matrix"]),
    }
    out: dict[str, Any] = {}
    for name, make in metrics.items():
        metric = make()
        preds, target = inputs[name]
        if rank == 0:
            _feed(metric, preds[:350], target[:350], batches=2)
        else:
            _feed(metric, preds[350:], target[350:], batches=1)
        metric.sync()
        out[name] = float(metric.compute())
        saved = metric.state_dict()
        out[f"{name} saved rows"] = int(saved["scores"].rows.shape[0])
        restored = make()
        restored.load_state_dict(saved)
        restored.sync()
        out[f"{name} restored"] = float(restored.compute())
        if name == "binary":
            out["saved"] = saved
    empty = BinaryAUROCMetric(exact=True)
    if rank == 0:
        _feed(empty, data["binary"], data["target"])
    empty.sync()
    out["one rank empty"] = float(empty.compute())
    metric = BinaryAUROCMetric(exact=True)
    collector = AsyncMetricCollector(metric).bind("cpu")
    if rank == 1:
        _feed(metric, data["binary"], data["target"])
    collector.schedule_collection(1)
    out["collector"] = collector.collect_results()
    collector.close()
    return out


def test_two_ranks_one_empty_match_sklearn_on_all_data(pools: Pools) -> None:
    seed = 10
    data = _data(seed, 500)
    kept = data["labels_ignored"] != IGNORE
    onehot = label_binarize(data["labels"][kept], classes=list(range(CLASSES)))
    # torch's softmax, as the metric's: another rounding could split tied probabilities.
    probs = torch.from_numpy(data["logits"]).softmax(-1).numpy()[kept]
    expected = {
        "binary": roc_auc_score(data["target"], data["binary"], max_fpr=0.5),
        "multiclass": average_precision_score(onehot, probs, average="weighted"),
        "multilabel": roc_auc_score(data["matrix"].reshape(-1), data["label_scores"].reshape(-1)),
    }
    full = roc_auc_score(data["target"], data["binary"])
    results = pools.get(2).run(_on_rank, seed)
    for result in results:
        for name, value in expected.items():
            assert result[name] == pytest.approx(value, rel=1e-12), name
            assert result[f"{name} restored"] == pytest.approx(value, rel=1e-12), name
            assert result[f"{name} saved rows"] == 500
        assert result["one rank empty"] == pytest.approx(full, rel=1e-12)
        assert result["collector"] == pytest.approx(full, rel=1e-12)
    # The checkpoint of 2 ranks, loaded by one process, continues the same value.
    single = BinaryAUROCMetric(exact=True, max_fpr=0.5)
    single.load_state_dict(results[0]["saved"])
    assert float(single.compute()) == pytest.approx(expected["binary"], rel=1e-12)


def test_device_path_drops_a_bad_batch_as_skipped_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA policy, run on CPU: a bad batch is kept as skipped rows and counted."""
    monkeypatch.setattr(_inputs, "checks_stay_on_device", lambda device: True)
    monkeypatch.setattr(_validation, "checks_stay_on_device", lambda device: True)
    monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    data = _data(11, 400)
    for make, preds, good, bad in (
        (
            lambda: MulticlassAUROCMetric(CLASSES, ignore_index=IGNORE, logits=True, exact=True),
            data["logits"],
            data["labels_ignored"],
            np.where(data["labels"] == 0, CLASSES, data["labels"]),
        ),
        (
            lambda: MultilabelAveragePrecisionMetric(CLASSES, average="micro", exact=True),
            data["label_scores"],
            data["matrix"],
            data["matrix"] * 2,
        ),
    ):
        metric, reference = make(), make()
        _feed(metric, preds, good)
        _feed(metric, preds, bad, batches=1)
        _feed(reference, preds, good)
        assert int(metric.rejected_updates) == 1
        assert metric.state_dict()["scores"].rows.shape[0] == 2 * len(preds)
        _close(metric.compute(), float(reference.compute()))


def test_device_path_copies_float64_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path stores a copy: a float64 batch the caller reuses does not change it."""
    monkeypatch.setattr(_inputs, "checks_stay_on_device", lambda device: True)
    monkeypatch.setattr(_validation, "checks_stay_on_device", lambda device: True)
    monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    rng = np.random.default_rng(5)
    batches = [(rng.random(64), rng.integers(0, 2, 64)) for _ in range(3)]
    metric = BinaryAUROCMetric(exact=True)
    buffer = torch.empty(64, dtype=torch.float64)  # one input buffer, refilled per batch
    for scores, target in batches:
        buffer.copy_(torch.from_numpy(scores))
        metric.update(buffer, torch.from_numpy(target))
    expected = roc_auc_score(
        np.concatenate([t for _, t in batches]), np.concatenate([s for s, _ in batches])
    )
    assert float(metric.compute()) == pytest.approx(expected, rel=1e-12)


def test_cpu_updates_keep_the_inputs_without_a_copy_and_widen_them_later() -> None:
    """float32 scores are borrowed as given (a copy into fresh memory costs more than the
    rest of an update) and become float64 rows when concatenated: the same rows, checkpoint
    format and value as converting at once."""
    data = _data(12, 600)
    scores = torch.from_numpy(data["binary"]).float()
    labels = {
        "int64": torch.from_numpy(data["target"]),
        "bool": torch.from_numpy(data["target"]).bool(),
        "uint8": torch.from_numpy(data["target"]).to(torch.uint8),
        "int8": torch.from_numpy(data["target"]).to(torch.int8),
        "float": torch.from_numpy(data["target"]).float(),
    }
    expected = roc_auc_score(data["target"], scores.double().numpy())
    for name, target in labels.items():
        metric = BinaryAUROCMetric(exact=True)
        # Batches of their own: a slice of a larger tensor is copied (SampleStore.borrow).
        first, first_target = scores[:250].clone(), target[:250].clone()
        metric.update(first, first_target)
        metric.update(scores[250:].clone(), target[250:].clone())
        kept = metric._samples._chunks["scores"]
        assert kept[0].data_ptr() == first.data_ptr(), name  # no copy
        if name in ("bool", "uint8", "int8"):  # the same bytes, viewed as int8
            assert metric._samples._chunks["labels"][0].data_ptr() == first_target.data_ptr()
        saved = metric.state_dict()
        assert (
            saved["scores"].rows.dtype == torch.float64 and saved["labels"].rows.dtype == torch.int8
        )
        assert torch.equal(saved["scores"].rows[:, 0], scores.double()), name
        assert torch.equal(saved["labels"].rows[:, 0], labels["int8"]), name
        _close(metric.compute(), expected)


def test_an_input_modified_in_place_after_update_raises_until_reset() -> None:
    """Borrowed inputs are watched by their version counters: rows that changed under the
    metric raise instead of giving a wrong value."""
    metric = BinaryAUROCMetric(exact=True)
    preds, target = torch.tensor([0.2, 0.8, 0.4]), torch.tensor([0, 1, 1])
    metric.update(preds, target)
    metric.to("cpu")  # no move: the rows are still the caller's tensors
    preds.mul_(0.5)  # a reused input buffer
    for _ in range(2):  # no value from changed rows, however often it is asked
        with pytest.raises(RuntimeError, match="modified in place"):
            metric.compute()
    with pytest.raises(RuntimeError, match="modified in place"):
        metric.state_dict()
    metric.reset()
    metric.update(preds.clone(), target.clone())
    preds.fill_(0.0)  # the metric holds a copy now
    _close(metric.compute(), roc_auc_score([0, 1, 1], [0.1, 0.4, 0.2]))
    # Once the rows are concatenated (compute), they are the store's own.
    again = BinaryAUROCMetric(exact=True)
    again.update(target.float() * 0.5, target)
    mine = target.float() * 0.5
    again.update(mine, target)
    _close(again.compute(), 1.0)
    mine.zero_()
    _close(again.compute(), 1.0)


def test_a_store_watches_borrowed_rows_kept_in_their_shape_through_moves_and_copies() -> None:
    """One-element rows are borrowed in any shape and come back as a column in order; a move
    that keeps a tensor and a staged copy (``copy_from``) still watch it, ``clear`` forgets."""
    store = SampleStore(
        scores=torch.zeros((0, 1), dtype=torch.float64),
        labels=torch.zeros((0, 1), dtype=torch.int8),
    )
    grid = torch.tensor([[0.1, 0.2], [0.3, 0.4]]).t()  # not contiguous
    store.borrow(scores=grid, labels=torch.tensor([True, False, True, True]).reshape(2, 2))
    store.borrow(scores=torch.tensor([[0.5]]), labels=torch.tensor([1], dtype=torch.uint8))
    store.append(
        scores=torch.tensor([[0.6]], dtype=torch.float64), labels=torch.tensor([[0]]).char()
    )
    store.to(torch.device("cpu"))  # the tensors stay: still the caller's
    staged = SampleStore(**{name: torch.zeros((0, 1)) for name in store.fields})
    staged.copy_from(store)
    grid.add_(1.0)
    for twin in (store, staged):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="modified in place"):
                twin.local()
    store.clear()
    store.borrow(scores=grid, labels=torch.tensor([1, 0, 1, 1]).reshape(2, 2))
    rows = store.local()
    assert rows["scores"].shape == (4, 1) and rows["scores"].dtype == torch.float64
    assert rows["scores"][:, 0].tolist() == pytest.approx([1.1, 1.3, 1.2, 1.4])
    assert rows["labels"].dtype == torch.int8 and rows["labels"][:, 0].tolist() == [1, 0, 1, 1]
    grid.zero_()  # merged: the rows are the store's own now
    assert store.local()["scores"][:, 0].tolist() == pytest.approx([1.1, 1.3, 1.2, 1.4])


def test_metrics_pickled_before_the_numpy_paths_still_update() -> None:
    """``torch.save`` of a metric object from before the exact numpy path, the per-chunk
    versions and the binned counter's kept view: unpickled here, each still updates (the
    attributes those added are missing from such a pickle)."""
    import pickle

    scores, target = torch.tensor([0.2, 0.8, 0.4]), torch.tensor([0, 1, 1])
    exact, binned = BinaryAUROCMetric(exact=True), BinaryAUROCMetric(num_bins=10)
    for metric in (exact, binned):
        metric.update(scores, target)
    old_exact = pickle.loads(pickle.dumps(exact))
    del old_exact.__dict__["_stores_on_host"]
    # Unpickling hands the saved state to __setstate__: an old store's had no versions.
    store = old_exact._samples
    added = ("_versions", "_borrowing", "_modified")
    saved = {key: value for key, value in store.__dict__.items() if key not in added}
    store.__dict__.clear()
    store.__setstate__({**saved, "_borrowed": []})
    old_binned = pickle.loads(pickle.dumps(binned))
    assert "_counts" not in old_binned._host_counter.__dict__
    for metric in (old_exact, old_binned):
        metric.update(torch.tensor([0.9, 0.1]), torch.tensor([0, 1]))
    every = ([0, 1, 1, 0, 1], [0.2, 0.8, 0.4, 0.9, 0.1])
    _close(old_exact.compute(), roc_auc_score(*every))
    _close(old_binned.compute(), roc_auc_score(*every))


def test_metrics_pickled_before_the_binary_host_counter_still_update() -> None:
    """``torch.save`` of a metric object from before the numpy counter of small binary batches
    (``_host_counter``; a pickle of commit 1d5106d failed its first update and compute with
    "'BinaryAUROCMetric' object has no attribute '_host_counter'")."""
    import pickle

    scores, target = torch.tensor([0.2, 0.8, 0.4]), torch.tensor([0, 1, 1])
    olds = []
    for metric in (BinaryAUROCMetric(exact=True), BinaryAUROCMetric(num_bins=10)):
        metric.update(scores, target)
        old = pickle.loads(pickle.dumps(metric))
        del old.__dict__["_host_counter"]
        olds.append(old)
    every = ([0, 1, 1, 0, 1], [0.2, 0.8, 0.4, 0.9, 0.1])
    for old in olds:
        _close(old.compute(), roc_auc_score([0, 1, 1], [0.2, 0.8, 0.4]))
        old.update(torch.tensor([0.9, 0.1]), torch.tensor([0, 1]))
        _close(old.compute(), roc_auc_score(*every))


def test_inference_tensors_are_copied() -> None:
    """An inference tensor has no version counter to watch, so the store copies it."""
    metric = BinaryAUROCMetric(exact=True)
    with torch.inference_mode():
        preds, target = torch.tensor([0.2, 0.8, 0.4]), torch.tensor([0, 1, 1])
        metric.update(preds, target)
        preds.zero_()
    _close(metric.compute(), roc_auc_score([0, 1, 1], [0.2, 0.8, 0.4]))


def test_half_precision_logits_rank_as_their_float64_values() -> None:
    """Exact binary logits are stored in their dtype and widened at compute: the same order."""
    generator = torch.Generator().manual_seed(3)
    target = torch.randint(0, 2, (500,), generator=generator)
    logits = (torch.randn(500, generator=generator) * 4 + 20 + target).to(torch.bfloat16)
    metric = BinaryAUROCMetric(exact=True, logits=True)
    metric.update(logits[:200], target[:200])
    metric.update(logits[200:], target[200:])
    expected = roc_auc_score(target, logits.double())
    assert float(metric.compute()) == pytest.approx(expected, abs=1e-12)
    with pytest.raises(ValueError, match="preds: expected logits without NaN"):
        metric.update(torch.tensor([1.0, float("nan")]), torch.tensor([0, 1]))
    metric.update(torch.tensor([float("inf"), -float("inf")]), torch.tensor([1, 0]))
    assert int(metric.state_dict()["scores"].rows.shape[0]) == 502


def test_a_large_target_is_checked_chunk_by_chunk_before_anything_is_stored() -> None:
    """A large integer target is checked and converted to int8 per chunk: a bad value in a
    later chunk, including one whose low byte is 0 or 1 (256, 2**32 + 1), still raises before
    the state changes."""
    from sidestream.metrics.classification import _scores

    size = _scores._TARGET_CHUNK * 2 + 7
    generator = torch.Generator().manual_seed(5)
    preds = torch.rand(size, generator=generator)
    target = torch.randint(0, 2, (size,), generator=generator)
    metric = BinaryAUROCMetric(exact=True)
    metric.update(preds, target)
    for bad in (2, -1, 256, 2**32, 2**32 + 1, -(2**63)):
        for dtype in (torch.int64, torch.int32):
            if torch.tensor(bad).to(dtype).item() != bad:
                continue  # not representable
            broken = target.to(dtype, copy=True)
            broken[-1] = bad
            with pytest.raises(ValueError, match="target: expected 0 or 1"):
                metric.update(preds, broken)
    metric.update(preds[::2], target[::2].to(torch.int32))  # strided: read contiguously
    assert _stored_rows(metric) == size + (size + 1) // 2
    scores = preds.numpy()
    labels = np.concatenate([target.numpy(), target.numpy()[::2]])
    _close(metric.compute(), roc_auc_score(labels, np.concatenate([scores, scores[::2]])))


def _tensor(value: object) -> torch.Tensor:
    """A saved state as a tensor: a sample store's rows are ``SavedRows``."""
    from sidestream._samples import SavedRows

    return value.rows if isinstance(value, SavedRows) else torch.as_tensor(value)
