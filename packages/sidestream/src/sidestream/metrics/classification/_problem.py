"""What kind of classification problem a confusion-count metric reads."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Problem", "ProblemKind"]


class ProblemKind(enum.Enum):
    """The three input conventions: one positive class, one of C classes, L independent labels."""

    BINARY = "binary"
    MULTICLASS = "multiclass"
    MULTILABEL = "multilabel"


@dataclass(frozen=True)
class Problem:
    """A validated problem description, made by the builder's ``.binary``/``.multiclass``/...

    Attributes:
        kind: Binary, multiclass or multilabel.
        num_classes: Classes (multiclass), labels (multilabel), or 1 (binary: the positive class).
        threshold: Binary and multilabel: a score at or above it counts as positive.
        logits: Binary and multilabel: scores are logits (a sigmoid is applied) rather than
            probabilities in [0, 1].
        top_k: Multiclass: a prediction is the set of the ``top_k`` highest scores.
    """

    kind: ProblemKind
    num_classes: int
    threshold: float = 0.5
    logits: bool = False
    top_k: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise TypeError(f"num_classes: expected an int, got {type(self.num_classes)}")
        minimum = 2 if self.kind is ProblemKind.MULTICLASS else 1
        if self.num_classes < minimum:
            raise ValueError(f"num_classes: expected an int >= {minimum}, got {self.num_classes}")
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"threshold: expected a probability in [0, 1], got {self.threshold}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise TypeError(f"top_k: expected an int or None, got {type(self.top_k)}")
        if not 1 <= self.top_k <= self.num_classes:
            raise ValueError(
                f"top_k: expected an int in [1, num_classes={self.num_classes}], got {self.top_k}"
            )
