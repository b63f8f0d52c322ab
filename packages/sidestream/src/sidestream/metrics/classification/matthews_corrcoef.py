"""Matthews correlation coefficient from the multiclass confusion matrix."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream.metrics.classification.multiclass_confusion_matrix import (
    MulticlassConfusionMatrixMetric,
)

__all__ = ["MatthewsCorrCoefMetric"]


class MatthewsCorrCoefMetric(MulticlassConfusionMatrixMetric):
    """Multiclass Matthews correlation coefficient (``sklearn.metrics.matthews_corrcoef``).

    Keeps the ``C x C`` confusion matrix (same state, inputs and bad-input policy as
    ``MulticlassConfusionMatrixMetric``) and computes, in float64, Gorodkin's R_K statistic:
    ``(c s - t.p) / sqrt((s² - p.p)(s² - t.t))`` with ``c`` the correct count, ``s`` the total,
    ``t`` and ``p`` the true and predicted class counts. A zero denominator (one class only, or
    no data) gives 0.0, as in scikit-learn. For a binary problem use ``num_classes=2``.

    ``confusion_matrix()`` still returns the matrix.

    Example:
        >>> metric = MatthewsCorrCoefMetric(2)
        >>> metric.update(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()
        tensor(0.5774, dtype=torch.float64)
    """

    def compute(self) -> Tensor:
        """The Matthews correlation coefficient, a float64 0-dim tensor in [-1, 1]."""
        matrix = self.confusion_matrix().to(torch.float64)
        true_counts = matrix.sum(1)
        predicted_counts = matrix.sum(0)
        samples = matrix.sum()
        covariance = matrix.trace() * samples - true_counts @ predicted_counts
        spread_predicted = samples * samples - predicted_counts @ predicted_counts
        spread_true = samples * samples - true_counts @ true_counts
        denominator = spread_predicted * spread_true
        safe = torch.where(denominator == 0, 1.0, denominator)
        return torch.where(denominator == 0, 0.0, covariance / safe.sqrt())
