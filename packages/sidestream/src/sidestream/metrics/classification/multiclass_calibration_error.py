"""Expected calibration error of the top-1 prediction of a multiclass classifier."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import as_tensor, check_floating
from sidestream.metrics.classification import _host
from sidestream.metrics.classification._calibration import CalibrationHistogramMetric
from sidestream.metrics.classification._score_histogram import check_positive_int, screen

__all__ = ["MulticlassCalibrationErrorMetric"]


class MulticlassCalibrationErrorMetric(CalibrationHistogramMetric):
    """Expected calibration error (L1) of the top-1 prediction.

    The confidence of a sample is its highest class probability, its accuracy 1 when that class
    is the target: ``sum_b |sum confidence - sum correct| / N`` over ``num_bins`` uniform bins.

    Args:
        num_classes: The number of classes (the width of ``preds``).
        num_bins: Confidence bins over ``[0, 1]``.

    Example:
        >>> metric = MulticlassCalibrationErrorMetric(num_classes=3, num_bins=2)
        >>> probs = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6]])
        >>> metric.update(probs, torch.tensor([0, 2, 2]))
        >>> metric.compute()
        tensor(0.0667, dtype=torch.float64)
    """

    def __init__(self, num_classes: int, num_bins: int = 15) -> None:
        check_positive_int("num_classes", num_classes, 2)
        super().__init__(num_bins)
        self._num_classes = num_classes

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add ``(N, C)`` probabilities in ``[0, 1]`` and ``(N,)`` class indices in ``[0, C)``.

        Raises:
            TypeError: If ``preds`` is not floating point.
            ValueError: On a wrong shape or class count, or (CPU) a probability outside
                ``[0, 1]`` or a class index outside ``[0, C)``; CUDA drops such a batch and
                counts it in ``rejected_updates``.
        """
        preds_t = as_tensor("preds", preds, self.device)
        target_t = as_tensor("target", target, self.device)
        check_floating("preds", preds_t)
        if target_t.is_floating_point() or target_t.dtype == torch.bool:
            raise TypeError(f"target: expected integer class indices, got dtype {target_t.dtype}")
        classes = self._num_classes
        if preds_t.ndim != 2 or preds_t.shape[1] != classes:
            raise ValueError(
                f"preds: expected shape (N, {classes}) for num_classes={classes}, "
                f"got {tuple(preds_t.shape)}"
            )
        if tuple(target_t.shape) != (preds_t.shape[0],):
            raise ValueError(
                f"target: expected shape {(preds_t.shape[0],)}, got {tuple(target_t.shape)}"
            )
        if preds_t.numel() == 0:
            return
        keep = screen(
            [
                (_host.outside(preds_t, 0, 1), "preds", "probabilities in [0, 1]"),
                (
                    _host.outside(target_t, 0, classes - 1),
                    "target",
                    f"class indices in [0, {classes})",
                ),
            ],
            self._rejected,
        )
        confidence, predicted = preds_t.max(dim=1)
        self._add(confidence, predicted == target_t, keep)
