"""The ``Metric`` interface every sidestream metric implements."""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, Generic, Self, TypeVar

import torch
from torch.distributed.checkpoint.stateful import Stateful

from sidestream._distributed import Group, group_rank, resolve_group
from sidestream.state import MetricAccumulator
from sidestream.sync import coalesced_sync, state_name

__all__ = ["Metric"]

T = TypeVar("T")


class Metric(Stateful, Generic[T], abc.ABC):
    """A metric whose state lives on the device and reduces linearly across ranks.

    Lifecycle: ``update`` any number of times (device ops only, no communication, no host
    sync), ``sync`` to reduce the state over the ranks of a group, ``compute`` to get the value
    (a tensor or a pytree of tensors), ``reset`` to start a new window.

    State is held in ``MetricAccumulator`` attributes (and child ``Metric`` attributes), found in
    attribute order; the default ``sync``, ``reset``, ``to``, ``state_dict`` and
    ``load_state_dict`` work on them, so a subclass usually implements only ``update`` and
    ``compute``.

    Checkpoints are world-size independent: on a multi-rank job ``state_dict`` is a collective
    that returns the globally reduced state (identical on every rank), and ``load_state_dict``
    puts that state on the group's first rank and the initial value on the others. Saving with
    4 ranks and loading with 2 (or 1) continues the same numbers.
    """

    _sync_group: Group = None

    @abc.abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add a batch to the local state. No communication and no host sync."""

    @abc.abstractmethod
    def compute(self) -> T:
        """Compute the value from the synchronized state if current, else the local state."""

    def named_accumulators(self, prefix: str = "") -> Iterator[tuple[str, MetricAccumulator]]:
        """Yield ``(dotted name, accumulator)`` for this metric's state, children included.

        Attribute names lose their leading underscore: ``self._total`` is ``"total"``.
        """
        for attribute, value in vars(self).items():
            name = prefix + attribute.lstrip("_")
            if isinstance(value, MetricAccumulator):
                yield name, value
            elif isinstance(value, Metric):
                yield from value.named_accumulators(name + ".")

    @property
    def sync_group(self) -> Group:
        """The group ``state_dict`` reduces over and ``load_state_dict`` places the state in.

        The group of the last ``sync`` (``None``, the default group, before any). Set it before
        ``load_state_dict`` when the metric syncs over a sub-group, such as the data-parallel
        dimension of a device mesh, so each such group's first rank takes the saved state.
        """
        return self._sync_group

    @sync_group.setter
    def sync_group(self, group: Group) -> None:
        self._sync_group = group

    def sync(self, group: Group = None) -> None:
        """Reduce the state over ``group`` with a coalesced, fixed number of collectives.

        A no-op when torch.distributed is not initialized or the group has one rank. Every rank
        of the group must call it, in the same order relative to other collectives.

        Args:
            group: A process group, a 1-D device mesh (for example the data-parallel dimension),
                or ``None`` for the default group. Remembered for ``state_dict``.
        """
        self._sync_group = group
        with coalesced_sync():
            for name, accumulator in self.named_accumulators():
                with state_name(name):
                    accumulator.sync(group)

    def reset(self) -> None:
        """Return every state to its initial value (no communication)."""
        for _, accumulator in self.named_accumulators():
            accumulator.reset()

    def to(self, device: torch.device | str) -> Self:
        """Move every state to ``device`` and return ``self``."""
        for _, accumulator in self.named_accumulators():
            accumulator.to(device)
        return self

    @property
    def device(self) -> torch.device:
        """The device of the metric's state (CPU for a metric without state)."""
        for _, accumulator in self.named_accumulators():
            return accumulator.device
        return torch.device("cpu")

    def state_dict(self) -> dict[str, Any]:
        """The globally reduced state, keyed by dotted accumulator name.

        On a multi-rank job this is a collective over the group of the last ``sync`` (the
        default group if there was none): every rank must call it, and every rank gets the same
        tensors. Single-process it is a copy of the local state.
        """
        reduced: dict[str, Any] = {}
        with coalesced_sync():
            for name, accumulator in self.named_accumulators():
                with state_name(name):
                    accumulator.reduce_into(self._sync_group, _receiver(reduced, name))
        return reduced

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by ``state_dict`` with any number of ranks.

        The group's first rank takes the saved global state; the others start from the initial
        value, so the next sync counts the saved data exactly once.

        Raises:
            KeyError: If ``state_dict`` lacks a state of this metric or has an unknown one.
            ValueError: If a saved tensor's shape differs from the state's shape.
        """
        accumulators = dict(self.named_accumulators())
        missing = sorted(set(accumulators) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(accumulators))
        if missing or unexpected:
            raise KeyError(
                f"state_dict: missing keys {missing}, unexpected keys {unexpected} "
                f"for {type(self).__name__}"
            )
        for name, accumulator in accumulators.items():
            saved = torch.as_tensor(state_dict[name])
            if tuple(saved.shape) != tuple(accumulator.local.shape):
                raise ValueError(
                    f"state_dict[{name!r}]: expected shape {tuple(accumulator.local.shape)}, "
                    f"got {tuple(saved.shape)}"
                )
        owner = group_rank(resolve_group(self._sync_group)) == 0
        for name, accumulator in accumulators.items():
            if owner:
                accumulator.load_local(torch.as_tensor(state_dict[name]).to(accumulator.device))
            else:
                accumulator.load_local(accumulator.initial)


def _receiver(into: dict[str, Any], name: str) -> Any:
    def receive(reduced: torch.Tensor) -> None:
        into[name] = reduced

    return receive
