"""A torchmetrics ``MetricCollection`` as a sidestream composition."""

from __future__ import annotations

from typing import Any

from torchmetrics import MetricCollection

from sidestream.metrics import ComposeMetric
from sidestream_torchmetrics.metric import TorchmetricsMetric

__all__ = ["TorchmetricsCollection"]


class TorchmetricsCollection(ComposeMetric):
    """Every member of a ``MetricCollection`` wrapped, synced in one coalesced sync.

    ``update`` feeds every member (torchmetrics' compute groups, which share state between
    members, are not used: each member keeps its own state). ``compute`` returns
    ``{name: value}`` with the collection's prefix and postfix applied, as torchmetrics does.

    Args:
        collection: The torchmetrics collection; every member must be wrappable (see
            ``TorchmetricsMetric``).
    """

    def __init__(self, collection: MetricCollection) -> None:
        if not isinstance(collection, MetricCollection):
            raise TypeError(f"collection: expected a MetricCollection, got {type(collection)}")
        members = dict(collection.items(keep_base=True, copy_state=False))
        super().__init__({name: TorchmetricsMetric(metric) for name, metric in members.items()})
        self._collection = collection

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Update every member with the same arguments. No communication.

        As ``MetricCollection.update``, each member gets only the keyword arguments its
        ``update`` takes (``preds=``/``target=`` for a classifier, ``value=`` for a mean).
        """
        for _, child in self.items():
            assert isinstance(child, TorchmetricsMetric)
            child.update(*args, **child.torchmetrics._filter_kwargs(**kwargs))

    def compute(self) -> dict[str, Any]:
        """``{name: value}``, names with the collection's prefix and postfix."""
        return {self._collection._set_name(name): child.compute() for name, child in self.items()}
