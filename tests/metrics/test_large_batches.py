"""Large CPU batches counted in chunks (``_cpu_path.count_in_chunks``): the same counts as
scikit-learn on the whole batch, and the whole batch's error, with the state untouched."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pytest
import torch
from sklearn.metrics import (
    cohen_kappa_score,
    confusion_matrix,
    f1_score,
    multilabel_confusion_matrix,
)

from sidestream.metrics.classification import (
    BinaryCalibrationErrorMetric,
    BinaryCohenKappaMetric,
    BinaryConfusionMatrixMetric,
    MulticlassConfusionMatrixMetric,
    MultilabelConfusionMatrixMetric,
    _cpu_path,
    confusion_count_metric,
)

SMALL_CHUNK = 256
"""Elements per chunk in most tests here, so batches of a few thousand take several chunks."""


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Small chunks; the list records, per ``count_in_chunks`` call, whether it chunked."""
    monkeypatch.setattr(_cpu_path, "CHUNK_ELEMENTS", SMALL_CHUNK)
    chunked: list[bool] = []
    original = _cpu_path.count_in_chunks

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        result = original(*args, **kwargs)
        chunked.append(result is not None)
        return result

    monkeypatch.setattr(_cpu_path, "count_in_chunks", recording)
    return chunked


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def test_a_binary_batch_of_the_default_chunks_counts_as_scikit_learn() -> None:
    generator = _generator()
    shape = (3, 2 * _cpu_path.CHUNK_ELEMENTS // 3 + 1001)  # any shape; 3 chunks and a remainder
    preds = torch.rand(shape, generator=generator)
    target = torch.randint(0, 2, shape, generator=generator)
    metric = BinaryConfusionMatrixMetric()
    metric.update(preds, target)
    expected = confusion_matrix(target.reshape(-1), (preds >= 0.5).reshape(-1), labels=[0, 1])
    np.testing.assert_array_equal(metric.compute().numpy(), expected)


@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32, torch.bool, torch.float32])
def test_binary_chunks_count_as_scikit_learn(
    target_dtype: torch.dtype, small_chunks: list[bool]
) -> None:
    generator = _generator()
    preds = torch.rand(40, 70, generator=generator)
    target = torch.randint(0, 2, (40, 70), generator=generator).to(target_dtype)
    metric = BinaryConfusionMatrixMetric()
    metric.update(preds, target)
    metric.update(preds[:3], target[:3])  # a small batch after a chunked one adds to it
    flat_target = torch.cat([target.reshape(-1), target[:3].reshape(-1)]).long().numpy()
    flat_preds = torch.cat([preds.reshape(-1), preds[:3].reshape(-1)]) >= 0.5
    expected = confusion_matrix(flat_target, flat_preds.numpy(), labels=[0, 1])
    np.testing.assert_array_equal(metric.compute().numpy(), expected)
    assert small_chunks == []  # binary batches are counted whole (one-byte flags)


@pytest.mark.usefixtures("small_chunks")
def test_binary_chunks_skip_ignore_index_as_scikit_learn_on_the_kept_elements() -> None:
    generator = _generator()
    preds = torch.rand(3000, generator=generator)
    target = torch.randint(0, 2, (3000,), generator=generator)
    target[torch.randperm(3000, generator=generator)[:700]] = -100
    metric = BinaryConfusionMatrixMetric(ignore_index=-100)
    metric.update(preds, target)
    kept = target != -100
    expected = confusion_matrix(target[kept], preds[kept] >= 0.5, labels=[0, 1])
    np.testing.assert_array_equal(metric.compute().numpy(), expected)


@pytest.mark.parametrize("one_hot", [False, True])
def test_multiclass_chunks_count_as_scikit_learn(one_hot: bool, small_chunks: list[bool]) -> None:
    generator = _generator()
    classes = 5
    logits = torch.randn(900, 3, classes, generator=generator)  # (N, extra, C)
    labels = torch.randint(0, classes, (900, 3), generator=generator)
    target = torch.nn.functional.one_hot(labels, classes) if one_hot else labels
    metric = MulticlassConfusionMatrixMetric(classes)
    metric.update(logits, target)
    expected = confusion_matrix(
        labels.reshape(-1), logits.argmax(-1).reshape(-1), labels=list(range(classes))
    )
    np.testing.assert_array_equal(metric.compute().numpy(), expected)
    assert small_chunks == [True]


