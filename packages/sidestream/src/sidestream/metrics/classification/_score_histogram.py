"""Fixed-size score histograms shared by the ranking metrics (AUROC, average precision).

Scores are probabilities in ``[0, 1]``. Bin ``b`` of ``num_bins`` holds scores in
``[b / num_bins, (b + 1) / num_bins)`` (1.0 goes to the last bin). For every class the state
counts negatives and positives per bin, so memory is ``2 * classes * num_bins`` int64 counts
whatever the number of samples, and two ranks' states add.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from sidestream._validation import (
    as_tensor,
    check_floating,
    check_same_shape,
    checks_stay_on_device,
    screen_invalid,
)
from sidestream.metric import Metric
from sidestream.metrics.classification import _host
from sidestream.state import MetricAccumulator

__all__: list[str] = []

Problem = Literal["binary", "multiclass", "multilabel"]
Average = Literal["macro", "weighted", "none"]

_AVERAGES = ("macro", "weighted", "none")


def bin_index(scores: Tensor, num_bins: int) -> Tensor:
    """The uniform-bin index of each score, clamped into ``[0, num_bins)``.

    Equivalent to ``torch.bucketize`` on ``linspace(0, 1, num_bins + 1)`` but without a
    boundary tensor or a binary search. Multiplying by a constant is monotone under rounding, so
    a higher score never lands in a lower bin, which is all the error bounds rely on. NaN and
    out-of-range scores get a valid index too (their batch is screened out), so a bad value can
    never index out of bounds on the device.
    """
    work = scores if scores.dtype == torch.float64 else scores.float()
    return (work * num_bins).to(torch.int64).clamp_(0, num_bins - 1)


def not_binary(target: Tensor) -> Tensor | bool:
    """True if any of the non-empty ``target`` is neither 0 nor 1.

    A Python bool on the host path, else a 0-dim bool on the device (``screen`` takes the
    device branch only when every check is a CUDA tensor).
    """
    if target.dtype == torch.bool:
        if _host.host_fast_path(target.device):
            return False
        return torch.zeros((), dtype=torch.bool, device=target.device)
    if target.is_floating_point():
        return ((target != 0) & (target != 1)).any()
    return _host.outside(target, 0, 1)


def screen(
    checks: list[tuple[Tensor | bool, str, str]], rejected: MetricAccumulator
) -> Tensor | None:
    """Apply ``screen_invalid`` to several arguments, counting a bad batch once on CUDA.

    Args:
        checks: ``(invalid, argument, expected)`` per argument; ``invalid`` is a bool where the
            check was read on the host.
        rejected: The metric's rejected-update counter.

    Returns:
        ``None`` off CUDA (a bad batch raised, naming the argument); on CUDA a 0-dim bool keep
        flag.
    """
    flags = [check for check, _, _ in checks]
    if any(isinstance(flag, bool) or not checks_stay_on_device(flag.device) for flag in flags):
        for invalid, argument, expected in checks:
            screen_invalid(invalid, rejected, argument, expected)
        return None
    invalid = torch.stack([flag.any() for flag in flags if isinstance(flag, Tensor)]).any()
    names = "/".join(argument for _, argument, _ in checks)
    return screen_invalid(invalid, rejected, names, "valid values")


def check_average(average: str) -> None:
    """Raise ``ValueError`` unless ``average`` is one of macro, weighted, none."""
    if average not in _AVERAGES:
        raise ValueError(f"average: expected one of {_AVERAGES}, got {average!r}")


def check_positive_int(argument: str, value: int, minimum: int) -> None:
    """Raise naming ``argument`` unless ``value`` is an int ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{argument}: expected an int >= {minimum}, got {value!r}")


def average_classes(values: Tensor, support: Tensor, average: str) -> Tensor:
    """Average per-class values; classes whose value is NaN (undefined) are left out.

    ``macro`` is the plain mean, ``weighted`` weighs each class by its number of positives
    (scikit-learn's ``average="weighted"``), ``none`` returns the per-class vector.
    """
    if average == "none":
        return values
    defined = ~torch.isnan(values)
    weights = torch.ones_like(values) if average == "macro" else support.to(values.dtype)
    weights = torch.where(defined, weights, 0.0)
    return torch.where(defined, values, 0.0).mul(weights).sum() / weights.sum()


