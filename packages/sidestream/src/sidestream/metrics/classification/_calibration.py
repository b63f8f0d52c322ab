"""Shared state of the calibration-error metrics: per-bin count, confidence and accuracy sums."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream.metric import Metric
from sidestream.metrics.classification import _host
from sidestream.metrics.classification._score_histogram import (
    bin_index,
    check_positive_int,
)
from sidestream.state import MetricAccumulator

__all__: list[str] = []


class CalibrationHistogramMetric(Metric[Tensor]):
    """Expected calibration error from per-bin sums over ``num_bins`` uniform confidence bins.

    ``ECE = sum_b |sum of confidences in b - sum of accuracies in b| / N``, the L1 form: the
    bin-size-weighted mean gap between confidence and accuracy. The sums are float64 and add
    across ranks, so the synced value equals the value on all the data (up to float64 rounding);
    no approximation beyond the binning that defines ECE itself. Over no data it is NaN.

    Args:
        num_bins: Confidence bins over ``[0, 1]``; bin ``b`` is ``[b/n, (b+1)/n)``, 1.0 in the
            last.
    """

    def __init__(self, num_bins: int = 15) -> None:
        check_positive_int("num_bins", num_bins, 1)
        self._num_bins = num_bins
        self._count = MetricAccumulator(torch.zeros(num_bins, dtype=torch.float64))
        self._confidence = MetricAccumulator(torch.zeros(num_bins, dtype=torch.float64))
        self._accuracy = MetricAccumulator(torch.zeros(num_bins, dtype=torch.float64))
        self._rejected = MetricAccumulator(0, dtype=torch.int64)

    @property
    def rejected_updates(self) -> Tensor:
        """How many updates were dropped for bad values (CUDA only; CPU raises instead)."""
        return self._rejected.value

    def _add(self, confidence: Tensor, accuracy: Tensor, keep: Tensor | None) -> None:
        if _host.host_fast_path(confidence.device):
            self._add_on_host(confidence.reshape(-1), accuracy.reshape(-1))
            return
        index = bin_index(confidence, self._num_bins).reshape(-1)
        weight = torch.ones_like(index, dtype=torch.float64)
        confidence = confidence.reshape(-1).to(torch.float64)
        accuracy = accuracy.reshape(-1).to(torch.float64)
        if keep is not None:
            # Selected, not multiplied: a dropped batch may hold NaN, and NaN * 0 is NaN.
            weight = weight * keep.to(torch.float64)
            confidence = torch.where(keep, confidence, 0.0)
            accuracy = torch.where(keep, accuracy, 0.0)
        self._count.scatter_add(index, weight)
        self._confidence.scatter_add(index, confidence)
        self._accuracy.scatter_add(index, accuracy)

    def _add_on_host(self, confidence: Tensor, accuracy: Tensor) -> None:
        """``bincount`` a checked batch: wrong and right samples per bin in one counting pass."""
        bins = self._num_bins
        stride = bins + 1
        index = _host.score_bins(confidence, bins, 2)
        correct = torch.add(index, accuracy.to(index.dtype), alpha=stride)
        tally = _host.fold_bins(torch.bincount(correct, minlength=2 * stride), 2, bins)
        wrong, right = tally.view(2, bins).to(torch.float64)
        sums = torch.bincount(index, weights=confidence.to(torch.float64), minlength=stride)
        self._count.accumulate(wrong + right)
        self._accuracy.accumulate(right)
        self._confidence.accumulate(_host.fold_bins(sums, 1, bins))

    def compute(self) -> Tensor:
        """The expected calibration error (L1); NaN over no data."""
        gap = (self._confidence.value - self._accuracy.value).abs().sum()
        return gap / self._count.value.sum()
