"""Accuracy, precision, recall, F-beta and specificity from per-class confusion counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor
from typing_extensions import TypeVar  # a default (PEP 696); torch requires typing_extensions

from sidestream.metrics._screened import ScreenedMetric
from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification._average import (
    Average,
    average_statistic,
    averaging_settings,
    check_average,
    check_zero_division,
)
from sidestream.metrics.classification._inputs import (
    batch_cells,
    check_tensor,
    confusion_counts,
    count_map,
    count_operands,
    host_cells_apply,
)
from sidestream.metrics.classification._problem import Problem, ProblemKind, configure_states
from sidestream.metrics.classification.statistics import Counts, Statistic, checked_ratio
from sidestream.state import MetricAccumulator

__all__ = ["ConfusionCountMetric", "ConfusionValue", "check_statistics", "macro_weights"]

#: What ``compute()`` returns: ``Tensor`` for one statistic, ``dict[str, Tensor]`` for several.
#: ``confusion_count_metric()...build()`` fills it in from the statistics chosen, so that
#: ``.with_f1().macro().build().compute()`` is a ``Tensor`` to a type checker, with no cast;
#: a metric made directly has the union (the default). Covariant (only compute() returns it):
#: a built ``ConfusionCountMetric[Tensor]`` is also a plain ``ConfusionCountMetric``, the type
#: a factory that may build one statistic or several is annotated with.
ConfusionValue = TypeVar(
    "ConfusionValue",
    covariant=True,
    bound=Tensor | dict[str, Tensor],
    default=Tensor | dict[str, Tensor],
)


class ConfusionCountMetric(ScreenedMetric[ConfusionValue]):
    """Per-class true/false positive/negative counts and the statistics built from them.

    Usually made by ``confusion_count_metric()...build()``. The state is one int64 ``(4, C)``
    table ``counts`` (rows ``tp``, ``fp``, ``fn``, ``tn``; C = 1 for binary problems) and a
    ``rejected`` counter, both SUM accumulators, so the reduction over ranks is exact. One
    table, not four vectors: a small CPU update adds all four counts with one ``addmv_``.
    Checkpoints of the older four-state layout still load.

    ``compute()`` returns float64 values: a tensor when one statistic is selected, else a dict
    ``{name: tensor}`` in selection order. Binary problems give 0-dim tensors (the positive
    class); ``average="none"`` gives shape (C,); the other averages give 0-dim tensors.

    Macro averaging follows torchmetrics: a multiclass class enters the mean once it appears in
    the targets or the predictions; with ``top_k > 1``, once it appears in the targets (a class
    that is only an extra member of a top-k set has no recall to report). Multilabel macro
    means are over every label.

    Args:
        problem: The problem description (binary, multiclass or multilabel; its
            ``ignore_index`` applies).
        statistics: The statistics to compute, at least one, names unique.
        average: ``micro``, ``macro``, ``weighted`` or ``none`` (ignored for binary problems).
        zero_division: The value of a ratio whose denominator is 0 (0.0, 1.0 or NaN; NaN
            classes are left out of macro and weighted means, like scikit-learn).
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
                "confusion_count_metric()"
            )
        check_statistics(statistics)
        check_average(average)
        zero_division = check_zero_division(zero_division)
        self._problem = problem
        self._statistics = tuple(statistics)
        self._average = "micro" if problem.kind is ProblemKind.BINARY else average
        self._zero_division = zero_division
        classes = problem.num_classes
        self._counts = MetricAccumulator(torch.zeros(4, classes, dtype=torch.int64))
        configure_states(problem, self._counts)
        # Whether the problem can take the small CPU path, decided here, not on every update
        # (a bool, not the map: compiled updates guard every tensor they read).
        self._host_cells = host_cells_apply(problem)
        self._count_map = count_map(classes) if self._host_cells else None

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
            target: Binary and multilabel: 0/1 (or ``ignore_index``) integers, bools or floats,
                the shape of ``preds``. Multiclass: class indices ``(N, ...)`` in ``[0, C)`` or
                ``ignore_index``, or one-hot ``(N, ..., C)``.

        Raises:
            TypeError: On a non-tensor or an unsupported dtype.
            ValueError: On a shape that does not match the problem or the other argument, a
                tensor on another device, and (CPU only) values out of range; on CUDA such a
                batch is dropped and counted in ``rejected_updates``.
        """
        device = self._counts.device
        preds_t = check_tensor("preds", preds, device)
        target_t = check_tensor("target", target, device)
        if self._host_cells:
            cell = batch_cells(self._problem.num_classes, preds_t, target_t, self._rejected)
            if cell is not None and self._count_map is not None:
                # The small CPU case: all four counts straight from the samples' confusion
                # cells, one addmv_ into the table, no intermediate count tensors.
                self._counts.add_product(*count_operands(self._count_map, cell))
                return
        if _cpu_path.enabled(device) and self._problem.kind is not ProblemKind.BINARY:
            # Binary flags are one byte each: a whole batch is counted fastest as it is.
            counts = _cpu_path.count_in_chunks(self._batch_counts, preds_t, target_t)
            if counts is not None:
                self._counts.accumulate(counts)
                return
        self._counts.accumulate(self._batch_counts(preds_t, target_t))

    def _batch_counts(self, preds: Tensor, target: Tensor) -> Tensor:
        return confusion_counts(self._problem, preds, target, self._rejected)

    def counts(self) -> dict[str, Tensor]:
        """The int64 per-class counts ``{"tp", "fp", "fn", "tn"}``, each of shape (C,).

        A copy: later updates leave the returned tensors alone.
        """
        tp, fp, fn, tn = self._counts.value.clone().unbind()
        return {"tp": tp, "fp": fp, "fn": fn, "tn": tn}

    def _upgrade_state_dict(self, prefix: str, state_dict: dict[str, Any]) -> None:
        """Stack a checkpoint's four ``tp``/``fp``/``fn``/``tn`` vectors into ``counts``.

        The layout before the ``(4, C)`` table: such checkpoints keep loading.
        """
        old = [prefix + name for name in ("tp", "fp", "fn", "tn")]
        if prefix + "counts" not in state_dict and all(key in state_dict for key in old):
            # Checked by key before they are stacked: torch.as_tensor and torch.stack raised
            # errors naming no key ("new(): invalid data type 'str'", "stack expects each
            # tensor to be equal size"). The stacked table's shape and dtype are checked later.
            rows = []
            for key in old:
                value = state_dict[key]
                try:
                    # device=: torch.as_tensor would move them to the caller's default device.
                    own = value.device if isinstance(value, Tensor) else "cpu"
                    rows.append(torch.as_tensor(value, device=own).detach())
                except (TypeError, ValueError, RuntimeError) as error:
                    raise TypeError(
                        f"state_dict[{key!r}]: expected a tensor, got {value!r}"
                    ) from error
            for key, row in zip(old, rows, strict=True):
                if row.shape != rows[0].shape:
                    raise ValueError(
                        f"state_dict[{key!r}]: expected shape {tuple(rows[0].shape)} (as "
                        f"state_dict[{old[0]!r}]), got {tuple(row.shape)}"
                    )
            for key in old:
                del state_dict[key]
            state_dict[prefix + "counts"] = torch.stack(rows)

    def _compute_settings(self) -> str:
        return averaging_settings(self._statistics, self._average, self._zero_division)

    def compute(self) -> ConfusionValue:
        """The selected statistics: a tensor for one, ``{name: tensor}`` for several."""
        counts = Counts(*self._counts.value.to(torch.float64).unbind())
        values = {statistic.name: self._value(statistic, counts) for statistic in self._statistics}
        if self._problem.kind is ProblemKind.BINARY:
            values = {name: value.reshape(()) for name, value in values.items()}
        # The casts are what the builder's types promise: one statistic, a Tensor.
        if len(values) == 1:
            return cast(ConfusionValue, next(iter(values.values())))
        return cast(ConfusionValue, values)

    def _value(self, statistic: Statistic, counts: Counts) -> Tensor:
        """One statistic, averaged over classes as configured, in float64."""
        numerator, denominator = checked_ratio(statistic, self._problem.kind, counts)
        return average_statistic(
            numerator,
            denominator,
            counts,
            self._average,
            macro_weights(self._problem, counts),
            self._zero_division,
        )


def check_statistics(statistics: Sequence[Statistic]) -> None:
    """Raise unless ``statistics`` holds at least one ``Statistic``, each of its own name.

    Raises:
        ValueError: If it is empty, a name is empty, or two statistics share a name (one key
            per name).
        TypeError: If an item does not follow the ``Statistic`` protocol (checked before the
            names are read: a string has no ``name``), or its name is not a str.
    """
    if not statistics:
        raise ValueError("statistics: select at least one, e.g. .with_accuracy()")
    for statistic in statistics:
        if not isinstance(statistic, Statistic):
            raise TypeError(f"statistics: expected Statistic objects, got {statistic!r}")
        if not isinstance(statistic.name, str):
            # The name is compute()'s key: another type failed the metric's construction
            # with str.join's "sequence item 0: expected str instance", naming nothing.
            raise TypeError(
                f"statistics: a statistic's name must be a str, got {statistic.name!r} "
                f"for {statistic!r}"
            )
        if not statistic.name:
            # An empty key vanishes from the flat names: "val/f1/" would be reported as
            # "val/f1", next to (or in place of) another statistic's value.
            raise ValueError(f"statistics: a statistic's name must not be empty: {statistic!r}")
    names = [statistic.name for statistic in statistics]
    if len(set(names)) != len(names):
        raise ValueError(f"statistics: names must be unique, got {names}")


def macro_weights(problem: Problem, counts: Counts) -> Tensor:
    """Which classes a macro mean covers, as torchmetrics (0/1 float64, shape of the counts).

    Multiclass: classes seen in the targets or the predictions; with ``top_k > 1``, classes
    seen in the targets (a class that is only an extra member of a top-k set has no recall to
    report). Binary and multilabel: every label.
    """
    tp, fp, fn, _ = counts
    if problem.kind is not ProblemKind.MULTICLASS:
        return torch.ones_like(tp)
    if problem.top_k > 1:
        return ((tp + fn) > 0).to(torch.float64)
    return ((tp + fp + fn) > 0).to(torch.float64)
