"""Ranking curves from per-class score histograms, each with a certified error bound.

The histograms are float64 ``(classes, bins)`` counts of negatives and positives, bins in
increasing score order. Only samples that share a bin can be ordered wrongly, so each function
returns the value and a bound on its distance to the exact value on the same scores.

Running totals go through ``running_counts``, never a floating-point ``cumsum``: CUDA has no
deterministic one, so under ``torch.use_deterministic_algorithms(True)`` it raises. Sums of
fractions go through ``ordered_sum``, whose bits do not depend on the number of CPU threads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream.metrics._ordered_sum import ordered_sum

__all__ = [
    "auroc_from_histograms",
    "average_precision_from_histograms",
    "partial_auroc_from_histograms",
    "running_counts",
]


def running_counts(counts: Tensor, dim: int = -1) -> Tensor:
    """``counts.cumsum(dim)`` of whole-number float counts, summed as int64, in ``counts``' dtype.

    CUDA's floating-point ``cumsum`` is not deterministic: under
    ``torch.use_deterministic_algorithms(True)`` it raises ``RuntimeError`` (a warning with
    ``warn_only=True``), which failed every ranking ``compute()`` on the GPU. Its integer
    ``cumsum`` is deterministic and needs no host sync. Counts below 2**53 are exact in float64,
    and so are their running totals, so the int64 sums are the same numbers on every device.
    """
    return counts.to(torch.int64).cumsum(dim).to(counts.dtype)


def auroc_from_histograms(negatives: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
    """AUROC per class and its error bound from float64 ``(classes, bins)`` histograms.

    A positive scores above every negative in a lower bin and ties with half of the negatives of
    its own bin (the trapezoid over bin thresholds). Only pairs sharing a bin can be misjudged,
    and each by at most half a pair, so the bound is ``0.5 * sum_b P_b N_b / (P * N)``.
    Classes without positives or without negatives are NaN.
    """
    below = running_counts(negatives) - negatives
    pairs = positives.sum(-1) * negatives.sum(-1)
    auroc = (positives * (below + 0.5 * negatives)).sum(-1) / pairs
    bound = 0.5 * (positives * negatives).sum(-1) / pairs
    return auroc, bound


def average_precision_from_histograms(
    negatives: Tensor, positives: Tensor
) -> tuple[Tensor, Tensor]:
    """Average precision per class and its error bound from ``(classes, bins)`` histograms.

    Like scikit-learn, ``sum_k (R_k - R_{k-1}) P_k`` over thresholds from high to low, here the
    bin edges. A positive in bin ``b`` has, at its own exact threshold, a precision between
    ``(TP_above + 1) / (TP_above + 1 + FP_b)`` and ``TP_b / (TP_b + FP_above)``; the histogram
    uses ``TP_b / (TP_b + FP_b)``, inside that interval, so the bound is the positive-weighted
    width of the intervals. Classes without positives are NaN.
    """
    positives_desc, negatives_desc = positives.flip(-1), negatives.flip(-1)
    true_pos = running_counts(positives_desc)
    false_pos = running_counts(negatives_desc)
    true_above, false_above = true_pos - positives_desc, false_pos - negatives_desc
    has_positive = positives_desc > 0
    ones = torch.ones_like(true_pos)
    precision = true_pos / torch.where(has_positive, true_pos + false_pos, ones)
    highest = true_pos / torch.where(has_positive, true_pos + false_above, ones)
    lowest = (true_above + 1) / (true_above + 1 + false_pos)
    total = positives.sum(-1)
    ap = ordered_sum(positives_desc * precision) / total
    bound = ordered_sum(positives_desc * (highest - lowest)) / total
    return ap, bound


def partial_auroc_from_histograms(
    negatives: Tensor, positives: Tensor, max_fpr: float
) -> tuple[Tensor, Tensor]:
    """AUROC over false-positive rates in ``[0, max_fpr]``, McClish-standardized, and a bound.

    The ROC points sit at the bin edges; the area is the trapezoid clipped at ``max_fpr`` with
    the true-positive rate interpolated there, then mapped as scikit-learn's
    ``roc_auc_score(max_fpr=...)``: ``0.5 * (1 + (A - max_fpr² / 2) / (max_fpr - max_fpr² / 2))``.
    The exact curve runs inside each bin's rectangle as this one does, so the bound is the
    clipped rectangles' area, standardized the same way.
    """
    zero = torch.zeros_like(negatives[..., :1])
    false_pos = torch.cat((zero, running_counts(negatives.flip(-1))), -1)
    true_pos = torch.cat((zero, running_counts(positives.flip(-1))), -1)
    fpr = false_pos / negatives.sum(-1, keepdim=True)
    tpr = true_pos / positives.sum(-1, keepdim=True)
    x0, x1, y0, y1 = fpr[..., :-1], fpr[..., 1:], tpr[..., :-1], tpr[..., 1:]
    left, right = x0.clamp(max=max_fpr), x1.clamp(max=max_fpr)
    width = right - left
    run = torch.where(x1 > x0, x1 - x0, 1.0)
    y_right = torch.where(x1 > x0, y0 + (y1 - y0) * (right - x0) / run, y1)
    area = ordered_sum(width * (y0 + y_right) / 2)
    bound = ordered_sum(width * (y1 - y0))
    smallest = 0.5 * max_fpr**2
    scale = 0.5 / (max_fpr - smallest)
    return 0.5 + (area - smallest) * scale, bound * scale
