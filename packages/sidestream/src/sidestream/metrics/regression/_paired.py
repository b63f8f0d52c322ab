"""Input handling shared by the regression metrics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from sidestream._validation import (
    any_not_finite,
    as_tensor,
    check_floating,
    check_int,
    check_same_shape,
    checks_stay_on_device,
    screen_invalid,
)
from sidestream.metrics._ordered_sum import ordered_sum
from sidestream.metrics._screened import ScreenedMetric
from sidestream.state import MetricAccumulator

__all__: list[str] = []

_EPS = torch.finfo(torch.float64).eps
# What a square's underflow may take from the sums, with room to spare: a variance that is
# not a million times more has lost digits to it (r off in its third digit at 8e-162).
_UNDERFLOW_LOSS = 2.0**-1074 * 2.0**20  # float64's subnormal spacing, times 2**20

MultiOutput = Literal["uniform_average", "raw_values"]
_MULTIOUTPUT = ("uniform_average", "raw_values")


class PairedRegressionMetric(ScreenedMetric[Tensor]):
    """Base of the regression metrics: checks ``(preds, target)`` and holds the float64 sums.

    Every state is a float64 sum per output (and one sample count), so ranks add exactly and
    ``compute`` on the synced state equals ``compute`` on all the data up to float64 rounding.

    Args:
        num_outputs: 1 for a scalar target (``preds`` and ``target`` of any equal shape), or
            ``D > 1`` for ``(N, D)`` inputs.
        multioutput: With ``D > 1``: ``uniform_average`` (mean over outputs, scikit-learn's
            default) or ``raw_values`` (a ``(D,)`` vector).
    """

    def __init__(self, num_outputs: int = 1, multioutput: MultiOutput = "uniform_average") -> None:
        super().__init__()
        check_int("num_outputs", num_outputs, 1)
        if multioutput not in _MULTIOUTPUT:
            raise ValueError(f"multioutput: expected one of {_MULTIOUTPUT}, got {multioutput!r}")
        self._num_outputs = num_outputs
        self._multioutput = multioutput
        self._count = MetricAccumulator(0.0, dtype=torch.float64)

    def _compute_settings(self) -> str:
        return f"multioutput={self._multioutput}"

    def _update_counter(self) -> MetricAccumulator:
        """Updates over every rank, for the rounding bound of ``spread`` (R², Pearson)."""
        return MetricAccumulator(0, dtype=torch.int64)

    def _count_update(self, keep: Tensor | None) -> None:
        """Count one update, unless ``keep`` (``_pairs``' device flag) says it was dropped."""
        updates: MetricAccumulator | None = getattr(self, "_updates", None)
        if updates is None:  # unpickled from a release that did not keep it
            return
        updates.accumulate(1 if keep is None else keep)  # a bool adds 0 or 1

    def _updates_so_far(self) -> Tensor:
        """The updates in the state, as float64 (``ceil(count / 3)`` if it does not keep them)."""
        updates: MetricAccumulator | None = getattr(self, "_updates", None)
        if updates is None:
            return torch.ceil(self._count.value / 3.0)
        return updates.value.to(torch.float64)

    def _sum_state(self) -> MetricAccumulator:
        return MetricAccumulator(torch.zeros(self._num_outputs, dtype=torch.float64))

    def _pairs(
        self, preds: Tensor | float, target: Tensor | float
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Checked float64 ``(N, D)`` preds and target, and the CUDA keep flag.

        A dropped CUDA batch comes back as zeros (``keep`` false). Also adds the batch's
        sample count (0 for a dropped batch).
        """
        preds_t = as_tensor("preds", preds, self.device, floating=True)
        target_t = as_tensor("target", target, self.device, floating=True)
        check_floating("preds", preds_t)
        outputs = self._num_outputs
        # preds against num_outputs first: a target of preds' shape would not fix a wrong preds.
        if outputs > 1 and (preds_t.ndim != 2 or preds_t.shape[1] != outputs):
            raise ValueError(
                f"preds: expected shape (N, {outputs}) for num_outputs={outputs}, "
                f"got {tuple(preds_t.shape)}"
            )
        check_same_shape(preds_t, target_t)
        preds_64 = preds_t.to(torch.float64).reshape(-1, outputs)
        target_64 = target_t.to(torch.float64).reshape(-1, outputs)
        if not checks_stay_on_device(preds_t.device):
            screen_invalid(
                ~torch.isfinite(preds_64), self._rejected, "preds", "finite values", values=preds_64
            )
            screen_invalid(
                ~torch.isfinite(target_64),
                self._rejected,
                "target",
                "finite values",
                values=target_64,
            )
            keep: Tensor | None = None
        else:
            invalid = any_not_finite(preds_64, target_64)
            keep = screen_invalid(invalid, self._rejected, "preds/target", "finite values")
        rows = float(preds_64.shape[0])  # metadata, not a device value
        if keep is None:
            self._count.accumulate(torch.tensor(rows, dtype=torch.float64, device="cpu"))
        else:
            # where, not multiply: 0 * inf would still be NaN.
            preds_64 = torch.where(keep, preds_64, 0.0)
            target_64 = torch.where(keep, target_64, 0.0)
            self._count.accumulate(keep.to(torch.float64) * rows)
        return preds_64, target_64, keep

    def _finish(self, per_output: Tensor) -> Tensor:
        if self._num_outputs == 1:
            return per_output[0]
        if self._multioutput == "raw_values":
            return per_output
        return ordered_sum(per_output) / self._num_outputs  # the same bits under any thread count


def spread(squares: Tensor, sums: Tensor, count: Tensor, updates: Tensor) -> Tensor:
    """``sum((v - mean v)^2)`` from the one-pass sums; NaN where rounding leaves nothing of it.

    The one-pass difference cancels: it keeps no information once it is within the rounding of
    the sums (a constant input, or a mean too far from the ``shift``). That is reported as NaN,
    not as the noise left over, which would make an R² of -1e15 or a correlation of +-1.

    The bound is the worst case of how the sums were made: each addition in a row costs at
    most ``eps`` of ``squares``, three times over (the squares, and twice through the squared
    sum). In a row are one addition per update into the state (``updates``, counted over every
    rank, which also covers the sync's) and those inside a batch's sum: a reduction adds at
    most about ``sqrt(batch)`` elements in a row (a CPU cascade far fewer, a CUDA thread its
    share of the batch), so ``sqrt(count)`` bounds them. Squares below float64's normal range
    (inputs under 1e-154) lose up to one subnormal step each: a variance not a million times
    that loss is NaN too. Sized by updates, not samples,
    so a long run of large batches keeps its variance (``count * eps`` made 4e8 samples of a
    mean 4000 standard deviations out NaN).
    """
    value = squares - sums * (sums / count)  # sums**2 / count overflows sooner
    noise = rounding_bound(squares, count, updates)
    return torch.where(value > noise, value, torch.nan)


def rounding_bound(squares: Tensor, count: Tensor, updates: Tensor) -> Tensor:
    """``spread``'s worst-case rounding of the one-pass ``sum((v - mean v)^2)`` (see there).

    Also the most a variance that ``spread`` reports as NaN can be: R²'s ``variance_weighted``
    weighs such an output by at most this.
    """
    steps = updates + count.sqrt() + 32.0
    return 3.0 * steps * _EPS * squares + count * _UNDERFLOW_LOSS


def fill_saved_updates(state_dict: dict[str, Any], prefix: str) -> None:
    """Give a checkpoint with no count of updates ``ceil(count / 3)`` as the count.

    Saved before ``updates`` was kept, or loaded by ``torch.distributed.checkpoint``'s partial
    load (which leaves a fresh metric's 0 beside the saved sums): ``spread``'s bound is then
    at least the ``count * eps`` one the sums were saved under.
    """
    key, count = prefix + "updates", state_dict.get(prefix + "count")
    if count is None:
        return
    saved = state_dict.get(key)
    try:
        # device=: torch.as_tensor would move them to the caller's default device.
        count_t = torch.as_tensor(count, device=_own_device(count)).detach()
        saved_t = None if saved is None else torch.as_tensor(saved, device=_own_device(saved))
    except (TypeError, ValueError, RuntimeError):
        # Not a tensor (nor numbers): load_state_dict's own check refuses it, naming the key,
        # where reading it here raised torch's "new(): invalid data type 'str'".
        return
    if count_t.is_meta or (saved_t is not None and saved_t.is_meta):
        # No values to read (a checkpoint loaded with map_location="meta"): reading them
        # raised torch's "Cannot copy out of meta tensor". load_state_dict's own check refuses
        # a meta tensor naming its key; a count of updates the checkpoint lacks stands in as
        # one, so that check (not a missing key) is what such a checkpoint gets.
        if saved_t is None:
            state_dict[key] = torch.empty((), dtype=torch.int64, device="meta")
        return
    count_t = count_t.cpu().to(torch.float64)
    unknown = saved_t is None or (
        saved_t.numel() == 1
        # Not read when it is no finite real number: int() of an infinity or a complex raised
        # Python's "cannot convert float infinity to integer" (or torch's overflow), naming no
        # key; load_state_dict's own check refuses such a count of updates, naming it.
        and not saved_t.is_complex()
        and bool(torch.isfinite(saved_t).all())
        and int(saved_t.reshape(())) == 0
        and float(count_t.sum()) > 0
    )
    if unknown:
        state_dict[key] = torch.ceil(count_t / 3.0).to(torch.int64)


def _own_device(value: object) -> torch.device:
    """A saved value's own device: a tensor's, else the CPU (numbers)."""
    return value.device if isinstance(value, Tensor) else torch.device("cpu")


def shift_vector(argument: str, shift: float | Sequence[float], outputs: int) -> Tensor:
    """``shift`` as a float64 ``(outputs,)`` vector; raises naming ``argument`` on a bad value."""
    try:
        vector = torch.as_tensor(shift, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"{argument}: expected a number or a sequence of numbers, got {shift!r}"
        ) from error
    if not bool(torch.isfinite(vector).all()):
        raise ValueError(f"{argument}: expected finite values, got {vector.tolist()}")
    if vector.numel() == 1:
        return vector.expand(outputs).clone()
    if vector.numel() != outputs:
        raise ValueError(
            f"{argument}: expected a scalar or {outputs} values (num_outputs), got {vector.numel()}"
        )
    return vector


def shift_state(argument: str, shift: float | Sequence[float], outputs: int) -> MetricAccumulator:
    """A shift as a state: constant (the MAX of equal values), and saved with the sums.

    The sums are of values minus the shift, so they mean something only with that shift;
    ``Metric.load_state_dict`` refuses a checkpoint taken with another one.
    """
    return MetricAccumulator.constant(shift_vector(argument, shift, outputs))
