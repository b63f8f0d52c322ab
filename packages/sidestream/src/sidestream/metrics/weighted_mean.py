"""Weighted mean, for example a loss averaged over tokens."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.compiler import is_compiling

from sidestream._scratch import scratch
from sidestream._validation import (
    WIDE_UNSIGNED,
    as_tensor,
    check_broadcastable,
    check_floating,
    check_floating_dtype,
    check_weight_number,
    checks_stay_on_device,
    drop_invalid,
    found_outside,
    found_where,
    given_as_number,
    summing_dtype,
)
from sidestream.metrics._nan_strategy import NanStrategy
from sidestream.metrics._screened import NanScreenedMetric
from sidestream.state import MetricAccumulator, accumulate_sums

__all__ = ["WeightedMeanMetric"]


class WeightedMeanMetric(NanScreenedMetric):
    """``sum(values * weights) / sum(weights)`` over every update and every rank.

    Weights must be finite and non-negative, and a batch's total weight finite in the
    accumulation ``dtype`` (float32 weights of 3e38 overflow a float32 total). On CPU a batch
    with a bad weight, or a total that overflows, raises
    ``ValueError`` before the state changes. On CUDA the check would need a host sync, so the
    batch is dropped on the device instead and counted in ``rejected_updates`` (reduced across
    ranks with the state): check it with the result.

    A mean with zero total weight (no data) is NaN.

    Args:
        dtype: The floating-point accumulation dtype, and the result's (float64 by default; an
            integer one would truncate the values: ``TypeError``). A dtype narrower than 32
            bits (float16, bfloat16) accumulates in float64, as ``MeanMetric``'s count does,
            and the mean is rounded into it once, by ``compute``: a float16 total weight
            overflowed past 65504 (a mean of NaN), and a bfloat16 one stopped growing at 256.
            ``dtype=torch.float32`` sums in float32, as torchmetrics does (a float32 batch is
            read in place, about 3x faster at 1M values): a sum past 3.4e38 (over updates or
            ranks too) is inf, and the mean inf or NaN, where the default float64 holds it.
        nan_strategy: What a NaN value does: ``"disable"`` (it propagates), ``"error"`` (bad
            input, like a bad weight), ``"ignore"`` (its weight becomes 0) or a fill value; see
            ``sidestream.metrics.NanPolicy``. A weight of 0 does not mask an infinite value
            (``inf * 0`` is NaN): under ``"error"`` such a batch, or one with +inf and -inf, is
            bad input too; under the other policies the result is NaN.

    Example:
        >>> metric = WeightedMeanMetric()
        >>> metric.update(values=torch.tensor([1.0, 3.0]), weights=torch.tensor([3, 1]))
        >>> metric.compute()
        tensor(1.5000, dtype=torch.float64)
    """

    _rejected: MetricAccumulator  # counts_rejected=True: always there
    # The result's dtype where the sums are kept wider (see summing_dtype); None: the sums'. A
    # class default, so a metric unpickled from a release that did not keep it still computes.
    _result_dtype: torch.dtype | None = None

    def __init__(
        self, dtype: torch.dtype = torch.float64, nan_strategy: NanStrategy = "disable"
    ) -> None:
        check_floating_dtype("dtype", dtype)
        self._weighted_sum = MetricAccumulator(0.0, dtype=summing_dtype(dtype))
        self._weight = MetricAccumulator(0.0, dtype=summing_dtype(dtype))
        # Read by update as a plain attribute: a compiled call guards a property's getter too.
        # The accumulation dtype: the batch's sums and weight checks are in it.
        self._dtype = self._weight.dtype
        if self._dtype != dtype:
            self._result_dtype = dtype
        # The weight checks drop bad batches on CUDA whatever the NaN policy.
        super().__init__(nan_strategy, counts_rejected=True, dtype=dtype)

    def update(self, values: Tensor | float, weights: Tensor | float = 1.0) -> None:
        """Add a batch.

        Args:
            values: Floating-point values, any shape (empty is fine).
            weights: A scalar or a tensor broadcastable to ``values``' shape; finite, >= 0.
                Integer weights (token counts) are fine.

        Raises:
            TypeError: If ``values`` is not floating point.
            ValueError: On a shape or device mismatch, a negative or non-finite Python number
                ``weights`` (on every device), or (CPU only) a negative or non-finite weight
                of a non-empty batch.
        """
        device = self.device
        values_t = as_tensor("values", values, device, floating=True)
        weights_t = as_tensor("weights", weights, device)
        check_floating("values", values_t)
        dtype = self._dtype
        if weights_t.shape != values_t.shape and weights_t.dim():
            # A scalar always broadcasts; torch.broadcast_shapes is slow.
            check_broadcastable("weights", weights_t, values_t, "values")
        on_device = checks_stay_on_device(device)
        if on_device or not values_t.numel():
            # A number is on the host: refused on every device. The CPU path checks it with a
            # non-empty batch, after the values (a NaN value is named first).
            check_weight_number("weights", weights)
        # Compiling, a number is an input of the graph, unchecked on the host: the device path
        # checks it, on its own, since the batch's weights (expanded to the values' shape, or
        # zeroed where a value is NaN) hold none of it when the batch is empty.
        number = weights_t if is_compiling() and given_as_number(weights) else None
        # CPU "error" rides on the result: a NaN value makes the weighted sum NaN (NaN * w is
        # NaN for every weight), so the NaN pass runs only for a NaN sum or a bad weight, and
        # raises (naming values, first, as before) before the state changes.
        rides = self._nan.checks and not on_device
        nan_seen: Tensor | None = None  # counted once the weights passed their checks
        if not self._nan.disabled and not self._nan.checks:
            (values_t, kept, _), nan_seen = self._nan.apply_uncounted(values_t, dtype)
            if kept is not None:  # nan_strategy="ignore": a NaN value's weight becomes 0
                # A bad weight (negative, inf, NaN) stays, so the checks below refuse it as
                # anywhere else: the policy is about values, and zeroing hid such weights.
                weights_t = weights_t.to(dtype)
                fine = (weights_t >= 0) & (weights_t < torch.inf)
                weights_t = torch.where(kept | ~fine, weights_t, 0.0)
        if not on_device:
            try:
                weighted, total = _host_sums(values_t, weights_t, dtype)
            except ValueError:
                if rides:  # a NaN value is reported first, as when it was checked first
                    self._nan.apply(values_t, self._rejected, self._nan_count)
                raise
            if rides and math.isnan(float(weighted)):
                self._nan.apply(values_t, self._rejected, self._nan_count)
                # No NaN value, and the weights passed: an infinite value at weight 0 (inf * 0
                # is NaN), +inf and -inf in one batch, or finite products that overflowed the
                # accumulation dtype both ways. Bad input all the same.
                infinite = torch.isinf(values_t)
                # An inf at a weight > 0 beside a finite product past the dtype's range (inf +
                # -inf) is the overflow: no inf at weight 0, no -inf beside it to name.
                named = bool((infinite & (weights_t == 0)).any()) or (
                    bool((values_t == torch.inf).any()) and bool((values_t == -torch.inf).any())
                )
                cause = (
                    "an infinite value at weight 0, or +inf and -inf"
                    f"{found_where(values_t, infinite)}"
                    if named
                    else f"values * weights past what {dtype} holds, of both signs"
                )
                raise ValueError(
                    "values: expected values whose weighted sum is not NaN (nan_strategy="
                    f"'error'); this batch has no NaN value but {cause}"
                )
            self._weighted_sum.accumulate(weighted)
            self._weight.accumulate(total)
        else:
            # The host check's logic in the total's own reduction: a weight that is not >= 0
            # (negative or NaN) becomes +inf, as an inf weight is, so the total is never NaN
            # and the batch is bad exactly when it is +inf (one comparison, where a finiteness
            # test is two kernels). An elementwise mask reduced with any() costs compiled CPU
            # code 20x more, and a separate amin() one more reduction per call.
            weights_t = weights_t.to(dtype)
            checked = torch.where(weights_t >= 0, weights_t, torch.inf).expand(values_t.shape)
            # Narrower values are widened inside the product's own kernel (exactly, as .to
            # would): one launch fewer on CUDA.
            if torch.promote_types(values_t.dtype, dtype) != dtype:
                values_t = values_t.to(dtype)
            products = values_t * checked
            sums: Tensor | tuple[Tensor, ...]
            if is_compiling():
                # Fused by the compiler, and not stacked (see state.stacked_sums): a stacked
                # batch would be materialized (3.6x slower compiled at 1M values on CPU).
                sums = (products.sum(), checked.sum())
            else:
                # Eager, both sums from one reduction: each op is a kernel launch on CUDA.
                sums = torch.stack((products, checked)).reshape(2, values_t.numel()).sum(1)
            # (A bad weight can make the weighted sum NaN, but the batch is then dropped.)
            invalid = sums[1] == torch.inf
            if number is not None:  # not a finite value >= 0 (NaN fails both comparisons)
                invalid = invalid | ~((number >= 0) & (number < torch.inf))
            if self._nan.checks:
                # One flag, so a batch bad in both ways is counted once. The weighted sum is NaN
                # for a NaN value (NaN * w is NaN for every w), an infinite value at weight 0
                # and +inf with -inf: one scalar test, where isnan(values) read the batch.
                invalid = invalid | torch.isnan(sums[0])
            if nan_seen is None:
                drop_invalid(invalid, self._rejected, sums)
            else:
                drop_invalid(invalid, self._rejected, sums, nan_seen)
            # Both sums dropped above and added into the arena as one tensor.
            accumulate_sums((self._weighted_sum, self._weight), sums)
        if nan_seen is not None:
            assert self._nan_count is not None  # "ignore" and fill values count NaNs
            self._nan_count.accumulate(nan_seen)

    @property
    def accumulated_weight(self) -> Tensor:
        """The total weight (a copy): over every rank after a sync, until the next update."""
        return self._weight.value.clone()

    def _compute_settings(self) -> str:
        # The result's dtype: ranks made with other dtypes hold the same float64 states, and
        # each would report its own rounding of the same mean.
        return f"dtype={self._result_dtype or self._weight.dtype}"

    def compute(self) -> Tensor:
        """The weighted mean, in ``dtype``; NaN when the total weight is zero."""
        mean = self._weighted_sum.value / self._weight.value
        # Summed wider than a half-precision dtype: rounded into it once, here.
        return mean if self._result_dtype is None else mean.to(self._result_dtype)


_CHUNK = 1 << 17


def _host_sums(values: Tensor, weights: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``sum(values * weights)`` and ``sum(weights)`` on the CPU, eager, weights checked first.

    Reading values costs no device sync here, so the check is one fused read: the smallest
    weight is >= 0 (NaN fails) and the total is finite (an inf weight makes it inf). Raises
    ``ValueError`` before any state changes.
    """
    low: Tensor | float | None
    if weights.dtype in WIDE_UNSIGNED:
        # torch has no CPU min kernel for them (the chunked path reads the input's minimum):
        # converted once, exactly (a float64 holds every uint32, and uint64 up to 2**53).
        weights = weights.to(dtype)
    if weights.dim() == 0:  # a scalar (the default 1.0): no batch-sized weights at all
        weight = weights.to(dtype)
        weighted, total = values.sum(dtype=dtype) * weight, weight * values.numel()
        # sum(values) * weight is sum(values * weights) with one rounding, but the plain sum
        # can overflow where the products' does not (a weight below 1: [3e38, 3e38] at 0.5 in
        # float32 is 3e38, not inf, as the device path gives). Redone only for such a sum.
        # One read of the weight serves this and the check below.
        weight_value = float(weight)
        if weight_value < 1 and not math.isfinite(float(weighted)):
            weighted = (values.to(dtype) * weight).sum()
        # Checked as the batch's weights, as broadcast ones and the device path's are: an
        # empty batch has none (a Python number is checked on its own in update).
        low = weight_value if values.numel() else None
    elif weights.shape != values.shape:
        expanded = weights.to(dtype).expand(values.shape)
        weighted, total = (values.to(dtype) * expanded).sum(), expanded.sum()
        low = expanded.amin() if expanded.numel() else None
    elif values.numel() <= _CHUNK:
        # One chunk: no slicing and no stacking (their dispatches dominate small batches).
        if values.dim() != 1:
            values, weights = values.reshape(-1), weights.reshape(-1)
        flat_weights = weights.to(dtype)
        weighted = torch.dot(values.to(dtype), flat_weights)
        total = flat_weights.sum()
        low = flat_weights.amin() if flat_weights.numel() else None
    else:
        weighted, total, low = _chunked_sums(values.reshape(-1), weights.reshape(-1), dtype)
    if low is not None and not (float(low) >= 0 and math.isfinite(float(total))):
        # The largest finite value of the weights' own dtype: inf lies above it.
        largest = torch.finfo(weights.dtype).max if weights.is_floating_point() else math.inf
        found = found_outside(weights, 0, largest)
        if not found and float(low) >= 0:
            # Every weight is fine: their sum overflowed the accumulation dtype.
            raise ValueError(
                f"weights: expected a total that {dtype} holds; this batch's finite weights sum "
                f"to {float(total)} (accumulate in a wider dtype, or scale the weights down)"
            )
        raise ValueError(
            f"weights: expected finite values >= 0; this batch has values that are not{found}"
        )
    return weighted, total


