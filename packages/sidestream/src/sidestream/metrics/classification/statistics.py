"""The statistics a confusion-count metric reports, one small class each.

A statistic is anything with a ``name`` and a ``ratio`` of per-class counts (the ``Statistic``
protocol), so users add their own without editing the package::

    @dataclass(frozen=True)
    class NegativePredictiveValue:
        name: str = "npv"

        def ratio(self, kind: ProblemKind, counts: Counts) -> tuple[Tensor, Tensor]:
            return counts.tn, counts.tn + counts.fn

    metric = confusion_count_metric().binary().with_statistic(NegativePredictiveValue()).build()

Micro averaging sums numerator and denominator over classes, so a ratio must be a ratio of
sums of counts for ``micro`` to mean what it says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from torch import Tensor

from sidestream.metrics.classification._problem import ProblemKind

__all__ = [
    "Accuracy",
    "Counts",
    "FBeta",
    "Precision",
    "Recall",
    "Specificity",
    "Statistic",
]


class Counts(NamedTuple):
    """Per-class confusion counts as float64 tensors of shape ``(C,)``."""

    tp: Tensor
    fp: Tensor
    fn: Tensor
    tn: Tensor


@runtime_checkable
class Statistic(Protocol):
    """A per-class ratio of confusion counts.

    Attributes:
        name: The key of the statistic in ``compute()``'s dict; unique within a metric.
    """

    @property
    def name(self) -> str:
        """The key of the statistic in ``compute()``'s dict."""
        ...

    def ratio(self, kind: ProblemKind, counts: Counts) -> tuple[Tensor, Tensor]:
        """Per-class ``(numerator, denominator)``; summing both over classes gives micro."""
        ...


@dataclass(frozen=True)
class Accuracy:
    """Correct over all: ``(tp + tn) / total`` per label; for multiclass, per-class recall.

    Per-class accuracy of a multiclass problem is its recall, so micro gives the fraction of
    samples classified correctly and macro the balanced accuracy (torchmetrics' convention).
    """

    name: str = "accuracy"

    def ratio(self, kind: ProblemKind, counts: Counts) -> tuple[Tensor, Tensor]:
        """See the class docstring."""
        tp, fp, fn, tn = counts
        if kind is ProblemKind.MULTICLASS:
            return tp, tp + fn
        return tp + tn, tp + tn + fp + fn


@dataclass(frozen=True)
class Precision:
    """``tp / (tp + fp)``."""

    name: str = "precision"

    def ratio(self, kind: ProblemKind, counts: Counts) -> tuple[Tensor, Tensor]:
        """See the class docstring."""
        return counts.tp, counts.tp + counts.fp


@dataclass(frozen=True)
class Recall:
    """``tp / (tp + fn)`` (sensitivity)."""

    name: str = "recall"

    def ratio(self, kind: ProblemKind, counts: Counts) -> tuple[Tensor, Tensor]:
        """See the class docstring."""
        return counts.tp, counts.tp + counts.fn


@dataclass(frozen=True)
class Specificity:
    """``tn / (tn + fp)``."""

    name: str = "specificity"

    def ratio(self, kind: ProblemKind, counts: Counts) -> tuple[Tensor, Tensor]:
        """See the class docstring."""
        return counts.tn, counts.tn + counts.fp


@dataclass(frozen=True)
class FBeta:
    """``(1 + b²) tp / ((1 + b²) tp + b² fn + fp)``; named ``f1``, ``f2``, ``f0.5``...

    Attributes:
        beta: Weight of recall against precision, finite and > 0.
    """

    beta: float = 1.0

    def __post_init__(self) -> None:
        # The builder's with_fbeta checked beta, an FBeta made directly (with_statistic, a
        # ConfusionCountMetric's statistics) did not: -1 was the F1 value under the name
        # "f-1", NaN and inf made every value NaN, and "2" failed in ``name``'s format.
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float):
            raise TypeError(f"beta: expected a finite number > 0, got {self.beta!r}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta: expected a finite number > 0, got {self.beta!r}")

    @property
    def name(self) -> str:
        """``f{beta:g}``: ``"f1"``, ``"f2"``, ``"f0.5"``; every digit where ``g`` rounds."""
        short = f"{self.beta:g}"
        # Two betas must never share a name: "f2" for 2.0000001 would stand for beta 2.
        return f"f{short}" if float(short) == self.beta else f"f{self.beta!r}"

    def ratio(self, kind: ProblemKind, counts: Counts) -> tuple[Tensor, Tensor]:
        """See the class docstring."""
        weight = 1.0 + self.beta**2
        return weight * counts.tp, weight * counts.tp + self.beta**2 * counts.fn + counts.fp


def checked_ratio(statistic: Statistic, kind: ProblemKind, counts: Counts) -> tuple[Tensor, Tensor]:
    """``statistic.ratio(kind, counts)``, refused unless both parts have the counts' shape.

    A custom statistic's ``(1,)`` numerator over ``(C,)`` denominators would broadcast into
    numbers that mean nothing.

    Raises:
        ValueError: If ``ratio`` returns anything but two tensors of the counts' shape.
    """
    parts = statistic.ratio(kind, counts)
    shape = counts.tp.shape
    if not (
        isinstance(parts, tuple)
        and len(parts) == 2
        and all(isinstance(part, Tensor) and part.shape == shape for part in parts)
    ):
        found = parts if not isinstance(parts, tuple) else tuple(map(_shape_or_type, parts))
        raise ValueError(
            f"statistic {statistic.name!r}: ratio must return (numerator, denominator), two "
            f"tensors of the counts' shape {tuple(shape)}; got {found}"
        )
    return parts


def _shape_or_type(part: object) -> object:
    return tuple(part.shape) if isinstance(part, Tensor) else type(part).__name__
