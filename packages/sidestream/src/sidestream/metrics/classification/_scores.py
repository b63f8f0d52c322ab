"""Score inputs of the ranking and calibration metrics: shapes, logits, ignore_index, checks."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from sidestream._validation import (
    check_floating,
    check_same_shape,
    checks_stay_on_device,
    clamped,
    expected_text,
    found_outside,
    found_where,
    ignore_index_of,
    screen_invalid,
)
from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification._inputs import (
    PROBABILITIES,
    Check,
    Found,
    check_tensor,
    not_binary,
    outside,
    screen,
)
from sidestream.metrics.classification._problem import Problem, ProblemKind, class_axis_hint
from sidestream.state import MetricAccumulator

__all__ = ["ScoreBatch", "score_batch", "screen_elements"]


class ScoreBatch(NamedTuple):
    """One checked batch, flattened to rows.

    Attributes:
        scores: ``(M, C)`` probabilities in ``[0, 1]`` (C = 1 for binary).
        target: ``(M,)`` class indices (multiclass) or ``(M, C)`` 0/1 values; ignored and
            dropped elements hold a valid placeholder.
        weight: ``(M,)`` (multiclass) or ``(M, C)`` 0/1 int64 weights of ``ignore_index``
            (a dropped batch's zero folded in), or ``None`` when every element counts.
        keep: Without ``ignore_index``, where the checks stay on the device: a 0-dim bool,
            false when the whole batch is dropped. One flag, not a batch-sized weight: counts
            are scaled by it once (a compiled CPU update would otherwise fill and select a
            weight per element). ``None`` when nothing is dropped (on the CPU a bad batch raised).
        valid: With ``per_element`` where the checks stay on the device, instead of ``keep``:
            a bool per element, broadcastable to ``scores``, false where a value fails a check
            (``ignore_index`` elements pass). Nothing was counted: pass whether any is false to
            ``screen_elements``, and drop the whole batch if so.
    """

    scores: Tensor
    target: Tensor
    weight: Tensor | None
    keep: Tensor | None = None
    valid: Tensor | None = None


def _rows(problem: Problem, preds: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """``preds`` as ``(M, C)`` rows and ``target`` as ``(M,)`` / ``(M, C)``; shape checks."""
    classes = problem.num_classes
    if problem.kind is ProblemKind.BINARY:
        check_same_shape(preds, target)
        return preds.reshape(-1, 1), target.reshape(-1, 1)
    name = problem.size_name
    if preds.ndim < 2 or preds.shape[1] != classes:
        raise ValueError(
            f"preds: expected shape (N, {classes}, ...) for {name}={classes}, "
            f"got {tuple(preds.shape)}"
            + class_axis_hint(
                preds.shape,
                classes,
                last=False,
                labels=problem.kind is ProblemKind.MULTILABEL,
            )
        )
    if problem.kind is ProblemKind.MULTICLASS:
        expected = (preds.shape[0], *preds.shape[2:])
        if target.is_floating_point() or target.dtype == torch.bool:
            raise TypeError(f"target: expected integer class indices, got dtype {target.dtype}")
        if tuple(target.shape) != expected:
            column = tuple(target.shape) == (*expected, 1)
            raise ValueError(
                f"target: expected shape {expected}, got {tuple(target.shape)}"
                + ("; for a column of class indices pass target.squeeze(-1)" if column else "")
            )
        return preds.movedim(1, -1).reshape(-1, classes), target.reshape(-1)
    check_same_shape(preds, target)
    return preds.movedim(1, -1).reshape(-1, classes), target.movedim(1, -1).reshape(-1, classes)


def score_batch(
    problem: Problem,
    preds: object,
    target: object,
    device: torch.device,
    rejected: MetricAccumulator,
    *,
    exact: bool = False,
    per_element: bool = False,
) -> ScoreBatch | None:
    """Check and flatten one update's ``(preds, target)``; ``None`` for an empty batch.

    Binary: scores and 0/1 targets of any equal shape. Multiclass: scores ``(N, C, ...)`` and
    class indices ``(N, ...)``. Multilabel: scores ``(N, L, ...)`` and 0/1 targets of that
    shape. With ``problem.logits`` the scores go through a sigmoid (binary, multilabel) or a
    softmax over ``C`` (multiclass) first.

    With ``exact`` (the stored scores of an exact ranking metric, whose value depends only on
    their order) binary and multilabel scores are returned as the logits themselves, in their
    dtype (only NaN is rejected: a sigmoid maps every other logit into ``[0, 1]``): a float32
    sigmoid rounds every logit above about 17 to 1.0, which would tie samples the logits order
    (the sigmoid is monotone, so the logits rank alike, and widening them to float64 later
    keeps that order). A multiclass softmax runs in float64.

    With ``per_element``, where the checks stay on the device (CUDA, compiling), they are not
    reduced here: the batch carries ``valid`` per element, for a caller that folds it into a
    pass it makes anyway (a compiled CPU histogram counts invalid elements in a slot of its
    own, so its graph reads the batch once, not once for the checks and again for the bins).

    Raises:
        TypeError: On a non-tensor or a wrong dtype.
        ValueError: On a wrong shape or device, or (CPU) a probability outside ``[0, 1]`` / NaN
            or a target outside its range; on CUDA the batch is dropped and counted instead.
    """
    preds_t = check_tensor("preds", preds, device)
    target_t = check_tensor("target", target, device)
    check_floating("preds", preds_t)
    binary = problem.kind is ProblemKind.BINARY and problem.ignore_index is None
    if binary and not problem.logits and _cpu_path.enabled(device):
        return _host_binary(preds_t, target_t, rejected, exact)
    scores, labels = _rows(problem, preds_t, target_t)
    if scores.numel() == 0:
        return None
    ranked: Tensor | None = None  # what an exact metric stores, if not the probabilities
    found: Found | None = None  # where a CPU error finds values
    if problem.logits:
        if problem.kind is ProblemKind.MULTICLASS:
            expected = (
                "logits without NaN or +inf, and no row of only -inf (the softmax of such a "
                "row is NaN)"
            )
        else:
            expected = "logits without NaN"
        if exact and problem.kind is not ProblemKind.MULTICLASS:
            # The logits themselves, in their dtype (widening to float64 keeps their order).
            # A sigmoid maps every logit but NaN into [0, 1], so that is all there is to check.
            ranked = scores
        else:
            if exact:
                work = scores.to(torch.float64)
            else:
                work = scores if scores.dtype == torch.float64 else scores.float()
            multiclass = problem.kind is ProblemKind.MULTICLASS
            if multiclass:
                # A message names the logits passed, not every element of their softmax rows,
                # which one bad logit makes NaN.
                found = functools.partial(_bad_logits, scores)
            scores = work.softmax(-1) if multiclass else work.sigmoid()
    else:
        expected = PROBABILITIES
    weight: Tensor | None = None
    checked = labels
    ignore = ignore_index_of(labels, problem.ignore_index)
    if ignore is not None:
        kept = labels != ignore
        weight = kept.to(torch.int64)
        # A valid placeholder, so ignored elements are neither checked nor indexed out of range.
        labels = torch.where(kept, labels, 0)
        checked = labels
    if ranked is None:
        # `is None`, not `found or ...`: dynamo before torch 2.13 cannot take the truth value
        # of a functools.partial ("Data-dependent branching"), a fullgraph compile failed.
        if found is None:
            found = (scores, 0, 1, False)
        checks: list[Check] = [(outside(scores, 0, 1), "preds", expected, found)]
    else:
        inf = torch.inf  # NaN only
        checks = [(outside(scores, -inf, inf), "preds", expected, (scores, -inf, inf, False))]
    if per_element and checks_stay_on_device(device):
        if problem.kind is ProblemKind.MULTICLASS:
            labels = clamped(labels, 0, problem.num_classes - 1)  # invalid ones index nothing
        final = scores if ranked is None else ranked
        valid = _valid_elements(problem, final, checked, nan_only=ranked is not None)
        return ScoreBatch(final, labels, weight, valid=valid)
    suffix = "" if ignore is None else expected_text(" or ignore_index={}", ignore)
    if problem.kind is ProblemKind.MULTICLASS:
        classes = problem.num_classes
        in_range = expected_text("class indices in [0, {})", classes) + suffix
        found = (checked, 0.0, classes - 1.0, False)
        checks.append((outside(checked, 0, classes - 1), "target", in_range, found))
    else:
        checks.append((not_binary(checked), "target", f"0 or 1{suffix}", (checked, 0, 1, True)))
    keep = screen(checks, rejected)
    if keep is not None:
        if weight is not None:
            weight, keep = weight * keep, None
        # Dropped batches may hold anything: keep indices in range.
        if problem.kind is ProblemKind.MULTICLASS:
            labels = clamped(labels, 0, problem.num_classes - 1)
    return ScoreBatch(scores if ranked is None else ranked, labels, weight, keep)


def _bad_logits(logits: Tensor) -> str:
    """For a CPU error message: the multiclass logits whose softmax row is NaN.

    A NaN or +inf logit, and every logit of a row of only -inf (no range names those).
    """
    bad = logits.isnan() | logits.isposinf() | logits.isneginf().all(-1, keepdim=True)
    return found_where(logits, bad)


def _valid_elements(problem: Problem, scores: Tensor, target: Tensor, nan_only: bool) -> Tensor:
    """``score_batch``'s checks per element: true where the score and its target pass.

    A NaN score fails both comparisons, as it fails ``outside``. Multiclass targets are
    ``(M,)`` and come back as a column, broadcast over the classes.
    """
    valid = ~torch.isnan(scores) if nan_only else (scores >= 0) & (scores <= 1)
    if problem.kind is ProblemKind.MULTICLASS:
        in_range = (target >= 0) & (target < problem.num_classes)
        return valid & in_range.unsqueeze(1)
    if target.dtype == torch.bool:
        return valid
    return valid & ((target == 0) | (target == 1))


def screen_elements(invalid: Tensor, rejected: MetricAccumulator) -> Tensor | None:
    """``screen`` for a batch checked with ``per_element``: the same count and message.

    Args:
        invalid: True (any element) where some element of the batch failed a check.
        rejected: The metric's rejected-updates counter.

    Returns:
        The keep flag (``screen_invalid``'s).
    """
    return screen_invalid(invalid, rejected, "preds/target", "valid values")


def _host_binary(
    preds: Tensor, target: Tensor, rejected: MetricAccumulator, exact: bool
) -> ScoreBatch | None:
    """``score_batch`` of binary probabilities without ``ignore_index`` on the CPU path.

    The same checks, messages and order as the general path, read on the host directly: a
    small batch's update is dominated by per-call overhead, not by its arithmetic. A bad batch
    raises (``screen_invalid`` of a host bool), so ``rejected`` is never touched here.

    For an exact metric (which stores int8 labels) a large integer target is checked and
    converted chunk by chunk (``_checked_int8``), so it is read from memory once, not twice.
    """
    check_same_shape(preds, target)
    if preds.numel() == 0:
        return None
    if _cpu_path.outside(preds, 0, 1):
        screen_invalid(True, rejected, "preds", PROBABILITIES, found_outside(preds, 0, 1))
    if target.is_floating_point():
        if not_binary(target):
            _not_binary_target(target, rejected)
    elif exact and target.element_size() > 1 and target.numel() > _TARGET_CHUNK:
        converted = _checked_int8(target)
        if converted is None:
            _not_binary_target(target, rejected)
        else:
            target = converted
    elif target.dtype != torch.bool and _cpu_path.outside(target, 0, 1):
        _not_binary_target(target, rejected)
    return ScoreBatch(preds.reshape(-1, 1), target.reshape(-1, 1), None)


def _not_binary_target(target: Tensor, rejected: MetricAccumulator) -> None:
    """Raise for a binary target that holds something else than 0 and 1 (CPU path)."""
    screen_invalid(True, rejected, "target", "0 or 1", found_outside(target, 0, 1, whole=True))


_TARGET_CHUNK = 1 << 17
"""Elements per chunk of ``_checked_int8``: 1 MiB of int64, read again from cache."""


def _checked_int8(target: Tensor) -> Tensor | None:
    """A large integer ``target`` as a new int8 tensor, or ``None`` if a value is not 0 or 1.

    ``target`` is contiguous-flattened first (a view of its bytes needs that).

    Each chunk is checked, then converted while it is still in cache: one read of the wide
    target from memory instead of a check pass and a conversion pass. The check must come
    first: the conversion wraps (256 would become 0).
    """
    flat = target.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.int8, device=flat.device)
    for piece, dest in zip(
        torch.split(flat, _TARGET_CHUNK), torch.split(out, _TARGET_CHUNK), strict=True
    ):
        # Bytes all 0 or 1 clear the sign bit (value >= 0), then a maximum of 1 leaves 0 and 1:
        # two max reductions, cheaper than aminmax, which has no vector kernel for int64.
        if piece.view(torch.uint8).amax().item() > 1 or piece.amax().item() > 1:
            return None
        dest.copy_(piece)
    return out.view(target.shape)
