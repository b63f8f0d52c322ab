"""``confusion_count_metric()``: choose a problem, statistics and an average, then build."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Generic, Literal, Self, TypeAlias, overload

from torch import Tensor
from typing_extensions import TypeVar, deprecated  # PEP 696 defaults, PEP 702 (torch needs it)

from sidestream.metrics.classification._average import Average, check_zero_division
from sidestream.metrics.classification._problem import Problem, ProblemKind, check_ignore_index
from sidestream.metrics.classification.confusion_count import ConfusionCountMetric
from sidestream.metrics.classification.samplewise import SamplewiseConfusionCountMetric
from sidestream.metrics.classification.statistics import (
    Accuracy,
    FBeta,
    Precision,
    Recall,
    Specificity,
    Statistic,
)

__all__ = [
    "ConfusionCountMetricBuilder",
    "NoStatistic",
    "confusion_count_metric",
    "confusion_matrix_metric",
]


class NoStatistic:
    """For type checkers: a builder with no statistic yet, which ``build()`` refuses."""


# For type checkers only (nothing reads them at run time). Statistics: what the metric's
# compute() will return (NoStatistic before the first with_*, Tensor after one, dict[str,
# Tensor] after more), so that `.with_f1().macro().build().compute()` is a Tensor without a
# cast. Multidim: multidim_average's value, which decides the class build() makes. Both
# covariant: a one-statistic builder is also a "some statistics" one to the overloads below.
Statistics = TypeVar("Statistics", covariant=True, default=Tensor | dict[str, Tensor])
Multidim = TypeVar("Multidim", covariant=True, default=str)
_Kind = TypeVar("_Kind")


@dataclass(frozen=True)
class ConfusionCountMetricBuilder(Generic[Statistics, Multidim]):
    """An immutable description of a confusion-count metric; every method returns a new one.

    Pick exactly one problem (``binary``, ``multiclass``, ``multilabel``), one or more
    statistics (``with_*``), at most one average (``micro``, ``macro`` (the default),
    ``weighted``, ``per_class``; binary problems take none), then ``build()``.

    To a type checker the builder also tracks what ``compute()`` will return: a ``Tensor``
    for one statistic, a ``dict[str, Tensor]`` for several (adding the same statistic twice,
    which is ignored, is typed as several).
    """

    problem: Problem | None = None
    statistics: tuple[Statistic, ...] = ()
    average: Average | None = None
    ignore_index: int | None = None
    zero_division: float = 0.0
    multidim_average: str = "global"

    def _with_problem(self, problem: Problem) -> Self:
        if self.problem is not None:
            raise ValueError(f"problem already chosen ({self.problem.kind.value}); pick one")
        return dataclasses.replace(self, problem=problem)

    def binary(self, threshold: float = 0.5, *, logits: bool = False) -> Self:
        """Binary problem: one score per element, positive when ``score >= threshold``.

        Args:
            threshold: Probability threshold in [0, 1].
            logits: Scores are logits; a sigmoid turns them into probabilities. Without it,
                floating scores must lie in [0, 1] (a value check).
        """
        return self._with_problem(
            Problem(ProblemKind.BINARY, 1, threshold, logits, ignore_index=self.ignore_index)
        )

    def multiclass(self, num_classes: int, top_k: int | None = None) -> Self:
        """Multiclass problem with ``num_classes`` classes.

        Args:
            num_classes: The number of classes C (>= 2).
            top_k: Count a prediction as the ``top_k`` highest scores (default 1: argmax).
        """
        top = 1 if top_k is None else top_k
        return self._with_problem(
            Problem(ProblemKind.MULTICLASS, num_classes, top_k=top, ignore_index=self.ignore_index)
        )

    def multilabel(self, num_labels: int, threshold: float = 0.5, *, logits: bool = False) -> Self:
        """Multilabel problem: ``num_labels`` independent binary labels in the last dim.

        Args:
            num_labels: The number of labels L.
            threshold: Probability threshold in [0, 1].
            logits: Scores are logits (see ``binary``).
        """
        return self._with_problem(
            Problem(
                ProblemKind.MULTILABEL,
                num_labels,
                threshold,
                logits,
                ignore_index=self.ignore_index,
            )
        )

    @overload
    def with_statistic(self: _Empty[_Kind], statistic: Statistic) -> _One[_Kind]: ...
    @overload
    def with_statistic(self: _Some[_Kind], statistic: Statistic) -> _Several[_Kind]: ...
    def with_statistic(self, statistic: Statistic) -> ConfusionCountMetricBuilder[Any, Any]:
        """Add any ``Statistic`` (a built-in one or your own); the same one again is ignored.

        Raises:
            TypeError: If ``statistic`` does not follow the ``Statistic`` protocol.
            ValueError: If another statistic already has its name (one key per name).
        """
        return self._adding(statistic)

    def _adding(self, statistic: Statistic) -> ConfusionCountMetricBuilder[Any, Any]:
        """``with_statistic``'s work, without the overloads (the ``with_*`` methods call it)."""
        if not isinstance(statistic, Statistic):
            raise TypeError(f"statistic: expected a Statistic (name and ratio), got {statistic!r}")
        for chosen in self.statistics:
            if chosen.name != statistic.name:
                continue
            if _same_statistic(chosen, statistic):
                return self
            raise ValueError(
                f"statistic: the name {statistic.name!r} is taken by {chosen!r}, so "
                f"{statistic!r} would be dropped; give each statistic its own name"
            )
        return dataclasses.replace(self, statistics=(*self.statistics, statistic))

    @overload
    def with_accuracy(self: _Empty[_Kind]) -> _One[_Kind]: ...
    @overload
    def with_accuracy(self: _Some[_Kind]) -> _Several[_Kind]: ...
    def with_accuracy(self) -> ConfusionCountMetricBuilder[Any, Any]:
        """Add ``"accuracy"`` (multiclass per class: recall; see the docs)."""
        return self._adding(Accuracy())

    @overload
    def with_precision(self: _Empty[_Kind]) -> _One[_Kind]: ...
    @overload
    def with_precision(self: _Some[_Kind]) -> _Several[_Kind]: ...
    def with_precision(self) -> ConfusionCountMetricBuilder[Any, Any]:
        """Add ``"precision"``: tp / (tp + fp)."""
        return self._adding(Precision())

    @overload
    def with_recall(self: _Empty[_Kind]) -> _One[_Kind]: ...
    @overload
    def with_recall(self: _Some[_Kind]) -> _Several[_Kind]: ...
    def with_recall(self) -> ConfusionCountMetricBuilder[Any, Any]:
        """Add ``"recall"``: tp / (tp + fn)."""
        return self._adding(Recall())

    @overload
    def with_f1(self: _Empty[_Kind]) -> _One[_Kind]: ...
    @overload
    def with_f1(self: _Some[_Kind]) -> _Several[_Kind]: ...
    def with_f1(self) -> ConfusionCountMetricBuilder[Any, Any]:
        """Add ``"f1"``: 2 tp / (2 tp + fn + fp)."""
        return self._adding(FBeta(1.0))

    @overload
    def with_fbeta(self: _Empty[_Kind], beta: float) -> _One[_Kind]: ...
    @overload
    def with_fbeta(self: _Some[_Kind], beta: float) -> _Several[_Kind]: ...
    def with_fbeta(self, beta: float) -> ConfusionCountMetricBuilder[Any, Any]:
        """Add ``f"f{beta:g}"``: (1 + b²) tp / ((1 + b²) tp + b² fn + fp).

        Args:
            beta: Weight of recall against precision, finite and > 0.
        """
        if isinstance(beta, bool) or not isinstance(beta, int | float):
            # True would be beta = 1 (F1), silently, as no other number argument takes it.
            raise TypeError(f"beta: expected a finite number > 0, got {beta!r}")
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"beta: expected a finite number > 0, got {beta!r}")
        return self._adding(FBeta(float(beta)))

    @overload
    def with_specificity(self: _Empty[_Kind]) -> _One[_Kind]: ...
    @overload
    def with_specificity(self: _Some[_Kind]) -> _Several[_Kind]: ...
    def with_specificity(self) -> ConfusionCountMetricBuilder[Any, Any]:
        """Add ``"specificity"``: tn / (tn + fp)."""
        return self._adding(Specificity())

    def _with_average(self, average: Average) -> Self:
        if self.average is not None and self.average != average:
            raise ValueError(
                f"average already chosen ({self.average}); build one metric per average"
            )
        return dataclasses.replace(self, average=average)

    def micro(self) -> Self:
        """Statistics of the counts summed over classes (torchmetrics' ``average="micro"``)."""
        return self._with_average("micro")

    def macro(self) -> Self:
        """Unweighted mean of per-class statistics (the default)."""
        return self._with_average("macro")

    def weighted(self) -> Self:
        """Mean of per-class statistics weighted by each class's support (tp + fn)."""
        return self._with_average("weighted")

    def per_class(self) -> Self:
        """One value per class, shape (C,) (torchmetrics' ``average="none"``)."""
        return self._with_average("none")

    # One overload per result, none for NoStatistic: a type checker refuses the build() of a
    # builder without a statistic, as the builder does at run time.
    @overload
    def build(self: _One[Literal["global"]]) -> ConfusionCountMetric[Tensor]: ...
    @overload
    def build(self: _Several[Literal["global"]]) -> ConfusionCountMetric[dict[str, Tensor]]: ...
    @overload
    def build(self: _One[Literal["samplewise"]]) -> SamplewiseConfusionCountMetric[Tensor]: ...
    @overload
    def build(
        self: _Several[Literal["samplewise"]],
    ) -> SamplewiseConfusionCountMetric[dict[str, Tensor]]: ...
    @overload
    def build(self: _Some[str]) -> ConfusionCountMetric | SamplewiseConfusionCountMetric: ...
    def build(self) -> ConfusionCountMetric[Any] | SamplewiseConfusionCountMetric[Any]:
        """The metric, on CPU (move it with ``.to(device)``).

        Raises:
            ValueError: Without a problem or a statistic, or with an average on a binary
                problem.
        """
        if self.problem is None:
            raise ValueError("choose a problem first: .binary(), .multiclass(C) or .multilabel(L)")
        if not self.statistics:
            raise ValueError("choose at least one statistic, e.g. .with_accuracy()")
        if self.problem.kind is ProblemKind.BINARY and self.average is not None:
            raise ValueError(
                "binary problems report the positive class and take no average; use "
                ".multiclass(2) for per-class or averaged values over both classes"
            )
        average = self.average or "macro"
        if self.multidim_average == "samplewise":
            return SamplewiseConfusionCountMetric(
                self.problem, self.statistics, average, self.zero_division
            )
        return ConfusionCountMetric(self.problem, self.statistics, average, self.zero_division)


