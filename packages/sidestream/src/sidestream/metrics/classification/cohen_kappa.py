"""Cohen's kappa from a confusion matrix."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from sidestream.metrics._ordered_sum import ordered_sum
from sidestream.metrics.classification._problem import Problem, ProblemKind, check_problem
from sidestream.metrics.classification.confusion_matrix import ConfusionMatrixMetric

__all__ = ["BinaryCohenKappaMetric", "CohenKappaMetric", "MulticlassCohenKappaMetric"]

Weights = Literal["linear", "quadratic"]
_WEIGHTINGS = (None, "linear", "quadratic")


class CohenKappaMetric(ConfusionMatrixMetric):
    """Cohen's kappa between targets and predictions, from the confusion matrix.

    Computes, in float64, ``1 - sum(w * observed) / sum(w * expected)`` where ``expected`` is
    the outer product of the true and predicted class counts over the total, and ``w`` is
    ``1 - I`` (no weighting), ``|i - j|`` (``"linear"``) or ``(i - j)²`` (``"quadratic"``). A
    zero denominator (no data, or both raters always answering the same single class) gives NaN.

    The weights use the class indices ``0 .. C-1`` whether or not a class occurs, as
    torchmetrics and ``sklearn.metrics.cohen_kappa_score(..., labels=range(C))``. Called
    without ``labels=``, scikit-learn numbers only the classes present in the data, so with
    ``"linear"`` or ``"quadratic"`` weights and a middle class absent (say 0 and 2 present, 1
    not) it puts 0 and 2 at distance 1 instead of 2 and its value differs.

    Args:
        problem: Binary or multiclass; its threshold, logits and ignore_index apply. An int
            ``C`` is short for ``Problem(ProblemKind.MULTICLASS, C)``.
        weights: ``None``, ``"linear"`` or ``"quadratic"`` disagreement weights.
    """

    def __init__(self, problem: Problem | int, weights: Weights | None = None) -> None:
        if isinstance(problem, int) and not isinstance(problem, bool):
            problem = Problem(ProblemKind.MULTICLASS, problem)
        problem = check_problem(problem, "CohenKappa")
        if weights not in _WEIGHTINGS:
            raise ValueError(f"weights: expected one of {_WEIGHTINGS}, got {weights!r}")
        if problem.kind is ProblemKind.MULTILABEL:
            raise ValueError("problem: Cohen's kappa takes a binary or multiclass problem")
        super().__init__(problem)
        self._weights = weights

    def _compute_settings(self) -> str:
        return f"{super()._compute_settings()} weights={self._weights}"

    def compute(self) -> Tensor:
        """Cohen's kappa, a float64 0-dim tensor (NaN when undefined)."""
        observed = self._matrix_view().to(torch.float64)
        samples = observed.sum()
        expected = torch.outer(observed.sum(1), observed.sum(0)) / samples.clamp_min(1.0)
        size = observed.shape[0]
        classes = torch.arange(size, device=observed.device, dtype=torch.float64)
        distance = (classes.unsqueeze(1) - classes.unsqueeze(0)).abs()
        if self._weights is None:
            weight = (distance > 0).to(torch.float64)
        elif self._weights == "linear":
            weight = distance
        else:
            weight = distance**2
        # Fractions (whole-number weights and counts below are exact in any order).
        disagreement = ordered_sum((weight * expected).reshape(-1))
        safe = torch.where(disagreement == 0, 1.0, disagreement)
        kappa = 1.0 - (weight * observed).sum() / safe
        return torch.where(disagreement == 0, torch.nan, kappa)


class BinaryCohenKappaMetric(CohenKappaMetric):
    """Cohen's kappa of thresholded binary predictions against 0/1 targets.

    Args:
        threshold: Probability threshold in [0, 1].
        weights: ``None``, ``"linear"`` or ``"quadratic"`` (all equal for two classes).
        logits: Scores are logits (a sigmoid is applied).
        ignore_index: Target value whose elements are skipped.

    Example:
        >>> metric = BinaryCohenKappaMetric()
        >>> metric.update(torch.tensor([0.1, 0.9, 0.8, 0.7]), torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    def __init__(
        self,
        threshold: float = 0.5,
        weights: Weights | None = None,
        *,
        logits: bool = False,
        ignore_index: int | None = None,
    ) -> None:
        problem = Problem(ProblemKind.BINARY, 1, threshold, logits, ignore_index=ignore_index)
        super().__init__(problem, weights)


class MulticlassCohenKappaMetric(CohenKappaMetric):
    """Cohen's kappa of multiclass predictions (``sklearn.metrics.cohen_kappa_score``).

    Args:
        num_classes: The number of classes C (>= 2).
        weights: ``None``, ``"linear"`` or ``"quadratic"``.
        ignore_index: Target value whose elements are skipped.

    Example:
        >>> metric = MulticlassCohenKappaMetric(2)
        >>> metric.update(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    def __init__(
        self,
        num_classes: int,
        weights: Weights | None = None,
        *,
        ignore_index: int | None = None,
    ) -> None:
        problem = Problem(ProblemKind.MULTICLASS, num_classes, ignore_index=ignore_index)
        super().__init__(problem, weights)