@pytest.mark.usefixtures("small_chunks")
def test_multilabel_chunks_count_as_scikit_learn() -> None:
    generator = _generator()
    preds = torch.rand(1500, 4, generator=generator)
    target = torch.randint(0, 2, (1500, 4), generator=generator)
    metric = MultilabelConfusionMatrixMetric(4)
    metric.update(preds, target)
    expected = multilabel_confusion_matrix(target.numpy(), (preds >= 0.5).numpy())
    np.testing.assert_array_equal(metric.compute().numpy(), expected)


@pytest.mark.usefixtures("small_chunks")
def test_cohen_kappa_of_chunks_equals_one_whole_count() -> None:
    generator = _generator()
    preds = torch.rand(5000, generator=generator)
    target = torch.randint(0, 2, (5000,), generator=generator)
    chunked = BinaryCohenKappaMetric()
    chunked.update(preds, target)
    whole = BinaryCohenKappaMetric()
    for start in range(0, 5000, 200):  # small batches: never chunked
        whole.update(preds[start : start + 200], target[start : start + 200])
    assert torch.equal(chunked.confusion_matrix(), whole.confusion_matrix())
    # And against scikit-learn, not only against the small-batch path.
    predicted = (preds >= 0.5).long()
    expected = confusion_matrix(target, predicted, labels=[0, 1])
    np.testing.assert_array_equal(chunked.confusion_matrix().numpy(), expected)
    assert chunked.compute().item() == pytest.approx(
        cohen_kappa_score(target, predicted), abs=1e-12
    )


def test_a_bad_value_in_a_late_chunk_raises_before_the_state_changes(
    small_chunks: list[bool],
) -> None:
    generator = _generator()
    preds = torch.rand(1000, 4, generator=generator)
    target = torch.randint(0, 2, (1000, 4), generator=generator)
    preds[990, 2] = 1.5  # in the last chunk: earlier chunks were counted already
    metric = MultilabelConfusionMatrixMetric(4)
    with pytest.raises(ValueError, match="preds"):
        metric.update(preds, target)
    assert metric.confusion_matrix().sum() == 0
    assert small_chunks == []  # count_in_chunks raised: the whole batch's error


def test_the_whole_batch_error_names_preds_before_a_bad_target_in_an_earlier_chunk(
    small_chunks: list[bool],
) -> None:
    generator = _generator()
    preds = torch.rand(1000, 4, generator=generator)
    target = torch.randint(0, 2, (1000, 4), generator=generator)
    target[5, 1] = 3  # the first chunk
    preds[990, 0] = float("nan")  # the last chunk
    chunked = MultilabelConfusionMatrixMetric(4)
    with pytest.raises(ValueError) as chunked_error:
        chunked.update(preds, target)
    whole = MultilabelConfusionMatrixMetric(4)
    with pytest.raises(ValueError) as whole_error, pytest.MonkeyPatch.context() as patch:
        patch.setattr(_cpu_path, "CHUNK_ELEMENTS", 10**9)  # one batch, never chunked
        whole.update(preds, target)
    assert str(chunked_error.value) == str(whole_error.value)
    assert str(chunked_error.value).startswith("preds")
    assert chunked.confusion_matrix().sum() == 0


