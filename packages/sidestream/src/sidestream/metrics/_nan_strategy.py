"""``nan_strategy`` of the aggregation metrics: what a NaN value does, with no host sync."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from sidestream._validation import screen_invalid
from sidestream.state import MetricAccumulator

__all__ = ["NanPolicy", "NanStrategy", "Screened"]

NanStrategy = Literal["error", "ignore", "disable"] | float
_NAMES = ("error", "ignore", "disable")


class Screened(NamedTuple):
    """One batch after the policy.

    Attributes:
        values: The values, NaN replaced (by the fill value, or by 0 where ``kept`` is false).
        kept: Elements that count (``"ignore"``), or ``None`` when every element does.
        keep: The batch keep flag on CUDA under ``"error"``, else ``None``.
    """

    values: Tensor
    kept: Tensor | None
    keep: Tensor | None


class NanPolicy:
    """What a NaN in ``values`` does, per torchmetrics' ``nan_strategy``.

    - ``"disable"`` (the default): no check; NaN propagates into the result.
    - ``"error"``: a NaN is bad input. CPU raises ``ValueError`` naming ``values`` before the
      state changes; CUDA drops the batch on the device and counts it in ``rejected_updates``.
    - ``"ignore"``: NaN elements are left out (weight 0); how many is counted on the device in
      the ``nan_count`` state.
    - a finite number: NaN elements are replaced by it, and counted in ``nan_count``.

    torchmetrics' ``"warn"`` needs the host to know whether to warn; use ``"ignore"`` and read
    ``nan_count`` with the result instead.

    Args:
        strategy: ``"error"``, ``"ignore"``, ``"disable"`` or a finite fill value.
        dtype: The metric's dtype (its result's), if known: a fill value must be finite in it
            too (1e5 is inf in float16), or every filled NaN would make the result inf.

    Raises:
        ValueError: If ``strategy`` is another string, or a fill value that is not finite (in
            ``dtype`` as well).
        TypeError: If ``strategy`` is neither a string nor a number.
    """

    def __init__(self, strategy: NanStrategy, dtype: torch.dtype | None = None) -> None:
        self._fill: float | None = None
        if isinstance(strategy, str):
            if strategy not in _NAMES:
                hint = (
                    ' (torchmetrics\' "warn" needs a host sync per update to know when to warn: '
                    'use "ignore" and read the metric\'s nan_count with the result)'
                    if strategy == "warn"  # type: ignore[comparison-overlap]
                    else ""
                )
                raise ValueError(
                    f"nan_strategy: expected one of {_NAMES} or a finite number, got "
                    f"{strategy!r}{hint}"
                )
        elif isinstance(strategy, bool) or not isinstance(strategy, int | float):
            raise TypeError(f"nan_strategy: expected a string or a number, got {type(strategy)}")
        elif not _finite(strategy):
            raise ValueError(f"nan_strategy: a fill value must be finite, got {strategy}")
        elif dtype is not None and dtype.is_floating_point and _overflows(strategy, dtype):
            raise ValueError(
                f"nan_strategy: a fill value must be finite in the metric's dtype {dtype} "
                f"(magnitude at most {torch.finfo(dtype).max:g}), got {strategy}; fill with a "
                "smaller value or accumulate in a wider dtype"
            )
        else:
            self._fill = float(strategy)
        self._strategy = strategy
        # Plain attributes, not properties: a compiled update guards each property it reads on
        # its getter's code as well (several guard checks per call instead of one).
        self.disabled = strategy == "disable"
        """Whether NaN just propagates (``"disable"``): ``apply`` returns the values as they are."""
        self.checks = strategy == "error"
        """Whether NaN is bad input (``"error"``): the metric needs a rejected counter."""
        self.counts = strategy == "ignore" or self._fill is not None
        """Whether NaN elements are counted (``"ignore"`` or a fill value)."""

    def counter(self) -> MetricAccumulator | None:
        """A fresh int64 ``nan_count`` state when the policy counts, else ``None``.

        The state carries the policy as its configuration: ranks (or a checkpoint) whose NaNs
        were ignored and filled, or filled with other values, are told apart instead of mixed.
        """
        if not self.counts:
            return None
        counter = MetricAccumulator(0, dtype=torch.int64)
        policy = "ignore" if self._fill is None else repr(self._fill)
        counter.set_configuration(f"nan_strategy={policy}")
        return counter

    def apply(
        self,
        values: Tensor,
        rejected: MetricAccumulator | None,
        nan_count: MetricAccumulator | None,
        dtype: torch.dtype | None = None,
    ) -> Screened:
        """Apply the policy to one batch; device ops only, except the CPU ``"error"`` raise.

        ``dtype``: the metric's accumulation dtype; values of a narrower one are widened to it
        before a fill value is written, which their own dtype may not hold (1e5 is inf in
        float16).
        """
        if self._strategy == "disable":
            return Screened(values, None, None)
        nan = torch.isnan(values)
        if self._strategy == "error":
            assert rejected is not None
            keep = screen_invalid(
                nan, rejected, "values", "values without NaN (nan_strategy)", values=values
            )
            if keep is not None:
                values = torch.where(keep, values, 0.0)
            return Screened(values, None, keep)
        assert nan_count is not None
        screened, count = self._replaced(values, nan, dtype)
        nan_count.accumulate(count)
        return screened

    def apply_uncounted(
        self, values: Tensor, dtype: torch.dtype | None = None
    ) -> tuple[Screened, Tensor]:
        """``apply`` for ``"ignore"`` or a fill value, returning the batch's NaN count instead.

        For a metric that checks more of the batch afterwards: it adds the count to
        ``nan_count`` only for a batch it keeps, so a refused batch changes no state.
        """
        return self._replaced(values, torch.isnan(values), dtype)

    def _replaced(
        self, values: Tensor, nan: Tensor, dtype: torch.dtype | None
    ) -> tuple[Screened, Tensor]:
        if self._fill is not None:
            if (
                dtype is not None
                and values.dtype != dtype
                and torch.promote_types(values.dtype, dtype) == dtype
            ):
                values = values.to(dtype)  # exact: the fill is then written at full width
            return Screened(torch.where(nan, self._fill, values), None, None), nan.sum()
        return Screened(torch.where(nan, 0.0, values), ~nan, None), nan.sum()


def _finite(number: float) -> bool:
    """Whether ``number`` is finite as a float (an int too large for one is not)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def _overflows(number: float, dtype: torch.dtype) -> bool:
    """Whether ``number`` becomes inf in the floating ``dtype`` (rounding as a cast does)."""
    return bool(torch.tensor(float(number), dtype=torch.float64).to(dtype).isinf())
