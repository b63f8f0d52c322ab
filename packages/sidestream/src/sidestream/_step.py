"""The training step of a window, a sync or a logged value: a checked Python int."""

from __future__ import annotations

import operator
from numbers import Integral

__all__ = ["training_step"]


def training_step(step: object) -> int:
    """``step`` as a Python int in ``[0, 2**63)`` (it travels as an int64).

    numpy integers are taken; a bool is not (``True`` is no step), nor a tensor (reading one
    is a host sync on CUDA: keep the step as a Python counter).

    Raises:
        TypeError: If ``step`` is not an integer.
        ValueError: If ``step`` is negative or 2**63 or more.
    """
    if isinstance(step, bool) or not isinstance(step, Integral):
        hint = ""
        if type(step).__module__.startswith("torch"):
            hint = " (reading a tensor is a host sync: count steps in Python)"
        raise TypeError(f"step: expected an int, got {type(step).__name__}{hint}")
    value = operator.index(step)
    if not 0 <= value < 2**63:
        raise ValueError(f"step: expected an int in [0, 2**63), got {value}")
    return value
