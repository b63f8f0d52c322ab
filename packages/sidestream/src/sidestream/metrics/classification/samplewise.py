"""Confusion-count statistics per sample, averaged over the samples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from sidestream.metrics._screened import ScreenedMetric
from sidestream.metrics.classification._average import (
    Average,
    average_statistic,
    averaging_settings,
    check_average,
    check_zero_division,
)
from sidestream.metrics.classification._inputs import (
    check_tensor,
    label_flags,
    multiclass_labels,
    sample_counts,
)
from sidestream.metrics.classification._problem import Problem, ProblemKind, configure_states
from sidestream.metrics.classification.confusion_count import (
    ConfusionValue,
    check_statistics,
    macro_weights,
)
from sidestream.metrics.classification.statistics import Counts, Statistic, checked_ratio
from sidestream.state import MetricAccumulator

__all__ = ["SamplewiseConfusionCountMetric"]


class SamplewiseConfusionCountMetric(ScreenedMetric[ConfusionValue]):
    """The mean over samples of each sample's statistic (``multidim_average="samplewise"``).

    Each sample (an index of the first dimension: an image, a sequence) gets its own confusion
    counts over its other positions, its statistics are computed from them and averaged over
    classes as chosen, and the metric keeps the float64 sum of those per-sample values and the
    sample count. torchmetrics' ``multidim_average="samplewise"`` returns the ``(N,)`` vector of
    per-sample values, which grows with the data; this is its mean (``tm(...).mean()``), in
    fixed memory and exact across ranks up to float64 rounding.

    Usually made by ``confusion_count_metric(multidim_average="samplewise")...build()``.

    Args:
        problem: The problem (binary, multiclass or multilabel).
        statistics: The statistics, at least one, names unique.
        average: How classes are combined within a sample (``none`` keeps ``(C,)`` values).
        zero_division: The value of a ratio whose denominator is 0 within a sample.
    """

    def __init__(
        self,
        problem: Problem,
        statistics: Sequence[Statistic],
        average: Average = "macro",
        zero_division: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(problem, Problem):
            raise TypeError(
                f"problem: expected a sidestream Problem, got {problem!r}; build the metric with "
                "confusion_count_metric(multidim_average='samplewise')"
            )
        # Two statistics of one name would share a key of compute()'s dict: one value lost.
        check_statistics(statistics)
        check_average(average)
        self._problem = problem
        self._statistics = tuple(statistics)
        self._average = "micro" if problem.kind is ProblemKind.BINARY else average
        self._zero_division = check_zero_division(zero_division)
        width = problem.num_classes if self._average == "none" else 1
        self._sums = MetricAccumulator(
            torch.zeros(len(self._statistics), width, dtype=torch.float64)
        )
        self._samples = MetricAccumulator(0.0, dtype=torch.float64)
        names = ",".join(statistic.name for statistic in self._statistics)  # f0.5, not FBeta
        more = f"statistics={names} average={self._average} zero_division={self._zero_division!r}"
        configure_states(problem, self._sums, more=more)

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch of ``N`` samples; inputs as ``ConfusionCountMetric.update``."""
        device = self._sums.device
        preds_t = check_tensor("preds", preds, device)
        target_t = check_tensor("target", target, device)
        _check_positions(self._problem, preds_t)
        if preds_t.shape[0] == 0:
            # No samples, but shapes and dtypes checked as the global metric checks them (a
            # wrong class count is refused on an empty batch too); an update all the same:
            # compute reads local state.
            if self._problem.kind is ProblemKind.MULTICLASS:
                multiclass_labels(self._problem, preds_t, target_t, self._rejected)
            else:
                label_flags(self._problem, preds_t, target_t, self._rejected)
            self._metric_freshness.stale()
            return
        before = self._rejected.local.clone()
        counts = sample_counts(self._problem, preds_t, target_t, self._rejected)
        float_counts = Counts(*(count.to(torch.float64) for count in counts))
        weights = macro_weights(self._problem, float_counts)
        rows = []
        for statistic in self._statistics:
            numerator, denominator = checked_ratio(statistic, self._problem.kind, float_counts)
            value = average_statistic(
                numerator, denominator, float_counts, self._average, weights, self._zero_division
            )
            rows.append(value.reshape(value.shape[0], -1).sum(0))
        # A batch dropped on CUDA raised the rejected counter: its samples do not count.
        kept = 1.0 - (self._rejected.local - before).to(torch.float64)
        samples = float(counts[0].shape[0])  # metadata, not a device value
        sums = torch.stack(rows)
        self._sums.accumulate(torch.where(kept > 0, sums, 0.0))
        self._samples.accumulate(kept * samples)

    def _compute_settings(self) -> str:
        return averaging_settings(self._statistics, self._average, self._zero_division)

    def compute(self) -> ConfusionValue:
        """The mean per-sample statistics: a tensor for one, ``{name: tensor}`` for several."""
        means: Tensor = self._sums.value / self._samples.value
        if self._average != "none":
            means = means[:, 0]
        values = {statistic.name: means[row] for row, statistic in enumerate(self._statistics)}
        # The casts are what the builder's types promise: one statistic, a Tensor.
        if len(values) == 1:
            return cast(ConfusionValue, next(iter(values.values())))
        return cast(ConfusionValue, values)


def _check_positions(problem: Problem, preds: Tensor) -> None:
    """Raise unless each sample has positions of its own past the first dimension.

    Inputs with none (binary ``(N,)``, multiclass scores ``(N, C)``) give every sample one
    element, whose per-sample statistics are 1, 0 or ``zero_division``: most likely the global
    metric was meant (torchmetrics refuses them too). Multilabel ``(N, L)`` is fine: a sample's
    positions are its labels (scikit-learn's ``average="samples"``).
    """
    if problem.kind is ProblemKind.MULTICLASS and preds.is_floating_point():
        expected, least = "scores (N, X, ..., C)", 3
    elif problem.kind is ProblemKind.MULTICLASS:
        expected, least = "class indices (N, X, ...)", 2
    elif problem.kind is ProblemKind.BINARY:
        expected, least = "(N, X, ...)", 2
    else:  # (N, ..., L): label_flags checks the rest of the shape
        expected, least = "", 2
    if preds.ndim < least:
        if not expected:
            # Built only here: compiled with dynamic=True, num_classes is a symbolic int,
            # and an f-string of one on every call fails to trace (BUILD_STRING).
            expected = f"(N, ..., L) with L = num_labels = {problem.num_classes}"
        raise ValueError(
            f"preds: expected {expected} for multidim_average='samplewise' (a sample's counts "
            f"run over its positions X, ...), got {tuple(preds.shape)}; for one element per "
            "sample use the global metric (multidim_average='global')"
        )
