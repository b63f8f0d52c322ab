"""Pearson correlation between predictions and targets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from sidestream.metrics.regression._paired import (
    MultiOutput,
    PairedRegressionMetric,
    fill_saved_updates,
    shift_state,
    spread,
)

__all__ = ["PearsonCorrelationMetric"]


class PearsonCorrelationMetric(PairedRegressionMetric):
    """Pearson's r from float64 sums of ``x``, ``y``, ``x^2``, ``y^2``, ``xy`` (x = preds).

    Both inputs are shifted by ``shift`` (the target by ``target_shift`` if given) before
    summing; as for ``R2ScoreMetric`` this only guards the one-pass covariance against
    cancellation when the means are far from 0 relative to the spread (relative error about
    ``1e-16 * (mean - shift)^2 / var`` per update, growing about with the square root of the
    number of updates). Fewer than two samples, a constant input, or a variance
    lost to that rounding give NaN. The variances are rooted one at a time, so the result
    holds at any scale whose sums of squares are normal, finite float64 numbers (below that
    the squares underflow: NaN once their loss may exceed what is left), and it is clamped to
    ``[-1, 1]``.

    Args:
        num_outputs: 1, or ``D`` for ``(N, D)`` inputs (one correlation per column).
        multioutput: ``uniform_average`` or ``raw_values`` (with ``D > 1``).
        shift: A scalar or one value per output, subtracted from preds and target.
        target_shift: Subtracted from the target instead of ``shift`` (a scalar or one value
            per output), for inputs whose means differ; ``None``: ``shift``. The correlation
            does not change with either shift, only the rounding does.

    Example:
        >>> metric = PearsonCorrelationMetric()
        >>> metric.update(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0]))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    def __init__(
        self,
        num_outputs: int = 1,
        multioutput: MultiOutput = "uniform_average",
        shift: float | Sequence[float] = 0.0,
        target_shift: float | Sequence[float] | None = None,
    ) -> None:
        super().__init__(num_outputs, multioutput)
        self._shift = shift_state("shift", shift, num_outputs)
        self._target_shift = shift_state(
            "target_shift", shift if target_shift is None else target_shift, num_outputs
        )
        self._preds_sum = self._sum_state()
        self._target_sum = self._sum_state()
        self._preds_squares = self._sum_state()
        self._target_squares = self._sum_state()
        self._products = self._sum_state()
        self._updates = self._update_counter()

    def update(self, preds: Tensor | float, target: Tensor | float) -> None:
        """Add predictions and targets of the same shape (``(N, D)`` with ``D`` outputs).

        Raises:
            TypeError: If ``preds`` is not floating point.
            ValueError: On a shape mismatch, or (CPU) a non-finite value; CUDA drops such a
                batch and counts it in ``rejected_updates``.
        """
        preds_64, target_64, keep = self._pairs(preds, target)
        x, y = preds_64 - self._shift.local, target_64 - self._target_shift.local
        if keep is not None:
            x, y = torch.where(keep, x, 0.0), torch.where(keep, y, 0.0)
        self._preds_sum.accumulate(x.sum(0))
        self._target_sum.accumulate(y.sum(0))
        self._preds_squares.accumulate(x.square().sum(0))
        self._target_squares.accumulate(y.square().sum(0))
        self._products.accumulate((x * y).sum(0))
        self._count_update(keep)

    def _upgrade_state_dict(self, prefix: str, state_dict: dict[str, Any]) -> None:
        fill_saved_updates(state_dict, prefix)

    def compute(self) -> Tensor:
        """Pearson's r per output then averaged; NaN when undefined."""
        n = self._count.value
        sx, sy = self._preds_sum.value, self._target_sum.value
        updates = self._updates_so_far()
        cov = self._products.value - sx * (sy / n)  # sx * sy overflows sooner
        var_x = spread(self._preds_squares.value, sx, n, updates)  # NaN for a constant input
        var_y = spread(self._target_squares.value, sy, n, updates)
        # Each variance is rooted on its own: their product can underflow or overflow while
        # every stored sum is finite (x, y ~ 1e-100 or 1e100). Rounding can push |r| a hair
        # past 1, hence the clamp (NaN stays NaN).
        r = cov / (var_x.sqrt() * var_y.sqrt())
        return self._finish(r.clamp(-1.0, 1.0))