@pytest.mark.parametrize("norm", ["l1", "l2", "max"])
def test_binary_calibration_error_of_chunks_equals_torchmetrics(
    norm: Literal["l1", "l2", "max"], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchmetrics.functional.classification import binary_calibration_error

    monkeypatch.setattr(_cpu_path, "CHUNK_ELEMENTS", SMALL_CHUNK)
    generator = _generator()
    # Scores on a 1/1000 grid, away from the 15 bin edges' float rounding; labels that follow
    # the scores, so every bin has a gap.
    preds = torch.randint(1, 1000, (5000,), generator=generator).double() / 1000
    target = (torch.rand(5000, generator=generator, dtype=torch.float64) < preds**2).long()
    metric = BinaryCalibrationErrorMetric(num_bins=15, norm=norm)
    metric.update(preds, target)
    expected = binary_calibration_error(preds, target, n_bins=15, norm=norm)
    assert metric.compute().item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kind", ["binary", "multilabel", "multiclass_ignore"])
def test_confusion_counts_of_chunks_give_scikit_learn_f1(
    kind: str, small_chunks: list[bool]
) -> None:
    generator = _generator()
    builder = confusion_count_metric()
    if kind == "binary":
        preds = torch.rand(60, 50, generator=generator)
        target = torch.randint(0, 2, (60, 50), generator=generator)
        metric = builder.binary().with_f1().build()
        expected = f1_score(target.reshape(-1), (preds >= 0.5).reshape(-1))
    elif kind == "multilabel":
        preds = torch.rand(1000, 4, generator=generator)
        target = torch.randint(0, 2, (1000, 4), generator=generator)
        metric = builder.multilabel(4).with_f1().macro().build()
        expected = f1_score(target, preds >= 0.5, average="macro")
    else:  # multiclass with ignore_index: not the small mapped case, so chunked
        preds = torch.randn(1000, 5, generator=generator)
        target = torch.randint(0, 5, (1000,), generator=generator)
        target[:100] = -1
        metric = confusion_count_metric(ignore_index=-1).multiclass(5).with_f1().macro().build()
        kept = target != -1
        expected = f1_score(target[kept], preds.argmax(-1)[kept], average="macro")
    metric.update(preds, target)
    assert metric.compute().item() == pytest.approx(expected, abs=1e-12)
    assert small_chunks == ([] if kind == "binary" else [True])  # binary: counted whole


FLOAT_SPECIALS = [0.0, -0.0, 1.0, 0.5, -1e-45, 1e-45, -1.0, 2.0, 1.0000001, NAN := float("nan")]
FLOAT_SPECIALS += [-NAN, float("inf"), -float("inf"), 65504.0, 3.0e38]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("special", FLOAT_SPECIALS)
def test_outside_the_unit_range_of_a_large_float_batch(dtype: torch.dtype, special: float) -> None:
    # Large enough for the check by bits (_BITS_FROM); one special value among valid ones.
    values = torch.rand(1 << 16, generator=_generator()).to(dtype)
    values[12345] = special
    reference = not bool(((values >= 0) & (values <= 1)).all())  # NaN fails both comparisons
    assert _cpu_path.outside(values, 0, 1) is reference
    strided = torch.stack((values, values), dim=1)[:, 0]  # a non-contiguous view
    assert _cpu_path.outside(strided, 0, 1) is reference


@pytest.mark.parametrize(
    "special", [0, 1, -1, 2, 256, 257, 1 << 32, (1 << 32) + 1, 1 << 56, -(1 << 63)]
)
def test_outside_the_unit_range_of_a_large_int64_batch(special: int) -> None:
    values = torch.randint(0, 2, (1 << 16,), generator=_generator())
    values[777] = special
    reference = not bool(((values >= 0) & (values <= 1)).all())
    assert _cpu_path.outside(values, 0, 1) is reference
    assert _cpu_path.outside(values.view(256, 256).t(), 0, 1) is reference  # non-contiguous


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_half_precision_mean_counts_past_what_its_dtype_holds(compiled: bool) -> None:
    # The count was kept in the mean's dtype: 70,000 float16 values made it inf (mean 0.0), and
    # a float32 count stopped growing at 2**24.
    from sidestream import MeanMetric

    metric = MeanMetric(dtype=torch.float16)
    update = metric.update
    if compiled:
        update = torch.compile(update, fullgraph=True, backend="aot_eager")
    values = torch.full((70_000,), 1e-4, dtype=torch.float16)
    update(values)
    expected = values.double().mean().item()
    result = metric.compute()
    assert result.dtype == torch.float16
    assert result.item() == pytest.approx(expected, rel=1e-3)
