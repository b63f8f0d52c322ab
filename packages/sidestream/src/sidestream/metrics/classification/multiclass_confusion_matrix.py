"""The full C x C multiclass confusion matrix."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream.metric import Metric
from sidestream.metrics.classification import _host
from sidestream.metrics.classification._inputs import check_tensor, multiclass_labels
from sidestream.state import MetricAccumulator

__all__ = ["MulticlassConfusionMatrixMetric"]


class MulticlassConfusionMatrixMetric(Metric[Tensor]):
    """Counts of (true class, predicted class) pairs, like ``sklearn.metrics.confusion_matrix``.

    ``compute()`` returns an int64 ``(C, C)`` tensor: row = true class, column = predicted
    class. The state is one int64 SUM accumulator of length C * C (the row-major matrix), filled
    with one ``index_add_`` per update (``bincount`` on CPU for batches of at least C * C
    samples), and a ``rejected`` counter.

    Inputs and bad-input policy are those of ``confusion_matrix_metric().multiclass(C)``:
    scores ``(N, ..., C)`` (argmax is taken) or class indices ``(N, ...)``; targets class indices
    ``(N, ...)`` or one-hot ``(N, ..., C)``.

    Args:
        num_classes: The number of classes C (>= 2).
        ignore_index: Target value whose elements are skipped, e.g. -100.

    Example:
        >>> metric = MulticlassConfusionMatrixMetric(2)
        >>> metric.update(torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]))
        >>> metric.compute()
        tensor([[1, 1],
                [0, 1]])
    """

    def __init__(self, num_classes: int, ignore_index: int | None = None) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes: expected an int >= 2, got {num_classes!r}")
        if ignore_index is not None and (
            isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
        ):
            raise TypeError(f"ignore_index: expected an int or None, got {type(ignore_index)}")
        self._num_classes = num_classes
        self._ignore_index = ignore_index
        self._matrix = MetricAccumulator(torch.zeros(num_classes * num_classes, dtype=torch.int64))
        self._rejected = MetricAccumulator(0, dtype=torch.int64)

    @property
    def num_classes(self) -> int:
        """The number of classes C."""
        return self._num_classes

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch. No communication and no host sync on CUDA.

        Args:
            preds: Scores ``(N, ..., C)`` in any floating dtype, or class indices ``(N, ...)``.
            target: Class indices ``(N, ...)`` (or ``ignore_index``), or one-hot ``(N, ..., C)``.

        Raises:
            TypeError: On a non-tensor or an unsupported dtype.
            ValueError: On a shape mismatch or wrong class dimension, a tensor on another
                device, and (CPU only) class indices outside ``[0, C)``; on CUDA such a batch is
                dropped and counted in ``rejected_updates``.
        """
        device = self._matrix.device
        predicted, labels, weight = multiclass_labels(
            self._num_classes,
            1,
            check_tensor("preds", preds, device),
            check_tensor("target", target, device),
            self._ignore_index,
            self._rejected,
        )
        cell = torch.add(predicted.reshape(-1), labels, alpha=self._num_classes)
        cells = self._num_classes**2
        if _host.host_fast_path(device) and cell.numel() >= cells:
            # bincount's O(cells) pass pays off once the batch is at least that large.
            self._matrix.accumulate(_host.count_indices(cell, cells, weight))
        else:
            self._matrix.scatter_add(cell, torch.ones_like(cell) if weight is None else weight)

    @property
    def rejected_updates(self) -> Tensor:
        """Updates dropped for out-of-range values (CUDA only; CPU raises instead)."""
        return self._rejected.value

    def confusion_matrix(self) -> Tensor:
        """The int64 ``(C, C)`` matrix, rows true class, columns predicted class."""
        return self._matrix.value.view(self._num_classes, self._num_classes)

    def compute(self) -> Tensor:
        """The int64 ``(C, C)`` confusion matrix."""
        return self.confusion_matrix()
