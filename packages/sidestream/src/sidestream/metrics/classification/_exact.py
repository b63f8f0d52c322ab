"""Exact ranking curves: stored samples turned into histograms with one bin per tied score.

With a bin per distinct score no two samples in different bins tie and samples sharing a bin
tie exactly, so the histogram curves of ``_curves`` are the exact ones, ties counted as
scikit-learn counts them (a tied positive-negative pair is half a correctly ordered pair; one
precision-recall point per distinct score).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["POSITIVE", "SKIPPED", "tie_histograms"]

POSITIVE = 1
"""Stored label of a positive; 0 marks a negative."""

SKIPPED = -1
"""Stored label of an ignored (``ignore_index``) or dropped (bad CUDA batch) element."""


def tie_histograms(scores: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Float64 ``(negatives, positives)`` counts per class and tie group, each ``(C, M)``.

    Args:
        scores: ``(M, C)`` float64 scores, one column per class.
        labels: ``(M, C)`` int8: 1 positive, 0 negative, -1 skipped (counted nowhere).

    Returns:
        Per class, in increasing score order, the counts of each group of equal scores at the
        group's last position and zeros elsewhere (empty bins change no curve).
    """
    rows, classes = scores.shape
    if rows == 0:
        empty = scores.new_zeros((classes, 1))
        return empty, empty.clone()
    order = scores.argsort(dim=0)
    ordered = scores.gather(0, order)
    kinds = labels.gather(0, order)
    last = torch.ones_like(ordered, dtype=torch.bool)
    last[:-1] = ordered[1:] != ordered[:-1]
    return _per_group(kinds == 0, last).T, _per_group(kinds == POSITIVE, last).T


def _per_group(members: Tensor, last: Tensor) -> Tensor:
    """``members`` counted per tie group (float64), the count at the group's last row."""
    # Counted in int64: CUDA's floating-point cumsum raises under
    # torch.use_deterministic_algorithms(True), its integer one is deterministic.
    running = members.to(torch.int64).cumsum(0)
    # The running count is non-decreasing, so its maximum over group ends so far is the count
    # at the latest group end: shifted one row, the count before each group.
    at_ends = torch.where(last, running, 0).cummax(0).values
    before = torch.cat((torch.zeros_like(at_ends[:1]), at_ends[:-1]))
    return torch.where(last, running - before, 0).to(torch.float64)
