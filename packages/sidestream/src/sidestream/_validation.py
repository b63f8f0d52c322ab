"""Input checks shared by the metrics.

Checks on metadata (type, dtype, shape, device) are free and raise at once. Checks on values
must not add a host sync on CUDA, so they take the policy of ``screen_invalid``.
"""

from __future__ import annotations

import math
import sys
from numbers import Integral, Real

import torch
from torch import Tensor
from torch.compiler import is_compiling

from sidestream._shapes import broadcasts_to
from sidestream.state import MetricAccumulator

__all__ = [
    "check_int",
    "refuse_distributed",
    "expected_text",
    "found_outside",
    "found_where",
    "ignore_index_of",
    "as_tensor",
    "check_dense",
    "check_tensor",
    "check_broadcastable",
    "check_floating",
    "check_same_shape",
    "check_weight_number",
    "checks_stay_on_device",
    "summing_dtype",
    "SUM_STATE_DTYPE",
    "screen_invalid",
    "WIDE_UNSIGNED",
]


_BOOL = torch.bool
_INT64 = torch.int64
_iinfo = torch.iinfo
"""Read by the update helpers below instead of through ``torch``: a compiled update that reaches
the torch module through this module's globals and another's pays an identity guard, run in
Python, on every call."""


WIDE_UNSIGNED = frozenset(
    dtype
    for dtype in (getattr(torch, name, None) for name in ("uint16", "uint32", "uint64"))
    if dtype is not None
)
"""Unsigned dtypes wider than uint8: torch (2.11 to 2.13) lacks most CPU kernels for them."""


def expected_text(template: str, *values: object) -> str:
    """``template.format(*values)``: what a check expected, for its error message.

    While compiling the bare template: the text is only read where a CPU update raises, and
    compiled with ``dynamic=True`` the values (class counts, vocabulary sizes) may be symbolic
    integers, which Dynamo cannot format into a string.
    """
    if torch.compiler.is_compiling():
        return template
    return template.format(*values)


def given_as_number(value: object) -> bool:
    """Whether ``value``, which ``as_tensor`` took, was not a tensor (a number it made one).

    Here, not at the caller: a compiled update that reads ``Tensor`` through another module
    too checks on every call, in Python, that both are the same class.
    """
    return not isinstance(value, Tensor)


def as_tensor(
    argument: str, value: object, device: torch.device, *, floating: bool = False
) -> Tensor:
    """Return ``value`` as a tensor on ``device``; Python numbers are converted.

    With ``floating`` (an argument that takes floating-point values) a Python ``int`` becomes
    a float tensor, as ``3.0`` would. Python floats become float64 tensors (exact), ints int64.

    Raises:
        TypeError: If ``value`` is neither a tensor nor a real number, or is a complex, sparse,
            nested or masked tensor.
        ValueError: If ``value`` is a tensor on another device than the metric, or a Python
            number out of float64's range (``floating`` or a float) or int64's (an int).
    """
    if isinstance(value, Tensor):
        if type(value) is not Tensor:
            refuse_distributed(argument, value)
            _refuse_masked(argument, value)
        check_dense(argument, value)
        if value.is_complex():
            # No metric here is defined on complex numbers; casting would drop the imaginary part.
            raise TypeError(f"{argument}: expected a real tensor, got dtype {value.dtype}")
        if value.device != device:
            raise ValueError(
                f"{argument}: expected a tensor on the metric's device {device}, got one on "
                f"{value.device}; move the metric with .to(device) or the tensor"
            )
        # detach() makes a new tensor object: skip it when there is no graph to cut.
        return value.detach() if value.requires_grad else value
    # A tuple, not int | float: torch 2.8's dynamo cannot trace isinstance with a
    # types.UnionType (a compiled update given a number).
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"{argument}: expected a torch.Tensor or a number, got {type(value)}")
        # Another real number (numpy.float32, numpy.int64, Fraction) as the Python one.
        value = int(value) if isinstance(value, Integral) else float(value)
    # A fill kernel, not a host-to-device copy from pageable memory (which would sync on CUDA).
    # A Python float is a double: float64, never torch's default dtype (float32 would round
    # 0.1 and 2**53 + 2, and overflow at 1e39 before a float64 state sees the value).
    if floating or isinstance(value, float):
        if is_compiling() and isinstance(value, float):
            return compiled_number(value, torch.float64, device)
        try:
            number = float(value)
        except OverflowError:  # an int past float64's range; its digits could fill a screen
            raise ValueError(
                f"{argument}: expected a number within float64's range (about 1.8e308), got "
                f"an int of {abs(int(value)).bit_length()} bits"
            ) from None
        return torch.full((), number, dtype=torch.float64, device=device)
    if not -(2**63) <= value < 2**63:
        raise ValueError(
            f"{argument}: expected an integer in [-2**63, 2**63) (it becomes an int64 tensor), "
            f"got one of {abs(int(value)).bit_length()} bits"
        )
    return torch.full((), value, dtype=torch.int64, device=device)


