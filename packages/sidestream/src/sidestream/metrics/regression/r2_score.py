"""Coefficient of determination."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from sidestream._validation import check_int
from sidestream.metrics._ordered_sum import ordered_sum
from sidestream.metrics.regression._paired import (
    PairedRegressionMetric,
    fill_saved_updates,
    rounding_bound,
    shift_state,
    spread,
)

__all__ = ["R2ScoreMetric"]

R2MultiOutput = Literal["uniform_average", "raw_values", "variance_weighted"]

# ``variance_weighted`` leaves out an output with no variance only if the most it could weigh
# is at most this share of the outputs that vary: 1e-16 * (mean / std)**2 of a constant output
# against the others' variance, so one within a few thousand standard deviations of ``shift``.
_NEGLIGIBLE_WEIGHT = 1e-6


class R2ScoreMetric(PairedRegressionMetric):
    """``1 - SSE / SST`` with ``SST = sum (y - mean y)^2``, from float64 sums.

    State per output: the squared-error sum, and ``sum(y - s)``, ``sum((y - s)^2)`` of the
    target shifted by ``shift`` ``s``; ``SST = sum((y-s)^2) - sum(y-s)^2 / n``. Shifting
    changes nothing mathematically but removes the cancellation of the one-pass formula: its
    relative error is about ``1e-16 * (mean(y) - s)^2 / var(y)`` for one update (growing
    about with the square root of the number of updates), so leave ``shift`` at 0 for
    targets whose mean is within a few thousand standard deviations of 0, and pass a rough
    mean otherwise (it must be the same on every rank).

    A constant target (``SST == 0``, or an SST lost to rounding: see ``shift``) gives NaN
    (scikit-learn returns 1.0 or 0.0 there); with ``variance_weighted`` such an output has
    weight 0, as a constant one has in scikit-learn, when the most its SST could be (the
    rounding bound) is under a millionth of the other outputs' SST. Otherwise the weighted
    mean is NaN: an output far from ``shift`` may vary, and weigh more than all the others.

    ``adjusted=k`` reports the adjusted R² of a model with ``k`` regressors,
    ``1 - (1 - R²) (n - 1) / (n - k - 1)`` (torchmetrics' ``R2Score(adjusted=k)``); it is NaN
    while ``n <= k + 1`` (torchmetrics warns and falls back to the plain R² there).

    Args:
        num_outputs: 1, or ``D`` for ``(N, D)`` inputs.
        multioutput: With ``D > 1``: ``uniform_average`` (the mean over outputs),
            ``raw_values`` (a ``(D,)`` vector) or ``variance_weighted`` (outputs weighted by
            their target variance, as scikit-learn).
        shift: A scalar or one value per output subtracted from the target before summing.
        adjusted: The number of regressors ``k`` for the adjusted R² (0: plain R²).

    Example:
        >>> metric = R2ScoreMetric()
        >>> metric.update(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 2.5]))
        >>> metric.compute()
        tensor(0.6667, dtype=torch.float64)
    """

    def __init__(
        self,
        num_outputs: int = 1,
        multioutput: R2MultiOutput = "uniform_average",
        shift: float | Sequence[float] = 0.0,
        adjusted: int = 0,
    ) -> None:
        choices = ("uniform_average", "raw_values", "variance_weighted")
        if multioutput not in choices:
            raise ValueError(f"multioutput: expected one of {choices}, got {multioutput!r}")
        weighted = multioutput == "variance_weighted"
        super().__init__(
            num_outputs, "raw_values" if multioutput == "raw_values" else "uniform_average"
        )
        check_int("adjusted (regressors)", adjusted, 0)
        self._variance_weighted = weighted
        self._adjusted = adjusted
        self._shift = shift_state("shift", shift, num_outputs)
        self._squared_error = self._sum_state()
        self._target_sum = self._sum_state()
        self._target_squares = self._sum_state()
        self._updates = self._update_counter()

    def update(self, preds: Tensor | float, target: Tensor | float) -> None:
        """Add predictions and targets of the same shape (``(N, D)`` with ``D`` outputs).

        Raises:
            TypeError: If ``preds`` is not floating point.
            ValueError: On a shape mismatch, or (CPU) a non-finite value; CUDA drops such a
                batch and counts it in ``rejected_updates``.
        """
        preds_64, target_64, keep = self._pairs(preds, target)
        shifted = target_64 - self._shift.local
        if keep is not None:
            shifted = torch.where(keep, shifted, 0.0)
        self._squared_error.accumulate((preds_64 - target_64).square().sum(0))
        self._target_sum.accumulate(shifted.sum(0))
        self._target_squares.accumulate(shifted.square().sum(0))
        self._count_update(keep)

    def _upgrade_state_dict(self, prefix: str, state_dict: dict[str, Any]) -> None:
        fill_saved_updates(state_dict, prefix)

    def _compute_settings(self) -> str:
        return (
            f"{super()._compute_settings()} variance_weighted={self._variance_weighted} "
            f"adjusted={self._adjusted}"
        )

    def compute(self) -> Tensor:
        """R² per output then averaged; NaN over no data or for a constant target."""
        count = self._count.value
        updates = self._updates_so_far()
        total = spread(self._target_squares.value, self._target_sum.value, count, updates)
        r2 = 1.0 - self._squared_error.value / total
        if self._adjusted:
            dof = count - self._adjusted - 1
            ratio = (count - 1) / torch.where(dof > 0, dof, 1.0)
            r2 = torch.where(dof > 0, 1.0 - (1.0 - r2) * ratio, torch.nan)
        if self._variance_weighted and self._num_outputs > 1:
            # A constant output has no variance, so no weight (as in scikit-learn). But NaN
            # also stands for a variance lost to rounding (a mean far from the shift), which
            # may be the largest weight of all: leave such an output out only where the most
            # it could weigh is negligible, else the weighted mean is unknown.
            varies = ~torch.isnan(total)
            weights = torch.where(varies, total, 0.0)
            hidden = ordered_sum(
                torch.where(varies, 0.0, rounding_bound(self._target_squares.value, count, updates))
            )
            total_weight = ordered_sum(weights)
            mean = ordered_sum(torch.where(varies, r2 * weights, 0.0)) / total_weight
            return torch.where(hidden <= _NEGLIGIBLE_WEIGHT * total_weight, mean, torch.nan)
        return self._finish(r2)
