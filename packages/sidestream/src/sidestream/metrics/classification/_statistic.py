"""One statistic of the confusion counts and how it turns into a value."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sidestream.metrics.classification._aggregation import Aggregation
from sidestream.metrics.classification._problem import ProblemKind

__all__ = ["Statistic"]


@dataclass(frozen=True)
class Statistic:
    """A ratio of confusion counts: accuracy, precision, recall, F-beta or specificity.

    Attributes:
        kind: ``"accuracy"``, ``"precision"``, ``"recall"``, ``"fbeta"`` or ``"specificity"``.
        beta: The F-score's beta (``kind == "fbeta"`` only).
    """

    kind: str
    beta: float = 1.0

    @property
    def name(self) -> str:
        """The key in ``compute()``'s dict: ``"f1"``, ``"f2"``, ``"f0.5"``, ``"precision"``..."""
        return f"f{self.beta:g}" if self.kind == "fbeta" else self.kind

    def ratio(
        self, problem: ProblemKind, tp: Tensor, fp: Tensor, fn: Tensor, tn: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Per-class ``(numerator, denominator)``; summing both over classes gives micro."""
        if self.kind == "precision":
            return tp, tp + fp
        if self.kind == "recall":
            return tp, tp + fn
        if self.kind == "specificity":
            return tn, tn + fp
        if self.kind == "fbeta":
            weight = 1.0 + self.beta**2
            return weight * tp, weight * tp + self.beta**2 * fn + fp
        if problem is ProblemKind.MULTICLASS:
            # Per-class accuracy of a multiclass problem is its recall: micro gives the fraction
            # of samples classified correctly, macro the balanced accuracy.
            return tp, tp + fn
        return tp + tn, tp + tn + fp + fn

    def value(
        self,
        problem: ProblemKind,
        aggregation: Aggregation,
        counts: tuple[Tensor, Tensor, Tensor, Tensor],
        zero_division: float,
    ) -> Tensor:
        """The aggregated statistic, in float64, from int64 ``(tp, fp, fn, tn)`` of shape (C,)."""
        tp, fp, fn, tn = (count.to(torch.float64) for count in counts)
        numerator, denominator = self.ratio(problem, tp, fp, fn, tn)
        if aggregation is Aggregation.MICRO:
            return _divide(numerator.sum(), denominator.sum(), zero_division)
        per_class = _divide(numerator, denominator, zero_division)
        if aggregation is Aggregation.PER_CLASS:
            return per_class
        if aggregation is Aggregation.WEIGHTED:
            weights = tp + fn
        elif problem is ProblemKind.MULTICLASS:
            # Like scikit-learn's default labels: only classes seen in targets or predictions.
            weights = ((tp + fp + fn) > 0).to(torch.float64)
        else:
            weights = torch.ones_like(tp)
        if math.isnan(zero_division):
            weights = torch.where(per_class.isnan(), 0.0, weights)
        total = weights.sum()
        mean = torch.where(weights > 0, per_class, 0.0).mul(weights).sum() / total.clamp_min(1e-300)
        return torch.where(total > 0, mean, zero_division)


def _divide(numerator: Tensor, denominator: Tensor, zero_division: float) -> Tensor:
    safe = torch.where(denominator == 0, 1.0, denominator)
    return torch.where(denominator == 0, zero_division, numerator / safe)
