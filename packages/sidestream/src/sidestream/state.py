"""Device-resident metric state: a local tensor and the synchronized copy a sync fills."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from sidestream._distributed import Group

__all__ = ["MetricAccumulator", "ReduceOp", "load_all", "reset_all"]


class ReduceOp(enum.Enum):
    """How an accumulator combines updates locally and states across ranks.

    There is deliberately no AVG: averages are not linearly reducible. Store a sum and a count.
    """

    SUM = "sum"
    MAX = "max"
    MIN = "min"


class MetricAccumulator:
    """One tensor of metric state, updated in place on its device.

    Updates touch only the local tensor: no communication and no host sync. ``sync`` fills a
    separate synchronized copy with the reduction over all ranks, and ``value`` returns that copy
    until the next update or reset, and the local tensor otherwise.

    Args:
        initial: The identity value of the state (0 for sums, -inf for a max, ...). Its shape and
            dtype are the state's shape and dtype.
        op: How updates and ranks are combined.
        dtype: Optional dtype to convert ``initial`` to.

    Example:
        >>> acc = MetricAccumulator(torch.zeros(3))
        >>> acc.accumulate(torch.tensor([1.0, 2.0, 3.0]))
        >>> acc.value
        tensor([1., 2., 3.])
    """

    def __init__(
        self,
        initial: Tensor | float | int | bool,
        op: ReduceOp = ReduceOp.SUM,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(op, ReduceOp):
            raise TypeError(f"op: expected a sidestream.state.ReduceOp, got {op!r}")
        initial_tensor = torch.as_tensor(initial, dtype=dtype)
        self._op = op
        self._initial = initial_tensor.detach().clone()
        self._local = initial_tensor.detach().clone()
        self._synced: Tensor | None = None

    @property
    def op(self) -> ReduceOp:
        """The reduction this state uses."""
        return self._op

    @property
    def initial(self) -> Tensor:
        """The identity value the state starts from and returns to on ``reset``."""
        return self._initial

    @property
    def local(self) -> Tensor:
        """This rank's accumulated state (not reduced)."""
        return self._local

    @property
    def synced(self) -> Tensor | None:
        """The state reduced over all ranks by the last ``sync``, or ``None`` when stale."""
        return self._synced

    @property
    def value(self) -> Tensor:
        """The synchronized state if the last sync is current, else the local state."""
        return self._local if self._synced is None else self._synced

    @property
    def device(self) -> torch.device:
        """The device the state lives on."""
        return self._local.device

    def accumulate(self, update: Tensor) -> None:
        """Combine ``update`` into the local state with this accumulator's op, in place.

        Args:
            update: A tensor broadcastable to the state's shape, on the state's device.
        """
        if self._op is ReduceOp.SUM:
            self._local.add_(update)
        elif self._op is ReduceOp.MAX:
            torch.maximum(self._local, update.to(self._local.dtype), out=self._local)
        else:
            torch.minimum(self._local, update.to(self._local.dtype), out=self._local)
        self._synced = None

    def scatter_add(self, index: Tensor, source: Tensor) -> None:
        """Add ``source`` into a one-dimensional SUM state at ``index`` (histograms, counts).

        Fixed-size and host-sync free, unlike ``bincount`` on CUDA.

        Args:
            index: int64 indices into the state, same shape as ``source``.
            source: The amounts to add.
        """
        if self._op is not ReduceOp.SUM:
            raise ValueError(f"scatter_add needs a SUM accumulator, this one is {self._op.name}")
        self._local.index_add_(0, index.reshape(-1), source.reshape(-1).to(self._local.dtype))
        self._synced = None

    def sync(self, group: Group = None) -> None:
        """Reduce the local state over ``group`` into the synchronized copy.

        Inside a running coalesced sync (any ``Metric.sync``), the reduction is batched with every
        other accumulator of that sync. A no-op when torch.distributed is not initialized or the
        group has one rank, so ``value`` stays the local state.

        Args:
            group: A process group, a 1-D device mesh, or ``None`` for the default group.
        """
        from sidestream.sync import reduce_accumulator

        reduce_accumulator(self, group, self._set_synced)

    def reduce_into(self, group: Group, receive: Callable[[Tensor], None]) -> None:
        """Reduce the local state over ``group`` and hand the result to ``receive``.

        Like ``sync`` but leaves the synchronized copy alone; checkpoints use it.
        """
        from sidestream.sync import reduce_accumulator

        reduce_accumulator(self, group, receive)

    def _set_synced(self, reduced: Tensor) -> None:
        self._synced = reduced

    def reset(self) -> None:
        """Return the local state to its initial value and drop the synchronized copy."""
        self._local.copy_(self._initial)
        self._synced = None

    def to(self, device: torch.device | str) -> MetricAccumulator:
        """Move the state to ``device`` and return ``self``."""
        self._initial = self._initial.to(device)
        self._local = self._local.to(device)
        self._synced = None if self._synced is None else self._synced.to(device)
        return self

    def load_local(self, value: Tensor) -> None:
        """Overwrite the local state with ``value`` (same shape) and drop the synchronized copy.

        Raises:
            ValueError: If ``value`` does not have the state's shape.
        """
        if tuple(value.shape) != tuple(self._local.shape):
            raise ValueError(
                f"state_dict: expected a tensor of shape {tuple(self._local.shape)}, "
                f"got {tuple(value.shape)}"
            )
        self._local.copy_(value)
        self._synced = None

    def state_dict(self) -> dict[str, Any]:
        """This accumulator's local state (the metric's ``state_dict`` reduces across ranks)."""
        return {"value": self._local.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the local state saved by ``state_dict``."""
        self.load_local(torch.as_tensor(state_dict["value"]).to(self.device))

    def __repr__(self) -> str:
        return (
            f"MetricAccumulator(op={self._op.name}, shape={tuple(self._local.shape)}, "
            f"dtype={self._local.dtype}, device={self._local.device})"
        )


def reset_all(accumulators: Sequence[MetricAccumulator]) -> None:
    """``reset`` every accumulator, with one batched copy instead of one call per state.

    Args:
        accumulators: The accumulators to return to their initial values.
    """
    if not accumulators:
        return
    torch._foreach_copy_([a._local for a in accumulators], [a._initial for a in accumulators])
    for accumulator in accumulators:
        accumulator._synced = None


def load_all(accumulators: Sequence[MetricAccumulator], values: Sequence[Tensor]) -> None:
    """``load_local`` every accumulator from the matching tensor, with one batched copy.

    Shapes are not checked here: callers pair accumulators with values of the same structure
    (for example the states of a metric and of its copy).

    Args:
        accumulators: The accumulators to overwrite.
        values: One tensor per accumulator, of its shape.
    """
    if not accumulators:
        return
    torch._foreach_copy_([a._local for a in accumulators], list(values))
    for accumulator in accumulators:
        accumulator._synced = None
