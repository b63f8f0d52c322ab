"""Largest and smallest value seen."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sidestream._validation import as_tensor, check_floating, check_floating_dtype
from sidestream.metrics._nan_strategy import NanStrategy
from sidestream.metrics._screened import NanScreenedMetric
from sidestream.state import ReduceOp

__all__ = ["MaxMetric", "MinMetric"]


class _ExtremumMetric(NanScreenedMetric):
    _op: ReduceOp
    # The op as a bool for update: under torch.compile the ReduceOp member, reached both here
    # and through the state's op, costs an identity guard evaluated in Python on every call.
    _maxes: bool

    def __init__(
        self, dtype: torch.dtype = torch.float64, nan_strategy: NanStrategy = "disable"
    ) -> None:
        check_floating_dtype("dtype", dtype)
        identity = -math.inf if self._maxes else math.inf
        # Named after the op, so a MaxMetric checkpoint cannot load into a MinMetric.
        self._extremum = self.add_state(self._op.value, identity, self._op, dtype=dtype)
        super().__init__(nan_strategy, dtype=dtype)

    def update(self, values: Tensor | float) -> None:
        """Fold ``values`` (any shape, floating point; empty is fine) into the extremum."""
        tensor = as_tensor("values", values, self.device, floating=True)
        check_floating("values", tensor)
        if tensor.numel() == 0:  # metadata only; amax of nothing is an error
            self._metric_freshness.stale()  # an update all the same: compute reads local state
            return
        reduce = torch.amax if self._maxes else torch.amin
        if self._nan.disabled:  # the default: nothing to screen, skip the policy's bookkeeping
            self._extremum.accumulate(reduce(tensor))
            return
        tensor, kept, keep = self._nan.apply(
            tensor, self._rejected, self._nan_count, self._extremum.dtype
        )
        identity = -math.inf if self._maxes else math.inf
        if kept is not None:
            tensor = torch.where(kept, tensor, identity)
        extremum = reduce(tensor)
        self._extremum.accumulate(
            extremum if keep is None else torch.where(keep, extremum, identity)
        )

    def compute(self) -> Tensor:
        """The extremum; the identity (-inf for max, +inf for min) over no data."""
        return self._extremum.value.clone()


class MaxMetric(_ExtremumMetric):
    """The largest value passed to ``update`` over every rank; -inf over no data.

    NaN propagates (a NaN value makes the result NaN) unless ``nan_strategy`` says otherwise.

    Args:
        dtype: The floating-point state dtype (float64 by default; ``TypeError`` otherwise).
        nan_strategy: ``"disable"``, ``"error"``, ``"ignore"`` or a fill value; see
            ``sidestream.metrics.NanPolicy``.
    """

    _op = ReduceOp.MAX
    _maxes = True


class MinMetric(_ExtremumMetric):
    """The smallest value passed to ``update`` over every rank; +inf over no data.

    NaN propagates (a NaN value makes the result NaN) unless ``nan_strategy`` says otherwise.

    Args:
        dtype: The floating-point state dtype (float64 by default; ``TypeError`` otherwise).
        nan_strategy: ``"disable"``, ``"error"``, ``"ignore"`` or a fill value; see
            ``sidestream.metrics.NanPolicy``.
    """

    _op = ReduceOp.MIN
    _maxes = False