def _chunked_sums(
    values: Tensor, weights: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """Dot product, weight total and smallest weight of two flat tensors longer than one chunk.

    Each chunk is cast into this thread's buffers (``copy_`` converts in one pass), so the
    products are exact in float64 (two float32 factors need 48 bits) with no batch-sized
    float64 copy of either input. Per chunk: two conversions, a ``dot`` and a ``sum`` (faster
    than one ``addmv_`` for both), each written into the chunk's slot of a small result tensor
    (no accumulating op), and the smallest weight read from the input chunk while it is in cache
    (narrower than the converted one, and its sign and NaN are the same).
    """
    # Inputs already of the accumulation dtype are read in place: a copy would convert nothing.
    same = values.dtype == dtype and weights.dtype == dtype
    # This thread's chunk buffers, reused by every update: a fresh float64 chunk per step costs
    # an allocation, and pages zeroed by the kernel, which is slower than the arithmetic.
    values_buffer = scratch("weighted_mean.values", dtype, (_CHUNK,), values.device)
    weights_buffer = scratch("weighted_mean.weights", dtype, (_CHUNK,), values.device)
    count = -(-values.numel() // _CHUNK)
    dots = torch.empty(count, dtype=dtype, device=values.device)
    totals = torch.empty(count, dtype=dtype, device=values.device)
    lows = torch.empty(count, dtype=weights.dtype, device=values.device)
    # split: every chunk's view from one call, instead of two slicing calls per chunk.
    chunks = zip(torch.split(values, _CHUNK), torch.split(weights, _CHUNK), strict=True)
    for index, (chunk_values, chunk_weights) in enumerate(chunks):
        if same:
            values_row, weights_row = chunk_values, chunk_weights
        else:
            length = chunk_values.numel()
            values_row, weights_row = values_buffer, weights_buffer
            if length < _CHUNK:
                values_row, weights_row = values_buffer[:length], weights_buffer[:length]
            values_row.copy_(chunk_values)
            weights_row.copy_(chunk_weights)
        torch.dot(values_row, weights_row, out=dots[index])
        torch.sum(weights_row, 0, out=totals[index])
        torch.amin(chunk_weights, 0, out=lows[index])
    return dots.sum(), totals.sum(), lows.amin()