@overload
def confusion_count_metric(
    *,
    ignore_index: int | None = None,
    zero_division: float = 0.0,
    multidim_average: Literal["global"] = "global",
) -> ConfusionCountMetricBuilder[NoStatistic, Literal["global"]]: ...
@overload
def confusion_count_metric(
    *,
    ignore_index: int | None = None,
    zero_division: float = 0.0,
    multidim_average: Literal["samplewise"],
) -> ConfusionCountMetricBuilder[NoStatistic, Literal["samplewise"]]: ...
@overload
def confusion_count_metric(
    *,
    ignore_index: int | None = None,
    zero_division: float = 0.0,
    multidim_average: Literal["global", "samplewise"],
) -> ConfusionCountMetricBuilder[NoStatistic, str]: ...
def confusion_count_metric(
    *,
    ignore_index: int | None = None,
    zero_division: float = 0.0,
    multidim_average: Literal["global", "samplewise"] = "global",
) -> ConfusionCountMetricBuilder[NoStatistic, str]:
    """Start building an accuracy / precision / recall / F-beta / specificity metric.

    Args:
        ignore_index: Target value whose elements are skipped (given weight 0), e.g. -100 for
            padding. Multiclass predictions of such elements are skipped too.
        zero_division: The value of a ratio whose denominator is 0: 0.0 (default, like
            scikit-learn), 1.0, or NaN (left out of macro and weighted means).
        multidim_average: ``global`` (counts over every position of every sample) or
            ``samplewise`` (each sample's statistic from its own counts, averaged over the
            samples; builds a ``SamplewiseConfusionCountMetric``).

    Example:
        >>> metric = confusion_count_metric().multiclass(3).with_f1().macro().build()
        >>> metric.update(torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]]), torch.tensor([0, 2]))
        >>> metric.compute()
        tensor(0.3333, dtype=torch.float64)
    """
    check_ignore_index(ignore_index)
    check_zero_division(zero_division)
    if multidim_average not in ("global", "samplewise"):
        raise ValueError(
            f"multidim_average: expected 'global' or 'samplewise', got {multidim_average!r}"
        )
    return ConfusionCountMetricBuilder(
        ignore_index=ignore_index,
        zero_division=zero_division,
        multidim_average=multidim_average,
    )


