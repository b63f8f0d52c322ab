"""``wrap``: the entry point of the bridge."""

from __future__ import annotations

from typing import overload

from torchmetrics import Metric as TorchmetricsBase
from torchmetrics import MetricCollection

from sidestream_torchmetrics.collection import TorchmetricsCollection
from sidestream_torchmetrics.metric import TorchmetricsMetric

__all__ = ["wrap"]


# The class the argument decides: a collection's wrapper is indexed by member
# (wrap(collection)["f1"].update(...)), which a type checker refused on a plain Metric.
@overload
def wrap(metric: MetricCollection) -> TorchmetricsCollection: ...
@overload
def wrap(metric: TorchmetricsBase) -> TorchmetricsMetric: ...
def wrap(
    metric: TorchmetricsBase | MetricCollection,
) -> TorchmetricsMetric | TorchmetricsCollection:
    """A torchmetrics ``Metric`` or ``MetricCollection`` as a sidestream ``Metric``.

    Wrap a fresh metric (before any update): the wrapper owns the state from then on.

    Args:
        metric: A torchmetrics metric or collection whose states are fixed-size tensors
            reduced by ``"sum"``, ``"max"`` or ``"min"``.

    Returns:
        A ``TorchmetricsMetric``, or a ``TorchmetricsCollection`` for a collection.

    Raises:
        UnsupportedStateError: Naming a state that concatenates samples, averages across ranks,
            is not reduced or uses a callable reduction, with the sidestream equivalent.
        ValueError: If a metric was already updated: wrap it fresh, or ``reset()`` it first.
        TypeError: For anything else.

    Example:
        >>> import torchmetrics
        >>> accuracy = wrap(torchmetrics.classification.BinaryAccuracy(validate_args=False))
        >>> accuracy.update(torch.tensor([0.9, 0.2, 0.7]), torch.tensor([1, 0, 0]))
        >>> accuracy.compute()
        tensor(0.6667)
    """
    if isinstance(metric, MetricCollection):
        return TorchmetricsCollection(metric)
    if isinstance(metric, TorchmetricsBase):
        return TorchmetricsMetric(metric)
    raise TypeError(
        f"metric: expected a torchmetrics Metric or MetricCollection, got {type(metric)}"
    )
