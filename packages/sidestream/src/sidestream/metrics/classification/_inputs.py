"""Turn predictions and targets into per-class confusion counts with fixed-size device ops.

Everything here is host-sync free on CUDA: no boolean-mask indexing, no ``bincount``, no
``.item()``. Ignored elements and dropped batches get weight 0 instead of being removed, and
class indices are clamped into range before ``index_add_`` so a dropped batch with garbage labels
can never index out of bounds on the device. On CPU (``_cpu_path.enabled``) checks are read
on the host and raise before anything is counted, so counts come from ``bincount`` and the clamp
is skipped where every value was checked.

This module is the one home of the classification input checks: ``check_tensor`` (type and
device; defined in ``sidestream._validation``, which the language metrics import it from
without importing this family), ``screen`` (the bad-value policy over several checks) and the
per-problem parsers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from sidestream._validation import (
    any_flag,
    check_same_shape,
    check_tensor,
    checks_stay_on_device,
    clamped,
    expected_text,
    found_outside,
    ignore_index_of,
    screen_invalid,
)
from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification._problem import Problem, ProblemKind, class_axis_hint
from sidestream.state import MetricAccumulator

__all__ = [
    "PROBABILITIES",
    "Check",
    "batch_cells",
    "check_tensor",
    "confusion_counts",
    "count_map",
    "count_operands",
    "host_cells_apply",
    "host_confusion_cells",
    "label_flags",
    "multiclass_labels",
    "not_binary",
    "outside",
    "sample_counts",
    "screen",
]

PROBABILITIES = "probabilities in [0, 1] (pass logits=True for logits)"
"""What ``preds`` without ``logits=True`` must hold, for the error messages of every metric."""

_SMALL_MATRIX_CLASSES = 64

_MAPPED_CLASSES = 16
"""Up to this many classes the CPU path derives the four counts with ``count_map``."""

_INDICATOR_MAX_ROWS = 256
"""Up to this many samples a compiled multiclass update counts with per-class indicators (a
small batch is dominated by dispatch, which they save); larger ones keep the matrix, which
measured as fast or faster there."""

_FUSED_MAX_ELEMENTS = 1 << 14
"""From this many scores, ``batch_cells`` takes predictions and the NaN check from one
``max(-1)`` pass."""

Found = tuple[Tensor, float, float, bool] | Callable[[], str]
"""``(values, low, high, whole)``: where a failed check's error message finds the values it
names (``found_outside``); or, where no range says which values are bad, a function that
names them (called only when the check failed)."""

Check = tuple[Tensor | bool, str, str, Found | None]
"""``(invalid elements, argument name, what valid values look like, where to find them)`` for
one value check.

