"""Confusion matrices: C x C for multiclass, 2 x 2 for binary, L x 2 x 2 for multilabel."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from sidestream.metrics._screened import ScreenedMetric
from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification._inputs import (
    check_tensor,
    confusion_counts,
    label_flags,
    multiclass_labels,
)
from sidestream.metrics.classification._problem import (
    Problem,
    ProblemKind,
    check_problem,
    configure_states,
)
from sidestream.state import MetricAccumulator

__all__ = [
    "BinaryConfusionMatrixMetric",
    "ConfusionMatrixMetric",
    "MulticlassConfusionMatrixMetric",
    "MultilabelConfusionMatrixMetric",
    "Normalize",
]

Normalize = Literal["true", "pred", "all"]
_NORMALIZE = (None, "true", "pred", "all")


class ConfusionMatrixMetric(ScreenedMetric[Tensor]):
    """Counts of (true class, predicted class) pairs, like ``sklearn.metrics.confusion_matrix``.

    Rows are the true class, columns the predicted class: a ``(C, C)`` matrix for multiclass,
    ``[[tn, fp], [fn, tp]]`` for binary, and one such ``2 x 2`` matrix per label, ``(L, 2, 2)``,
    for multilabel (``sklearn.metrics.multilabel_confusion_matrix``). The state is one int64
    SUM accumulator of the flattened matrix, filled with one counting pass per update.

    ``compute()`` returns the int64 counts, or with ``normalize`` float64 fractions: ``"true"``
    (each row sums to 1), ``"pred"`` (each column) or ``"all"`` (each matrix); an empty row,
    column or matrix gives zeros, as scikit-learn and torchmetrics.

    Args:
        problem: The problem; its threshold, logits and ignore_index apply.
        normalize: ``None``, ``"true"``, ``"pred"`` or ``"all"``.
    """

    def __init__(self, problem: Problem, normalize: Normalize | None = None) -> None:
        super().__init__()
        check_problem(problem, "ConfusionMatrix")
        if normalize not in _NORMALIZE:
            raise ValueError(f"normalize: expected one of {_NORMALIZE}, got {normalize!r}")
        self._problem = problem
        self._normalize = normalize
        self._matrix = MetricAccumulator(torch.zeros(self._cells(), dtype=torch.int64))
        configure_states(problem, self._matrix)

    def _cells(self) -> int:
        classes = self._problem.num_classes
        if self._problem.kind is ProblemKind.MULTICLASS:
            return classes * classes
        return 4 * classes

    @property
    def num_classes(self) -> int:
        """The number of classes C (multiclass), labels L (multilabel), or 1 (binary)."""
        return self._problem.num_classes

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch. No communication and no host sync on CUDA.

        Args:
            preds: Multiclass: scores ``(N, ..., C)`` (argmax is taken) or class indices
                ``(N, ...)``. Binary and multilabel: probabilities (or logits with
                ``logits=True``) or 0/1 predictions, any shape for binary, ``(N, ..., L)``
                for multilabel; positive at or above the threshold.
            target: Multiclass: class indices ``(N, ...)`` or one-hot ``(N, ..., C)``. Binary
                and multilabel: 0/1 of ``preds``' shape. ``ignore_index`` elements are skipped.

        Raises:
            TypeError: On a non-tensor or an unsupported dtype.
            ValueError: On a shape mismatch or wrong class dimension, a tensor on another
                device, and (CPU only) values out of range or NaN scores; on CUDA such a batch
                is dropped and counted in ``rejected_updates``.
        """
        device = self._matrix.device
        preds_t = check_tensor("preds", preds, device)
        target_t = check_tensor("target", target, device)
        cells = self._cells()
        if _cpu_path.enabled(device) and preds_t.numel() >= _cpu_path.CHUNK_ELEMENTS:
            counts: Tensor | None
            if self._problem.kind is ProblemKind.BINARY:
                # Its flags are one byte each: counted whole, the fewest passes.
                counts = self._cpu_counts(preds_t, target_t)
            elif cells <= _cpu_path.CHUNK_ELEMENTS:
                counts = _cpu_path.count_in_chunks(self._cpu_counts, preds_t, target_t)
            else:
                counts = None
            if counts is not None:
                self._matrix.accumulate(counts)
                return
        cell, weight = self._batch_cells(preds_t, target_t)
        if _cpu_path.enabled(device) and cell.numel() >= cells:
            # bincount's O(cells) pass pays off once the batch is at least that large.
            self._matrix.accumulate(_cpu_path.count_indices(cell, cells, weight))
        else:
            source = torch.ones_like(cell) if weight is None else weight.to(torch.int64)
            self._matrix.add_at(cell.reshape(-1), source.expand(cell.shape).reshape(-1))

    def _batch_cells(self, preds: Tensor, target: Tensor) -> tuple[Tensor, Tensor | None]:
        """Each sample's matrix cell (int64) and its 0/1 weight (``None``: all count)."""
        classes = self._problem.num_classes
        if self._problem.kind is ProblemKind.MULTICLASS:
            predicted, labels, weight = multiclass_labels(
                self._problem, preds, target, self._rejected
            )
            return torch.add(predicted.reshape(-1), labels, alpha=classes), weight
        positive, truth, weight = label_flags(self._problem, preds, target, self._rejected)
        cell = 2 * truth.to(torch.int64) + positive.to(torch.int64)
        if self._problem.kind is ProblemKind.MULTILABEL:
            cell = cell + 4 * torch.arange(classes, device=cell.device)
        return cell, weight

    def _cpu_counts(self, preds: Tensor, target: Tensor) -> Tensor:
        """The counts of one chunk of a large batch (CPU path, ``count_in_chunks``)."""
        if self._problem.kind is ProblemKind.MULTICLASS:
            cell, weight = self._batch_cells(preds, target)
            return _cpu_path.count_indices(cell, self._cells(), weight)
        # Per label, from 0/1 flags counted where they are set (as the confusion-count metrics
        # do): fewer passes than an int64 cell per element and its bincount.
        tp, fp, fn, tn = confusion_counts(self._problem, preds, target, self._rejected)
        return torch.stack((tn, fp, fn, tp), dim=1).reshape(-1)

    def confusion_matrix(self) -> Tensor:
        """The int64 counts: ``(C, C)``, ``(2, 2)`` or ``(L, 2, 2)``; a copy, not the state."""
        return self._matrix_view().clone()

    def _matrix_view(self) -> Tensor:
        """The counts as a view of the state (later updates change it)."""
        counts = self._matrix.value
        if self._problem.kind is ProblemKind.MULTICLASS:
            return counts.view(self.num_classes, self.num_classes)
        if self._problem.kind is ProblemKind.BINARY:
            return counts.view(2, 2)
        return counts.view(self.num_classes, 2, 2)

    def _compute_settings(self) -> str:
        return f"normalize={self._normalize}"

    def compute(self) -> Tensor:
        """The confusion matrix: int64 counts, or float64 fractions with ``normalize``."""
        if self._normalize is None:
            return self.confusion_matrix()
        matrix = self._matrix_view()
        counts = matrix.to(torch.float64)
        if self._normalize == "true":
            total = counts.sum(-1, keepdim=True)
        elif self._normalize == "pred":
            total = counts.sum(-2, keepdim=True)
        else:
            total = counts.sum((-2, -1), keepdim=True)
        return torch.where(total > 0, counts / total.clamp_min(1.0), 0.0)


