"""What kind of classification problem a metric reads, and the argument checks it needs."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import Tensor

from sidestream._validation import check_int
from sidestream.state import MetricAccumulator

__all__ = [
    "Problem",
    "ProblemKind",
    "check_ignore_index",
    "check_int",
    "check_problem",
    "configure_states",
]


class ProblemKind(enum.Enum):
    """The three input conventions: one positive class, one of C classes, L independent labels."""

    BINARY = "binary"
    MULTICLASS = "multiclass"
    MULTILABEL = "multilabel"


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_ignore_index(ignore_index: object) -> None:
    """Raise unless ``ignore_index`` is ``None`` or an int that int64 targets can hold.

    ``TypeError`` for another type; ``ValueError`` past int64, which matched no target but
    failed the first update, far from its cause, with torch's "int too big to convert".
    """
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
    ):
        raise TypeError(f"ignore_index: expected an int or None, got {type(ignore_index)}")
    if ignore_index is not None and not _INT64_MIN <= ignore_index <= _INT64_MAX:
        raise ValueError(
            f"ignore_index: expected an int64 value (in [{_INT64_MIN}, {_INT64_MAX}]) or None, "
            f"got {ignore_index}"
        )


@dataclass(frozen=True)
class Problem:
    """A validated problem description, shared by every classification metric.

    Attributes:
        kind: Binary, multiclass or multilabel.
        num_classes: Classes (multiclass), labels (multilabel), or 1 (binary: the positive class).
        threshold: Binary and multilabel: a score at or above it counts as positive.
        logits: Scores are logits rather than probabilities in ``[0, 1]``: binary and multilabel
            scores go through a sigmoid, multiclass scores (ranking, calibration) a softmax.
        top_k: Multiclass: a prediction is the set of the ``top_k`` highest scores.
        ignore_index: Target value whose elements are skipped (weight 0), e.g. -100.
    """

    kind: ProblemKind
    num_classes: int = 1
    threshold: float = 0.5
    logits: bool = False
    top_k: int = 1
    ignore_index: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ProblemKind):
            # A string ("multiclass") was kept and failed the metric built on it with
            # "'str' object has no attribute 'value'", far from here.
            raise TypeError(
                f"kind: expected a ProblemKind (ProblemKind.BINARY, .MULTICLASS, .MULTILABEL), "
                f"got {self.kind!r}"
            )
        name = "num_labels" if self.kind is ProblemKind.MULTILABEL else "num_classes"
        check_int(name, self.num_classes, 2 if self.kind is ProblemKind.MULTICLASS else 1)
        _check_threshold_type(self.threshold)
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"threshold: expected a probability in [0, 1], got {self.threshold}")
        if not isinstance(self.logits, bool):
            raise TypeError(f"logits: expected a bool, got {type(self.logits)}")
        check_int("top_k", self.top_k, 1)
        if self.top_k > self.num_classes:
            raise ValueError(
                f"top_k: expected an int in [1, num_classes={self.num_classes}], got {self.top_k}"
            )
        check_ignore_index(self.ignore_index)

    @property
    def size_name(self) -> str:
        """``num_classes`` or ``num_labels``, for error messages."""
        return "num_labels" if self.kind is ProblemKind.MULTILABEL else "num_classes"


def _check_threshold_type(threshold: object) -> None:
    """Raise naming ``threshold`` unless ``float()`` reads it as one number (not a str or bool).

    ``float()`` alone took a string ("0.5"), which then failed the first update with torch's
    "'>=' not supported between instances of 'Tensor' and 'str'", and raised Python's own
    errors, naming nothing, for ``None`` or a tensor of several thresholds.
    """
    if isinstance(threshold, bool | str | bytes):
        raise TypeError(f"threshold: expected a probability in [0, 1], got {threshold!r}")
    if isinstance(threshold, Tensor) and threshold.numel() != 1:
        raise ValueError(
            "threshold: expected one probability in [0, 1], got a tensor of shape "
            f"{tuple(threshold.shape)}"
        )
    try:
        float(threshold)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"threshold: expected a probability in [0, 1], got {threshold!r}") from None


def class_axis_hint(shape: tuple[int, ...], size: int, *, last: bool, labels: bool) -> str:
    """A hint for scores whose class (or label) axis is where the other layout keeps it.

    The confusion-count metrics take it last, ``(N, ..., C)``; the ranking and calibration
    metrics take it second, ``(N, C, ...)``, as torchmetrics does. ``""`` when the shape does
    not look like the other layout.

    Args:
        shape: The refused ``preds`` shape.
        size: ``num_classes`` or ``num_labels``.
        last: Whether the refusing metric wants the axis last.
        labels: Multilabel (the axis is ``L``, and the 0/1 targets share the layout).
    """
    if len(shape) < 3:
        return ""
    axis, what = ("L", "scores and 0/1 targets") if labels else ("C", "scores")
    if last and shape[1] == size:
        moved = (shape[0], *shape[2:], shape[1])
        return (
            f"; {what} laid out (N, {axis}, ...), as torchmetrics takes them, go in as "
            f".movedim(1, -1), a view of shape {moved}"
        )
    if not last and shape[-1] == size:
        moved = (shape[0], shape[-1], *shape[1:-1])
        return (
            f"; {axis}-last {what} (N, ..., {axis}) go in as .movedim(-1, 1), a view of shape "
            f"{moved}"
        )
    return ""


def configure_states(problem: Problem, *states: MetricAccumulator, more: str = "") -> None:
    """Record that ``states`` count under ``problem``, for the structure check across ranks.

    Counts of another threshold, kind, top-k or ignore_index mean something else: ranks
    configured otherwise then fail their first sync (``RankMismatchError`` naming both
    problems) instead of adding them together. Costs nothing per sync. ``more`` adds what else
    the states depend on (the statistics a samplewise metric sums).
    """
    text = (
        # Normalized values (a threshold given as 1, 1.0 or a 0-dim tensor on any device is
        # the same problem), in full precision.
        f"{problem.kind.value} {problem.size_name}={int(problem.num_classes)} "
        f"threshold={float(problem.threshold)!r} logits={problem.logits} "
        f"top_k={int(problem.top_k)} ignore_index={problem.ignore_index}"
        + (f" {more}" if more else "")
    )
    for state in states:
        state.set_configuration(text)


def check_problem(problem: object, family: str) -> Problem:
    """Return ``problem`` if it is a ``Problem``; else raise naming the thin classes to use.

    Args:
        problem: The argument to check.
        family: The metric family, e.g. ``"MatthewsCorrCoef"``, for the hint.
    """
    if not isinstance(problem, Problem):
        raise TypeError(
            f"problem: expected a sidestream Problem, got {problem!r}; for C classes use "
            f"Multiclass{family}Metric(C) (or Binary{family}Metric / Multilabel{family}Metric)"
        )
    return problem
