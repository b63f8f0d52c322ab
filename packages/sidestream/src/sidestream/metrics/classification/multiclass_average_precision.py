"""One-vs-rest average precision from fixed-size score histograms."""

from __future__ import annotations

from torch import Tensor

from sidestream.metrics.classification._score_histogram import (
    Average,
    ScoreHistogramMetric,
    average_precision_from_histograms,
)

__all__ = ["MulticlassAveragePrecisionMetric"]


class MulticlassAveragePrecisionMetric(ScoreHistogramMetric):
    """One-vs-rest average precision, in constant memory.

    ``preds``: ``(N, C)`` probabilities in ``[0, 1]``; ``target``: ``(N,)`` class indices.

    State: ``2 * classes * num_bins`` int64 counts, whatever the number of samples; no
    predictions are stored. ``compute`` differs from the exact average precision by at most
    ``error_bound()`` (see ``average_precision_from_histograms``); on continuous scores
    with 10,000 bins this is well below 1e-3. Bad values follow the library policy: CPU
    raises before the state changes, CUDA drops the batch and counts it in
    ``rejected_updates``.

    Args:
        num_classes: The number of classes (the width of ``preds``).
        num_bins: Histogram bins over ``[0, 1]``; the error bound shrinks with more bins.
        average: ``macro`` (mean over classes), ``weighted`` (by number of positives) or
            ``none`` (a vector per class). Undefined classes (no positives)
            are NaN and left out of the averages.

    Example:
        >>> metric = MulticlassAveragePrecisionMetric(num_classes=3, num_bins=1000)
        >>> probs = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6]])
        >>> metric.update(probs, torch.tensor([0, 1, 2]))
        >>> round(float(metric.compute()), 4)
        1.0
    """

    def __init__(
        self, num_classes: int, num_bins: int = 10_000, average: Average = "macro"
    ) -> None:
        super().__init__("multiclass", num_classes, num_bins, average)

    def _per_class(self, negatives: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
        return average_precision_from_histograms(negatives, positives)
