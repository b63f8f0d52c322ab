"""Count the collectives code issues: the measure of a coalesced sync, in tests and benchmarks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from sidestream import _distributed

__all__ = ["COLLECTIVES", "count_collectives"]

#: The torch.distributed functions counted, wherever they are called from.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
)


_ALIASES = {
    "all_gather_into_tensor": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single",
}
"""Old names that call the new one inside them (torch 2.13): one collective, counted once."""


_lock = threading.Lock()
_blocks: list[list[str]] = []  # the open blocks' lists, whichever thread opened them
_saved: list[tuple[Any, str, Any]] = []  # the functions replaced while a block is open
_thread = threading.local()  # per thread: the collectives it is inside (see ``call``)


def _counted(name: str, original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        # Per thread: a collective another thread is inside is a separate call.
        active: set[str] = getattr(_thread, "active", None) or set()
        _thread.active = active
        if name in active:
            return original(*args, **kwargs)
        with _lock:
            for calls in _blocks:
                calls.append(name)
        inside = {name, _ALIASES.get(name, name)} - active
        active.update(inside)
        try:
            return original(*args, **kwargs)
        finally:
            active.difference_update(inside)

    return call


def _install() -> None:
    for module in (dist, c10d):
        for name in COLLECTIVES:
            original = getattr(module, name, None)
            if original is not None:
                _saved.append((module, name, original))
                setattr(module, name, _counted(name, original))
    for attribute, name in (("_GATHER", _distributed.PUBLIC_GATHER), ("_REDUCE", "all_reduce")):
        original = getattr(_distributed, attribute)
        if original is not None:
            _saved.append((_distributed, attribute, original))
            setattr(_distributed, attribute, _counted(name, original))


def _uninstall() -> None:
    for module, name, original in reversed(_saved):
        setattr(module, name, original)
    _saved.clear()


@contextlib.contextmanager
def count_collectives() -> Iterator[list[str]]:
    """Record the name of every collective issued inside the block, in order.

    Calls through ``torch.distributed`` and through ``distributed_c10d`` (where torch's own
    helpers call each other) both count, so ``all_gather_object`` shows its inner
    ``all_gather`` calls too; an old name that calls its new one (``all_gather_into_tensor``,
    ``all_gather_single``) counts once, under the name called. So do the collectives a sync
    starts through the process group's own methods (which skip the public functions' per-call
    checks), under the public name the same call would have: ``all_gather_single``
    (``all_gather_into_tensor`` on torch versions without it) and ``all_reduce``. A collective
    that re-enters itself counts once: under a ``torch.device`` context (as ``on_rank_device``
    sets) torch dispatches the call again by its public name.

    The count is of the whole process: a block open on one thread also records the collectives
    other threads issue meanwhile. Blocks may be nested and may be open on several threads at
    once; ``torch.distributed`` is restored when the last one closes.

    Example:
        >>> with count_collectives() as calls:
        ...     metric.sync()  # doctest: +SKIP
        >>> calls  # doctest: +SKIP
        ['all_gather_single']
    """
    calls: list[str] = []
    with _lock:
        if not _blocks:
            _install()
        _blocks.append(calls)
    try:
        yield calls
    finally:
        with _lock:
            # By identity: two blocks' lists may be equal.
            del _blocks[next(i for i, block in enumerate(_blocks) if block is calls)]
            if not _blocks:
                _uninstall()
