"""Matthews correlation coefficient from a confusion matrix."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream.metrics.classification._problem import Problem, ProblemKind, check_problem
from sidestream.metrics.classification.confusion_matrix import ConfusionMatrixMetric

__all__ = [
    "BinaryMatthewsCorrCoefMetric",
    "MatthewsCorrCoefMetric",
    "MulticlassMatthewsCorrCoefMetric",
    "MultilabelMatthewsCorrCoefMetric",
]


def matthews_corrcoef(matrix: Tensor) -> Tensor:
    """Gorodkin's R_K of a square count matrix (rows true), float64; 0.0 when undefined.

    ``(c s - t.p) / sqrt((s² - p.p)(s² - t.t))`` with ``c`` the correct count, ``s`` the total,
    ``t`` and ``p`` the true and predicted class counts, as ``sklearn.metrics.matthews_corrcoef``.
    """
    counts = matrix.to(torch.float64)
    true_counts = counts.sum(1)
    predicted_counts = counts.sum(0)
    samples = counts.sum()
    covariance = counts.trace() * samples - true_counts @ predicted_counts
    spread_predicted = samples * samples - predicted_counts @ predicted_counts
    spread_true = samples * samples - true_counts @ true_counts
    # One root of the product, as scikit-learn (a perfect prediction is then exactly 1: two
    # roots rounded apart gave 1.0000000000000002); one at a time only where the product
    # overflows float64 (past ~1e77 samples²).
    product = spread_predicted * spread_true
    denominator = torch.where(
        torch.isfinite(product), product.sqrt(), spread_predicted.sqrt() * spread_true.sqrt()
    )
    safe = torch.where(denominator == 0, 1.0, denominator)
    return torch.where(denominator == 0, 0.0, covariance / safe).clamp(-1.0, 1.0)


class MatthewsCorrCoefMetric(ConfusionMatrixMetric):
    """Matthews correlation coefficient of any problem, from its confusion matrix.

    Binary: the ``2 x 2`` matrix; multiclass: the ``C x C`` matrix (Gorodkin's R_K);
    multilabel: the sum of the per-label ``2 x 2`` matrices (torchmetrics'
    ``MultilabelMatthewsCorrCoef``). A zero denominator (one class only, or no data) gives 0.0,
    as in scikit-learn (torchmetrics has its own limits for some binary corner cases).

    ``confusion_matrix()`` still returns the matrix.

    Args:
        problem: The problem; its threshold, logits and ignore_index apply. An int ``C`` is
            short for ``Problem(ProblemKind.MULTICLASS, C)``.
    """

    def __init__(self, problem: Problem | int) -> None:
        if isinstance(problem, int) and not isinstance(problem, bool):
            problem = Problem(ProblemKind.MULTICLASS, problem)
        super().__init__(check_problem(problem, "MatthewsCorrCoef"))

    def compute(self) -> Tensor:
        """The Matthews correlation coefficient, a float64 0-dim tensor in [-1, 1]."""
        matrix = self._matrix_view()
        if matrix.ndim == 3:
            matrix = matrix.sum(0)
        return matthews_corrcoef(matrix)


class BinaryMatthewsCorrCoefMetric(MatthewsCorrCoefMetric):
    """MCC of binary predictions (probabilities, logits or 0/1) against 0/1 targets.

    Args:
        threshold: Probability threshold in [0, 1].
        logits: Scores are logits (a sigmoid is applied).
        ignore_index: Target value whose elements are skipped.

    Example:
        >>> metric = BinaryMatthewsCorrCoefMetric()
        >>> metric.update(torch.tensor([0.1, 0.9, 0.8, 0.7]), torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()
        tensor(0.5774, dtype=torch.float64)
    """

    def __init__(
        self, threshold: float = 0.5, *, logits: bool = False, ignore_index: int | None = None
    ) -> None:
        super().__init__(
            Problem(ProblemKind.BINARY, 1, threshold, logits, ignore_index=ignore_index)
        )


class MulticlassMatthewsCorrCoefMetric(MatthewsCorrCoefMetric):
    """Multiclass MCC (``sklearn.metrics.matthews_corrcoef``); inputs as the confusion matrix.

    Args:
        num_classes: The number of classes C (>= 2).
        ignore_index: Target value whose elements are skipped.

    Example:
        >>> metric = MulticlassMatthewsCorrCoefMetric(2)
        >>> metric.update(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1]))
        >>> metric.compute()
        tensor(0.5774, dtype=torch.float64)
    """

    def __init__(self, num_classes: int, *, ignore_index: int | None = None) -> None:
        super().__init__(Problem(ProblemKind.MULTICLASS, num_classes, ignore_index=ignore_index))


class MultilabelMatthewsCorrCoefMetric(MatthewsCorrCoefMetric):
    """MCC of multilabel predictions over the summed per-label ``2 x 2`` matrices.

    Args:
        num_labels: The number of labels L.
        threshold: Probability threshold in [0, 1].
        logits: Scores are logits (a sigmoid is applied).
        ignore_index: Target value whose elements are skipped.
    """

    def __init__(
        self,
        num_labels: int,
        threshold: float = 0.5,
        *,
        logits: bool = False,
        ignore_index: int | None = None,
    ) -> None:
        super().__init__(
            Problem(
                ProblemKind.MULTILABEL, num_labels, threshold, logits, ignore_index=ignore_index
            )
        )