The first item is a bool when the check was already read on the host (CPU fast path)."""

_INF = float("inf")


def screen(checks: list[Check], rejected: MetricAccumulator) -> Tensor | None:
    """Apply ``screen_invalid`` to the value checks of one update.

    On the CPU each check raises with its own argument name, before the state changes. On CUDA
    the checks are folded into one device flag, so a bad batch is counted once in ``rejected``.

    Returns:
        ``None`` when nothing needs dropping (on the CPU, or no checks); on CUDA a 0-dim bool
        tensor, true to keep the batch.
    """
    if not checks:
        return None
    flags = [check[0] for check in checks]
    if all(flag is False for flag in flags):
        return None  # every check already read on the host, and passed: the common case
    if any(isinstance(flag, bool) or not checks_stay_on_device(flag.device) for flag in flags):
        for invalid, argument, expected, source in checks:
            failed = invalid if isinstance(invalid, bool) else bool(invalid.any())
            found = ""
            if failed and source is not None:
                if callable(source):
                    found = source()
                else:
                    values, low, high, whole = source
                    found = found_outside(values, low, high, whole=whole)
            screen_invalid(failed, rejected, argument, expected, found)
        return None
    device_flags = [any_flag(flag) for flag in flags if isinstance(flag, Tensor)]
    any_invalid = device_flags[0]
    for flag in device_flags[1:]:
        any_invalid = any_invalid | flag
    names = "/".join(argument for _, argument, _, _ in checks)
    return screen_invalid(any_invalid, rejected, names, "valid values")


def not_binary(target: Tensor) -> Tensor | bool:
    """True if any of ``target`` is neither 0 nor 1 (see ``outside`` for the result type)."""
    if target.dtype == torch.bool:
        if _cpu_path.enabled(target.device):
            return False
        return torch.zeros((), dtype=torch.bool, device=target.device)
    if target.is_floating_point():
        return outside(torch.where(target == 1, 0, target), 0, 0)
    return outside(target, 0, 1)


def has_nan(scores: Tensor) -> Tensor | bool:
    """True if any score is NaN: a Python bool on the CPU path, else a 0-dim device bool."""
    if _cpu_path.enabled(scores.device):
        if not scores.numel():
            return False
        # amax propagates NaN: one reduction and a read, instead of a mask, any() and a read.
        largest = scores.amax().item()
        return largest != largest
    if scores.numel():
        # amax propagates NaN: no bool per score (a quarter of a float32 batch, half of bf16).
        return scores.amax().isnan()
    return torch.isnan(scores).any()


def _integer(tensor: Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


def _found_rows(rows: Tensor, invalid: Tensor) -> str:
    """For a CPU error message: up to two rows (last dimension) where ``invalid``, how many."""
    flat = rows.detach().reshape(-1, rows.shape[-1])
    bad = invalid.detach().reshape(-1)
    count = int(bad.sum())
    if not count:
        return ""
    shown = "; ".join(str(row) for row in flat[bad][:2].tolist())
    more = "; ..." if count > 2 else ""
    return f" (found {shown}{more}: {count} of {flat.shape[0]} rows)"


def _target_labels(
    num_classes: int, sample_shape: torch.Size, target: Tensor, ignore_index: int | None
) -> tuple[Tensor, Tensor | None, list[Check]]:
    """Class indices ``(M,)``, weights ``(M,)`` (``None``: all 1) and checks for a target."""
    if target.shape == (*sample_shape, num_classes):
        one_hot = target.to(torch.uint8) if target.dtype == torch.bool else target
        is_binary = (one_hot == 0) | (one_hot == 1)
        invalid = ~is_binary.all(-1) | (one_hot.sum(-1) != 1)
        labels = one_hot.argmax(-1).reshape(-1)
        rows = functools.partial(_found_rows, one_hot, invalid)
        return labels, None, [(invalid, "target", "one-hot rows: one 1, zeros elsewhere", rows)]
    if target.shape != sample_shape:
        column = target.shape == (*sample_shape, 1)
        raise ValueError(
            f"target: expected class indices of shape {tuple(sample_shape)} or one-hot targets "
            f"of shape {(*sample_shape, num_classes)} to match preds, got {tuple(target.shape)}"
            + ("; for a column of class indices pass target.squeeze(-1)" if column else "")
        )
    if not _integer(target):
        raise TypeError(f"target: expected integer class indices, got dtype {target.dtype}")
    labels = target.reshape(-1)
    weight = None
    expected = expected_text("class indices in [0, {})", num_classes)
    checked = labels
    ignore_index = ignore_index_of(labels, ignore_index)
    if ignore_index is not None:
        kept = labels != ignore_index
        weight = kept.to(torch.int64)
        checked = torch.where(kept, labels, 0)
        expected += expected_text(" or ignore_index={}", ignore_index)
    found = (checked, 0.0, num_classes - 1.0, False)
    if _cpu_path.enabled(labels.device):
        checks: list[Check] = [(outside(checked, 0, num_classes - 1), "target", expected, found)]
        return _in_range(labels, num_classes, all_checked=ignore_index is None), weight, checks
    # The device path: one clamp serves the check and the in-bounds indices (an ignored
    # element's 0 is in bounds, and its weight is 0).
    bounded = clamped(checked, 0, num_classes - 1)
    invalid = (bounded != checked).any()
    return bounded.long(), weight, [(invalid, "target", expected, found)]


def _in_range(values: Tensor, num_classes: int, all_checked: bool) -> Tensor:
    """int64 class indices in ``[0, C)``, so no index can go out of bounds.

    The device path clamps (a dropped batch may hold anything, and so may ignored elements). On
    the host path values that were all checked have raised already if out of range, so the
    clamp pass is skipped.
    """
    if all_checked and _cpu_path.enabled(values.device):
        return values.long()
    # clamped: a narrow dtype (int8 ids with 130 classes) cannot hold num_classes - 1.
    return clamped(values, 0, num_classes - 1).long()


def outside(values: Tensor, low: float, high: float) -> Tensor | bool:
    """True when any value is outside ``[low, high]`` (or NaN); see ``_cpu_path.outside``."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=values.device)
    return _cpu_path.outside(values, low, high)