def compiled_number(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A Python float given to a compiled update, as a 0-dim tensor that stays a graph input.

    torch (``specialize_float=False``) passes a float argument into the graph as a tensor,
    unless an op takes it as a Python number: ``torch.full((), value)`` (or ``float(value)``)
    made Dynamo bake it into the graph as a constant, so every new value (a learning rate, a
    token count as a float) compiled again, and the 9th failed a ``fullgraph=True`` step at
    torch's recompile limit. Added to a tensor it stays an input: dynamic from its second
    value, as a Python int is. Exact: ``0 + value`` in float64 is ``value``.
    """
    return torch.zeros((), dtype=dtype, device=device) + value


def refuse_distributed(argument: str, value: Tensor) -> None:
    """Raise ``TypeError`` naming ``argument`` if ``value`` is a ``DTensor``.

    Its ops into a plain state tensor raised a bare ``AssertionError`` or "mixed torch.Tensor
    and DTensor" after a state had already taken the batch (a mean's sum, not its count). Which
    part to count is the caller's choice: the local part, or the whole (a collective). For
    ``Run.log`` too: reading one could start a collective on the ranks that log.
    """
    # Looked up, not imported: a process that never imported DTensor holds none, and the
    # import costs more than an update.
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(value, module.DTensor):
        raise TypeError(
            f"{argument}: expected a plain torch.Tensor, got a DTensor (placements "
            f"{tuple(value.placements)}); pass {argument}.to_local() (this rank's part) or "
            f"{argument}.full_tensor() (the whole tensor, a collective every rank must join)"
        )


def check_floating_dtype(argument: str, dtype: object) -> None:
    """Raise ``TypeError`` naming ``argument`` unless ``dtype`` is a floating ``torch.dtype``.

    For a state's accumulation dtype: an integer one would truncate every float value.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{argument}: expected a floating-point torch.dtype (torch.float64, torch.float32, "
            f"...), got {dtype!r}"
        )


# The dtype of ``SumMetric``'s and ``MeanMetric``'s sums (each batch's and the running one),
# whatever their ``dtype``, which is only the result's: a float32 sum overflowed past 3.4e38 (a
# mean of ten values of 1e38 was inf) and stopped growing at 2**24 added ones. Summing a
# float32 batch in float64 costs what adding its float32 sum into a float64 state would.
SUM_STATE_DTYPE = torch.float64


