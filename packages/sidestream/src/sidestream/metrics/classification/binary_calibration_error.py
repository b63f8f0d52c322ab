"""Expected calibration error of binary probabilities."""

from __future__ import annotations

from torch import Tensor

from sidestream._validation import as_tensor, check_floating, check_same_shape
from sidestream.metrics.classification import _host
from sidestream.metrics.classification._calibration import CalibrationHistogramMetric
from sidestream.metrics.classification._score_histogram import not_binary, screen

__all__ = ["BinaryCalibrationErrorMetric"]


class BinaryCalibrationErrorMetric(CalibrationHistogramMetric):
    """Expected calibration error (L1) of the positive-class probability.

    The confidence of a sample is its probability ``p`` and its accuracy its 0/1 target (the
    convention of torchmetrics' ``BinaryCalibrationError``): ``sum_b |sum p - sum y| / N`` over
    ``num_bins`` uniform bins of ``p``.

    Args:
        num_bins: Confidence bins over ``[0, 1]``.

    Example:
        >>> metric = BinaryCalibrationErrorMetric(num_bins=2)
        >>> metric.update(torch.tensor([0.2, 0.9, 0.7]), torch.tensor([0, 1, 0]))
        >>> metric.compute()
        tensor(0.2667, dtype=torch.float64)
    """

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add probabilities ``preds`` in ``[0, 1]`` and 0/1 ``target`` of the same shape.

        Raises:
            TypeError: If ``preds`` is not floating point.
            ValueError: On a shape mismatch, or (CPU) a probability outside ``[0, 1]`` or a
                target other than 0/1; CUDA drops such a batch and counts it in
                ``rejected_updates``.
        """
        preds_t = as_tensor("preds", preds, self.device)
        target_t = as_tensor("target", target, self.device)
        check_floating("preds", preds_t)
        check_same_shape(preds_t, target_t)
        if preds_t.numel() == 0:
            return
        keep = screen(
            [
                (_host.outside(preds_t, 0, 1), "preds", "probabilities in [0, 1]"),
                (not_binary(target_t), "target", "0 or 1"),
            ],
            self._rejected,
        )
        self._add(preds_t, target_t, keep)
