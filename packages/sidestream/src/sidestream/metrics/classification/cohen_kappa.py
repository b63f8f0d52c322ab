"""Cohen's kappa from the multiclass confusion matrix."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream.metrics.classification.multiclass_confusion_matrix import (
    MulticlassConfusionMatrixMetric,
)

__all__ = ["CohenKappaMetric"]

_WEIGHTINGS = (None, "linear", "quadratic")


class CohenKappaMetric(MulticlassConfusionMatrixMetric):
    """Cohen's kappa between targets and predictions (``sklearn.metrics.cohen_kappa_score``).

    Keeps the ``C x C`` confusion matrix (same state, inputs and bad-input policy as
    ``MulticlassConfusionMatrixMetric``) and computes, in float64,
    ``1 - sum(w * observed) / sum(w * expected)`` where ``expected`` is the outer product of the
    true and predicted class counts over the total, and ``w`` is ``1 - I`` (no weighting),
    ``|i - j|`` (``"linear"``) or ``(i - j)²`` (``"quadratic"``). A zero denominator (no data,
    or both raters always answering the same single class) gives NaN.

    Args:
        num_classes: The number of classes C (>= 2).
        ignore_index: Target value whose elements are skipped.
        weights: ``None``, ``"linear"`` or ``"quadratic"`` disagreement weights.

    Example:
        >>> metric = CohenKappaMetric(2)
        >>> metric.update(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    def __init__(
        self, num_classes: int, ignore_index: int | None = None, weights: str | None = None
    ) -> None:
        if weights not in _WEIGHTINGS:
            raise ValueError(f"weights: expected one of {_WEIGHTINGS}, got {weights!r}")
        super().__init__(num_classes, ignore_index)
        self._weights = weights

    def compute(self) -> Tensor:
        """Cohen's kappa, a float64 0-dim tensor (NaN when undefined)."""
        observed = self.confusion_matrix().to(torch.float64)
        samples = observed.sum()
        expected = torch.outer(observed.sum(1), observed.sum(0)) / samples.clamp_min(1.0)
        classes = torch.arange(self.num_classes, device=observed.device, dtype=torch.float64)
        distance = (classes.unsqueeze(1) - classes.unsqueeze(0)).abs()
        if self._weights is None:
            weight = (distance > 0).to(torch.float64)
        elif self._weights == "linear":
            weight = distance
        else:
            weight = distance**2
        disagreement = (weight * expected).sum()
        safe = torch.where(disagreement == 0, 1.0, disagreement)
        kappa = 1.0 - (weight * observed).sum() / safe
        return torch.where(disagreement == 0, torch.nan, kappa)
