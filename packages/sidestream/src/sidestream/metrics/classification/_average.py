"""How per-class values are combined: ``average`` = micro, macro, weighted or none."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

__all__ = ["AVERAGES", "Average", "check_average", "divide", "mean_over_classes"]

Average = Literal["micro", "macro", "weighted", "none"]
AVERAGES: tuple[str, ...] = ("micro", "macro", "weighted", "none")


def check_average(average: str, allowed: tuple[str, ...] = AVERAGES) -> None:
    """Raise ``ValueError`` naming ``average`` unless it is one of ``allowed``."""
    if average not in allowed:
        raise ValueError(f"average: expected one of {allowed}, got {average!r}")


def divide(numerator: Tensor, denominator: Tensor, zero_division: float) -> Tensor:
    """``numerator / denominator``, ``zero_division`` where the denominator is 0."""
    safe = torch.where(denominator == 0, 1.0, denominator)
    return torch.where(denominator == 0, zero_division, numerator / safe)


def mean_over_classes(
    per_class: Tensor, weights: Tensor, zero_division: float = math.nan
) -> Tensor:
    """The ``weights``-weighted mean of ``per_class``; ``zero_division`` if no weight is > 0.

    Classes whose value is NaN (undefined) are left out when ``zero_division`` is NaN.
    """
    if math.isnan(zero_division):
        weights = torch.where(per_class.isnan(), 0.0, weights)
    total = weights.sum()
    mean = torch.where(weights > 0, per_class, 0.0).mul(weights).sum() / total.clamp_min(1e-300)
    return torch.where(total > 0, mean, zero_division)
