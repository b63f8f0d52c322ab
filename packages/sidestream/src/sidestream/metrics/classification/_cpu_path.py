"""The CPU path of the classification updates.

On CPU the values are already in host memory, so reading them costs no device sync: a value
check can be read into a Python bool, and counts can come from ``torch.bincount``, several times
faster there than ``index_add_``. On CUDA both would stall the host, so the device paths
(fixed-size ``index_add_`` with 0/1 weights, checks kept as device flags) are the only ones used
there. ``enabled`` is the single switch; tests turn it off to run the device paths on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sidestream import _scratch
from sidestream._validation import clamped

__all__ = [
    "CHUNK_ELEMENTS",
    "EDGE_LIFT",
    "bin_scale",
    "bincount_enabled",
    "binning_scores",
    "count_in_chunks",
    "count_indices",
    "count_valid_indices",
    "fold_bins",
    "enabled",
    "outside",
    "score_bins",
]

_INT32_LIMIT = 2**31 - 1

CHUNK_ELEMENTS = 2**18
"""Elements per chunk of a large CPU-path batch: its int32/float32 temporaries (1 MiB each)
fit in cache and are recycled by the allocator."""


def enabled(device: torch.device) -> bool:
    """Whether updates on ``device`` may read values on the host (CPU, not compiling)."""
    # The negation of checks_stay_on_device, written out: this runs on every update.
    return device.type == "cpu" and not torch.compiler.is_compiling()


def bincount_enabled(device: torch.device) -> bool:
    """Whether counts on ``device`` may come from ``bincount``: the CPU path, or compiling for CPU.

    Off CUDA ``bincount`` reads nothing back to a device, so a compiled CPU update may use it
    too (inductor runs it faster than its ``index_add_``); tests that turn ``enabled`` off run
    the device paths instead, as without compiling.
    """
    return device.type == "cpu" and (enabled(device) or torch.compiler.is_compiling())


def outside(values: Tensor, low: float, high: float) -> Tensor | bool:
    """Whether any of the non-empty ``values`` is outside ``[low, high]`` or NaN.

    On the CPU path one fused min/max pass, read into a Python bool; otherwise a 0-dim bool
    tensor that stays on the device.
    """
    if enabled(values.device):
        if low == 0 and high == 1 and values.numel() >= _BITS_FROM and _surely_in_unit(values):
            return False
        # Eager aminmax reduces every element without a flattening view (a dispatch that
        # costs small batches as much as the reduction). NaN propagates through aminmax and
        # compares false: outside.
        smallest, largest = torch.aminmax(values)
        return not (smallest.item() >= low and largest.item() <= high)
    if values.numel() >= _REDUCED_FROM and values.dtype != torch.bool:
        # The clamped copy below is as large as the batch (213 MB of extra memory for 2048 x
        # 21,841 float32 scores); aminmax reads the batch with no temporary, and NaN
        # propagates through it and compares false: outside.
        smallest, largest = torch.aminmax(values)
        return ~((smallest >= low) & (largest <= high))
    # Three kernels (an aminmax and its two comparisons, an "and" and a "not" are five, each a
    # launch on CUDA): clamping moves exactly the values outside [low, high], and NaN, which
    # clamp keeps, never equals itself.
    return (clamped(values, low, high) != values).any()


_REDUCED_FROM = 1 << 20
"""Elements from which the device-path ``outside`` reduces with ``aminmax`` (five kernels, no
temporary) instead of comparing a clamped copy (three kernels, a copy of the batch): past a
million elements the launches cost nothing next to the batch, and the copy is megabytes."""


_BITS_FROM = 1 << 16
"""Elements from which ``outside(values, 0, 1)`` first tries ``_surely_in_unit`` (measured on
one thread: 2.4x faster for float32 at 1M elements, 1.4x for int64; slower for small ones)."""

_UNIT_BITS = {
    torch.float32: (torch.int32, 0x3F800000),
    torch.float16: (torch.int16, 0x3C00),
    torch.bfloat16: (torch.int16, 0x3F80),
}
"""Per float dtype: the integer dtype of its bits, and the bits of 1.0."""


def _surely_in_unit(values: Tensor) -> bool:
    """True only if every one of ``values`` is certainly in ``[0, 1]``, by a cheaper pass.

    False means not known: the caller's exact check decides (it finds, say, -0.0 inside).
    """
    bits = _UNIT_BITS.get(values.dtype)
    if bits is not None:
        # Non-negative floats order as their bits, as integers. A set sign bit (every negative,
        # -0.0, a negative NaN) reads below 0, and a positive NaN or inf above 1.0's bits.
        # Integer aminmax is vectorized; float aminmax, with its NaN handling, is not.
        smallest, largest = torch.aminmax(values.view(bits[0]))
        return smallest.item() >= 0 and largest.item() <= bits[1]
    if values.dtype == torch.int64 and values.is_contiguous():
        # aminmax has no vector kernel for int64, amax has: bytes of at most 1 clear the sign
        # bit (so every value is >= 0), and then a maximum of 1 leaves 0 and 1. Flattened
        # first: a contiguous tensor may still have a last stride other than 1 (a size-1 last
        # dimension, as a (N, 1, H, W) mask's .movedim(1, -1) has), which a view as bytes
        # refuses, while the flat view of a contiguous tensor always has stride 1.
        flat = values.view(-1)
        return flat.view(torch.uint8).amax().item() <= 1 and flat.amax().item() <= 1
    return False


def count_indices(index: Tensor, size: int, weight: Tensor | None = None) -> Tensor:
    """int64 counts of each value of ``index`` in ``[0, size)``, elements weighted 0 or 1.

    Args:
        index: Integer indices; those of weight-1 elements must lie in ``[0, size)``.
        size: The number of counts.
        weight: 0/1 weights of ``index``'s shape (integer or bool); ``None`` counts all.

    Returns:
        A ``(size,)`` int64 tensor. Where ``bincount_enabled`` (CPU, eager or compiled) it
        comes from ``bincount``, weight-0 elements sent to an extra bin that is dropped; on the
        device path the weights are added with ``index_add_``.
    """
    flat = index.reshape(-1)
    if bincount_enabled(index.device):
        if weight is None:
            counts = torch.bincount(flat, minlength=size)
            # Sliced when compiling: the output's size is the largest index + 1 as far as a
            # compiler knows. Eager, it is exactly size already (indices are in range).
            return counts[:size] if torch.compiler.is_compiling() else counts
        flat = torch.where(weight.reshape(-1).bool(), flat, size)
        return torch.bincount(flat, minlength=size + 1)[:size]
    source = torch.ones_like(flat) if weight is None else weight.reshape(-1).to(torch.int64)
    counts = torch.zeros(size, dtype=torch.int64, device=index.device)
    return counts.index_add_(0, flat, source)


def count_in_chunks(
    count: Callable[[Tensor, Tensor], Tensor], preds: Tensor, target: Tensor
) -> Tensor | None:
    """``count(preds, target)`` of a large CPU batch, summed over chunks of its samples.

    Each chunk's temporaries (about ``CHUNK_ELEMENTS`` elements) stay in cache and are reused by
    the allocator, where batch-sized ones are fresh memory paged in on every update, which costs
    more than the arithmetic (multilabel and multiclass batches: their per-element temporaries
    are wide). Integer counts add exactly, so the sum is the whole batch's count.

    A chunk that raises makes ``count`` run on the whole batch as given: that raises the error
    the whole batch gets (a bad ``preds`` value is named before a bad ``target`` in a later
    chunk). The caller's state is untouched either way.

    Args:
        count: Integer counts of one batch (same shape for every batch). It raises on a bad
            batch and must not change any state.
        preds: The batch's predictions, samples along the first dimension.
        target: Its targets, with as many samples as ``preds``.

    Returns:
        The summed counts, or ``None`` when the batch is not worth chunking (fewer than two
        chunks' elements, or samples that do not pair up): the caller counts it whole.
    """
    if preds.numel() < 2 * CHUNK_ELEMENTS or preds.dim() == 0 or target.dim() == 0:
        return None
    rows = preds.shape[0]
    if rows < 2 or target.shape[0] != rows:
        return None
    step = max(1, CHUNK_ELEMENTS * rows // preds.numel())
    total: Tensor | None = None
    try:
        chunks = zip(torch.split(preds, step), torch.split(target, step), strict=True)
        for chunk_preds, chunk_target in chunks:
            counts = count(chunk_preds, chunk_target)
            total = counts if total is None else total.add_(counts)
    except (TypeError, ValueError):
        return count(preds, target)
    return total


def count_valid_indices(
    index: Tensor, size: int, weight: Tensor | None, valid: Tensor
) -> tuple[Tensor, Tensor]:
    """``count_indices`` of a batch checked per element, and whether any element failed.

    One ``bincount`` counts the batch and its invalid elements together (in a slot past the
    counts, weight-0 elements in one more), so a compiled graph checks the batch in the pass
    that makes the index instead of in a reduction of its own. Where ``bincount_enabled``.

    Args:
        index: Integer indices; those of valid weight-1 elements must lie in ``[0, size)``.
        size: The number of counts.
        weight: 0/1 weights broadcastable to ``index`` (integer or bool), or ``None``.
        valid: Bools broadcastable to ``index``: false where an element failed a check.

    Returns:
        ``(counts, invalid)``: the ``(size,)`` int64 counts of the valid elements, and a
        ``(1,)`` bool, true if any element was not valid (the caller drops the batch then).
    """
    if weight is not None:
        index = torch.where(weight.bool(), index, size)
    index = torch.where(valid, index, size + 1).reshape(-1)
    counts = torch.bincount(index, minlength=size + 2)
    # Every index is below minlength, so this holds; compiled, the length is otherwise
    # data-dependent and slicing past ``size`` cannot be traced.
    torch._check(counts.shape[0] == size + 2)  # type: ignore[no-untyped-call]
    return counts[:size], counts[size + 1 :] > 0


def score_bins(
    scores: Tensor, num_bins: int, rows: int, *, scratch: bool = False, lift: float = 0.0
) -> Tensor:
    """CPU path: uniform-bin indices of validated scores in ``[0, 1]``, laid out for rows.

    The index of a score is ``bin + row_offset`` with rows of ``num_bins + 1`` slots: the extra
    slot holds scores of exactly 1.0 (or that round up to ``num_bins``), which ``fold_bins``
    moves into the last bin afterwards, so no clamp pass is needed. int32 when ``rows`` rows
    fit, which halves the memory traffic of the index.

    Args:
        scores: Probabilities in ``[0, 1]`` (already checked).
        num_bins: Bins over ``[0, 1]``.
        rows: The number of rows the caller will offset into (for the dtype choice).
        scratch: Return this thread's scratch tensor (``sidestream._scratch``), valid until
            the next call that takes it: for a chunk loop, which then allocates nothing per
            chunk.
        lift: ``bin_scale``'s lift factor (0: ``EDGE_LIFT``, the ranking bins').

    Returns:
        Integer bin indices of ``scores``' shape, in ``[0, num_bins]``.
    """
    dtype = torch.int32 if rows * (num_bins + 1) <= _INT32_LIMIT else torch.int64
    # The same float64 product and truncation as the device path's bin index (copy_ converts
    # exactly, as .to does).
    if scratch and scores.numel() <= SCRATCH_ELEMENTS:
        product = _scratch.scratch("score_bins.product", torch.float64, scores.shape, scores.device)
        product.copy_(scores)
        product.mul_(bin_scale(num_bins, lift))
        index = _scratch.scratch("score_bins.index", dtype, scores.shape, scores.device)
        index.copy_(product)
    else:
        index = (binning_scores(scores) * bin_scale(num_bins, lift)).to(dtype)
    if num_bins >= _SPILL_FROM:
        # The nudge is a whole bin or more here (float32 rounding gets there a little before
        # 2**20 bins): 1.0 would land past the extra slot, in the next row.
        index.clamp_max_(num_bins)
    return index


_SPILL_FROM = 2**19
"""Bin counts from which ``score_bins`` clamps: below, ``1.0 * bin_scale(num_bins)`` is less
than ``num_bins + 1``, so every index is at most ``num_bins`` (float64 gets there at 2**20;
the margin is float32's, which binned here before)."""


SCRATCH_ELEMENTS = 4 * CHUNK_ELEMENTS
"""The largest chunk ``score_bins`` bins into scratch tensors (a chunk of a large batch; when
the histogram itself is larger, chunks are larger and allocate as before)."""


def binning_scores(scores: Tensor) -> Tensor:
    """``scores`` as float64, the one dtype every score is binned in.

    One map from score to bin for float16, bfloat16, float32 and float64 batches alike:
    binning each in its own dtype is monotone within a dtype only (a float32 product just below
    an edge rounds up to it, the float64 product of a slightly higher score does not), and
    batches of several dtypes may meet in one histogram (or across ranks). Every narrower
    float converts to float64 exactly, and float64 scores keep their resolution.
    """
    return scores if scores.dtype == torch.float64 else scores.double()


def bin_scale(num_bins: int, lift: float = 0.0) -> float:
    """The factor that maps a score in ``[0, 1]`` to its bin: ``num_bins``, nudged up.

    A decimal score such as 0.29 is stored a hair below its value (``0.29 * 100`` is
    28.999999999999996 in float64), so a bare ``floor(score * num_bins)`` puts a score that sits
    on a bin edge into the bin below, next to 0.28. Scaling by ``num_bins * (1 + 2**-20)`` lifts
    every edge score into its own bin for float32 and float64 scores (their rounding error is at
    most ``2**-24`` relative; the product is float64, ``binning_scores``) and moves only scores
    within about ``1e-6`` relative below an edge,
    so scores with ``d`` decimals land in distinct bins once ``num_bins >= 10**d``.

    A ``lift`` factor other than 0 replaces ``EDGE_LIFT`` (the calibration metrics lift by
    their scores' own rounding, ``calibration._edge_lift``).
    """
    return num_bins * (lift or EDGE_LIFT)


EDGE_LIFT = 1.0 + 2.0**-20
"""The relative lift of ``bin_scale``: a score this close below a bin edge counts at the edge
(threshold edges are divided by it, the same rule)."""


def fold_bins(counts: Tensor, rows: int, num_bins: int) -> Tensor:
    """Fold ``bincount`` output over ``rows`` rows of ``num_bins + 1`` slots into ``num_bins``.

    Returns:
        The flattened ``(rows, num_bins)`` counts, the extra slot added to the last bin.
    """
    table = counts.view(rows, num_bins + 1)
    table[:, -2] += table[:, -1]
    return table[:, :-1].reshape(-1)
