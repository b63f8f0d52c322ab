"""Defects a probe of input memory layouts found (strides, views into larger buffers)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from sklearn.metrics import confusion_matrix, f1_score, roc_auc_score

from sidestream import Metric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryCalibrationErrorMetric,
    BinaryConfusionMatrixMetric,
    confusion_count_metric,
)


def _masks() -> tuple[torch.Tensor, torch.Tensor]:
    """(N, H, W, 1) scores and int64 masks of 131,072 elements, moved from (N, 1, H, W).

    ``movedim`` leaves the size-1 channel last with a stride of H * W: the tensors are
    contiguous (size-1 dimensions do not count), but their last stride is not 1.
    """
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(8, 1, 128, 128, generator=generator)
    masks = (torch.rand(8, 1, 128, 128, generator=generator) < scores).long()
    return scores.movedim(1, -1), masks.movedim(1, -1)


_METRICS: dict[str, Callable[[], Metric]] = {
    "f1": lambda: confusion_count_metric().binary().with_f1().build(),
    "confusion matrix": BinaryConfusionMatrixMetric,
    "auroc": BinaryAUROCMetric,
    "exact auroc": lambda: BinaryAUROCMetric(exact=True),
    "calibration": BinaryCalibrationErrorMetric,
}


@pytest.mark.parametrize("name", sorted(_METRICS))
def test_a_channel_moved_last_binary_mask_is_counted(name: str) -> None:
    """A large int64 target's 0/1 check viewed it as bytes, which torch refuses for a last
    stride other than 1 even on a contiguous tensor: binary segmentation masks
    ``(N, 1, H, W)`` passed as ``.movedim(1, -1)`` raised torch's "self.stride(-1) must be 1
    to view Long as Byte" from every binary metric once the batch had 65,536 elements (and
    more than 65,536 for the ranking metrics, whose smaller batches numpy counts)."""
    scores, masks = _masks()
    assert masks.is_contiguous() and masks.stride(-1) != 1
    metric = _METRICS[name]()
    metric.update(scores, masks)
    expected = _METRICS[name]()
    expected.update(scores.contiguous().view(-1), masks.contiguous().view(-1))
    assert torch.equal(metric.compute(), expected.compute())
    flat_scores, flat_masks = scores.reshape(-1).numpy(), masks.reshape(-1).numpy()
    if name == "f1":
        assert metric.compute().item() == pytest.approx(f1_score(flat_masks, flat_scores >= 0.5))
    elif name == "confusion matrix":
        reference = confusion_matrix(flat_masks, flat_scores >= 0.5)
        assert metric.compute().tolist() == reference.tolist()
    elif name == "exact auroc":
        assert metric.compute().item() == pytest.approx(roc_auc_score(flat_masks, flat_scores))


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_slices_of_a_buffer_filled_batch_by_batch_are_not_taken_as_changed(path: str) -> None:
    """An exact metric kept a view of part of a larger tensor without a copy, and watched the
    larger tensor's version counter, which its views share: filling the next slice of a
    preallocated buffer after an update made ``compute`` raise "a tensor passed to update was
    modified in place" though the rows passed had not changed."""
    generator = torch.Generator().manual_seed(1)
    scores, target = torch.rand(40, generator=generator), torch.arange(40) % 2
    buffer, labels = torch.empty(40), torch.empty(40, dtype=torch.bool)
    # ignore_index takes the torch path; without it small batches go through numpy.
    metric = BinaryAUROCMetric(exact=True, ignore_index=-1 if path == "torch" else None)
    for start in range(0, 40, 10):
        part = slice(start, start + 10)
        buffer[part], labels[part] = scores[part], target[part].bool()
        metric.update(buffer[part], labels[part])
    assert metric.compute().item() == pytest.approx(roc_auc_score(target, scores), rel=1e-12)
    buffer.fill_(0.5)  # reused for the next epoch: the metric holds copies of the slices
    assert metric.compute().item() == pytest.approx(roc_auc_score(target, scores), rel=1e-12)


def test_a_whole_input_tensor_is_still_kept_without_a_copy_and_watched() -> None:
    scores, target = torch.tensor([0.2, 0.8, 0.4, 0.1]), torch.tensor([0, 1, 1, 0])
    metric = BinaryAUROCMetric(exact=True)
    metric.update(scores.view(2, 2), target.view(2, 2))  # a view of all of it: borrowed
    assert metric._samples._chunks["scores"][0].data_ptr() == scores.data_ptr()
    scores.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified in place"):
        metric.compute()


def test_an_expanded_slice_of_a_buffer_is_copied_not_watched() -> None:
    """A slice of a buffer expanded to more elements than the buffer holds (one label per
    sequence, broadcast over its tokens) was taken as all of the buffer: kept, and watched
    through the buffer's version counter, so filling the buffer's next slice made ``compute``
    raise "modified in place" though the rows read had not changed."""
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.2, 0.9]).view(2, 3)  # 2 sequences, 3 tokens
    # The eval buffer, 2 sequences a batch; bool labels are kept as they are (viewed as int8).
    sequence_labels = torch.zeros(4, dtype=torch.bool)
    metric = BinaryAUROCMetric(exact=True)
    sequence_labels[:2] = torch.tensor([False, True])
    metric.update(scores, sequence_labels[:2, None].expand(-1, 3))
    sequence_labels[2:] = True  # the next batch's labels
    expected = roc_auc_score([0, 0, 0, 1, 1, 1], scores.view(-1))
    assert metric.compute().item() == pytest.approx(expected, rel=1e-12)


def test_an_expanded_whole_tensor_is_still_kept_without_a_copy() -> None:
    scores, labels = torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([True])
    metric = BinaryAUROCMetric(exact=True)
    metric.update(scores, labels.expand(4))  # all of its one element: watched, not copied
    assert metric._samples._chunks["labels"][0].data_ptr() == labels.data_ptr()
    labels.logical_not_()
    with pytest.raises(RuntimeError, match="modified in place"):
        metric.compute()
