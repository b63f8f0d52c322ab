"""Sum of all values seen."""

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

__all__ = ["SumMetric"]


class SumMetric(NanScreenedMetric):
    """The sum of every value passed to ``update``, over all ranks after ``sync``.

    Args:
        dtype: The floating-point dtype of the result (float64 by default; an integer one would
            truncate the values: ``TypeError``). The sum itself is float64 whatever ``dtype``,
            and the result is rounded into ``dtype`` once, by ``compute``: a float16 sum
            stopped growing at 2048 when adding ones, a bfloat16 one at 256, a float32 one at
            2**24, and a float32 one overflowed past 3.4e38 (inf, and still inf after negative
            batches brought the total back).
        nan_strategy: ``"disable"`` (NaN propagates), ``"error"``, ``"ignore"`` or a fill
            value; see ``sidestream.metrics.NanPolicy``.

    Example:
        >>> metric = SumMetric()
        >>> metric.update(torch.tensor([1.0, 2.0]))
        >>> metric.compute()
        tensor(3., dtype=torch.float64)
    """

    # The result's dtype where the sum is kept wider (SUM_STATE_DTYPE); None: the sum's. A
    # class default, so a metric unpickled from a release that did not keep it still computes.
    _result_dtype: torch.dtype | None = None

    def __init__(
        self, dtype: torch.dtype = torch.float64, nan_strategy: NanStrategy = "disable"
    ) -> None:
        check_floating_dtype("dtype", dtype)
        self._total = MetricAccumulator(0.0, dtype=SUM_STATE_DTYPE)
        if self._total.dtype != dtype:
            self._result_dtype = dtype
        # A fill value is checked against dtype: the result could not hold one it does not.
        super().__init__(nan_strategy, dtype=dtype)

    def update(self, values: Tensor | float) -> None:
        """Add ``values`` (any shape, floating point) to the sum."""
        tensor = as_tensor("values", values, self.device, floating=True)
        check_floating("values", tensor)
        tensor = self._nan.apply(tensor, self._rejected, self._nan_count, self._total.dtype).values
        self._total.accumulate(tensor.sum(dtype=self._total.dtype))

    def _compute_settings(self) -> str:
        # The result's dtype: ranks made with other dtypes hold the same float64 state, and
        # each would report its own rounding of the same sum.
        return f"dtype={self._result_dtype or self._total.dtype}"

    def compute(self) -> Tensor:
        """The sum (0 over no data), in ``dtype``."""
        if self._result_dtype is not None:  # summed wider: rounded into dtype once, here
            return self._total.value.to(self._result_dtype)
        return self._total.value.clone()