def summing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a metric keeps a running sum of ``dtype`` results in: float64 below 32 bits.

    A float16 sum overflows past 65504 and, adding ones, stops growing at 2048; a bfloat16 one
    stops at 256. A mean of many values then came out inf or percent-off while the mean itself
    fits the dtype. Such sums are kept in float64 (exact to 2**53 added ones, as
    ``MeanMetric``'s count) and rounded into ``dtype`` once, by ``compute``.
    """
    return torch.float64 if dtype.itemsize < 4 else dtype


def check_floating(argument: str, tensor: Tensor) -> None:
    """Raise ``TypeError`` naming ``argument`` unless ``tensor`` has a floating dtype."""
    if not tensor.is_floating_point():
        raise TypeError(f"{argument}: expected a floating-point tensor, got dtype {tensor.dtype}")


def check_same_shape(preds: Tensor, target: Tensor) -> None:
    """Raise ``ValueError`` naming ``target`` unless it has exactly ``preds``' shape."""
    if target.shape != preds.shape:
        hint = ""
        if preds.shape == (*target.shape, 1):
            hint = " (a trailing axis of size 1: pass preds.squeeze(-1))"
        elif target.shape == (*preds.shape, 1):
            hint = " (a trailing axis of size 1: pass target.squeeze(-1))"
        raise ValueError(
            f"target: expected the shape of preds {tuple(preds.shape)}, got "
            f"{tuple(target.shape)}{hint}"
        )


def check_dense(argument: str, value: Tensor) -> None:
    """Raise ``TypeError`` naming ``argument`` unless ``value`` is a dense tensor.

    Sparse layouts and nested tensors are refused here (``as_tensor``), for every metric:
    further in, the first operator without a kernel for them failed instead (``aten::amax``
    for sparse COO values of ``MaxMetric``, "NestedTensorImpl doesn't support sizes" for a
    nested ``preds``), naming neither the argument nor a fix. A nested tensor of the default
    layout reports ``torch.strided``, so it is refused by ``is_nested``, not by its layout.
    """
    if value.is_nested:
        raise TypeError(
            f"{argument}: expected a dense tensor, got a nested tensor; pass its components "
            "concatenated (torch.cat), or one update each"
        )
    if value.layout is not torch.strided:
        raise TypeError(
            f"{argument}: expected a dense tensor, got layout {value.layout}; pass "
            f"{argument}.to_dense()"
        )


def _refuse_masked(argument: str, value: Tensor) -> None:
    """Raise ``TypeError`` naming ``argument`` if ``value`` is a ``torch.masked`` tensor.

    Its ``__torch_dispatch__`` failed on the first operator it has no rule for, naming
    neither the argument nor a fix.
    """
    # Looked up, not imported (as refuse_distributed's DTensor): a process that made a
    # MaskedTensor has imported it, and the import costs more than an update.
    masked = sys.modules.get("torch.masked")
    if masked is not None and isinstance(value, masked.MaskedTensor):
        raise TypeError(
            f"{argument}: expected a plain torch.Tensor, got a torch.masked MaskedTensor; "
            f"pass the kept elements ({argument}.get_data()[{argument}.get_mask()]), or "
            "for the classification metrics an ignore_index in the target"
        )


def check_tensor(argument: str, value: object, device: torch.device) -> Tensor:
    """Return ``value`` detached, after checking it is a tensor on ``device``.

    Raises:
        TypeError: If ``value`` is not a dense tensor (sparse layouts, nested and masked
            tensors are refused).
        ValueError: If it lives on another device than the metric (``as_tensor``'s check).
    """
    if not isinstance(value, Tensor):
        raise TypeError(f"{argument}: expected a torch.Tensor, got {type(value)}")
    if value.dtype in WIDE_UNSIGNED:
        # torch has no comparison or reduction kernels for them on the CPU: an update died in
        # aminmax or clamp, with an error that named neither the argument nor a fix.
        raise TypeError(
            f"{argument}: dtype {value.dtype} has too few torch kernels to be checked and "
            f"counted; convert it first ({argument}.long() or .int())"
        )
    return as_tensor(argument, value, device)


def check_int(argument: str, value: object, minimum: int) -> None:
    """Raise naming ``argument`` unless ``value`` is an int ``>= minimum`` (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{argument}: expected an int >= {minimum}, got {value!r} ({type(value).__name__})"
        )
    if value < minimum:
        raise ValueError(f"{argument}: expected an int >= {minimum}, got {value}")


def check_weight_number(argument: str, value: object) -> None:
    """Raise ``ValueError`` naming ``argument`` for a number that is not a finite weight >= 0.

    Anything but a Python (or numpy) number passes: a tensor is checked with its batch. A
    number is on the host already, so it is read on every device, even where tensor weights are
    counted and dropped on the device, and whatever the batch holds (an empty one too).
    Compiling, a number is an input of the graph (a check would break it): the device path
    counts and drops its batch.
    """
    if isinstance(value, Real) and not isinstance(value, bool) and not is_compiling():
        number = float(value)
        if not (number >= 0 and math.isfinite(number)):
            raise ValueError(f"{argument}: expected a finite value >= 0, got {value!r}")


def check_broadcastable(argument: str, tensor: Tensor, target: Tensor, target_name: str) -> None:
    """Raise ``ValueError`` unless ``tensor`` broadcasts to ``target``'s shape exactly."""
    if not broadcasts_to(tuple(tensor.shape), tuple(target.shape)):
        raise ValueError(
            f"{argument}: expected a scalar or a shape broadcastable to the shape of {target_name} "
            f"{tuple(target.shape)}, got {tuple(tensor.shape)}"
        )


def found_outside(values: Tensor, low: float, high: float, *, whole: bool = False) -> str:
    """For a CPU error message: up to three values outside ``[low, high]`` and how many.

    NaN counts as outside, and with ``whole`` so does a number with a fraction. Reads the
    values on the host: call it only where the update raises anyway.
    """
    flat = values.detach().reshape(-1)
    bad = ~((flat >= low) & (flat <= high))
    if whole and flat.is_floating_point():
        bad |= flat != flat.round()
    return _found(flat, bad)


def found_where(values: Tensor, invalid: Tensor) -> str:
    """For a CPU error message: up to three of ``values`` where ``invalid`` is true, and how many.

    ``invalid`` must broadcast to ``values``. Reads the values on the host: call it only where
    the update raises anyway.
    """
    bad = invalid.detach().expand(values.shape).reshape(-1)
    return _found(values.detach().reshape(-1), bad)


def _found(flat: Tensor, bad: Tensor) -> str:
    count = int(bad.sum())
    if not count:
        return ""
    # Integers in full (a class index of 1234567), floats to float32's precision (1.0000001).
    shown = ", ".join(
        str(value) if isinstance(value, int) else f"{value:.8g}" for value in flat[bad][:3].tolist()
    )
    more = ", ..." if count > 3 else ""
    return f" (found {shown}{more}: {count} of {flat.numel()} elements)"


def ignore_index_of(target: Tensor, ignore_index: int | None) -> int | None:
    """``ignore_index`` as it applies to ``target``: ``None`` where its dtype cannot hold it.

    torch compares a Python int in the tensor's own integer dtype, so ``-100`` against uint8
    ids is ``156``, and id 156 would be taken for padding. An index the dtype cannot hold
    matches no element: nothing is ignored.
    """
    dtype = target.dtype
    # The dtypes as constants of this module: reaching torch through it as well as through the
    # caller's module costs a compiled update an identity guard in Python on every call.
    if ignore_index is None or dtype is _INT64 or dtype.is_floating_point:
        return ignore_index  # int64 and floats hold any index given (checked as an int)
    if dtype is _BOOL:
        return ignore_index  # bools compare as integers
    limits = torch.iinfo(dtype)
    return ignore_index if limits.min <= ignore_index <= limits.max else None


def checks_stay_on_device(device: torch.device) -> bool:
    """Whether value checks on ``device`` must stay on the device (count and drop, no raise).

    True on any device but the CPU, CUDA first (a host read would sync), and inside
    ``torch.compile`` on any device (a host read would break the graph); false in eager mode on
    the CPU, where reading is free. The meta device takes the device path too, so counting its
    dispatched ops counts the kernels CUDA would launch (``benchmarks/kernel_count.py``).
    """
    # is_compiling by name, not torch.compiler.is_compiling: a compiled update that reaches the
    # torch module through two modules' globals pays an identity guard, run in Python, per call.
    return device.type != "cpu" or is_compiling()


def any_flag(invalid: Tensor) -> Tensor:
    """``invalid.any()``, or ``invalid`` itself when it is a 0-dim bool already.

    Each kernel is a launch on CUDA, the host cost of a small update: a flag the caller
    reduced needs no second reduction.
    """
    return invalid if invalid.dim() == 0 and invalid.dtype == _BOOL else invalid.any()


def clamped(values: Tensor, low: float, high: float) -> Tensor:
    """``values.clamp(low, high)``: ``values`` where in range (and NaN), else the nearer bound.

    ``values == clamped(values, ...)`` is the in-range mask in two kernels, where two
    comparisons and their "and" are three, each a launch on CUDA. An integer dtype's bounds
    are first clipped to its range (``clamp`` refuses a bound the dtype cannot hold, which
    excludes nothing the dtype can hold); the range must overlap the dtype's.
    """
    if not values.is_floating_point() and values.dtype != _BOOL:
        info = _iinfo(values.dtype)
        low, high = max(low, info.min), min(high, info.max)
    return values.clamp(low, high)


def not_finite(values: Tensor) -> Tensor:
    """True where floating-point ``values`` are NaN or infinite, in two kernels.

    ``x - x`` is exactly 0 for every finite ``x`` and NaN for an infinity or NaN. Eager
    ``~torch.isfinite`` is five kernels (a comparison with itself, ``abs``, a comparison with
    inf, their product and the negation), each a launch on CUDA.
    """
    return (values - values) != 0


def any_not_finite(first: Tensor, *others: Tensor) -> Tensor:
    """0-dim bool: whether any element of the floating-point tensors is NaN or infinite.

    ``not_finite``'s ``x - x`` summed (0 exactly when every element is finite, else NaN), so
    the verdict is reduced once for all the tensors, whose shapes must broadcast.
    """
    zeros = first - first
    for other in others:
        zeros = zeros + (other - other)
    return zeros.sum() != 0


def drop_invalid(
    invalid: Tensor, rejected: MetricAccumulator, *sums: Tensor | tuple[Tensor, ...]
) -> None:
    """``screen_invalid``'s device path for a batch already summed: ``sums`` zeroed if it is bad.

    ``rejected`` counts the batch when any element of ``invalid`` is true, and each of ``sums``
    (a tuple counts as its tensors: ``state.stacked_sums`` when compiling) is filled with 0
    then, in place: they must be the caller's own results (an out-of-place fill is a copy and a
    fill, two launches on CUDA). A fill, not a product with a keep flag: a dropped batch's NaN
    or inf must not leak (0 * inf is NaN), and no negated flag is made. Only where
    ``checks_stay_on_device``: the caller has taken the device path. Compiling, it leaves the
    metric's freshness flag to the caller, which adds its sums into the metric's states right
    after (that clears it).
    """
    bad = any_flag(invalid)
    if is_compiling():
        # The caller adds its sums right after (accumulate_sums), which clears the metric's
        # one flag, the counter's too.
        rejected._add_unflagged(bad)
    else:
        rejected.accumulate(bad)  # a bool adds as 0 or 1
    for value in sums:
        for part in value if isinstance(value, tuple) else (value,):
            part.masked_fill_(bad, 0)


def screen_invalid(
    invalid: Tensor | bool,
    rejected: MetricAccumulator,
    argument: str,
    expected: str,
    found: str = "",
    *,
    values: Tensor | None = None,
) -> Tensor | None:
    """Apply the bad-value policy to a batch.

    On the CPU reading the values costs no device sync, so a batch with any ``invalid``
    element raises ``ValueError`` at once, before the state changes.

    On CUDA (any device but the CPU), and inside ``torch.compile`` on any device (a host read
    would break the graph), the check stays on the device: the whole batch is dropped (the
    caller zeroes its contribution with the returned keep flag) and ``rejected`` counts one
    rejected update. The count is reduced and checkpointed with the state and exposed by the
    metric, so bad input is reported with the result instead of stalling the training thread.

    Args:
        invalid: A boolean tensor, true where an element is out of range, or a Python bool
            (true: some element is) from a check already read on the host.
        rejected: The metric's int64 SUM counter of rejected updates.
        argument: The argument name for the error message.
        expected: What valid values look like, for the error message.
        found: What the batch held instead, for the error message (``found_outside``).
        values: The checked values, that ``invalid`` (a tensor) marks: without ``found``, the
            CPU error message shows those marked (``found_where``).

    Returns:
        ``None`` when the batch is valid on CPU; on CUDA a 0-dim bool tensor, true to keep the
        batch.
    """
    if isinstance(invalid, bool):
        if invalid:
            raise ValueError(
                f"{argument}: expected {expected}; this batch has values that are not{found}"
            )
        return None
    if not checks_stay_on_device(invalid.device):
        if bool(invalid.any()):
            if not found and values is not None:
                found = found_where(values, invalid)
            raise ValueError(
                f"{argument}: expected {expected}; this batch has values that are not{found}"
            )
        return None
    bad = any_flag(invalid)
    rejected.accumulate(bad)  # a bool adds as 0 or 1 (no cast: one guard less per compiled call)
    return ~bad
