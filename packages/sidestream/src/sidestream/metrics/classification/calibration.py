"""Expected calibration error from per-bin count, confidence and accuracy sums."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from sidestream.metrics._ordered_sum import ordered_sum
from sidestream.metrics._screened import ScreenedMetric
from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification._binning import bin_index
from sidestream.metrics.classification._problem import (
    Problem,
    ProblemKind,
    check_int,
    check_problem,
    configure_states,
)
from sidestream.metrics.classification._scores import score_batch
from sidestream.state import MetricAccumulator

__all__ = [
    "BinaryCalibrationErrorMetric",
    "CalibrationErrorMetric",
    "MulticlassCalibrationErrorMetric",
    "Norm",
]

Norm = Literal["l1", "l2", "max"]
_NORMS = ("l1", "l2", "max")


def _edge_lift(dtype: torch.dtype) -> float:
    """The lift factor of calibration bins for scores of ``dtype``: ``1 + 2**-50`` or ``-23``.

    ``floor(score * num_bins * lift)`` in float64 puts a score that is an edge ``k / num_bins``
    up to its dtype's rounding (at most ``2**-53`` relative for float64, ``2**-24`` for
    float32) into bin ``k``, with a margin for the float64 product's rounding, and moves only
    scores that close below an edge (float16 and bfloat16 scores get float32's). Calibration
    bins need no one map across dtypes, unlike the ranking bins (``_cpu_path.EDGE_LIFT``, whose
    error bound relies on it).
    """
    return _FLOAT64_LIFT if dtype == torch.float64 else _FLOAT32_LIFT


_FLOAT64_LIFT = 1.0 + 2.0**-50
_FLOAT32_LIFT = 1.0 + 2.0**-23


class CalibrationErrorMetric(ScreenedMetric[Tensor]):
    """Calibration error over ``num_bins`` uniform confidence bins, from per-bin sums.

    Per bin the state holds the sample count and the sums of confidences and accuracies, all
    float64, so ranks add and the synced value equals the value on all the data up to float64
    rounding; no approximation beyond the binning that defines the metric itself. With
    ``a_b`` and ``c_b`` the mean accuracy and confidence of bin ``b`` and ``p_b`` its share of
    the samples (empty bins count 0), as torchmetrics:

    - ``l1`` (the expected calibration error): ``sum_b p_b |a_b - c_b|``;
    - ``l2``: ``sqrt(sum_b p_b (a_b - c_b)²)``;
    - ``max`` (the maximum calibration error): ``max_b |a_b - c_b|``.

    Over no data it is NaN. Bin ``b`` is ``[b/n, (b+1)/n)``, with 1.0 in the last bin
    (torchmetrics gives a score of exactly 1.0 a bin of its own). A score that is an edge
    ``k/n`` up to its own dtype's rounding (float32 ``0.7`` with 10 bins is 0.69999998) opens
    bin ``k``: within a relative ``2**-23`` below the edge for float32 (and narrower) scores,
    ``2**-50`` for float64 ones (``_edge_lift``); any other score lies in its bin by the
    definition. torchmetrics compares with float32 ``linspace`` edges, which lie a hair off
    ``k/n``, so an edge score may land one bin lower there (see docs/ranking.md).

    Args:
        problem: Binary (confidence = the probability, accuracy = the 0/1 target) or
            multiclass (confidence = the top probability, accuracy = top-1 correct).
        num_bins: Confidence bins over ``[0, 1]``.
        norm: ``l1``, ``l2`` or ``max``.
    """

    def __init__(self, problem: Problem, num_bins: int = 15, norm: Norm = "l1") -> None:
        super().__init__()
        check_problem(problem, "CalibrationError")
        check_int("num_bins", num_bins, 1)
        if norm not in _NORMS:
            raise ValueError(f"norm: expected one of {_NORMS}, got {norm!r}")
        if problem.kind is ProblemKind.MULTILABEL:
            raise ValueError("problem: calibration error takes a binary or multiclass problem")
        self._problem = problem
        self._num_bins = num_bins
        self._norm = norm
        self._count = MetricAccumulator(torch.zeros(num_bins, dtype=torch.float64))
        self._confidence = MetricAccumulator(torch.zeros(num_bins, dtype=torch.float64))
        self._accuracy = MetricAccumulator(torch.zeros(num_bins, dtype=torch.float64))
        configure_states(problem, self._count)

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch. No communication and no host sync on CUDA.

        Args:
            preds: Probabilities in ``[0, 1]`` (or logits with ``logits=True``). Binary: any
                shape; multiclass: ``(N, C, ...)``.
            target: Binary: 0/1 of ``preds``' shape; multiclass: ``(N, ...)`` class indices.
                Elements equal to ``ignore_index`` are skipped.

        Raises:
            TypeError: If ``preds`` is not floating point.
            ValueError: On a wrong shape, or (CPU) a probability outside ``[0, 1]`` or a target
                outside its range; CUDA drops such a batch and counts it in
                ``rejected_updates``.
        """
        batch = score_batch(self._problem, preds, target, self.device, self._rejected)
        if batch is None:  # empty: an update all the same, so compute reads local state
            self._metric_freshness.stale()
            return
        scores, labels, weight, keep, _ = batch  # valid: only with per_element
        if keep is not None:  # a whole batch dropped on the device: a zero weight for each
            weight = keep.expand(labels.shape)
        if self._problem.kind is ProblemKind.MULTICLASS:
            confidence, predicted = scores.max(dim=1)
            accuracy = predicted == labels
        else:
            confidence, accuracy = scores.reshape(-1), labels.reshape(-1)
        if weight is None and _cpu_path.enabled(confidence.device):
            self._add_on_cpu(confidence, accuracy)
            return
        index = bin_index(confidence, self._num_bins, _edge_lift(confidence.dtype)).reshape(-1)
        confidence = confidence.to(torch.float64)
        accuracy = accuracy.to(torch.float64)
        count = torch.ones_like(confidence)
        if weight is not None:
            kept = weight.reshape(-1).bool()
            # Selected, not multiplied: a dropped batch may hold NaN, and NaN * 0 is NaN.
            count = kept.to(torch.float64)
            confidence = torch.where(kept, confidence, 0.0)
            accuracy = torch.where(kept, accuracy, 0.0)
        # Indices made in range by bin_index: no check.
        self._count.add_at(index, count.reshape(-1))
        self._confidence.add_at(index, confidence.reshape(-1))
        self._accuracy.add_at(index, accuracy.reshape(-1))

    def _add_on_cpu(self, confidence: Tensor, accuracy: Tensor) -> None:
        """``bincount`` a checked batch: wrong and right samples per bin in one counting pass.

        A large batch goes in chunks whose temporaries stay in cache and are reused, instead of
        batch-sized buffers paged in on every update (see ``_cpu_path.CHUNK_ELEMENTS``).
        """
        bins = self._num_bins
        stride = bins + 1
        tally: Tensor | None = None
        sums: Tensor | None = None
        step = _cpu_path.CHUNK_ELEMENTS
        lift = _edge_lift(confidence.dtype)
        for chunk_confidence, chunk_accuracy in zip(
            torch.split(confidence, step), torch.split(accuracy, step), strict=True
        ):
            index = _cpu_path.score_bins(chunk_confidence, bins, 2, scratch=True, lift=lift)
            correct = torch.add(index, chunk_accuracy.to(index.dtype), alpha=stride)
            chunk_tally = torch.bincount(correct, minlength=2 * stride)
            weights = chunk_confidence.to(torch.float64)
            chunk_sums = torch.bincount(index, weights=weights, minlength=stride)
            tally = chunk_tally if tally is None else tally.add_(chunk_tally)
            sums = chunk_sums if sums is None else sums.add_(chunk_sums)
        assert tally is not None and sums is not None  # a checked batch is not empty
        wrong, right = _cpu_path.fold_bins(tally, 2, bins).view(2, bins).to(torch.float64)
        self._count.accumulate(wrong + right)
        self._accuracy.accumulate(right)
        self._confidence.accumulate(_cpu_path.fold_bins(sums, 1, bins))

    def _compute_settings(self) -> str:
        return f"norm={self._norm}"

    def compute(self) -> Tensor:
        """The calibration error in the chosen norm; NaN over no data."""
        count = self._count.value
        gap = self._confidence.value - self._accuracy.value
        total = count.sum()
        if self._norm == "l1":
            return ordered_sum(gap.abs()) / total
        mean_gap = gap / count.clamp_min(1.0)
        if self._norm == "max":
            return torch.where(total > 0, mean_gap.abs().max(), torch.nan)
        return (ordered_sum(mean_gap.square().mul(count)) / total).sqrt()


class BinaryCalibrationErrorMetric(CalibrationErrorMetric):
    """Calibration error of the positive-class probability.

    The confidence of a sample is its probability ``p`` and its accuracy its 0/1 target (the
    convention of torchmetrics' ``BinaryCalibrationError``).

    Args:
        num_bins: Confidence bins over ``[0, 1]``.
        norm: ``l1`` (ECE), ``l2`` or ``max`` (MCE).
        logits: Scores are logits (a sigmoid is applied).
        ignore_index: Target value whose elements are skipped.

    Example:
        >>> metric = BinaryCalibrationErrorMetric(num_bins=2)
        >>> metric.update(torch.tensor([0.2, 0.9, 0.7]), torch.tensor([0, 1, 0]))
        >>> metric.compute()
        tensor(0.2667, dtype=torch.float64)
    """

    def __init__(
        self,
        num_bins: int = 15,
        norm: Norm = "l1",
        *,
        logits: bool = False,
        ignore_index: int | None = None,
    ) -> None:
        problem = Problem(ProblemKind.BINARY, logits=logits, ignore_index=ignore_index)
        super().__init__(problem, num_bins, norm)


class MulticlassCalibrationErrorMetric(CalibrationErrorMetric):
    """Calibration error of the top-1 prediction of ``(N, C, ...)`` class scores.

    The confidence of a sample is its highest class probability, its accuracy 1 when that class
    is the target.

    Args:
        num_classes: The number of classes C.
        num_bins: Confidence bins over ``[0, 1]``.
        norm: ``l1`` (ECE), ``l2`` or ``max`` (MCE).
        logits: Scores are logits (a softmax over C is applied).
        ignore_index: Target value whose samples are skipped.

    Example:
        >>> metric = MulticlassCalibrationErrorMetric(num_classes=3, num_bins=2)
        >>> probs = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6]])
        >>> metric.update(probs, torch.tensor([0, 2, 2]))
        >>> metric.compute()
        tensor(0.0667, dtype=torch.float64)
    """

    def __init__(
        self,
        num_classes: int,
        num_bins: int = 15,
        norm: Norm = "l1",
        *,
        logits: bool = False,
        ignore_index: int | None = None,
    ) -> None:
        problem = Problem(
            ProblemKind.MULTICLASS, num_classes, logits=logits, ignore_index=ignore_index
        )
        super().__init__(problem, num_bins, norm)
