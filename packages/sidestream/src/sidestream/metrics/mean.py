"""Arithmetic mean of all values seen."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import (
    SUM_STATE_DTYPE,
    as_tensor,
    check_floating,
    check_floating_dtype,
)
from sidestream.metrics._nan_strategy import NanStrategy
from sidestream.metrics._screened import NanScreenedMetric
from sidestream.state import MetricAccumulator

__all__ = ["MeanMetric"]


class MeanMetric(NanScreenedMetric):
    """The mean of every element passed to ``update``, stored as a sum and a count.

    A mean over no data is NaN (0 / 0), on purpose: it is not a zero loss.

    Args:
        dtype: The floating-point dtype of the result (float64 by default; an integer one would
            truncate the values: ``TypeError``). The sum and the count are float64 whatever
            ``dtype``: exact to 2**53 elements, where a bfloat16 count stops at 256, a float16
            one at 2048 (and overflows past 65504), a float32 one at 2**24; a float16 sum
            overflowed past 65504 and a float32 one past 3.4e38 (a mean of inf where the mean
            fits). The mean is rounded into ``dtype`` once, by ``compute``.
        nan_strategy: ``"disable"`` (NaN propagates), ``"error"``, ``"ignore"`` or a fill
            value; see ``sidestream.metrics.NanPolicy``.
    """

    # The result's dtype where the sum is kept wider (SUM_STATE_DTYPE); None: the sum's. A
    # class default, so a metric unpickled from a release that did not keep it still computes.
    _result_dtype: torch.dtype | None = None

    def __init__(
        self, dtype: torch.dtype = torch.float64, nan_strategy: NanStrategy = "disable"
    ) -> None:
        check_floating_dtype("dtype", dtype)
        self._total = MetricAccumulator(0.0, dtype=SUM_STATE_DTYPE)
        self._count = MetricAccumulator(0.0, dtype=torch.float64)
        if self._total.dtype != dtype:
            self._result_dtype = dtype
        # A fill value is checked against dtype: the result could not hold one it does not.
        super().__init__(nan_strategy, dtype=dtype)

    def update(self, values: Tensor | float) -> None:
        """Add the elements of ``values`` (any shape, floating point; empty is fine)."""
        tensor = as_tensor("values", values, self.device, floating=True)
        check_floating("values", tensor)
        tensor, kept, keep = self._nan.apply(
            tensor, self._rejected, self._nan_count, self._total.dtype
        )
        self._total.accumulate(tensor.sum(dtype=self._total.dtype))
        dtype = self._count.dtype
        if kept is not None:  # nan_strategy="ignore": NaN elements do not count
            self._count.accumulate(kept.sum(dtype=dtype))
            return
        # numel is metadata: a CPU scalar rides into the add as an argument, not a sync (even
        # under a CUDA default device, hence device="cpu").
        count = torch.tensor(float(tensor.numel()), dtype=dtype, device="cpu")
        self._count.accumulate(count if keep is None else keep.to(dtype) * count)

    def _compute_settings(self) -> str:
        # The result's dtype: ranks made with other dtypes hold the same float64 state, and
        # each would report its own rounding of the same mean.
        return f"dtype={self._result_dtype or self._total.dtype}"

    def compute(self) -> Tensor:
        """Sum / count, in ``dtype``; NaN over no data."""
        total = self._total.value
        mean = total / self._count.value
        # The sum and count are float64: only a narrower dtype's mean (or a float32 sum's,
        # unpickled from a release that kept one) needs converting. A .to() of the default
        # float64 one is a no-op that still cost every compute about 1 µs (1.8x).
        dtype = total.dtype if self._result_dtype is None else self._result_dtype
        return mean if mean.dtype == dtype else mean.to(dtype)