@deprecated(
    "confusion_matrix_metric() is now confusion_count_metric(); the C x C matrix is "
    "MulticlassConfusionMatrixMetric. Its statistics follow scikit-learn, not d9d's builder: "
    "per-class accuracy is recall, zero_division defaults to 0.0 (d9d: NaN), top_k averages "
    "macro unless .micro(), and the threshold compares with >= (see 'Coming from d9d' in "
    "the docs)"
)
def confusion_matrix_metric(
    *, ignore_index: int | None = None, zero_division: float = 0.0
) -> ConfusionCountMetricBuilder[NoStatistic, Literal["global"]]:
    """Deprecated name of ``confusion_count_metric`` (it never built a confusion matrix).

    Kept for one release so existing code keeps running: each call warns
    (``DeprecationWarning``), and type checkers flag its uses (PEP 702).
    """
    return confusion_count_metric(ignore_index=ignore_index, zero_division=zero_division)


# The builder types the with_* methods' overloads name.
_Empty: TypeAlias = ConfusionCountMetricBuilder[NoStatistic, _Kind]
_One: TypeAlias = ConfusionCountMetricBuilder[Tensor, _Kind]
_Some: TypeAlias = ConfusionCountMetricBuilder[Tensor | dict[str, Tensor], _Kind]
_Several: TypeAlias = ConfusionCountMetricBuilder[dict[str, Tensor], _Kind]


def _same_statistic(chosen: Statistic, statistic: Statistic) -> bool:
    """Whether ``statistic`` repeats ``chosen``: equal, or with equal attributes.

    The attributes count for a class that defines no equality: ``TopK(1)`` is not ``TopK(3)``,
    and two ``NegativePredictiveValue()`` are one.
    """
    if type(chosen) is not type(statistic):
        return False
    if type(statistic).__eq__ is not object.__eq__:
        return bool(chosen == statistic)
    try:
        return bool(vars(chosen) == vars(statistic))
    except (TypeError, RuntimeError):  # no __dict__, or attributes that do not compare
        return chosen is statistic
