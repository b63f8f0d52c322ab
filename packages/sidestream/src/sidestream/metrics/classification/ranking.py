"""AUROC and average precision in constant memory, from per-class score histograms.

One generic ``RankingMetric`` does the work; the six public classes only choose its curve and
problem. Bin ``b`` of ``num_bins`` holds scores in ``[b / num_bins, (b + 1) / num_bins)`` (1.0
goes to the last bin), or the bins lie between user-given ``thresholds``. For every class the
state counts negatives and positives per bin, so memory is ``2 * classes * bins`` int64 counts
whatever the number of samples, and two ranks' states add.

``exact=True`` instead stores every score in a ``SampleStore`` (memory grows with the data)
and builds the histograms at ``compute`` with one bin per distinct score, which makes the same
curves exact.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from numbers import Real
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from sidestream._eager import host_call
from sidestream._samples import SampleStore
from sidestream._scratch import scratch
from sidestream.metrics._screened import ScreenedMetric
from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification._average import check_average, mean_over_classes
from sidestream.metrics.classification._binning import Bins
from sidestream.metrics.classification._curves import (
    auroc_from_histograms,
    average_precision_from_histograms,
    partial_auroc_from_histograms,
)
from sidestream.metrics.classification._exact import SKIPPED, tie_histograms
from sidestream.metrics.classification._host_counts import BinaryHostCounter, borrow_checked
from sidestream.metrics.classification._problem import (
    Problem,
    ProblemKind,
    check_problem,
    configure_states,
)
from sidestream.metrics.classification._scores import score_batch, screen_elements
from sidestream.state import MetricAccumulator

_DEVICE_BLOCK = 2**22
"""Scores per block of a device-path histogram update: its float64 scores and int64 slots
(32 MiB each at most), where a whole batch's are 4x a float32 batch."""

__all__ = [
    "BinaryAUROCMetric",
    "BinaryAveragePrecisionMetric",
    "Curve",
    "Estimate",
    "MulticlassAUROCMetric",
    "MulticlassAveragePrecisionMetric",
    "MultilabelAUROCMetric",
    "MultilabelAveragePrecisionMetric",
    "RankingMetric",
]

RankingAverage = Literal["micro", "macro", "weighted", "none"]
Thresholds = Sequence[float] | Tensor | None

DEFAULT_BINS = 10_000


class Curve(enum.Enum):
    """The area a ``RankingMetric`` reports."""

    AUROC = "auroc"
    AVERAGE_PRECISION = "average_precision"


def _int8_labels(labels: Tensor) -> Tensor:
    """0/1 labels (checked) as int8: a view of bool and uint8 labels, else one conversion."""
    if labels.dtype == torch.int8:
        return labels
    if labels.dtype in (torch.bool, torch.uint8):
        return labels.view(torch.int8)  # the same bytes: 0 and 1
    return labels.to(torch.int8)


class Estimate(NamedTuple):
    """A value from the histograms and a certified bound on its distance to the exact value."""

    value: Tensor
    bound: Tensor


