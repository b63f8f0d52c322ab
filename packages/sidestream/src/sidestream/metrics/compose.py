"""A named collection of metrics that syncs, resets, moves and checkpoints together."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from sidestream._text import check_encodable
from sidestream.metric import Metric

__all__ = ["ComposeMetric"]


class ComposeMetric(Metric[dict[str, Any]]):
    """Several metrics under names; ``compute`` returns ``{name: child.compute()}``.

    One ``sync`` reduces every child's state in the same coalesced collectives, and the whole
    tree shares one state arena. Children may be ``ComposeMetric`` themselves. Update the
    children, not the composition; each child's update makes only that child's synced value
    stale.

    Args:
        metrics: Child metrics by name (at least one). Names may not contain ``.`` or ``/``.

    Example:
        >>> from sidestream import MaxMetric, MeanMetric
        >>> metrics = ComposeMetric({"loss": MeanMetric(), "max_loss": MaxMetric()})
        >>> metrics["loss"].update(torch.tensor([1.0, 3.0]))
        >>> metrics.compute()["loss"]
        tensor(2., dtype=torch.float64)
    """

    _independent_children = True
    _children: dict[str, Metric[Any]]

    def __init__(self, metrics: Mapping[str, Metric[Any]]) -> None:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics: expected a mapping of names to metrics, got {type(metrics)}")
        if not metrics:
            # Children cannot be added later: a collector of it would report nothing, every
            # window, with no sign why.
            raise ValueError("metrics: expected at least one metric, got none")
        for name, metric in metrics.items():
            if not isinstance(name, str):
                raise TypeError(f"metrics: names must be strings, got {name!r} ({type(name)})")
            if not name or "." in name or "/" in name:
                raise ValueError(
                    f"metrics: names must be non-empty without '.' or '/', got {name!r}"
                )
            check_encodable("metrics: a name", name)  # it names the values in a tracker
            if not isinstance(metric, Metric):
                raise TypeError(
                    f"metrics[{name!r}]: expected a sidestream Metric, got {type(metric)}"
                )
        for name, metric in metrics.items():
            self._declare(name, metric, None)
        object.__setattr__(self, "_children", dict(metrics))

    def __getitem__(self, name: str) -> Any:
        """The child ``name``: a metric, or a composition to index again.

        Typed ``Any``: a child may be a leaf metric or a ``ComposeMetric``, and no annotation
        can say which per name. ``Metric[Any]`` made a type checker refuse the documented
        ``compose["train"]["tokens"].update(...)``.
        """
        return self._children[name]

    def __repr__(self) -> str:
        # getattr: a constructor that raised part-way (a child already in another tree) leaves
        # an object without children that a debugger or pytest --showlocals prints.
        children = getattr(self, "_children", {})
        inner = ", ".join(f"{name!r}: {child!r}" for name, child in children.items())
        return f"{type(self).__name__}({{{inner}}})"

    def __iter__(self) -> Iterator[str]:
        return iter(self._children)

    def __len__(self) -> int:
        return len(self._children)

    def items(self) -> Iterator[tuple[str, Metric[Any]]]:
        """``(name, child)`` pairs in insertion order."""
        return iter(self._children.items())

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Refused: update the children, for example ``compose["loss"].update(...)``."""
        raise TypeError(
            "ComposeMetric.update: a composition has no update of its own; update its children, "
            f"for example compose[{next(iter(self._children), 'name')!r}].update(...)"
        )

    def compute(self) -> dict[str, Any]:
        """``{name: child.compute()}``."""
        return {name: child.compute() for name, child in self._children.items()}
