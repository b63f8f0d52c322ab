"""Area under the ROC curve from fixed-size score histograms."""

from __future__ import annotations

from torch import Tensor

from sidestream.metrics.classification._score_histogram import (
    ScoreHistogramMetric,
    auroc_from_histograms,
)

__all__ = ["BinaryAUROCMetric"]


class BinaryAUROCMetric(ScoreHistogramMetric):
    """Area under the ROC curve, in constant memory.

    ``preds``: probabilities in ``[0, 1]`` of any shape; ``target``: 0/1 of the same shape.

    State: ``2 * classes * num_bins`` int64 counts, whatever the number of samples; no
    predictions are stored. ``compute`` differs from the exact AUROC by at most
    ``error_bound()`` (see ``auroc_from_histograms``); on continuous scores with 10,000
    bins this is well below 1e-3. Bad values follow the library policy: CPU raises before the state
    changes, CUDA drops the batch and counts it in ``rejected_updates``.

    Args:
        num_bins: Histogram bins over ``[0, 1]``; the error bound shrinks with more bins.

    Example:
        >>> metric = BinaryAUROCMetric(num_bins=1000)
        >>> metric.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> round(float(metric.compute()), 4)
        0.75
    """

    def __init__(self, num_bins: int = 10_000) -> None:
        super().__init__("binary", 1, num_bins, "none")

    def _per_class(self, negatives: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
        return auroc_from_histograms(negatives, positives)