class RankingMetric(ScreenedMetric[Tensor]):
    """AUROC or average precision of a binary, multiclass (one-vs-rest) or multilabel problem.

    State: ``2 * classes * bins`` int64 counts whatever the number of samples; no predictions
    are stored. ``compute()`` differs from the exact value (scikit-learn's on the same scores)
    by at most ``error_bound()``. Bad values follow the library policy: CPU raises before the
    state changes, CUDA drops the batch and counts it in ``rejected_updates``.

    With ``exact=True`` the metric stores every score instead: **memory is unbounded**, 9 bytes
    per score and class (a float64 score and an int8 label) for every sample since the last
    ``reset``, on the metric's device, and ``sync``/``state_dict`` gather every rank's samples
    (blocking). ``compute()`` then equals scikit-learn's value, ties included, for every
    class with a positive (and, for AUROC, a negative) sample, and ``error_bound()`` is 0. A
    class without is NaN and left out of the averages, where scikit-learn's average precision
    gives it 0 and averages it in. Meant for evaluation sets small enough to hold. An eager
    CPU update keeps the given ``preds`` (and 1-byte targets) without a copy until
    ``compute``/``sync``/``state_dict`` concatenate them, like torchmetrics: modifying them in
    place before then makes those raise ``RuntimeError`` until ``reset`` (see
    ``SampleStore.borrow``).

    Args:
        curve: ``Curve.AUROC`` or ``Curve.AVERAGE_PRECISION``.
        problem: The problem; its ``logits`` and ``ignore_index`` apply.
        num_bins: Uniform histogram bins over ``[0, 1]``; the bound shrinks with more bins.
        thresholds: Increasing edges in ``[0, 1]`` instead of uniform bins (one curve point
            per edge).
        average: Multiclass and multilabel: ``macro`` (mean over classes), ``weighted`` (by
            number of positives), ``none`` (per class), and for multilabel ``micro`` (every
            label's scores as one binary problem). Undefined classes (NaN) are left out.
        max_fpr: Binary AUROC only: the McClish-standardized partial AUROC over false-positive
            rates in ``[0, max_fpr]`` (scikit-learn's and torchmetrics' ``max_fpr``).
        exact: Store every sample and compute the exact value (unbounded memory); no
            ``num_bins`` or ``thresholds`` then.

    Raises:
        ValueError: If ``exact=True`` comes with ``thresholds`` or a ``num_bins`` other than
            the default (exact mode has no bins).
    """

    # A metric pickled (torch.save of the object) before the exact numpy path existed takes
    # the torch path; so does one pickled before the numpy counter of small binary batches.
    _stores_on_host = False
    _host_counter: BinaryHostCounter | None = None

    def __init__(
        self,
        curve: Curve,
        problem: Problem,
        num_bins: int = DEFAULT_BINS,
        thresholds: Thresholds = None,
        average: RankingAverage = "macro",
        max_fpr: float | None = None,
        *,
        exact: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(curve, Curve):
            # A string ("auroc") failed below with "'str' object has no attribute 'name'".
            raise TypeError(f"curve: expected a Curve (Curve.AUROC, ...), got {curve!r}")
        check_problem(problem, "AUROC")
        allowed: tuple[str, ...] = ("macro", "weighted", "none")
        if problem.kind is ProblemKind.MULTILABEL:
            allowed = ("micro", *allowed)
        check_average(average, allowed)
        if max_fpr is not None:
            if curve is not Curve.AUROC or problem.kind is not ProblemKind.BINARY:
                raise ValueError("max_fpr: only binary AUROC has a partial area")
            if isinstance(max_fpr, bool) or not isinstance(max_fpr, Real):
                # float() would take True (1.0), "0.1" and b"1" without a word.
                kind = type(max_fpr).__name__
                raise TypeError(f"max_fpr: expected a number in (0, 1], got {max_fpr!r} ({kind})")
            if not 0.0 < float(max_fpr) <= 1.0:
                raise ValueError(f"max_fpr: expected a number in (0, 1], got {max_fpr}")
        if not isinstance(exact, bool):
            raise TypeError(f"exact: expected a bool, got {type(exact)}")
        if exact and thresholds is not None:
            raise ValueError("thresholds: exact mode (exact=True) has no bins; pass one of them")
        if exact and num_bins != DEFAULT_BINS:
            raise ValueError("num_bins: exact mode (exact=True) has no bins; pass one of them")
        if thresholds is not None and num_bins != DEFAULT_BINS:
            raise ValueError("num_bins: thresholds set the bins themselves; pass one of them")
        self._curve = curve
        self._problem = problem
        self._bins = Bins(num_bins, thresholds)
        self._average = average
        # A float: 1, 1.0 and numpy's 1.0 are one setting (compared across ranks).
        self._max_fpr = None if max_fpr is None else float(max_fpr)
        self._exact = exact
        # Small binary CPU batches, counted (or stored) through numpy (see _host_counts).
        self._host_counter: BinaryHostCounter | None = None
        plain_binary = problem.kind is ProblemKind.BINARY and problem.ignore_index is None
        host_checks = plain_binary and not problem.logits and BinaryHostCounter.available()
        self._stores_on_host = exact and host_checks
        classes = problem.num_classes
        if exact:
            self._samples = SampleStore(
                scores=torch.zeros((0, classes), dtype=torch.float64),
                labels=torch.zeros((0, classes), dtype=torch.int8),
            )
            # The rows are raw scores (logits or probabilities) of one problem: rows of another
            # are refused by the first sync and by load_state_dict, not ranked together. Only
            # the rejected counter is an accumulator here, so it carries the problem.
            configure_states(problem, self._rejected)
            return
        # Layout (is_positive, class, bin), flattened so one index_add_ fills it.
        self._histogram = MetricAccumulator(
            torch.zeros(2 * classes * self._bins.count, dtype=torch.int64)
        )
        # Saved with the counts, which mean something only over these bins: a checkpoint of
        # other bins is refused (Metric.load_state_dict), not added into the wrong ones, and so
        # are ranks of other bins. Compared as float32, as float32 scores are binned:
        # thresholds given as a float32 linspace and as Python floats are the same bins.
        self._bin_layout = MetricAccumulator.constant(
            self._bins.layout(), compared_as=torch.float32
        )
        configure_states(problem, self._histogram)
        if host_checks and self._bins.uniform:
            self._host_counter = BinaryHostCounter(self._bins.count)

    @property
    def exact(self) -> bool:
        """Whether every sample is stored and the value is exact (unbounded memory)."""
        return self._exact

    @property
    def num_bins(self) -> int:
        """The number of histogram bins.

        Raises:
            ValueError: In exact mode, which has none.
        """
        self._refuse_exact("num_bins")
        return self._bins.count

    def _refuse_exact(self, what: str) -> None:
        if self._exact:
            raise ValueError(f"{what}: an exact-mode metric (exact=True) has no bins")

    def _move_extras(self, device: torch.device) -> None:
        self._bins.to(device)  # the threshold edges

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch of scores and targets. No communication and no host sync on CUDA.

        Args:
            preds: Floating-point probabilities in ``[0, 1]`` (or logits with ``logits=True``).
                Binary: any shape; multiclass: ``(N, C, ...)``; multilabel: ``(N, L, ...)``.
            target: Binary: 0/1 of ``preds``' shape (int, bool or float); multiclass:
                ``(N, ...)`` class indices in ``[0, C)``; multilabel: 0/1 of ``preds``' shape.
                Elements equal to ``ignore_index`` are skipped.

        Raises:
            TypeError: If ``preds`` is not floating point (or a multiclass target not integer).
            ValueError: On a wrong shape or class count (always), or (CPU) a score outside
                ``[0, 1]`` / NaN or a target outside its range. On CUDA such a batch is dropped
                and counted in ``rejected_updates`` instead.
        """
        # The counter's device is the metric's: cheaper than Metric.device before the state
        # arena is built (a fresh metric), which small batches notice.
        host = self._host_counter
        if host is not None and host.count(self._histogram, preds, target, self._rejected):
            return
        if self._stores_on_host and borrow_checked(self._samples, preds, target, self._rejected):
            self._metric_freshness.stale()
            return
        device = self._rejected.device
        # Compiled for CPU the histogram counts with bincount, which can count invalid
        # elements in a slot of their own: the checks then cost no pass of their own.
        per_element = not self._exact and _cpu_path.bincount_enabled(device)
        batch = score_batch(
            self._problem,
            preds,
            target,
            device,
            self._rejected,
            exact=self._exact,
            per_element=per_element,
        )
        if batch is None:  # empty: an update all the same, so compute reads local state
            self._metric_freshness.stale()
            return
        scores, labels, weight, keep, valid = batch
        if self._exact:
            if keep is not None:
                # Dropped as a whole (device checks, no ignore_index): a zero weight per row.
                weight = keep.expand(labels.shape)
            if torch.compiler.is_compiling():
                self._store_outside_the_graph(scores, labels, weight, borrow=False)
            else:
                self._store(scores, labels, weight, borrow=_cpu_path.enabled(device))
            return
        classes, bins = self._problem.num_classes, self._bins.count
        # bincount's O(slots) pass pays off once the batch is at least that large.
        cpu_path = (
            weight is None and keep is None and self._bins.uniform and _cpu_path.enabled(device)
        )
        if cpu_path and scores.numel() >= 2 * classes * (bins + 1):
            self._histogram.accumulate(self._cpu_counts(scores, labels))
            return
        slots = 2 * classes * bins
        if scores.numel() >= slots and _cpu_path.bincount_enabled(device):
            # Compiled for CPU, with ignore_index, or with threshold edges: bincount's pass over
            # the slots pays off once the batch is at least that large.
            index, weight = self._slot_index(scores, labels, weight, cpu_path)
            if valid is None:
                self._histogram.accumulate(_cpu_path.count_indices(index, slots, weight))
                return
            counts, invalid = _cpu_path.count_valid_indices(index, slots, weight, valid)
            keep = screen_elements(invalid, self._rejected)
            self._histogram.accumulate(counts if keep is None else counts * keep)
            return
        if valid is not None:
            keep = screen_elements(~valid, self._rejected)
        if keep is not None:
            weight = keep.to(torch.int64) if weight is None else weight * keep
        # In blocks of rows: binning widens each score to float64, and its slot index is int64,
        # so a whole float32 (N, C) batch cost 6x its size at once (1 GB for 2048 x 21,841).
        if scores.numel() <= _DEVICE_BLOCK:
            # Whole, with no loop: range() over a compiled batch's symbolic row count would
            # specialize it, compiling a graph per batch size (fullgraph fails at the 9th).
            self._add_slots(scores, labels, weight, cpu_path)
            return
        rows = scores.shape[0]  # (M, C) rows; never empty here (score_batch returned None)
        step = max(1, _DEVICE_BLOCK // max(1, scores.numel() // rows))
        for start in range(0, rows, step):
            block = slice(start, start + step)
            rows_weight = weight[block] if weight is not None and weight.ndim > 0 else weight
            self._add_slots(scores[block], labels[block], rows_weight, cpu_path)

    def _add_slots(
        self, scores: Tensor, labels: Tensor, weight: Tensor | None, cpu_path: bool
    ) -> None:
        """Add one block of scores to the histogram with ``index_add_`` (the device path)."""
        index, source = self._slot_index(scores, labels, weight, cpu_path)
        if source is None:
            source = torch.ones((), dtype=torch.int64, device=scores.device)
        self._histogram.add_at(index.reshape(-1), source.expand(index.shape).reshape(-1))

    def _slot_index(
        self, scores: Tensor, labels: Tensor, weight: Tensor | None, cpu_path: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The int64 histogram slot of each score, and its weight broadcast to the scores'."""
        device = scores.device
        classes, bins = self._problem.num_classes, self._bins.count
        if self._problem.kind is ProblemKind.MULTICLASS:
            positive = labels.unsqueeze(1) == torch.arange(classes, device=device)
            if weight is not None and weight.ndim > 0:  # per row; a 0-dim keep flag expands
                weight = weight.unsqueeze(1).expand(positive.shape)
        elif cpu_path and not labels.is_floating_point():
            # Checked on the host to be 0/1 (or bool) already: the labels are the flags.
            positive = labels
        else:
            # Compared, not used as is: a dropped batch may hold any target value.
            positive = labels == 1
        # Fused in place: index = bin + class * bins + is_positive * classes * bins.
        index = self._bins.index(scores)
        if classes > 1:
            index.add_(torch.arange(0, classes * bins, bins, device=device))
        # add_ promotes bool and narrower integer flags itself: no int64 copy first.
        index.add_(positive, alpha=classes * bins)
        return index, weight

    def _store(self, scores: Tensor, labels: Tensor, weight: Tensor | None, borrow: bool) -> None:
        """Keep one checked batch as float64 scores and int8 labels, both ``(M, C)``.

        On the CPU path the scores are kept as given, with no copy (``SampleStore.borrow``): a
        copy into fresh memory costs more than the rest of the update, and the store converts
        them to float64 only when it concatenates (``compute``, ``sync``, ``state_dict``), with
        the same result. 0/1 labels checked on the host become int8 in at most one pass.

        Args:
            scores: ``(M, C)`` checked scores (or logits).
            labels: ``(M,)`` class indices (multiclass) or ``(M, C)`` 0/1 labels.
            weight: 0/1 weights, or ``None`` when every element counts.
            borrow: On the CPU path (``_cpu_path.enabled``): keep the tensors as given.
        """
        if borrow and weight is None and self._problem.kind is not ProblemKind.MULTICLASS:
            self._samples.borrow(scores=scores, labels=_int8_labels(labels))
            self._metric_freshness.stale()
            return
        if self._problem.kind is ProblemKind.MULTICLASS:
            classes = torch.arange(self._problem.num_classes, device=labels.device)
            positive = labels.unsqueeze(1) == classes
            if weight is not None and weight.ndim > 0:  # per row; a 0-dim keep flag expands
                weight = weight.unsqueeze(1).expand(positive.shape)
        else:
            positive = labels == 1
        kinds = positive.to(torch.int8)
        if weight is not None:
            # Kept on the device with a mark, not filtered: a boolean mask would sync the host.
            kinds = torch.where(weight > 0, kinds, SKIPPED)
        if borrow:
            self._samples.borrow(scores=scores, labels=kinds)
        else:
            # A copy even when already float64: the caller may refill its input buffer.
            self._samples.append(scores=scores.to(torch.float64, copy=True), labels=kinds)
        self._metric_freshness.stale()

    # Compiled, the checks above stay in the graph and the rows are stored here, eagerly: a
    # graph that appended to the store's growing list would be recompiled on every call.
    # host_call, not torch.compiler.disable: that imported torch._dynamo (about 800 modules,
    # 2 s) into every job that imports the classification metrics.
    _store_outside_the_graph = host_call(
        _store,
        reason="an exact ranking metric (exact=True) appends every batch's rows to a growing "
        "list, which a compiled graph cannot hold; compile without fullgraph=True (the rows "
        "are stored outside the graph) or use the binned metric (the default)",
    )

    def _cpu_counts(self, scores: Tensor, target: Tensor) -> Tensor:
        """The histogram of one checked batch by ``bincount`` (CPU path).

        Large batches go in row chunks whose temporaries stay in cache and are reused by the
        allocator, instead of fresh batch-sized buffers paged in on every update.
        """
        classes = self._problem.num_classes
        rows = 2 * classes
        slots = rows * (self._bins.count + 1)
        # At least as many elements per chunk as bincount zeroes, so that pass stays minor.
        step = max(_cpu_path.CHUNK_ELEMENTS, slots) // classes
        total = self._chunk_counts(scores[:step], target[:step], slots)
        for start in range(step, scores.shape[0], step):
            end = start + step
            total += self._chunk_counts(scores[start:end], target[start:end], slots)
        return _cpu_path.fold_bins(total, rows, self._bins.count)

    def _chunk_counts(self, scores: Tensor, target: Tensor, slots: int) -> Tensor:
        classes, bins = self._problem.num_classes, self._bins.count
        stride = bins + 1
        index = _cpu_path.score_bins(scores, bins, 2 * classes, scratch=True)
        if classes > 1:
            index += torch.arange(
                0, classes * stride, stride, dtype=index.dtype, device=index.device
            )
        if self._problem.kind is ProblemKind.MULTICLASS:
            # One offset per sample at its true class, not an (N, C) comparison.
            samples = torch.arange(index.shape[0], device=index.device)
            index[samples, target.long()] += classes * stride
        elif target.dtype == index.dtype:
            index.add_(target, alpha=classes * stride)
        else:
            # Converted first (into scratch): add_ of another integer dtype takes a slow path.
            flags = scratch("ranking.flags", index.dtype, target.shape, index.device)
            flags.copy_(target)
            index.add_(flags, alpha=classes * stride)
        return torch.bincount(index.reshape(-1), minlength=slots)

    def histograms(self) -> tuple[Tensor, Tensor]:
        """``(negatives, positives)`` counts per class and bin, each ``(classes, bins)``.

        A copy: later updates leave the returned tensors alone.

        Raises:
            ValueError: In exact mode, which stores samples, not histograms.
        """
        self._refuse_exact("histograms")
        classes, bins = self._problem.num_classes, self._bins.count
        counts = self._histogram.value.view(2, classes, bins).clone()
        return counts[0], counts[1]

    def estimate(self) -> Estimate:
        """The value and its certified error bound, averaged as configured."""
        if self._exact:
            negatives, positives = self._exact_histograms()
        else:
            negatives, positives = (h.to(torch.float64) for h in self.histograms())
        if self._average == "micro":
            negatives, positives = negatives.sum(0, keepdim=True), positives.sum(0, keepdim=True)
        if self._max_fpr is not None:
            value, bound = partial_auroc_from_histograms(negatives, positives, self._max_fpr)
        elif self._curve is Curve.AUROC:
            value, bound = auroc_from_histograms(negatives, positives)
        else:
            value, bound = average_precision_from_histograms(negatives, positives)
        if self._exact:
            bound = value * 0.0  # one bin per distinct score: nothing is misordered
        if self._problem.kind is ProblemKind.BINARY or self._average == "micro":
            return Estimate(value[0], bound[0])
        if self._average == "none":
            return Estimate(value, bound)
        support = positives.sum(-1)
        weights = torch.ones_like(value) if self._average == "macro" else support
        defined = ~value.isnan()
        # The bound is averaged with the value's weights: a mean of errors is within the mean
        # of their bounds.
        return Estimate(
            mean_over_classes(value, weights),
            mean_over_classes(torch.where(defined, bound, torch.nan), weights),
        )

    def _exact_histograms(self) -> tuple[Tensor, Tensor]:
        rows = self._samples.value(self._metric_freshness.current)
        scores, labels = rows["scores"], rows["labels"]
        if self._average == "micro":
            scores, labels = scores.reshape(-1, 1), labels.reshape(-1, 1)
        return tie_histograms(scores, labels)

    def _compute_settings(self) -> str:
        return f"curve={self._curve.name} average={self._average} max_fpr={self._max_fpr!r}"

    def compute(self) -> Tensor:
        """The value (a scalar, or per class with ``average="none"``); NaN where undefined."""
        return self.estimate().value

    def error_bound(self) -> Tensor:
        """A certified bound on ``|compute() - exact|`` from the histograms alone.

        The exact value (scikit-learn's on the same scores) lies within this distance of
        ``compute()``; same shape as ``compute()``. Zero in exact mode (NaN where undefined).
        """
        return self.estimate().bound


class BinaryAUROCMetric(RankingMetric):
    """Area under the ROC curve of binary scores, in constant memory.

    ``preds``: probabilities in ``[0, 1]`` (or logits with ``logits=True``) of any shape;
    ``target``: 0/1 of the same shape. See ``RankingMetric`` for the state, the error bound
    and the bad-input policy.

    Args:
        num_bins: Uniform histogram bins over ``[0, 1]``.
        thresholds: Increasing edges in ``[0, 1]`` instead of uniform bins.
        max_fpr: Partial AUROC over false-positive rates up to ``max_fpr`` (McClish).
        logits: Scores are logits (a sigmoid is applied).
        ignore_index: Target value whose elements are skipped, e.g. -100.
        exact: Store every sample and compute the exact value (unbounded memory; see
            ``RankingMetric``), without ``num_bins`` or ``thresholds``.

    Example:
        >>> metric = BinaryAUROCMetric(num_bins=1000)
        >>> metric.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> round(float(metric.compute()), 4)
        0.75
    """

    def __init__(
        self,
        num_bins: int = DEFAULT_BINS,
        *,
        thresholds: Thresholds = None,
        max_fpr: float | None = None,
        logits: bool = False,
        ignore_index: int | None = None,
        exact: bool = False,
    ) -> None:
        problem = Problem(ProblemKind.BINARY, logits=logits, ignore_index=ignore_index)
        super().__init__(Curve.AUROC, problem, num_bins, thresholds, "none", max_fpr, exact=exact)


class BinaryAveragePrecisionMetric(RankingMetric):
    """Average precision (area under the precision-recall curve) of binary scores.

    Inputs and options as ``BinaryAUROCMetric`` (without ``max_fpr``).

    Example:
        >>> metric = BinaryAveragePrecisionMetric(num_bins=1000)
        >>> metric.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> round(float(metric.compute()), 4)
        0.8333
    """

    def __init__(
        self,
        num_bins: int = DEFAULT_BINS,
        *,
        thresholds: Thresholds = None,
        logits: bool = False,
        ignore_index: int | None = None,
        exact: bool = False,
    ) -> None:
        problem = Problem(ProblemKind.BINARY, logits=logits, ignore_index=ignore_index)
        super().__init__(
            Curve.AVERAGE_PRECISION, problem, num_bins, thresholds, "none", exact=exact
        )


class MulticlassAUROCMetric(RankingMetric):
    """One-vs-rest AUROC of ``(N, C, ...)`` scores against ``(N, ...)`` class indices.

    Args:
        num_classes: The number of classes C.
        num_bins: Uniform histogram bins over ``[0, 1]``.
        average: ``macro``, ``weighted`` (by positives) or ``none`` (per class).
        thresholds: Increasing edges in ``[0, 1]`` instead of uniform bins.
        logits: Scores are logits (a softmax over C is applied).
        ignore_index: Target value whose samples are skipped, e.g. -100.
        exact: Store every sample and compute the exact value (unbounded memory; see
            ``RankingMetric``), without ``num_bins`` or ``thresholds``.

    Example:
        >>> metric = MulticlassAUROCMetric(num_classes=3, num_bins=1000)
        >>> probs = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6]])
        >>> metric.update(probs, torch.tensor([0, 1, 2]))
        >>> round(float(metric.compute()), 4)
        1.0
    """

    def __init__(
        self,
        num_classes: int,
        num_bins: int = DEFAULT_BINS,
        average: Literal["macro", "weighted", "none"] = "macro",
        *,
        thresholds: Thresholds = None,
        logits: bool = False,
        ignore_index: int | None = None,
        exact: bool = False,
    ) -> None:
        problem = Problem(
            ProblemKind.MULTICLASS, num_classes, logits=logits, ignore_index=ignore_index
        )
        super().__init__(Curve.AUROC, problem, num_bins, thresholds, average, exact=exact)


class MulticlassAveragePrecisionMetric(RankingMetric):
    """One-vs-rest average precision; inputs and options as ``MulticlassAUROCMetric``.

    Example:
        >>> metric = MulticlassAveragePrecisionMetric(num_classes=3, num_bins=1000)
        >>> probs = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6]])
        >>> metric.update(probs, torch.tensor([0, 1, 2]))
        >>> round(float(metric.compute()), 4)
        1.0
    """

    def __init__(
        self,
        num_classes: int,
        num_bins: int = DEFAULT_BINS,
        average: Literal["macro", "weighted", "none"] = "macro",
        *,
        thresholds: Thresholds = None,
        logits: bool = False,
        ignore_index: int | None = None,
        exact: bool = False,
    ) -> None:
        problem = Problem(
            ProblemKind.MULTICLASS, num_classes, logits=logits, ignore_index=ignore_index
        )
        super().__init__(
            Curve.AVERAGE_PRECISION, problem, num_bins, thresholds, average, exact=exact
        )


class MultilabelAUROCMetric(RankingMetric):
    """Per-label AUROC of ``(N, L, ...)`` scores against 0/1 targets of that shape.

    Args:
        num_labels: The number of labels L.
        num_bins: Uniform histogram bins over ``[0, 1]``.
        average: ``micro`` (all labels as one binary problem), ``macro``, ``weighted`` or
            ``none``.
        thresholds: Increasing edges in ``[0, 1]`` instead of uniform bins.
        logits: Scores are logits (a sigmoid is applied).
        ignore_index: Target value whose elements are skipped, e.g. -100.
        exact: Store every sample and compute the exact value (unbounded memory; see
            ``RankingMetric``), without ``num_bins`` or ``thresholds``.

    Example:
        >>> metric = MultilabelAUROCMetric(num_labels=2, num_bins=1000)
        >>> probs = torch.tensor([[0.9, 0.2], [0.3, 0.8], [0.6, 0.4]])
        >>> metric.update(probs, torch.tensor([[1, 0], [0, 1], [0, 1]]))
        >>> round(float(metric.compute()), 4)
        1.0
    """

    def __init__(
        self,
        num_labels: int,
        num_bins: int = DEFAULT_BINS,
        average: RankingAverage = "macro",
        *,
        thresholds: Thresholds = None,
        logits: bool = False,
        ignore_index: int | None = None,
        exact: bool = False,
    ) -> None:
        problem = Problem(
            ProblemKind.MULTILABEL, num_labels, logits=logits, ignore_index=ignore_index
        )
        super().__init__(Curve.AUROC, problem, num_bins, thresholds, average, exact=exact)


class MultilabelAveragePrecisionMetric(RankingMetric):
    """Per-label average precision; inputs and options as ``MultilabelAUROCMetric``.

    Example:
        >>> metric = MultilabelAveragePrecisionMetric(num_labels=2, num_bins=1000)
        >>> probs = torch.tensor([[0.9, 0.2], [0.3, 0.8], [0.6, 0.4]])
        >>> metric.update(probs, torch.tensor([[1, 0], [0, 1], [0, 1]]))
        >>> round(float(metric.compute()), 4)
        1.0
    """

    def __init__(
        self,
        num_labels: int,
        num_bins: int = DEFAULT_BINS,
        average: RankingAverage = "macro",
        *,
        thresholds: Thresholds = None,
        logits: bool = False,
        ignore_index: int | None = None,
        exact: bool = False,
    ) -> None:
        problem = Problem(
            ProblemKind.MULTILABEL, num_labels, logits=logits, ignore_index=ignore_index
        )
        super().__init__(
            Curve.AVERAGE_PRECISION, problem, num_bins, thresholds, average, exact=exact
        )
