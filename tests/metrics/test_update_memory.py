"""Peak memory of updates on large inputs, relative to the input (docs/metrics.md).

A language-model batch of logits is the largest tensor a training step hands a metric
(4 x 2048 x 32,000 bfloat16 logits are 0.5 GB): a whole-batch float copy of it, or a bool per
logit, is memory the training job no longer has. Measured as the process's peak resident
memory (``VmHWM``, reset through ``/proc/self/clear_refs``) over the memory before the update;
references are direct float64 computations.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from sidestream import _validation
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    MulticlassAUROCMetric,
    MultilabelAUROCMetric,
    _cpu_path,
    _inputs,
    _scores,
    confusion_count_metric,
    ranking,
)
from sidestream.metrics.language import (
    PerplexityMetric,
    TokenAccuracyMetric,
    _tokens,
    perplexity,
    token_accuracy,
)

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset"
)


def _status(field: str) -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _peak_extra(update: Callable[[], object]) -> int:
    """Bytes the process's resident memory peaked at during ``update``, over the memory before."""
    before = _status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")  # resets VmHWM to the current resident size
    except OSError:
        pytest.skip("cannot reset the peak resident size here")
    update()
    return _status("VmHWM") - before


@pytest.fixture(params=["host", "device"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The CPU path, or the path CUDA takes (checks kept on the device), eagerly on CPU."""
    if request.param == "device":
        for module in (_validation, perplexity, token_accuracy):
            monkeypatch.setattr(module, "checks_stay_on_device", lambda device: True)
        monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    yield request.param


def _logits(tokens: int, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=generator).to(dtype)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    target[::5] = -100
    return logits, target


def test_perplexity_of_bfloat16_logits_makes_no_whole_batch_float_copy(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2**24 bf16 logits (32 MiB): a float32 copy and its log-softmax were 4x that (128 MiB).
    monkeypatch.setattr(_tokens, "WORK_ELEMENTS", 2**18, raising=False)
    logits, target = _logits(2**10, 2**14, torch.bfloat16)
    metric = PerplexityMetric()
    metric.update(logits[:2], target[:2])  # lazily made state and kernels out of the measure
    metric.reset()
    extra = _peak_extra(lambda: metric.update(logits, target))
    size = logits.numel() * logits.element_size()
    assert extra < size / 2, f"{extra / 2**20:.0f} MiB extra for {size / 2**20:.0f} MiB of logits"
    # The same number as one float32 cross_entropy over the batch (the per-token losses'
    # dtype; test_perplexity_in_blocks_equals_float64_cross_entropy checks them in float64).
    keep = target != -100
    nll = F.cross_entropy(logits[keep].float(), target[keep], reduction="none").double().sum()
    assert metric.compute().item() == pytest.approx(math.exp(nll.item() / keep.sum()), rel=1e-6)


@pytest.mark.parametrize("layout", ["contiguous", "shifted", "transposed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_perplexity_in_blocks_equals_float64_cross_entropy(
    path: str, layout: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of 40 logits: every way of cutting (within one entry, several entries per block).
    monkeypatch.setattr(_tokens, "WORK_ELEMENTS", 40, raising=False)
    generator = torch.Generator().manual_seed(1)
    full = (torch.randn(3, 9, 8, generator=generator) * 4).to(dtype)
    if layout == "shifted":  # logits[:, :-1], as a next-token loss takes them: not a view
        logits = full[:, :-1]
    elif layout == "transposed":
        logits = full.transpose(0, 1)
    else:
        logits = full
    target = torch.randint(0, 8, logits.shape[:-1], generator=generator)
    target[0, ::2] = -100
    metric = PerplexityMetric()
    metric.update(logits, target)
    keep = target != -100
    nll = F.cross_entropy(logits[keep].double(), target[keep], reduction="sum")
    expected = math.exp(nll.item() / keep.sum().item())
    assert metric.compute().item() == pytest.approx(expected, rel=1e-6)
    assert metric.rejected_updates == 0


def test_token_accuracy_makes_no_bool_per_logit(path: str) -> None:
    # 2**25 bf16 logits (64 MiB): isnan() of the batch was a bool per logit (32 MiB).
    logits, target = _logits(2**10, 2**15, torch.bfloat16)
    logits[3, 7] = math.nan
    target[3] = -100  # NaN at a padding token: not read
    metric = TokenAccuracyMetric()
    metric.update(logits[:2], target[:2])
    metric.reset()
    extra = _peak_extra(lambda: metric.update(logits, target))
    size = logits.numel() * logits.element_size()
    assert extra < size / 4, f"{extra / 2**20:.0f} MiB extra for {size / 2**20:.0f} MiB of logits"
    keep = target != -100
    expected = (logits.argmax(-1) == target)[keep].double().mean()
    assert metric.compute().item() == pytest.approx(expected.item(), rel=1e-12)


def test_token_accuracy_still_finds_a_nan_at_a_counted_token(path: str) -> None:
    logits, target = _logits(6, 5, torch.float32)
    target[:] = 1
    logits[4, 3] = math.nan
    logits[4, 1] = math.inf  # the NaN is found past a larger score too
    metric = TokenAccuracyMetric()
    if path == "host":
        with pytest.raises(ValueError, match="NaN scores at 1 of 6 counted tokens"):
            metric.update(logits, target)
    else:
        metric.update(logits, target)
        assert metric.rejected_updates == 1
    assert math.isnan(metric.compute().item())


@pytest.fixture
def ranking_device_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The binned ranking metrics' device path (index_add_, checks kept as flags), on CPU."""
    for module in (_validation, _inputs, _scores):
        if hasattr(module, "checks_stay_on_device"):
            monkeypatch.setattr(module, "checks_stay_on_device", lambda device: True)
    monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    yield


def test_binned_auroc_device_path_makes_no_whole_batch_float64_copies(
    ranking_device_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2**22 float32 scores (16 MiB): float64 scores, their product and int64 slots of the whole
    # batch were 6x that at once.
    monkeypatch.setattr(ranking, "_DEVICE_BLOCK", 2**16, raising=False)
    generator = torch.Generator().manual_seed(2)
    preds = torch.rand(512, 8192, generator=generator)
    target = torch.randint(0, 8192, (512,), generator=generator)
    metric = MulticlassAUROCMetric(8192, num_bins=100)
    metric.update(preds[:2], target[:2])
    metric.reset()
    extra = _peak_extra(lambda: metric.update(preds, target))
    size = preds.numel() * preds.element_size()
    assert extra < size / 2, f"{extra / 2**20:.0f} MiB extra for {size / 2**20:.0f} MiB of scores"


@pytest.mark.parametrize("kind", ["binary", "multiclass", "multilabel"])
@pytest.mark.parametrize("ignore_index", [None, -1])
def test_binned_histograms_in_blocks_equal_a_direct_count(
    ranking_device_path: None, monkeypatch: pytest.MonkeyPatch, kind: str, ignore_index: int | None
) -> None:
    monkeypatch.setattr(ranking, "_DEVICE_BLOCK", 7, raising=False)
    generator = torch.Generator().manual_seed(3)
    classes, bins, rows = 3, 10, 23
    if kind == "binary":
        preds = torch.rand(rows, generator=generator)
        target = torch.randint(0, 2, (rows,), generator=generator)
        metric = BinaryAUROCMetric(num_bins=bins, ignore_index=ignore_index)
    elif kind == "multiclass":
        preds = torch.rand(rows, classes, generator=generator)
        target = torch.randint(0, classes, (rows,), generator=generator)
        metric = MulticlassAUROCMetric(classes, num_bins=bins, ignore_index=ignore_index)
    else:
        preds = torch.rand(rows, classes, generator=generator)
        target = torch.randint(0, 2, (rows, classes), generator=generator)
        metric = MultilabelAUROCMetric(classes, num_bins=bins, ignore_index=ignore_index)
    if ignore_index is not None:
        target.view(-1)[::4] = ignore_index
    metric.update(preds, target)
    bad = preds.clone()
    bad.view(-1)[5] = math.nan  # a dropped batch adds nothing
    metric.update(bad, target)
    assert metric.rejected_updates == 1
    # Direct count: per class, scores binned by floor(score * bins), positives and negatives.
    scores = preds.reshape(rows, -1).double()
    if kind == "multiclass":
        positive = target[:, None] == torch.arange(classes)
        counted = (target != -1)[:, None].expand(scores.shape)
    else:
        flags = target.reshape(rows, -1)
        positive, counted = flags == 1, flags != -1
    index = (scores * bins).long().clamp(0, bins - 1)
    negatives, positives = metric.histograms()
    for column in range(scores.shape[1]):
        for label, histogram in ((True, positives), (False, negatives)):
            chosen = counted[:, column] & (positive[:, column] == label)
            expected = torch.bincount(index[chosen, column], minlength=bins)
            assert histogram.reshape(-1, bins)[column].tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("bad", [None, "nan", "low", "high"])
def test_device_range_check_of_a_large_batch_finds_each_bad_value(
    ranking_device_path: None, dtype: torch.dtype, bad: str | None
) -> None:
    values = torch.zeros(2**20 + 3, dtype=dtype)
    values[::3] = 1
    if bad is not None:
        if bad == "nan" and not dtype.is_floating_point:
            pytest.skip("integers hold no NaN")
        values[-2] = {"nan": math.nan, "low": -1, "high": 2}[bad]
    flag = _cpu_path.outside(values, 0, 1)
    assert isinstance(flag, torch.Tensor) and flag.dim() == 0
    assert bool(flag) is (bad is not None)


def test_device_range_check_makes_no_copy_of_a_large_batch(ranking_device_path: None) -> None:
    # 2**23 float32 scores (32 MiB): their clamped copy was as large.
    scores = torch.rand(2**23, generator=torch.Generator().manual_seed(4))
    _cpu_path.outside(scores[: 2**20], 0, 1)
    extra = _peak_extra(lambda: _cpu_path.outside(scores, 0, 1))
    assert extra < 2**23, f"{extra / 2**20:.0f} MiB extra for 32 MiB of scores"


def test_class_last_view_of_segmentation_scores_is_not_copied(ranking_device_path: None) -> None:
    # (N, C, H, W) scores moved class-last (a view, as docs/classification.md says): the
    # device path's reshape copied all 32 MiB, and isnan() added a bool per score.
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(8, 16, 256, 256, generator=generator)
    target = torch.randint(0, 16, (8, 256, 256), generator=generator)
    metric = confusion_count_metric().multiclass(16).with_accuracy().micro().build()
    metric.update(scores[:1].movedim(1, -1), target[:1])
    metric.reset()
    preds = scores.movedim(1, -1)
    extra = _peak_extra(lambda: metric.update(preds, target))
    size = scores.numel() * scores.element_size()
    assert extra < size / 2, f"{extra / 2**20:.0f} MiB extra for {size / 2**20:.0f} MiB of scores"
    expected = (scores.argmax(1) == target).double().mean().item()
    assert metric.compute().item() == pytest.approx(expected, rel=1e-12)


def test_device_path_drops_a_class_last_batch_with_a_nan(ranking_device_path: None) -> None:
    scores = torch.randn(2, 4, 3, 3).movedim(1, -1)
    scores[1, 2, 0, 3] = math.nan
    metric = confusion_count_metric().multiclass(4, top_k=2).with_accuracy().micro().build()
    metric.update(scores, torch.zeros(2, 3, 3, dtype=torch.int64))
    assert metric.rejected_updates == 1
    assert math.isnan(metric.compute().item()) or metric.compute().item() == 0.0