class ScoreHistogramMetric(Metric[Tensor]):
    """Base of the ranking metrics: per-class histograms of negative and positive scores.

    Subclasses choose the problem and turn the histograms into a value with ``_per_class``.

    Args:
        problem: ``binary`` (scores and 0/1 targets of any equal shape), ``multiclass``
            (``(N, C)`` scores and ``(N,)`` class indices, one-vs-rest) or ``multilabel``
            (``(N, L)`` scores and ``(N, L)`` 0/1 targets).
        num_classes: Classes (multiclass) or labels (multilabel); 1 for binary.
        num_bins: Histogram bins over ``[0, 1]``.
        average: ``macro``, ``weighted`` or ``none`` (per class); ignored for binary.
    """

    def __init__(self, problem: Problem, num_classes: int, num_bins: int, average: str) -> None:
        check_positive_int("num_bins", num_bins, 2)
        minimum = 1 if problem == "binary" else 2
        check_positive_int(
            "num_classes" if problem == "multiclass" else "num_labels", num_classes, minimum
        )
        check_average(average)
        self._problem = problem
        self._num_classes = num_classes
        self._num_bins = num_bins
        self._average = average
        # Layout (is_positive, class, bin), flattened so one index_add_ fills it.
        self._histogram = MetricAccumulator(
            torch.zeros(2 * num_classes * num_bins, dtype=torch.int64)
        )
        self._rejected = MetricAccumulator(0, dtype=torch.int64)

    @property
    def num_bins(self) -> int:
        """The number of histogram bins over ``[0, 1]``."""
        return self._num_bins

    @property
    def rejected_updates(self) -> Tensor:
        """How many updates were dropped for bad values (CUDA only; CPU raises instead)."""
        return self._rejected.value

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch of scores and targets.

        Args:
            preds: Probabilities in ``[0, 1]``, floating point. Binary: any shape;
                multiclass and multilabel: ``(N, C)``.
            target: Binary: 0/1 of ``preds``' shape (int, bool or float); multiclass: ``(N,)``
                class indices in ``[0, C)``; multilabel: 0/1 of shape ``(N, C)``.

        Raises:
            TypeError: If ``preds`` is not floating point.
            ValueError: On a wrong shape or class count (always), or (CPU) a score outside
                ``[0, 1]`` / NaN or a target outside its range. On CUDA such a batch is dropped
                and counted in ``rejected_updates`` instead.
        """
        preds_t = as_tensor("preds", preds, self.device)
        target_t = as_tensor("target", target, self.device)
        check_floating("preds", preds_t)
        self._check_shapes(preds_t, target_t)
        if preds_t.numel() == 0:
            return
        classes, bins = self._num_classes, self._num_bins
        if self._problem == "multiclass":
            target_check = _host.outside(target_t, 0, classes - 1)
            target_expected = f"class indices in [0, {classes})"
        else:
            target_check, target_expected = not_binary(target_t), "0 or 1"
        keep = screen(
            [
                (_host.outside(preds_t, 0, 1), "preds", "probabilities in [0, 1]"),
                (target_check, "target", target_expected),
            ],
            self._rejected,
        )
        if self._problem == "binary":
            preds_t, target_t = preds_t.reshape(-1, 1), target_t.reshape(-1, 1)
        slots = 2 * classes * (bins + 1)
        if _host.host_fast_path(self.device) and preds_t.numel() >= slots:
            # bincount's O(slots) pass pays off once the batch is at least that large.
            self._histogram.accumulate(self._host_counts(preds_t, target_t))
            return
        if self._problem == "multiclass":
            positive = target_t.unsqueeze(1) == torch.arange(classes, device=self.device)
        else:
            # Compared, not used as is: a dropped batch may hold any target value.
            positive = target_t == 1
        # Fused in place: index = bin + class * bins + is_positive * classes * bins.
        index = bin_index(preds_t, bins)
        if classes > 1:
            index.add_(torch.arange(0, classes * bins, bins, device=self.device))
        index.add_(positive.to(torch.int64), alpha=classes * bins)
        if keep is None:
            source = torch.ones((), dtype=torch.int64, device=self.device)
        else:
            source = keep.to(torch.int64)
        self._histogram.scatter_add(index, source.expand(index.shape))

    def _host_counts(self, preds: Tensor, target: Tensor) -> Tensor:
        """The histogram of one checked batch by ``bincount`` (host path, CPU).

        ``preds`` is ``(M, classes)``; ``target`` ``(M,)`` class indices (multiclass) or 0/1 of
        ``preds``' shape, already checked, so it is the positive flag as it is. Large batches go
        in row chunks whose temporaries stay in cache and are reused by the allocator, instead
        of fresh batch-sized buffers paged in on every update.
        """
        rows = 2 * self._num_classes
        slots = rows * (self._num_bins + 1)
        # At least as many elements per chunk as bincount zeroes, so that pass stays minor.
        step = max(_host.CHUNK_ELEMENTS, slots) // self._num_classes
        total = self._chunk_counts(preds[:step], target[:step], slots)
        for start in range(step, preds.shape[0], step):
            end = start + step
            total += self._chunk_counts(preds[start:end], target[start:end], slots)
        return _host.fold_bins(total, rows, self._num_bins)

    def _chunk_counts(self, preds: Tensor, target: Tensor, slots: int) -> Tensor:
        classes, bins = self._num_classes, self._num_bins
        stride = bins + 1
        index = _host.score_bins(preds, bins, 2 * classes)
        if classes > 1:
            index += torch.arange(
                0, classes * stride, stride, dtype=index.dtype, device=index.device
            )
        if self._problem == "multiclass":
            # One offset per sample at its true class, not an (N, C) comparison.
            samples = torch.arange(index.shape[0], device=index.device)
            index[samples, target.long()] += classes * stride
        else:
            index.add_(target.to(index.dtype), alpha=classes * stride)
        return torch.bincount(index.reshape(-1), minlength=slots)

    def _check_shapes(self, preds: Tensor, target: Tensor) -> None:
        classes = self._num_classes
        if self._problem == "multiclass" and (
            target.is_floating_point() or target.dtype == torch.bool
        ):
            raise TypeError(f"target: expected integer class indices, got dtype {target.dtype}")
        if self._problem == "binary":
            check_same_shape(preds, target)
            return
        name = "num_classes" if self._problem == "multiclass" else "num_labels"
        if preds.ndim != 2 or preds.shape[1] != classes:
            raise ValueError(
                f"preds: expected shape (N, {classes}) for {name}={classes}, "
                f"got {tuple(preds.shape)}"
            )
        expected = (preds.shape[0],) if self._problem == "multiclass" else tuple(preds.shape)
        if tuple(target.shape) != expected:
            raise ValueError(f"target: expected shape {expected}, got {tuple(target.shape)}")

    def histograms(self) -> tuple[Tensor, Tensor]:
        """``(negatives, positives)`` counts per class and bin, each ``(classes, num_bins)``."""
        counts = self._histogram.value.view(2, self._num_classes, self._num_bins)
        return counts[0], counts[1]

    def _per_class(self, negatives: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _reduce(self, pick: int) -> Tensor:
        negatives, positives = (h.to(torch.float64) for h in self.histograms())
        per_class = self._per_class(negatives, positives)[pick]
        if self._problem == "binary":
            return per_class[0]
        return average_classes(per_class, positives.sum(-1), self._average)

    def compute(self) -> Tensor:
        """The value (a scalar, or per class with ``average="none"``); NaN where undefined."""
        return self._reduce(0)

    def error_bound(self) -> Tensor:
        """A certified bound on ``|compute() - exact|`` from the histograms alone.

        The exact value (scikit-learn's on the same scores) lies within this distance of
        ``compute()``; same shape as ``compute()``.
        """
        return self._reduce(1)


def auroc_from_histograms(negatives: Tensor, positives: Tensor) -> tuple[Tensor, Tensor]:
    """AUROC per class and its error bound from float64 ``(classes, bins)`` histograms.

    A positive scores above every negative in a lower bin and ties with half of the negatives of
    its own bin (the trapezoid over bin thresholds). Only pairs sharing a bin can be misjudged,
    and each by at most half a pair, so the bound is ``0.5 * sum_b P_b N_b / (P * N)``.
    Classes without positives or without negatives are NaN.
    """
    below = negatives.cumsum(-1) - negatives
    pairs = positives.sum(-1) * negatives.sum(-1)
    auroc = (positives * (below + 0.5 * negatives)).sum(-1) / pairs
    bound = 0.5 * (positives * negatives).sum(-1) / pairs
    return auroc, bound


def average_precision_from_histograms(
    negatives: Tensor, positives: Tensor
) -> tuple[Tensor, Tensor]:
    """Average precision per class and its error bound from ``(classes, bins)`` histograms.

    Like scikit-learn, ``sum_k (R_k - R_{k-1}) P_k`` over thresholds from high to low, here the
    bin edges. A positive in bin ``b`` has, at its own exact threshold, a precision between
    ``(TP_above + 1) / (TP_above + 1 + FP_b)`` and ``TP_b / (TP_b + FP_above)``; the histogram
    uses ``TP_b / (TP_b + FP_b)``, inside that interval, so the bound is the positive-weighted
    width of the intervals. Classes without positives are NaN.
    """
    positives_desc, negatives_desc = positives.flip(-1), negatives.flip(-1)
    true_pos = positives_desc.cumsum(-1)
    false_pos = negatives_desc.cumsum(-1)
    true_above, false_above = true_pos - positives_desc, false_pos - negatives_desc
    has_positive = positives_desc > 0
    ones = torch.ones_like(true_pos)
    precision = true_pos / torch.where(has_positive, true_pos + false_pos, ones)
    highest = true_pos / torch.where(has_positive, true_pos + false_above, ones)
    lowest = (true_above + 1) / (true_above + 1 + false_pos)
    total = positives.sum(-1)
    ap = (positives_desc * precision).sum(-1) / total
    bound = (positives_desc * (highest - lowest)).sum(-1) / total
    return ap, bound
