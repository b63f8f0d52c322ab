"""sidestream's own threads, and the blocking calls that must not be made on them.

User code runs on these threads: a sink's methods on its sink thread, a metric's ``sync`` and
``compute`` on a collector's dispatcher thread, and any ``logging`` handler on whichever thread
logs. A call that waits for the thread it runs on never ends: ``run.state_dict(None)`` from a
sink's ``write`` waited forever for that write; ``run.close()`` there returned ``False`` at once
("cannot join current thread"), keeping no spool file, and the reports still queued died with
the process; ``schedule_collection`` from a ``compute`` with every staging slot in use waited
forever for the window it was computing. Such calls raise instead (``refuse_on_own_thread``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable

__all__ = ["FirstTimes", "own_thread", "refuse_on_own_thread"]

_ROLE = "_sidestream_role"  # the attribute a thread made by own_thread carries


def own_thread(target: Callable[[], object], *, name: str, role: str) -> threading.Thread:
    """A daemon thread of sidestream's, not started; ``role`` says what runs on it.

    Args:
        target: What the thread runs.
        name: The thread's name.
        role: The thread as an error names it, with the user code that runs on it
            (``"thread of sink 'jsonl' (from the sink's methods, or a logging handler)"``).
    """
    thread = threading.Thread(target=target, name=name, daemon=True)
    setattr(thread, _ROLE, role)
    return thread


def refuse_on_own_thread(call: str) -> None:
    """Raise if this is one of sidestream's threads: ``call`` waits for them, so for itself.

    Raises:
        RuntimeError: Naming ``call``, the thread, and what to do instead.
    """
    role = getattr(threading.current_thread(), _ROLE, None)
    if role is not None:
        raise RuntimeError(
            f"{call}: called on sidestream's {role}, which it waits for: it would wait for "
            "itself (a hang, or a close that loses what was not delivered). Make it from the "
            "training loop's thread (from a sink, a metric or a logging handler, set a flag "
            "the loop reads)"
        )


class FirstTimes:
    """The keys seen so far, for what is said once per key from any number of threads.

    A bare ``if key not in seen: seen.add(key)`` lets two threads both find the key missing
    and say the same warning twice.
    """

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def first(self, key: Hashable) -> bool:
        """Whether this is the first call with ``key``; exactly one caller per key gets True."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` was seen (a quick check; only ``first`` decides who says it)."""
        return key in self._seen

    def __getstate__(self) -> tuple[set[Hashable]]:
        # Picklable (a sink that holds one runs in a ProcessSink's child); the lock is new there.
        # A tuple, never empty: pickle protocols 0 and 1 skip __setstate__ for a false state
        # (an empty set), which left an unpickled FirstTimes with no lock and no keys.
        with self._lock:
            return (set(self._seen),)

    def __setstate__(self, state: tuple[set[Hashable]]) -> None:
        self._seen = set(state[0])
        self._lock = threading.Lock()


def _forget_role_in_child() -> None:
    """In a process forked from one of sidestream's threads: that thread is its own now.

    The child runs on the forking thread's object (its main thread from then on), which still
    carried the role, so every blocking call there was refused.
    """
    thread = threading.current_thread()
    if hasattr(thread, _ROLE):
        delattr(thread, _ROLE)


if hasattr(os, "register_at_fork"):  # not on Windows, which does not fork
    os.register_at_fork(after_in_child=_forget_role_in_child)
