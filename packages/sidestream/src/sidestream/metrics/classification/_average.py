"""How per-class values are combined: ``average`` = micro, macro, weighted or none."""

from __future__ import annotations

import math
from collections.abc import Iterable
from numbers import Real
from typing import Any, Literal

import torch
from torch import Tensor

from sidestream.metrics._ordered_sum import ordered_sum

__all__ = [
    "AVERAGES",
    "Average",
    "average_statistic",
    "averaging_settings",
    "check_average",
    "check_zero_division",
    "divide",
    "mean_over_classes",
]

Average = Literal["micro", "macro", "weighted", "none"]
AVERAGES: tuple[str, ...] = ("micro", "macro", "weighted", "none")


def check_average(average: str, allowed: tuple[str, ...] = AVERAGES) -> None:
    """Raise ``ValueError`` naming ``average`` unless it is one of ``allowed``."""
    if average not in allowed:
        raise ValueError(f"average: expected one of {allowed}, got {average!r}")


def averaging_settings(statistics: Iterable[Any], average: str, zero_division: float) -> str:
    """What ``compute`` reads of a confusion-count metric's settings, as compared across ranks.

    Args:
        statistics: Objects with a ``name`` (the ``Statistic`` of each reported value).
        average: The average the values are reported under.
        zero_division: The value of a ratio whose denominator is 0.
    """
    names = ",".join(statistic.name for statistic in statistics)
    return f"statistics={names} average={average} zero_division={zero_division!r}"


def check_zero_division(zero_division: object) -> float:
    """``zero_division`` as a float: 0.0, 1.0 or NaN.

    Raises:
        ValueError: Naming ``zero_division`` for anything else (scikit-learn's ``"warn"``
            included: its value is 0.0, the default here).
    """
    if isinstance(zero_division, bool) or not isinstance(zero_division, Real):
        hint = " (scikit-learn's 'warn' gives 0.0: pass 0.0)" if zero_division == "warn" else ""
        raise ValueError(f"zero_division: expected 0.0, 1.0 or NaN, got {zero_division!r}{hint}")
    value = float(zero_division)
    if value not in (0.0, 1.0) and not math.isnan(value):
        raise ValueError(f"zero_division: expected 0.0, 1.0 or NaN, got {zero_division!r}")
    return value


def divide(numerator: Tensor, denominator: Tensor, zero_division: float) -> Tensor:
    """``numerator / denominator``, ``zero_division`` where the denominator is 0."""
    safe = torch.where(denominator == 0, 1.0, denominator)
    return torch.where(denominator == 0, zero_division, numerator / safe)


def mean_over_classes(
    per_class: Tensor,
    weights: Tensor,
    zero_division: float = math.nan,
    *,
    support_weighted: bool = False,
    present: Tensor | None = None,
) -> Tensor:
    """The ``weights``-weighted mean of ``per_class`` over its last dimension.

    ``zero_division`` where no weight is > 0. Classes whose value is NaN (undefined) are left
    out when ``zero_division`` is NaN.

    With ``support_weighted`` (``average="weighted"``) a mean with zero total weight (no class
    has support, or with ``zero_division`` NaN every class with support is left out) is the
    plain mean of the classes left, as scikit-learn's: NaN only when every class is undefined.
    Only the ``present`` classes (> 0; ``None`` or none present: all) are among them, as
    scikit-learn's labels are the classes in the targets or predictions: a class that never
    occurs would otherwise count, with a specificity of 1.
    """
    # Not math.isnan: compiled with dynamic=True a float setting may be a symbolic float.
    undefined = zero_division != zero_division  # NaN
    if undefined:
        weights = torch.where(per_class.isnan(), 0.0, weights)
    total = weights.sum(-1)
    # Fractions: summed in an order of their own, the same under any CPU thread count.
    weighted = ordered_sum(torch.where(weights > 0, per_class, 0.0).mul(weights))
    if support_weighted:
        defined = ~per_class.isnan()
        if present is not None:
            # Without any class present (no sample counted) every defined class stays.
            occurs = present > 0
            defined = defined & (occurs | ~occurs.any(-1, keepdim=True))
        fallback = ordered_sum(torch.where(defined, per_class, 0.0)) / defined.sum(-1)  # 0/0: NaN
    else:
        fallback = torch.full_like(weighted, zero_division)
    return torch.where(total > 0, weighted / total.clamp_min(1e-300), fallback)


def average_statistic(
    numerator: Tensor,
    denominator: Tensor,
    counts: tuple[Tensor, Tensor, Tensor, Tensor],
    average: str,
    macro_weights: Tensor,
    zero_division: float,
) -> Tensor:
    """A statistic's per-class ``numerator / denominator`` averaged over the last dimension.

    Args:
        numerator: Per-class numerators, ``(..., C)``.
        denominator: Per-class denominators, ``(..., C)``.
        counts: ``(tp, fp, fn, tn)`` of the same shape (``weighted`` uses ``tp + fn``).
        average: ``micro``, ``macro``, ``weighted`` or ``none``.
        macro_weights: Which classes enter a macro mean (0/1, shape ``(..., C)``).
        zero_division: The value of a ratio whose denominator is 0.
    """
    if average == "micro":
        return divide(numerator.sum(-1), denominator.sum(-1), zero_division)
    per_class = divide(numerator, denominator, zero_division)
    if average == "none":
        return per_class
    tp, _, fn, _ = counts
    weighted = average == "weighted"
    weights = tp + fn if weighted else macro_weights
    return mean_over_classes(
        per_class, weights, zero_division, support_weighted=weighted, present=macro_weights
    )
