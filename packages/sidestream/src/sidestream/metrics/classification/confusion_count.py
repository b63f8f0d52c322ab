"""Accuracy, precision, recall, F-beta and specificity from per-class confusion counts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sidestream.metric import Metric
from sidestream.metrics.classification._aggregation import Aggregation
from sidestream.metrics.classification._inputs import check_tensor, confusion_counts
from sidestream.metrics.classification._problem import Problem, ProblemKind
from sidestream.metrics.classification._statistic import Statistic
from sidestream.state import MetricAccumulator

__all__ = ["ConfusionCountMetric"]


class ConfusionCountMetric(Metric[Tensor | dict[str, Tensor]]):
    """Per-class true/false positive/negative counts and the statistics built from them.

    Usually made by ``confusion_matrix_metric()...build()``. The state is four int64 vectors of
    fixed length C (``tp``, ``fp``, ``fn``, ``tn``; C = 1 for binary problems) and a
    ``rejected`` counter, all SUM accumulators, so the reduction over ranks is exact.

    ``compute()`` returns float64 values: a tensor when one statistic is selected, else a dict
    ``{name: tensor}`` in selection order. Binary problems give 0-dim tensors (the positive
    class); ``per_class`` gives shape (C,); the other aggregations give 0-dim tensors.

    Args:
        problem: The problem description (binary, multiclass or multilabel).
        statistics: The statistics to compute, at least one, names unique.
        aggregation: How classes are combined (ignored for binary problems).
        ignore_index: Target value whose elements are skipped (weight 0), e.g. -100.
        zero_division: The value of a ratio whose denominator is 0 (0.0, 1.0 or NaN; NaN
            classes are left out of macro and weighted means, like scikit-learn).
    """

    def __init__(
        self,
        problem: Problem,
        statistics: Sequence[Statistic],
        aggregation: Aggregation = Aggregation.MACRO,
        ignore_index: int | None = None,
        zero_division: float = 0.0,
    ) -> None:
        if not statistics:
            raise ValueError("statistics: select at least one, e.g. .with_accuracy()")
        names = [statistic.name for statistic in statistics]
        if len(set(names)) != len(names):
            raise ValueError(f"statistics: names must be unique, got {names}")
        if ignore_index is not None and (
            isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
        ):
            raise TypeError(f"ignore_index: expected an int or None, got {type(ignore_index)}")
        zero_division = float(zero_division)
        if zero_division not in (0.0, 1.0) and zero_division == zero_division:
            raise ValueError(f"zero_division: expected 0.0, 1.0 or NaN, got {zero_division}")
        self._problem = problem
        self._statistics = tuple(statistics)
        self._aggregation = Aggregation.MICRO if problem.kind is ProblemKind.BINARY else aggregation
        self._ignore_index = ignore_index
        self._zero_division = zero_division
        classes = problem.num_classes
        self._tp = MetricAccumulator(torch.zeros(classes, dtype=torch.int64))
        self._fp = MetricAccumulator(torch.zeros(classes, dtype=torch.int64))
        self._fn = MetricAccumulator(torch.zeros(classes, dtype=torch.int64))
        self._tn = MetricAccumulator(torch.zeros(classes, dtype=torch.int64))
        self._rejected = MetricAccumulator(0, dtype=torch.int64)

    @property
    def problem(self) -> Problem:
        """The problem this metric reads."""
        return self._problem

    @property
    def statistic_names(self) -> tuple[str, ...]:
        """The keys of ``compute()``'s dict, in order."""
        return tuple(statistic.name for statistic in self._statistics)

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch. No communication and no host sync on CUDA.

        Args:
            preds: Binary: probabilities in [0, 1] (or logits with ``logits=True``) or 0/1
                predictions, any shape. Multiclass: scores ``(N, ..., C)`` (logits or
                probabilities) or class indices ``(N, ...)``. Multilabel: ``(N, ..., L)``
                probabilities/logits or 0/1 predictions. Floating dtypes bf16/fp16/fp32/fp64.
            target: Binary and multilabel: 0/1 (or ``ignore_index``) integers or bools, the
                shape of ``preds``. Multiclass: class indices ``(N, ...)`` in ``[0, C)`` or
                ``ignore_index``, or one-hot ``(N, ..., C)``.

        Raises:
            TypeError: On a non-tensor or an unsupported dtype.
            ValueError: On a shape that does not match the problem or the other argument, a
                tensor on another device, and (CPU only) values out of range; on CUDA such a
                batch is dropped and counted in ``rejected_updates``.
        """
        device = self._tp.device
        preds_t = check_tensor("preds", preds, device)
        target_t = check_tensor("target", target, device)
        tp, fp, fn, tn = confusion_counts(
            self._problem, preds_t, target_t, self._ignore_index, self._rejected
        )
        self._tp.accumulate(tp)
        self._fp.accumulate(fp)
        self._fn.accumulate(fn)
        self._tn.accumulate(tn)

    @property
    def rejected_updates(self) -> Tensor:
        """Updates dropped for out-of-range values (CUDA only; CPU raises instead)."""
        return self._rejected.value

    def counts(self) -> dict[str, Tensor]:
        """The int64 per-class counts ``{"tp", "fp", "fn", "tn"}``, each of shape (C,)."""
        return {
            "tp": self._tp.value,
            "fp": self._fp.value,
            "fn": self._fn.value,
            "tn": self._tn.value,
        }

    def compute(self) -> Tensor | dict[str, Tensor]:
        """The selected statistics: a tensor for one, ``{name: tensor}`` for several."""
        counts = (self._tp.value, self._fp.value, self._fn.value, self._tn.value)
        values = {
            statistic.name: statistic.value(
                self._problem.kind, self._aggregation, counts, self._zero_division
            )
            for statistic in self._statistics
        }
        if self._problem.kind is ProblemKind.BINARY:
            values = {name: value.reshape(()) for name, value in values.items()}
        if len(values) == 1:
            return next(iter(values.values()))
        return values