class BinaryConfusionMatrixMetric(ConfusionMatrixMetric):
    """The ``2 x 2`` matrix ``[[tn, fp], [fn, tp]]`` of binary predictions.

    Args:
        threshold: Probability threshold in [0, 1]; a score at or above it is positive.
        normalize: ``None``, ``"true"``, ``"pred"`` or ``"all"``.
        logits: Scores are logits (a sigmoid is applied).
        ignore_index: Target value whose elements are skipped.

    Example:
        >>> metric = BinaryConfusionMatrixMetric()
        >>> metric.update(torch.tensor([0.2, 0.8, 0.6]), torch.tensor([0, 0, 1]))
        >>> metric.compute()
        tensor([[1, 1],
                [0, 1]])
    """

    def __init__(
        self,
        threshold: float = 0.5,
        normalize: Normalize | None = None,
        *,
        logits: bool = False,
        ignore_index: int | None = None,
    ) -> None:
        problem = Problem(ProblemKind.BINARY, 1, threshold, logits, ignore_index=ignore_index)
        super().__init__(problem, normalize)


class MulticlassConfusionMatrixMetric(ConfusionMatrixMetric):
    """The ``(C, C)`` matrix of multiclass predictions (rows true, columns predicted).

    Args:
        num_classes: The number of classes C (>= 2).
        normalize: ``None``, ``"true"``, ``"pred"`` or ``"all"``.
        ignore_index: Target value whose elements are skipped, e.g. -100.

    Example:
        >>> metric = MulticlassConfusionMatrixMetric(2)
        >>> metric.update(torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]))
        >>> metric.compute()
        tensor([[1, 1],
                [0, 1]])
    """

    def __init__(
        self,
        num_classes: int,
        normalize: Normalize | None = None,
        *,
        ignore_index: int | None = None,
    ) -> None:
        super().__init__(
            Problem(ProblemKind.MULTICLASS, num_classes, ignore_index=ignore_index), normalize
        )


class MultilabelConfusionMatrixMetric(ConfusionMatrixMetric):
    """One ``[[tn, fp], [fn, tp]]`` matrix per label: ``(L, 2, 2)``.

    Args:
        num_labels: The number of labels L.
        threshold: Probability threshold in [0, 1].
        normalize: ``None``, ``"true"``, ``"pred"`` or ``"all"`` (per label).
        logits: Scores are logits (a sigmoid is applied).
        ignore_index: Target value whose elements are skipped.
    """

    def __init__(
        self,
        num_labels: int,
        threshold: float = 0.5,
        normalize: Normalize | None = None,
        *,
        logits: bool = False,
        ignore_index: int | None = None,
    ) -> None:
        problem = Problem(
            ProblemKind.MULTILABEL, num_labels, threshold, logits, ignore_index=ignore_index
        )
        super().__init__(problem, normalize)
