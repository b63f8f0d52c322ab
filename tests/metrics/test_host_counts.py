"""Small binary ranking batches counted through numpy (``_host_counts``) on the CPU path.

The numpy path must give the torch path's counts exactly (the same bins, also on edges) and
raise its errors before the state changes; the counts are checked against ``np.bincount`` of
the documented bin rule and the value against scikit-learn.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    _cpu_path,
    _host_counts,
    ranking,
)
from sidestream.metrics.classification._host_counts import BinaryHostCounter


def _without_host_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BinaryHostCounter, "count", lambda *args: False)


def _expected_counts(scores: torch.Tensor, target: torch.Tensor, bins: int) -> np.ndarray:
    """``np.bincount`` of the documented rule: ``floor(score * bins * (1 + 2**-20))``, clamped."""
    wide = scores.double() if scores.dtype == torch.float64 else scores.float()
    # float32 scores scale in float32, as the metric's float product does.
    product = wide * (bins * (1 + 2**-20))
    index = np.minimum(product.to(torch.int64).numpy().reshape(-1), bins - 1)
    positive = target.numpy().reshape(-1).astype(bool)
    return np.concatenate(
        [
            np.bincount(index[~positive], minlength=bins),
            np.bincount(index[positive], minlength=bins),
        ]
    )


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What each ``BinaryHostCounter.count`` call did: True (counted), False, or the error."""
    return _spy(monkeypatch, BinaryHostCounter, "count")


