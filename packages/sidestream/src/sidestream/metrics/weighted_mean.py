"""Weighted mean, for example a loss averaged over tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import as_tensor, check_broadcastable, check_floating, screen_invalid
from sidestream.metric import Metric
from sidestream.metrics._nan_strategy import NanPolicy, NanStrategy
from sidestream.state import MetricAccumulator

__all__ = ["WeightedMeanMetric"]


class WeightedMeanMetric(Metric[Tensor]):
    """``sum(values * weights) / sum(weights)`` over every update and every rank.

    Weights must be finite and non-negative. On CPU a batch with a bad weight raises
    ``ValueError`` before the state changes. On CUDA the check would need a host sync, so the
    batch is dropped on the device instead and counted in ``rejected_updates`` (reduced across
    ranks with the state): check it with the result.

    A mean with zero total weight (no data) is NaN.

    Args:
        dtype: The accumulation dtype (float64 by default).
        nan_strategy: What a NaN value does: ``"disable"`` (it propagates), ``"error"`` (bad
            input, like a bad weight), ``"ignore"`` (its weight becomes 0) or a fill value; see
            ``sidestream.metrics.NanPolicy``.

    Example:
        >>> metric = WeightedMeanMetric()
        >>> metric.update(values=torch.tensor([1.0, 3.0]), weights=torch.tensor([3, 1]))
        >>> metric.compute()
        tensor(1.5000, dtype=torch.float64)
    """

    def __init__(
        self, dtype: torch.dtype = torch.float64, nan_strategy: NanStrategy = "disable"
    ) -> None:
        self._weighted_sum = MetricAccumulator(0.0, dtype=dtype)
        self._weight = MetricAccumulator(0.0, dtype=dtype)
        self._rejected = MetricAccumulator(0, dtype=torch.int64)
        self._nan = NanPolicy(nan_strategy)
        self._nan_count = self._nan.counter()

    def update(self, values: Tensor | float, weights: Tensor | float = 1.0) -> None:
        """Add a batch.

        Args:
            values: Floating-point values, any shape (empty is fine).
            weights: A scalar or a tensor broadcastable to ``values``' shape; finite, >= 0.
                Integer weights (token counts) are fine.

        Raises:
            TypeError: If ``values`` is not floating point.
            ValueError: On a shape or device mismatch, or (CPU only) a negative or non-finite
                weight.
        """
        values_t = as_tensor("values", values, self.device)
        weights_t = as_tensor("weights", weights, self.device)
        check_floating("values", values_t)
        check_broadcastable("weights", weights_t, values_t, "values")
        dtype = self._weight.local.dtype
        weights_t = weights_t.to(dtype)
        invalid = (weights_t < 0) | ~torch.isfinite(weights_t)
        kept = None
        if self._nan.checks and values_t.device.type == "cuda":
            # One flag, so a batch bad in both ways is counted once.
            invalid = invalid.any() | torch.isnan(values_t).any()
        else:
            # CPU "error" raises here, naming values, before the state changes.
            values_t, kept, _ = self._nan.apply(values_t, self._rejected, self._nan_count)
        keep = screen_invalid(invalid, self._rejected, "weights", "finite values >= 0")
        weights_t = weights_t.expand(values_t.shape)
        if kept is not None:  # nan_strategy="ignore": a NaN value's weight becomes 0
            weights_t = torch.where(kept, weights_t, 0.0)
        contribution = values_t.to(dtype) * weights_t
        if keep is not None:
            # Selected, not multiplied: a dropped batch may hold NaN, and NaN * 0 is NaN.
            contribution = torch.where(keep, contribution, 0.0)
            weights_t = torch.where(keep, weights_t, 0.0)
        self._weighted_sum.accumulate(contribution.sum())
        self._weight.accumulate(weights_t.sum())

    @property
    def rejected_updates(self) -> Tensor:
        """How many updates were dropped for bad weights (CUDA only; CPU raises instead)."""
        return self._rejected.value

    @property
    def nan_count(self) -> Tensor | None:
        """NaN values ignored or filled (``nan_strategy`` "ignore" or a number), else None."""
        return None if self._nan_count is None else self._nan_count.value

    def compute(self) -> Tensor:
        """The weighted mean; NaN when the total weight is zero."""
        return self._weighted_sum.value / self._weight.value
