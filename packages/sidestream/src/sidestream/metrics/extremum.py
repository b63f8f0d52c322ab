"""Largest and smallest value seen."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sidestream._validation import as_tensor, check_floating
from sidestream.metric import Metric
from sidestream.state import ReduceOp

__all__ = ["MaxMetric", "MinMetric"]


class _ExtremumMetric(Metric[Tensor]):
    _op: ReduceOp

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        identity = -math.inf if self._op is ReduceOp.MAX else math.inf
        # Named after the op, so a MaxMetric checkpoint cannot load into a MinMetric.
        self._extremum = self.add_state(self._op.value, identity, self._op, dtype=dtype)

    def update(self, values: Tensor | float) -> None:
        """Fold ``values`` (any shape, floating point; empty is fine) into the extremum."""
        tensor = as_tensor("values", values, self.device)
        check_floating("values", tensor)
        if tensor.numel() == 0:  # metadata only; amax of nothing is an error
            return
        reduce = torch.amax if self._op is ReduceOp.MAX else torch.amin
        self._extremum.accumulate(reduce(tensor))

    def compute(self) -> Tensor:
        """The extremum; the identity (-inf for max, +inf for min) over no data."""
        return self._extremum.value.clone()


class MaxMetric(_ExtremumMetric):
    """The largest value passed to ``update`` over every rank; -inf over no data.

    NaN propagates: a NaN value makes the result NaN.

    Args:
        dtype: The state dtype (float64 by default).
    """

    _op = ReduceOp.MAX


class MinMetric(_ExtremumMetric):
    """The smallest value passed to ``update`` over every rank; +inf over no data.

    NaN propagates: a NaN value makes the result NaN.

    Args:
        dtype: The state dtype (float64 by default).
    """

    _op = ReduceOp.MIN