def multiclass_labels(
    problem: Problem, preds: Tensor, target: Tensor, rejected: MetricAccumulator
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Predicted classes ``(M, top_k)``, target classes ``(M,)`` and weights ``(M,)`` or ``None``.

    ``preds`` are scores ``(N, ..., C)`` (logits or probabilities: argmax / top-k is the same for
    both) or class indices ``(N, ...)``; ``target`` is class indices ``(N, ...)`` or one-hot
    ``(N, ..., C)``. Value checks go through ``screen``; on CUDA a dropped batch has all weights 0.

    Raises:
        ValueError: On a shape that does not fit ``num_classes`` or ``target``, or (CPU) on
            labels outside ``[0, C)`` other than ``ignore_index`` or a malformed one-hot row.
        TypeError: On a dtype that is neither scores nor class indices.
    """
    num_classes, top_k, ignore_index = problem.num_classes, problem.top_k, problem.ignore_index
    checks: list[Check] = []
    if preds.is_floating_point():
        # At least (N, C): a 1-D float vector is ambiguous (one sample's scores, or class
        # indices in a float dtype), so it is refused rather than read as one sample.
        if preds.ndim < 2 or preds.shape[-1] != num_classes:
            raise ValueError(
                f"preds: expected scores of shape (N, ..., C) with C = num_classes = "
                f"{num_classes}, or integer class indices (N, ...), got "
                f"{preds.dtype} of shape {tuple(preds.shape)}"
                + class_axis_hint(preds.shape, num_classes, last=True, labels=False)
            )
        sample_shape = preds.shape[:-1]
        # Ranked in their own layout and the (M, top_k) result flattened: reshaping the scores
        # copied a class-last view (preds.movedim(1, -1) of (N, C, H, W) scores) whole.
        scores = preds
        # argmax / topk rank NaN as the highest score: a NaN row would be counted as a class.
        checks.append(
            (has_nan(scores), "preds", "scores without NaN", (scores, -_INF, _INF, False))
        )
        if top_k == 1:
            predicted = scores.argmax(-1, keepdim=True).reshape(-1, 1)
        else:
            predicted = scores.topk(top_k, dim=-1).indices.reshape(-1, top_k)
    elif _integer(preds):
        if top_k != 1:
            raise ValueError(f"preds: top_k={top_k} needs scores (N, ..., C), got class indices")
        if preds.ndim >= 2 and preds.shape[-1] == num_classes and target.shape == preds.shape[:-1]:
            # Refused anyway (target fits neither layout), but the target was blamed.
            raise ValueError(
                f"preds: integer preds are class indices of the target's shape, got "
                f"{tuple(preds.shape)} for a target of shape {tuple(target.shape)}; one-hot "
                "or 0/1 predictions (N, ..., C) go in as preds.argmax(-1), or as float scores"
            )
        sample_shape = preds.shape
        flat = preds.reshape(-1, 1)
        checks.append(
            (
                outside(flat, 0, num_classes - 1),
                "preds",
                expected_text("class indices in [0, {})", num_classes),
                (flat, 0.0, num_classes - 1.0, False),
            )
        )
        predicted = _in_range(flat, num_classes, all_checked=True)
    else:
        raise TypeError(
            f"preds: expected floating-point scores or integer class indices, got {preds.dtype}"
        )
    labels, weight, target_checks = _target_labels(num_classes, sample_shape, target, ignore_index)
    keep = screen(checks + target_checks, rejected)
    if keep is not None:
        # Materialized (the copy of an expanded flag is contiguous) so index_add_ gets an
        # ordinary source: one kernel, where ones_like and a product are two.
        weight = keep.expand(labels.shape).long() if weight is None else weight * keep
    return predicted, labels, weight


def _multiclass_counts(
    problem: Problem, preds: Tensor, target: Tensor, rejected: MetricAccumulator
) -> Tensor:
    classes = problem.num_classes
    cell = host_confusion_cells(problem, preds, target, rejected)
    if cell is not None:
        return torch.mv(*count_operands(count_map(classes), cell)).view(4, classes)
    predicted, labels, weight = multiclass_labels(problem, preds, target, rejected)
    if (
        problem.top_k == 1
        and classes <= _SMALL_MATRIX_CLASSES
        and torch.compiler.is_compiling()
        and labels.shape[0] <= _INDICATOR_MAX_ROWS
    ):
        # Compiled small batch: per-class indicators, which inductor fuses into one reduction
        # over the samples; the confusion matrix below would cost an index_put_ fallback
        # kernel, a C x C buffer and their dispatch (a third of a small compiled update).
        # Eager would materialize the (M, C) masks instead, so it keeps the matrix.
        classes_row = torch.arange(classes, device=labels.device)
        is_predicted = predicted.view(-1, 1) == classes_row
        is_target = labels.unsqueeze(-1) == classes_row
        if weight is not None:
            kept = weight.unsqueeze(-1).bool()
            is_predicted, is_target = is_predicted & kept, is_target & kept
        tp = (is_predicted & is_target).sum(0)
        predicted_count, support = is_predicted.sum(0), is_target.sum(0)
    elif problem.top_k == 1 and classes <= _SMALL_MATRIX_CLASSES:
        # A C x C confusion matrix costs one counting pass over the samples; its diagonal,
        # column and row sums are tp, predicted and true counts.
        cell = torch.add(predicted.view(-1), labels, alpha=classes)
        cells = _cpu_path.count_indices(cell, classes * classes, weight)
        if classes <= _MAPPED_CLASSES and not torch.compiler.is_compiling():
            # All four counts are linear in the matrix: one small matrix-vector product
            # instead of eight reductions and differences (per-op dispatch, or a kernel launch
            # each on CUDA, dominates here).
            if _cpu_path.enabled(cells.device):
                counts = torch.mv(count_map(classes), cells)
            else:
                product = torch.mv(device_count_map(classes, cells.device), cells.double())
                counts = product.to(torch.int64)
            return counts.view(4, classes)
        matrix = cells.view(classes, classes)
        tp = matrix.diagonal()
        predicted_count = matrix.sum(0)
        support = matrix.sum(1)
    else:
        ones = torch.ones_like(labels) if weight is None else weight
        hit = (predicted == labels.unsqueeze(-1)).any(-1).to(torch.int64)
        predicted_weight = ones.unsqueeze(-1).expand(predicted.shape).reshape(-1)
        # One counting pass over three stacked count vectors: true positives, support, predicted.
        index = torch.cat((labels, labels + classes, predicted.reshape(-1) + 2 * classes))
        source = torch.cat((hit * ones, ones, predicted_weight))
        stacked = _cpu_path.count_indices(index, 3 * classes, source)
        tp, support, predicted_count = stacked.view(3, classes)
    fp = predicted_count - tp
    fn = support - tp
    return torch.stack((tp, fp, fn, support.sum() - support - fp))


def host_cells_apply(problem: Problem) -> bool:
    """Whether ``problem`` is one ``host_confusion_cells`` can count (decided once per metric).

    Multiclass, ``top_k == 1``, no ``ignore_index`` and ``C <= _MAPPED_CLASSES``. Binary
    problems are excluded even with one class: their ``(N, 1)`` scores against ``(N,)``
    targets are a shape error, not a one-class multiclass batch.
    """
    return (
        problem.kind is ProblemKind.MULTICLASS
        and problem.top_k == 1
        and problem.ignore_index is None
        and problem.num_classes <= _MAPPED_CLASSES
    )


def host_confusion_cells(
    problem: Problem, preds: Tensor, target: Tensor, rejected: MetricAccumulator
) -> Tensor | None:
    """``batch_cells`` for a problem that qualifies (``host_cells_apply``), else ``None``."""
    if not host_cells_apply(problem):
        return None
    return batch_cells(problem.num_classes, preds, target, rejected)


def batch_cells(
    classes: int, preds: Tensor, target: Tensor, rejected: MetricAccumulator
) -> Tensor | None:
    """The common small case on the CPU path, in as few ops as its checks allow.

    For a problem that ``host_cells_apply`` accepts (the caller checks, once): scores
    ``(N, ..., C)`` and class-index targets ``(N, ...)``. It does what ``multiclass_labels``
    and ``_multiclass_counts`` do, with the same checks raising the same errors in the same
    order, minus their per-call generality (which costs several times the arithmetic on small
    batches).

    Returns:
        The int64 ``(M,)`` confusion-matrix cell of each sample, ``target * C + predicted``
        (``count_operands`` turns them into the four counts), or ``None`` for anything else
        (the general path then handles it, and raises for a bad shape or dtype).
    """
    shape = preds.shape
    if (
        not preds.is_floating_point()
        or len(shape) < 2
        or shape[-1] != classes
        or target.shape != shape[:-1]
        or not _integer(target)
        or not preds.numel()
        or not _cpu_path.enabled(preds.device)
    ):
        return None
    scores = preds if len(shape) == 2 else preds.reshape(-1, classes)
    # max and amax propagate NaN: one reduction where isnan().any() is two. A large batch
    # takes its predictions from the same max(-1) pass (same indices as argmax, ties and NaN
    # included), and the NaN check then reads only the row maxima; on a small one the extra
    # output of max(-1) costs more than a second pass.
    if scores.numel() >= _FUSED_MAX_ELEMENTS:
        row_largest, predicted = scores.max(-1)
        largest = row_largest.amax().item()
    else:
        predicted, largest = None, scores.amax().item()
    if largest != largest:
        found = found_outside(scores, -_INF, _INF)
        screen_invalid(True, rejected, "preds", "scores without NaN", found)
    labels = target if target.ndim == 1 else target.reshape(-1)
    low, high = torch.aminmax(labels)
    if not (low.item() >= 0 and high.item() <= classes - 1):
        found = found_outside(labels, 0, classes - 1)
        screen_invalid(True, rejected, "target", f"class indices in [0, {classes})", found)
    if predicted is None:
        predicted = scores.argmax(-1)
    return torch.add(predicted, labels, alpha=classes)


def count_operands(count_map: Tensor, cell: Tensor) -> tuple[Tensor, Tensor]:
    """``(matrix, vector)`` whose product is a batch's four counts, ``(4 * C,)`` int64.

    ``count_map`` is ``count_map(C)``, ``cell`` the samples' cells from ``batch_cells``.
    Usually the batch's confusion matrix (``bincount``) through the map; a batch of at most
    ``C * C`` samples instead takes the map's columns of its cells, summed by a product with
    ones: that reads no more than the map does and skips ``bincount`` (a fill and two
    reductions, which dominate a small batch).
    """
    rows, cells = cell.shape[0], count_map.shape[1]
    if rows <= cells:
        return count_map.index_select(1, cell), _ones(rows)
    return count_map, torch.bincount(cell, minlength=cells)


@functools.cache
def _ones(rows: int) -> Tensor:
    """A CPU int64 vector of ``rows`` ones, cached (``rows <= 16 * 16``); never written to."""
    # device=: a default device set by the caller (torch.set_default_device) must not leak in.
    return torch.ones(rows, dtype=torch.int64, device="cpu")


@functools.cache
def count_map(classes: int) -> Tensor:
    """The int64 ``(4C, C*C)`` CPU map from a flattened confusion matrix to ``(tp, fp, fn, tn)``.

    Cell ``target * C + predicted`` counts for class ``c`` as a true positive when both are
    ``c``, a false positive when only the prediction is, a false negative when only the target
    is and a true negative when neither is. Cached per class count (64 KiB at most); never
    written to.
    """
    return _build_count_map(classes, torch.device("cpu"), torch.int64)


@functools.cache
def device_count_map(classes: int, device: torch.device) -> Tensor:
    """``count_map`` in float64 on ``device``, built there (a copy from the host would sync).

    CUDA has no int64 matrix product; float64 products of 0/1 entries and counts are exact
    while a batch holds fewer than 2**53 samples. Cached per class count and device.
    """
    return _build_count_map(classes, device, torch.float64)


def _build_count_map(classes: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    # device= everywhere: a default device set by the caller (torch.set_default_device) must
    # not leak in. Division and remainder, not repeat_interleave (which may read its size).
    index = torch.arange(classes, device=device)
    cell = torch.arange(classes * classes, device=device)
    target, predicted = cell // classes, cell % classes  # each cell's row and column
    is_target = target == index.unsqueeze(1)  # (C, C*C): is cell's target class c
    is_predicted = predicted == index.unsqueeze(1)
    stacked = (
        is_target & is_predicted,
        ~is_target & is_predicted,
        is_target & ~is_predicted,
        ~is_target & ~is_predicted,
    )
    return torch.cat(stacked).to(dtype)


def _logit(threshold: float | Tensor) -> float | Tensor:
    """The logit at or above which ``sigmoid(logit) >= threshold``: ``log(t / (1 - t))``.

    Logits are compared with it, not sent through a sigmoid: a float32 sigmoid rounds every
    logit above about 17 to 1.0 (so threshold 1.0 took them as positive) and logits within
    about 1e-7 of 0 to 0.5. ``-inf`` for threshold 0, ``inf`` for 1. Not exact at the bound: a
    logit within a rounding step of it (the float64 logs', or float32's when compared with
    float32 logits) may fall on the other side.
    """
    if isinstance(threshold, Tensor):
        return torch.logit(threshold.to(torch.float64))
    if threshold <= 0.0:
        return -_INF
    if threshold >= 1.0:
        return _INF
    return math.log(threshold) - math.log1p(-threshold)


def _positives(problem: Problem, preds: Tensor) -> tuple[Tensor, list[Check]]:
    if preds.is_floating_point():
        # Half precision is widened so the threshold is compared exactly as given.
        scores = preds if preds.dtype in (torch.float32, torch.float64) else preds.float()
        if problem.logits:
            # NaN >= any threshold is false: a NaN would be counted as a negative.
            nan: Check = (
                has_nan(scores),
                "preds",
                "logits without NaN",
                (scores, -_INF, _INF, False),
            )
            return scores >= _logit(problem.threshold), [nan]
        bad: Check = (outside(scores, 0, 1), "preds", PROBABILITIES, (scores, 0.0, 1.0, False))
        return scores >= problem.threshold, [bad]
    if preds.dtype == torch.bool:
        return preds, []
    if _integer(preds):
        found = (preds, 0.0, 1.0, False)
        return preds == 1, [(outside(preds, 0, 1), "preds", "0/1 predictions", found)]
    raise TypeError(f"preds: expected probabilities, logits or 0/1 predictions, got {preds.dtype}")


def _count(flags: Tensor, problem: Problem) -> Tensor:
    """Per-class count of true ``flags``: (1,) for binary, (L,) over the last dim otherwise."""
    if problem.kind is ProblemKind.BINARY:
        return torch.count_nonzero(flags).reshape(1)
    return torch.count_nonzero(flags.reshape(-1, problem.num_classes), dim=0)


def label_flags(
    problem: Problem, preds: Tensor, target: Tensor, rejected: MetricAccumulator
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Binary and multilabel inputs as ``(positive, truth, weight)`` bool tensors.

    ``positive`` is the thresholded prediction and ``truth`` the target, both of ``preds``'
    shape and already zero where ``weight`` is false; ``weight`` is ``None`` when every element
    counts (no ``ignore_index`` hit, and on the CPU, where a bad batch raised instead).
    """
    labels = problem.num_classes
    # Two dimensions at least: a 1-D (L,) batch is far more likely L binary scores passed by
    # mistake than one sample without its sample dimension.
    if problem.kind is ProblemKind.MULTILABEL and (preds.ndim < 2 or preds.shape[-1] != labels):
        raise ValueError(
            f"preds: expected shape (N, ..., L) with L = num_labels = {labels}, "
            f"got {tuple(preds.shape)}"
            + class_axis_hint(preds.shape, labels, last=True, labels=True)
        )
    check_same_shape(preds, target)
    if target.is_complex():
        raise TypeError(f"target: expected 0/1 targets, got dtype {target.dtype}")
    positive, checks = _positives(problem, preds)
    truth = target if target.dtype == torch.bool else target == 1
    weight: Tensor | None = None
    if target.dtype == torch.bool:
        ignore = ignore_index_of(target, problem.ignore_index)
        if ignore in (0, 1):  # False or True is the ignored label, as for any other dtype
            weight = target != bool(ignore)
    else:
        expected = "0/1 targets"
        checked = target
        ignore = ignore_index_of(target, problem.ignore_index)
        if ignore is not None:
            weight = target != ignore
            checked = torch.where(weight, target, 0)
            expected += expected_text(" or ignore_index={}", ignore)
        # A float target must be exactly 0 or 1 (0.5 is not a label), as the ranking metrics'.
        bad = not_binary(checked) if checked.is_floating_point() else outside(checked, 0, 1)
        checks.append((bad, "target", expected, (checked, 0.0, 1.0, True)))
    keep = screen(checks, rejected)
    if keep is not None:
        weight = keep.expand(target.shape) if weight is None else weight & keep
    if weight is not None:
        positive = positive & weight
        truth = truth & weight
    return positive, truth, weight


def _label_counts(
    problem: Problem, preds: Tensor, target: Tensor, rejected: MetricAccumulator
) -> Tensor:
    positive, truth, weight = label_flags(problem, preds, target, rejected)
    tp = _count(positive & truth, problem)
    predicted_count = _count(positive, problem)
    support = _count(truth, problem)
    if weight is None:
        total = torch.full_like(tp, preds.numel() // problem.num_classes)
    else:
        total = _count(weight, problem)
    fp = predicted_count - tp
    fn = support - tp
    return torch.stack((tp, fp, fn, total - tp - fp - fn))


def confusion_counts(
    problem: Problem, preds: Tensor, target: Tensor, rejected: MetricAccumulator
) -> Tensor:
    """Per-class int64 counts of one batch, ``(4, C)``: rows tp, fp, fn, tn.

    Binary problems have one class (the positive one), multilabel problems one per label.
    Raises (CPU) or drops and counts (CUDA) as documented on the metric.
    """
    if problem.kind is ProblemKind.MULTICLASS:
        return _multiclass_counts(problem, preds, target, rejected)
    return _label_counts(problem, preds, target, rejected)


def sample_counts(
    problem: Problem, preds: Tensor, target: Tensor, rejected: MetricAccumulator
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample, per-class ``(tp, fp, fn, tn)`` int64 counts, each ``(N, C)``.

    A sample is one index of the first dimension; its counts run over every other position
    (torchmetrics' ``multidim_average="samplewise"``). Fixed-size ops only: one-hot indicators
    summed over the positions, no masking. Checks and policy as ``confusion_counts``.
    """
    samples = preds.shape[0] if preds.ndim else 1
    classes = problem.num_classes
    if problem.kind is ProblemKind.MULTICLASS:
        predicted, labels, weight = multiclass_labels(problem, preds, target, rejected)
        chosen = torch.zeros(labels.shape[0], classes, dtype=torch.int64, device=labels.device)
        chosen.scatter_(1, predicted, 1)
        # scatter_, not one_hot: indicators by one fixed-size op on every device.
        truth = torch.zeros_like(chosen).scatter_(1, labels.unsqueeze(1), 1)
        kept = torch.ones_like(labels) if weight is None else weight.to(torch.int64)
        kept = kept.unsqueeze(1)
        positive, actual = chosen * kept, truth * kept
    else:
        positive_flags, truth_flags, weight = label_flags(problem, preds, target, rejected)
        positive = positive_flags.reshape(-1, classes).to(torch.int64)
        actual = truth_flags.reshape(-1, classes).to(torch.int64)
        if weight is None:
            kept = torch.ones_like(positive)
        else:
            kept = weight.reshape(-1, classes).to(torch.int64)

    def per_sample(flags: Tensor) -> Tensor:
        return flags.reshape(samples, -1, classes).sum(1)

    tp = per_sample(positive * actual)
    predicted_count, support = per_sample(positive), per_sample(actual)
    total = per_sample(kept.expand(positive.shape))
    fp, fn = predicted_count - tp, support - tp
    return tp, fp, fn, total - tp - fp - fn
