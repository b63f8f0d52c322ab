"""``confusion_matrix_metric()``: choose a problem, statistics and an aggregation, then build."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sidestream.metrics.classification._aggregation import Aggregation
from sidestream.metrics.classification._problem import Problem, ProblemKind
from sidestream.metrics.classification._statistic import Statistic
from sidestream.metrics.classification.confusion_count import ConfusionCountMetric

__all__ = ["ConfusionMatrixMetricBuilder", "confusion_matrix_metric"]


@dataclass(frozen=True)
class ConfusionMatrixMetricBuilder:
    """An immutable description of a confusion-count metric; every method returns a new one.

    Pick exactly one problem (``binary``, ``multiclass``, ``multilabel``), one or more
    statistics (``with_*``), at most one aggregation (``micro``, ``macro`` (the default),
    ``weighted``, ``per_class``; binary problems take none), then ``build()``.
    """

    problem: Problem | None = None
    statistics: tuple[Statistic, ...] = ()
    aggregation: Aggregation | None = None
    ignore_index: int | None = None
    zero_division: float = 0.0

    def _with_problem(self, problem: Problem) -> ConfusionMatrixMetricBuilder:
        if self.problem is not None:
            raise ValueError(f"problem already chosen ({self.problem.kind.value}); pick one")
        return dataclasses.replace(self, problem=problem)

    def binary(
        self, threshold: float = 0.5, *, logits: bool = False
    ) -> ConfusionMatrixMetricBuilder:
        """Binary problem: one score per element, positive when ``score >= threshold``.

        Args:
            threshold: Probability threshold in [0, 1].
            logits: Scores are logits; a sigmoid turns them into probabilities. Without it,
                floating scores must lie in [0, 1] (a value check).
        """
        return self._with_problem(Problem(ProblemKind.BINARY, 1, threshold, logits))

    def multiclass(
        self, num_classes: int, top_k: int | None = None
    ) -> ConfusionMatrixMetricBuilder:
        """Multiclass problem with ``num_classes`` classes.

        Args:
            num_classes: The number of classes C (>= 2).
            top_k: Count a prediction as the ``top_k`` highest scores (default 1: argmax).
        """
        return self._with_problem(
            Problem(ProblemKind.MULTICLASS, num_classes, top_k=1 if top_k is None else top_k)
        )

    def multilabel(
        self, num_labels: int, threshold: float = 0.5, *, logits: bool = False
    ) -> ConfusionMatrixMetricBuilder:
        """Multilabel problem: ``num_labels`` independent binary labels in the last dim.

        Args:
            num_labels: The number of labels L.
            threshold: Probability threshold in [0, 1].
            logits: Scores are logits (see ``binary``).
        """
        return self._with_problem(Problem(ProblemKind.MULTILABEL, num_labels, threshold, logits))

    def _with_statistic(self, statistic: Statistic) -> ConfusionMatrixMetricBuilder:
        if any(chosen.name == statistic.name for chosen in self.statistics):
            return self
        return dataclasses.replace(self, statistics=(*self.statistics, statistic))

    def with_accuracy(self) -> ConfusionMatrixMetricBuilder:
        """Add ``"accuracy"`` (multiclass per class: recall; see the docs)."""
        return self._with_statistic(Statistic("accuracy"))

    def with_precision(self) -> ConfusionMatrixMetricBuilder:
        """Add ``"precision"``: tp / (tp + fp)."""
        return self._with_statistic(Statistic("precision"))

    def with_recall(self) -> ConfusionMatrixMetricBuilder:
        """Add ``"recall"``: tp / (tp + fn)."""
        return self._with_statistic(Statistic("recall"))

    def with_f1(self) -> ConfusionMatrixMetricBuilder:
        """Add ``"f1"``: 2 tp / (2 tp + fn + fp)."""
        return self._with_statistic(Statistic("fbeta", 1.0))

    def with_fbeta(self, beta: float) -> ConfusionMatrixMetricBuilder:
        """Add ``f"f{beta:g}"``: (1 + b²) tp / ((1 + b²) tp + b² fn + fp).

        Args:
            beta: Weight of recall against precision, finite and > 0.
        """
        if not (isinstance(beta, int | float) and math.isfinite(beta) and beta > 0):
            raise ValueError(f"beta: expected a finite number > 0, got {beta!r}")
        return self._with_statistic(Statistic("fbeta", float(beta)))

    def with_specificity(self) -> ConfusionMatrixMetricBuilder:
        """Add ``"specificity"``: tn / (tn + fp)."""
        return self._with_statistic(Statistic("specificity"))

    def _with_aggregation(self, aggregation: Aggregation) -> ConfusionMatrixMetricBuilder:
        if self.aggregation is not None and self.aggregation is not aggregation:
            raise ValueError(
                f"aggregation already chosen ({self.aggregation.value}); build one metric per "
                "aggregation"
            )
        return dataclasses.replace(self, aggregation=aggregation)

    def micro(self) -> ConfusionMatrixMetricBuilder:
        """Statistics of the counts summed over classes."""
        return self._with_aggregation(Aggregation.MICRO)

    def macro(self) -> ConfusionMatrixMetricBuilder:
        """Unweighted mean of per-class statistics (the default)."""
        return self._with_aggregation(Aggregation.MACRO)

    def weighted(self) -> ConfusionMatrixMetricBuilder:
        """Mean of per-class statistics weighted by each class's support (tp + fn)."""
        return self._with_aggregation(Aggregation.WEIGHTED)

    def per_class(self) -> ConfusionMatrixMetricBuilder:
        """One value per class, shape (C,)."""
        return self._with_aggregation(Aggregation.PER_CLASS)

    def build(self) -> ConfusionCountMetric:
        """The metric, on CPU (move it with ``.to(device)``).

        Raises:
            ValueError: Without a problem or a statistic, or with an aggregation on a binary
                problem.
        """
        if self.problem is None:
            raise ValueError("choose a problem first: .binary(), .multiclass(C) or .multilabel(L)")
        if not self.statistics:
            raise ValueError("choose at least one statistic, e.g. .with_accuracy()")
        if self.problem.kind is ProblemKind.BINARY and self.aggregation is not None:
            raise ValueError(
                "binary problems report the positive class and take no aggregation; use "
                ".multiclass(2) for per-class or averaged values over both classes"
            )
        return ConfusionCountMetric(
            self.problem,
            self.statistics,
            self.aggregation or Aggregation.MACRO,
            ignore_index=self.ignore_index,
            zero_division=self.zero_division,
        )


def confusion_matrix_metric(
    *, ignore_index: int | None = None, zero_division: float = 0.0
) -> ConfusionMatrixMetricBuilder:
    """Start building an accuracy / precision / recall / F-beta / specificity metric.

    Args:
        ignore_index: Target value whose elements are skipped (given weight 0), e.g. -100 for
            padding. Multiclass predictions of such elements are skipped too.
        zero_division: The value of a ratio whose denominator is 0: 0.0 (default, like
            scikit-learn), 1.0, or NaN (left out of macro and weighted means).

    Example:
        >>> metric = confusion_matrix_metric().multiclass(3).with_f1().macro().build()
        >>> metric.update(torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]]), torch.tensor([0, 2]))
        >>> metric.compute()
        tensor(0.3333, dtype=torch.float64)
    """
    return ConfusionMatrixMetricBuilder(ignore_index=ignore_index, zero_division=zero_division)
