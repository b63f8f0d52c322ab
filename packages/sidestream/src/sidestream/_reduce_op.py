"""``ReduceOp``: how a state combines updates and ranks. A leaf module: it imports nothing."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """How a state combines updates locally and states across ranks.

    There is deliberately no AVG: averages are not linearly reducible. Store a sum and a count.
    MAX and MIN propagate NaN, on one rank and across ranks alike.
    """

    SUM = "sum"
    MAX = "max"
    MIN = "min"
