"""Small binary ranking batches checked and counted (or stored) with numpy on the CPU path.

A batch of a few thousand scores costs a torch update about a dozen operator dispatches (checks,
bin index, offsets, ``index_add_``), each of which costs more than its arithmetic. The same
steps through numpy views of the tensors (no copies: CPU tensors share their memory) cost a
fraction of that, and ``np.add.at`` (fast since numpy 1.25) adds the counts straight into the
histogram state. The bins and checks are those of the torch path: the same float product and
truncation (``_binning.bin_index``), the same messages, raised before the state changes. An
exact metric's batch takes the same checks, then is kept in its ``SampleStore`` as the torch
path keeps it.

Only on the CPU path (``_cpu_path.enabled``) and only when numpy 1.25 or later is installed;
otherwise, and for any input this path does not take, the caller uses the torch path.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sidestream._samples import SampleStore
from sidestream._validation import found_outside, screen_invalid
from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification._inputs import PROBABILITIES
from sidestream.state import MetricAccumulator

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = ["BinaryHostCounter", "borrow_checked", "checked_arrays"]

MAX_ELEMENTS = 1 << 16
"""The largest batch taken here: above it the torch path's chunked ``bincount`` is faster per
element than ``np.add.at``, and the dispatch cost this path saves no longer matters."""

_SCORES = frozenset({torch.float32, torch.float64})
_ONE_BYTE_TARGETS = frozenset({torch.bool, torch.uint8, torch.int8})
_TARGETS = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def _numpy() -> ModuleType | None:
    """The numpy module if installed with the fast ``ufunc.at`` (1.25 or later), else ``None``."""
    try:
        import numpy
    except ImportError:
        return None
    if numpy.lib.NumpyVersion(numpy.__version__) < "1.25.0":
        return None
    return numpy


_np = _numpy()
_UNSIGNED = {} if _np is None else {1: _np.uint8, 2: _np.uint16, 4: _np.uint32, 8: _np.uint64}


class BinaryHostCounter:
    """Counts a small CPU batch of binary probabilities into a ``(2 * num_bins,)`` histogram.

    Layout as the torch path's: negatives in ``[0, num_bins)``, positives after them.

    Args:
        num_bins: Uniform bins over ``[0, 1]``.
    """

    # The histogram tensor last counted into and its numpy view: a view per update costs a
    # small batch about 5% more. Held, so the tensor's id cannot be reused by another. Class
    # defaults: a fresh counter, a copy and one pickled before the view was kept make a view on
    # their first count.
    _counted_into: Tensor | None = None
    _counts: NDArray[Any] | None = None

    def __init__(self, num_bins: int) -> None:
        self._last_bin = num_bins - 1
        self._scale = _cpu_path.bin_scale(num_bins)
        self._positive_offset = num_bins

    def __getstate__(self) -> dict[str, Any]:
        # A copy's view would be a copy of the array, no longer the copied tensor's memory:
        # the copy makes its own view on its first count.
        state = dict(self.__dict__)
        state.pop("_counted_into", None)
        state.pop("_counts", None)
        return state

    @staticmethod
    def available() -> bool:
        """Whether numpy (1.25 or later) is installed."""
        return _np is not None

    def count(
        self,
        histogram: MetricAccumulator,
        preds: object,
        target: object,
        rejected: MetricAccumulator,
    ) -> bool:
        """Check and count one batch, or return ``False`` (nothing done) if it is not for here.

        Taken: the batches ``checked_arrays`` takes.

        Raises:
            ValueError: As ``checked_arrays``, before the histogram changes.
        """
        checked = checked_arrays(preds, target, rejected)
        if checked is None:
            return False
        np = _np
        assert np is not None  # checked_arrays takes nothing without it
        scores, labels, top = checked
        # The torch path's bin: float64 product (float32 scores widened exactly, as there),
        # truncated, then clamped; below 0.99 no score reaches the last bin's upper edge, so no
        # clamp is needed.
        index = np.multiply(scores, self._scale, dtype=np.float64).astype(np.intp)
        if top >= _CLAMP_FROM_BITS[scores.dtype.itemsize]:
            np.minimum(index, self._last_bin, out=index)
        index += labels * np.intp(self._positive_offset)
        local = histogram.local
        if local is not self._counted_into or self._counts is None:
            self._counted_into, self._counts = local, local.numpy()
        np.add.at(self._counts, index, 1)
        histogram.mark_changed()
        return True


def borrow_checked(
    samples: SampleStore, preds: object, target: object, rejected: MetricAccumulator
) -> bool:
    """Check one batch and keep it in an exact metric's store, or return ``False`` (no change).

    Taken: the batches ``checked_arrays`` takes. The scores are kept as given, with no copy
    (``SampleStore.borrow``), and so is a one-byte target; a wider one becomes new int8 labels.
    The store's rows are those of the torch path.

    Raises:
        ValueError: As ``checked_arrays``, before anything is stored.
    """
    checked = checked_arrays(preds, target, rejected)
    if checked is None:
        return False
    np = _np
    assert np is not None and isinstance(preds, Tensor) and isinstance(target, Tensor)
    # Kept in their shape: a field of one-element rows takes any (SampleStore.borrow), and a
    # view per update would be one more object for the garbage collector to scan.
    if target.dtype in _ONE_BYTE_TARGETS:
        labels = target  # 0 and 1 in one byte: the store converts them to int8 exactly
    else:
        labels = torch.from_numpy(checked[1].astype(np.int8))
    samples.borrow(scores=preds.detach() if preds.requires_grad else preds, labels=labels)
    return True


def checked_arrays(
    preds: object, target: object, rejected: MetricAccumulator
) -> tuple[NDArray[Any], NDArray[Any], int] | None:
    """Flat numpy views of a checked batch and its largest score's bits, or ``None``.

    Taken: plain (dense) CPU tensors of the same shape, float32/float64 ``preds`` and bool or
    integer ``target``, at most ``MAX_ELEMENTS`` elements, for a metric (its ``rejected``
    counter) on the CPU path. Anything else (another device, shape or dtype, an empty batch,
    compiling) is left to the torch path, which checks it in full.

    Returns:
        The scores and labels (views of the tensors where their layout allows), and the largest
        score's bits as an unsigned integer (no score is above 1.0).

    Raises:
        ValueError: If a score is outside ``[0, 1]`` or NaN, or a target is not 0 or 1,
            before anything is kept (the torch path's messages).
    """
    np = _np
    if (
        np is None
        # First: compiling, the checks below (is_neg) would break the graph.
        or not _cpu_path.enabled(rejected.device)
        or type(preds) is not Tensor
        or type(target) is not Tensor
        # Before any size: a nested tensor of the default layout says strided, and its shape
        # raises. Left to the torch path, whose check_tensor refuses it naming the argument.
        or preds.is_nested
        or target.is_nested
        or preds.dtype not in _SCORES
        or target.dtype not in _TARGETS
        or preds.shape != target.shape
        or preds.layout is not torch.strided
        or target.layout is not torch.strided
        or preds.is_neg()  # a lazily negated view (.conj().imag): numpy() refuses it
        or target.is_neg()
        or not 0 < preds.numel() <= MAX_ELEMENTS
        or preds.device.type != "cpu"
        or target.device.type != "cpu"
    ):
        return None
    scores = (preds.detach() if preds.requires_grad else preds).numpy()
    labels = target.numpy()
    if scores.ndim != 1:
        scores, labels = scores.reshape(-1), labels.reshape(-1)
    # One reduction per argument, over the bits as unsigned integers: for floats >= 0 the
    # order of the bits is the order of the values, and a negative number (sign bit) or
    # NaN has bits above 1.0's. Only -0.0 (valid) lands there too: the exact check decides.
    # A negative integer target has bits above 1 as well.
    top = int(np.maximum.reduce(scores.view(_UNSIGNED[scores.dtype.itemsize])))
    if top > _ONE_BITS[scores.dtype.itemsize]:
        # NaN compares false: outside, as on the torch path.
        if not (scores.min() >= 0 and scores.max() <= 1):
            found = found_outside(preds, 0, 1)
            screen_invalid(True, rejected, "preds", PROBABILITIES, found)
        top = _ONE_BITS[scores.dtype.itemsize]  # only -0.0 got here: clamp, to be safe
    bits = _UNSIGNED[labels.dtype.itemsize]
    if labels.dtype != np.bool_ and np.maximum.reduce(labels.view(bits)) > 1:
        found = found_outside(target, 0, 1, whole=True)
        screen_invalid(True, rejected, "target", "0 or 1", found)
    return scores, labels, top


def _bits(value: float, dtype: torch.dtype) -> int:
    """The bits of ``value`` in ``dtype`` as an unsigned integer."""
    unsigned = torch.int32 if dtype == torch.float32 else torch.int64
    bits = int(torch.tensor(value, dtype=dtype).view(unsigned).item())
    return bits % (1 << (8 * dtype.itemsize))


_ONE_BITS = {4: _bits(1.0, torch.float32), 8: _bits(1.0, torch.float64)}
_CLAMP_FROM_BITS = {4: _bits(0.99, torch.float32), 8: _bits(0.99, torch.float64)}