def _recording_stores(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What each exact-mode ``borrow_checked`` call did: True (stored), False, or the error."""
    return _spy(monkeypatch, ranking, "borrow_checked")


def _spy(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[object]:
    """Replace ``owner.name`` by a wrapper that records what each call returned or raised."""
    calls: list[object] = []
    original = getattr(owner, name)

    def spy(*args: object) -> bool:
        try:
            calls.append(original(*args))
        except ValueError as error:
            calls.append(error)
            raise
        return bool(calls[-1])

    monkeypatch.setattr(owner, name, spy)
    return calls


def _edge_scores(bins: int, dtype: torch.dtype) -> torch.Tensor:
    """Every bin edge (for many bins, the first and last 10,000 and 10,000 spread between:
    the numpy path takes batches up to MAX_ELEMENTS), the values just below them, and more."""
    if bins <= 20_000:
        edges = np.arange(bins + 1) / bins
    else:
        picked = np.r_[0:10_000, bins - 10_000 : bins + 1, np.linspace(0, bins, 10_000)]
        edges = np.unique(picked.astype(np.int64)) / bins
    below = np.nextafter(edges[1:], 0)
    values = np.concatenate([edges, below, [0.0, -0.0, 1.0, 0.99, 0.995, np.nextafter(1.0, 0)]])
    return torch.tensor(values).to(dtype)


@pytest.mark.parametrize("bins", [2, 7, 100, 10_000, 2**19 + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "target_dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
)
def test_edge_scores_count_as_on_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, bins: int, dtype: torch.dtype, target_dtype: torch.dtype
) -> None:
    scores = _edge_scores(bins, dtype)
    assert scores.numel() <= _host_counts.MAX_ELEMENTS
    target = (torch.arange(scores.numel()) % 3 == 1).to(target_dtype)
    fast = BinaryAUROCMetric(bins)
    with monkeypatch.context() as patch:
        calls = _recording(patch)
        fast.update(scores, target)
    assert calls == [True]  # counted by the numpy path
    counts = torch.cat(fast.histograms(), dim=1)[0].numpy()
    assert counts.tolist() == _expected_counts(scores, target, bins).tolist()
    with monkeypatch.context() as patch:
        _without_host_counts(patch)
        torch_path = BinaryAUROCMetric(bins)
        torch_path.update(scores, target)
    assert torch.equal(torch.cat(torch_path.histograms(), 1), torch.cat(fast.histograms(), 1))


def test_values_match_sklearn_over_many_batches_and_shapes() -> None:
    """Uneven batches (2-D, non-contiguous, requiring grad, large ones on the torch path)."""
    generator = torch.Generator().manual_seed(11)
    auroc, precision = BinaryAUROCMetric(), BinaryAveragePrecisionMetric(1000)
    seen_scores, seen_target = [], []
    for size in [1, 5, 64, 1024, 3000, 70_000, 17]:
        # k / 1000 for k < 1000: every distinct score has a bin of its own (1000 bins or more,
        # the documented edge rule), so the binned values are exact.
        scores = torch.randint(0, 1000, (size,), generator=generator) / 1000
        target = torch.randint(0, 2, (size,), generator=generator)
        if size == 64:
            scores, target = scores.reshape(8, 8).t(), target.reshape(8, 8).t()  # strided
        if size == 1024:
            scores = scores.clone().requires_grad_()
        for metric in (auroc, precision):
            metric.update(scores, target.bool() if size == 5 else target)
        seen_scores.append(scores.detach().reshape(-1))
        seen_target.append(target.reshape(-1))
    every_score = torch.cat(seen_scores).double().numpy()
    every_target = torch.cat(seen_target).numpy()
    assert auroc.compute().item() == pytest.approx(
        roc_auc_score(every_target, every_score), abs=1e-12
    )
    assert precision.compute().item() == pytest.approx(
        average_precision_score(every_target, every_score), abs=1e-12
    )


@pytest.mark.parametrize(
    ("preds", "target", "argument"),
    [
        ([0.2, float("nan")], [0, 1], "preds"),
        ([0.2, -float("nan")], [0, 1], "preds"),
        ([0.2, 1.0000001], [0, 1], "preds"),
        ([-1e-30, 0.5], [0, 1], "preds"),
        ([0.2, float("inf")], [0, 1], "preds"),
        ([0.2, 0.5], [0, 2], "target"),
        ([0.2, 0.5], [-1, 1], "target"),
    ],
)
@pytest.mark.parametrize("target_dtype", [torch.int8, torch.uint8, torch.int64])
def test_bad_values_raise_the_torch_path_error_before_counting(
    monkeypatch: pytest.MonkeyPatch,
    preds: list[float],
    target: list[int],
    argument: str,
    target_dtype: torch.dtype,
) -> None:
    if target_dtype == torch.uint8 and min(target) < 0:
        pytest.skip("uint8 holds no negative target")
    messages = []
    for numpy_path in (True, False):
        with monkeypatch.context() as patch:
            if numpy_path:
                calls = _recording(patch)
            else:
                _without_host_counts(patch)
            metric = BinaryAUROCMetric(16)
            metric.update(torch.tensor([0.1, 0.9]), torch.tensor([0, 1]))
            before = torch.cat(metric.histograms(), 1).clone()
            with pytest.raises(ValueError, match=f"^{argument}: ") as raised:
                metric.update(torch.tensor(preds), torch.tensor(target, dtype=target_dtype))
            assert torch.equal(torch.cat(metric.histograms(), 1), before)
            messages.append(str(raised.value))
            if numpy_path:
                assert calls[0] is True and calls[1] is raised.value  # raised by numpy's path
    assert messages[0] == messages[1]


def test_negative_zero_is_a_valid_score() -> None:
    metric = BinaryAUROCMetric(4)
    metric.update(torch.tensor([-0.0, 1.0]), torch.tensor([0, 1]))
    assert metric.histograms()[0][0].tolist() == [1, 0, 0, 0]
    assert metric.histograms()[1][0].tolist() == [0, 0, 0, 1]


def test_other_inputs_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float or bfloat16 inputs, float targets, large or empty batches, logits, thresholds."""
    taken = _recording(monkeypatch)
    metric = BinaryAUROCMetric(16)
    scores, target = torch.tensor([0.25, 0.75]), torch.tensor([0, 1])
    metric.update(scores, target)
    metric.update(scores.bfloat16(), target)
    metric.update(scores, target.float())
    large = _host_counts.MAX_ELEMENTS + 1
    metric.update(torch.rand(large), torch.zeros(large, dtype=torch.int64))
    metric.update(torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    with monkeypatch.context() as patch:
        patch.setattr(_cpu_path, "enabled", lambda device: False)
        metric.update(scores, target)
    assert taken == [True, False, False, False, False, False]
    assert BinaryAUROCMetric(16, logits=True)._host_counter is None
    assert BinaryAUROCMetric(thresholds=[0.5])._host_counter is None
    assert BinaryAUROCMetric(16, ignore_index=-1)._host_counter is None
    assert BinaryAUROCMetric(exact=True)._host_counter is None


def test_counts_after_a_sync_make_the_synced_value_stale() -> None:
    metric = BinaryAUROCMetric(100)
    metric.update(torch.tensor([0.1, 0.9]), torch.tensor([0, 1]))
    metric.sync()  # one process: the synced state is the local one
    assert metric.compute().item() == 1.0
    metric.update(torch.tensor([0.95]), torch.tensor([0]))
    assert metric.compute().item() == 0.5  # the new count is seen


def test_a_copy_counts_into_its_own_state() -> None:
    import copy
    import pickle

    metric = BinaryAUROCMetric(4)
    metric.update(torch.tensor([0.1]), torch.tensor([0]))
    for twin in (copy.deepcopy(metric), pickle.loads(pickle.dumps(metric))):
        twin.update(torch.tensor([0.9]), torch.tensor([1]))
        assert int(torch.cat(twin.histograms(), 1).sum()) == 2
    assert int(torch.cat(metric.histograms(), 1).sum()) == 1


def test_counts_land_in_the_current_state_after_a_load_and_in_a_copy_its_own() -> None:
    """The counter keeps its numpy view of the histogram between updates: a loaded state, a
    deep copy and a pickled one each count into their own state."""
    import copy
    import pickle

    metric = BinaryAUROCMetric(4)
    metric.update(torch.tensor([0.1]), torch.tensor([0]))
    other = BinaryAUROCMetric(4)
    other.update(torch.tensor([0.9]), torch.tensor([1]))
    metric.load_state_dict(other.state_dict())
    metric.update(torch.tensor([0.6]), torch.tensor([1]))
    assert metric.histograms()[0][0].tolist() == [0, 0, 0, 0]
    assert metric.histograms()[1][0].tolist() == [0, 0, 1, 1]
    for twin in (copy.deepcopy(metric), pickle.loads(pickle.dumps(metric))):
        twin.update(torch.tensor([0.1]), torch.tensor([0]))
        assert twin.histograms()[0][0].tolist() == [1, 0, 0, 0]
    metric.update(torch.tensor([0.3]), torch.tensor([0]))
    assert metric.histograms()[0][0].tolist() == [0, 1, 0, 0]
    metric.reset()
    metric.update(torch.tensor([0.9]), torch.tensor([0]))
    assert metric.histograms()[0][0].tolist() == [0, 0, 0, 1]
    assert int(metric.histograms()[1].sum()) == 0


def test_without_a_recent_numpy_the_torch_path_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy

    monkeypatch.setattr(numpy, "__version__", "1.24.4")  # no fast ufunc.at yet
    assert _host_counts._numpy() is None
    monkeypatch.setattr(_host_counts, "_np", None)
    metric = BinaryAUROCMetric(4)
    assert metric._host_counter is None
    metric.update(torch.tensor([0.1, 0.9]), torch.tensor([0, 1]))
    assert metric.histograms()[0][0].tolist() == [1, 0, 0, 0]
    assert metric.histograms()[1][0].tolist() == [0, 0, 0, 1]


def test_a_sparse_batch_is_refused_naming_the_argument() -> None:
    dense_scores, dense_target = torch.tensor([0.1, 0.9]), torch.tensor([0, 1])
    for preds, target, argument in (
        (dense_scores.to_sparse(), dense_target, "preds"),
        (dense_scores, dense_target.to_sparse(), "target"),
    ):
        with pytest.raises(TypeError, match=f"^{argument}: expected a dense tensor"):
            BinaryAUROCMetric(4).update(preds, target)


def test_a_lazily_negated_view_counts_as_its_values() -> None:
    """``complex(0, -p).conj().imag`` equals ``p`` but is a view with torch's negative bit,
    which numpy() refuses: such inputs take the torch path."""
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    target = torch.tensor([0, 0, 1, 1])
    view = torch.complex(torch.zeros(4), -scores).conj().imag
    assert view.is_neg() and torch.equal(view, scores)
    metric = BinaryAUROCMetric()
    metric.update(view, target)
    assert metric.compute().item() == pytest.approx(roc_auc_score(target, scores))


def _exact_batches(target_dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Ties, edges, a 2-D strided batch and one requiring grad, in float32 and float64."""
    generator = torch.Generator().manual_seed(5)
    batches = []
    for size, dtype in ((7, torch.float32), (64, torch.float64), (1024, torch.float32)):
        scores = (torch.randint(0, 50, (size,), generator=generator) / 49).to(dtype)
        target = torch.randint(0, 2, (size,), generator=generator).to(target_dtype)
        batches.append((scores, target))
    edges = torch.tensor([0.0, -0.0, 1.0, np.nextafter(1.0, 0), 0.5, 0.5])
    batches.append((edges, torch.tensor([0, 1, 1, 0, 1, 0]).to(target_dtype)))
    scores, target = batches[1]
    batches[1] = (scores.reshape(8, 8).t(), target.reshape(8, 8).t())  # not contiguous
    batches[2] = (batches[2][0].clone().requires_grad_(), batches[2][1])
    return batches


@pytest.mark.parametrize("target_dtype", [torch.bool, torch.uint8, torch.int8, torch.int64])
def test_exact_rows_stored_through_numpy_are_those_of_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, target_dtype: torch.dtype
) -> None:
    """Exact mode keeps small batches after numpy's checks: the same rows, and the value is
    scikit-learn's on the concatenated batches."""
    batches = _exact_batches(target_dtype)
    fast = BinaryAUROCMetric(exact=True)
    with monkeypatch.context() as patch:
        calls = _recording_stores(patch)
        for scores, target in batches:
            fast.update(scores, target)
    assert calls == [True] * len(batches)
    with monkeypatch.context() as patch:
        patch.setattr(ranking, "borrow_checked", lambda *args: False)
        torch_path = BinaryAUROCMetric(exact=True)
        for scores, target in batches:
            torch_path.update(scores, target)
    fast_rows, torch_rows = fast.state_dict(), torch_path.state_dict()
    for field in ("scores", "labels"):
        assert fast_rows[field].rows.dtype == torch_rows[field].rows.dtype
        assert torch.equal(fast_rows[field].rows, torch_rows[field].rows), field
    every_score = torch.cat([s.detach().reshape(-1).double() for s, _ in batches]).numpy()
    every_target = torch.cat([t.reshape(-1).to(torch.int64) for _, t in batches]).numpy()
    assert fast.compute().item() == pytest.approx(
        roc_auc_score(every_target, every_score), abs=1e-12
    )


@pytest.mark.parametrize(
    ("preds", "target", "argument"),
    [
        ([0.2, float("nan")], [0, 1], "preds"),
        ([0.2, 1.0000001], [0, 1], "preds"),
        ([-1e-30, 0.5], [0, 1], "preds"),
        ([0.2, 0.5], [0, 2], "target"),
        ([0.2, 0.5], [-1, 1], "target"),
    ],
)
def test_exact_bad_values_raise_the_torch_path_error_before_storing(
    monkeypatch: pytest.MonkeyPatch, preds: list[float], target: list[int], argument: str
) -> None:
    messages = []
    for numpy_path in (True, False):
        with monkeypatch.context() as patch:
            if numpy_path:
                calls = _recording_stores(patch)
            else:
                patch.setattr(ranking, "borrow_checked", lambda *args: False)
            metric = BinaryAveragePrecisionMetric(exact=True)
            metric.update(torch.tensor([0.1, 0.9]), torch.tensor([0, 1]))
            with pytest.raises(ValueError, match=f"^{argument}: ") as raised:
                metric.update(torch.tensor(preds), torch.tensor(target))
            assert metric.state_dict()["scores"].rows[:, 0].tolist() == pytest.approx([0.1, 0.9])
            assert metric.compute().item() == 1.0
            messages.append(str(raised.value))
            if numpy_path:
                assert calls[0] is True and calls[1] is raised.value  # raised by numpy's path
    assert messages[0] == messages[1]


def test_exact_batches_numpy_does_not_check_take_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Large, empty, bfloat16 or float-target batches, and exact metrics of logits or with
    ignore_index, are stored by the torch path; the values stay scikit-learn's."""
    taken = _recording_stores(monkeypatch)
    metric = BinaryAUROCMetric(exact=True)
    large = _host_counts.MAX_ELEMENTS + 1
    batches = [
        (torch.tensor([0.25, 0.75]), torch.tensor([0, 1])),
        (torch.tensor([0.5, 0.25]).bfloat16(), torch.tensor([1, 0])),
        (torch.tensor([0.3, 0.6]), torch.tensor([1.0, 0.0])),
        (torch.rand(large, generator=torch.Generator().manual_seed(1)), torch.arange(large) % 2),
        (torch.zeros(0), torch.zeros(0, dtype=torch.int64)),
    ]
    for scores, target in batches:
        metric.update(scores, target)
    assert taken == [True, False, False, False, False]
    every_score = torch.cat([s.float() for s, _ in batches]).numpy()
    every_target = torch.cat([t.to(torch.int64) for _, t in batches]).numpy()
    assert metric.compute().item() == pytest.approx(
        roc_auc_score(every_target, every_score), abs=1e-12
    )
    assert not BinaryAUROCMetric(exact=True, logits=True)._stores_on_host
    assert not BinaryAUROCMetric(exact=True, ignore_index=-1)._stores_on_host
    assert not BinaryAUROCMetric()._stores_on_host
