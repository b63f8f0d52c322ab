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
        if not members:
            raise ValueError("collection: expected at least one metric, got an empty one")
        # torchmetrics keys may hold "/" or "." ("val/acc"), which sidestream names refuse: the
        # members get plain names inside, and compute() gives back the collection's keys.
        self._keys = {_plain_name(name): name for name in members}
        if len(self._keys) != len(members):
            raise ValueError(
                f"collection: keys {sorted(members)} collide once '/' and '.' become '_'; "
                "rename one of them"
            )
        # One torchmetrics object under two keys: each wrapper would point its states at it
        # in turn, and the second's first update took the first's for a direct update of the
        # torchmetrics object ("updated, called or reset directly"), far from the cause.
        first_key: dict[int, str] = {}
        for key, held in members.items():
            if id(held) in first_key:
                raise ValueError(
                    f"collection: keys {first_key[id(held)]!r} and {key!r} hold the same "
                    f"{type(held).__name__} object; give each key a metric of its own "
                    "(copy.deepcopy of a fresh one)"
                )
            first_key[id(held)] = key
        wrapped: dict[str, TorchmetricsMetric] = {}
        for plain, key in self._keys.items():
            try:
                wrapped[plain] = TorchmetricsMetric(members[key])
            except (TypeError, ValueError) as error:  # which member, besides its class
                # The members wrapped so far sync on their own again: a refused collection,
                # used as it is instead, must not report each rank's own values.
                for member in wrapped.values():
                    member.restore_distribution()
                raise type(error)(f"collection[{key!r}]: {error}") from None
        super().__init__(wrapped)
        self._collection = collection

    def __repr__(self) -> str:
        return f"TorchmetricsCollection({getattr(self, '_collection', None)!r})"

    def __getitem__(self, name: str) -> Any:  # as ComposeMetric's
        """The wrapped member under its collection key (``"val/acc"``) or its plain name."""
        return super().__getitem__(_plain_name(name))

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Update every member with the same arguments. No communication.

        As ``MetricCollection.update``, each member gets only the keyword arguments its
        ``update`` takes (``preds=``/``target=`` for a classifier, ``value=`` for a mean).
        A member that refuses the batch (or raises) leaves it in none of them.
        """
        done: list[tuple[TorchmetricsMetric, list[Any]]] = []
        try:
            for _, child in self.items():
                assert isinstance(child, TorchmetricsMetric)
                snapshot = child._update(args, child.torchmetrics._filter_kwargs(**kwargs))
                done.append((child, snapshot))
        except BaseException:
            # A member refused the batch: the members before it give it back too, so a
            # retried update does not count it twice in them.
            for child, snapshot in reversed(done):
                child._undo(snapshot)
            raise

    def compute(self) -> dict[str, Any]:
        """``{name: value}``, names with the collection's prefix and postfix.

        A member whose ``compute`` returns a dict adds its entries under their own keys, as
        ``MetricCollection.compute`` flattens them: when a key would come twice, every dict
        entry is named after its member too (``"<member>_<key>"``), as torchmetrics does.
        """
        results: dict[str, Any] = {}
        for plain, child in self.items():
            results[self._keys[plain]] = child.compute()
        seen: set[str] = set()
        duplicates = False
        for key, value in results.items():
            for name in value if isinstance(value, dict) else (key,):
                duplicates = duplicates or name in seen
                seen.add(name)
        flat: dict[str, Any] = {}
        for plain, child in self.items():
            key, value = self._keys[plain], results[self._keys[plain]]
            if not isinstance(value, dict):
                flat[key] = value
                continue
            assert isinstance(child, TorchmetricsMetric)
            member = child.torchmetrics
            for name, entry in value.items():
                if duplicates:
                    own = key.replace(getattr(member, "prefix", None) or "", "")
                    own = own.replace(getattr(member, "postfix", None) or "", "")
                    name = f"{own}_{name}"
                if getattr(member, "_from_collection", None):
                    name = f"{member.prefix or ''}{name}{member.postfix or ''}"
                flat[name] = entry
        return {self._collection._set_name(name): value for name, value in flat.items()}


def _plain_name(key: str) -> str:
    return key.replace("/", "_").replace(".", "_")
