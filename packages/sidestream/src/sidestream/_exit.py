"""The at-exit closes of runs and collectors, kept ahead of their backends' own teardowns.

``atexit`` runs the newest registration first. A run registers its close when it is made, but
a tracker client registers its teardown (wandb stops its service process) when the sink opens,
later, so at exit the client would be gone before the run's close delivers what is left. A sink
whose backend registers such a teardown calls ``close_before_backends_exit`` once it has, and
every close registered here moves in front of it again.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable

__all__ = ["close_at_exit", "close_before_backends_exit", "forget_close_at_exit"]

_LOCK = threading.Lock()
_CLOSES: list[Callable[[], object]] = []  # oldest first, as registered with atexit


def close_at_exit(close: Callable[[], object]) -> None:
    """Run ``close`` at interpreter exit (before the teardowns of backends opened later)."""
    with _LOCK:
        _CLOSES.append(close)
        atexit.register(close)


def forget_close_at_exit(close: Callable[[], object]) -> None:
    """Undo ``close_at_exit`` (the run or collector was closed already)."""
    with _LOCK:
        if close in _CLOSES:
            _CLOSES.remove(close)
        atexit.unregister(close)


def close_before_backends_exit() -> None:
    """Move every registered close in front of the at-exit hooks registered so far.

    For sinks (``open``, after a client registered its own at-exit teardown). Keeps the order
    among the closes.
    """
    with _LOCK:
        for close in _CLOSES:
            atexit.unregister(close)
        for close in _CLOSES:
            atexit.register(close)
