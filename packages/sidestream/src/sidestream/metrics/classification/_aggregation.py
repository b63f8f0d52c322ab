"""How per-class statistics are combined into the reported value."""

from __future__ import annotations

import enum

__all__ = ["Aggregation"]


class Aggregation(enum.Enum):
    """How classes are combined.

    ``micro``: the statistic of the counts summed over classes; ``macro``: the unweighted mean
    of per-class values; ``weighted``: their mean weighted by support (true count);
    ``per_class``: one value per class.
    """

    MICRO = "micro"
    MACRO = "macro"
    WEIGHTED = "weighted"
    PER_CLASS = "per_class"
