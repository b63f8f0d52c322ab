"""One close per object, and the answer that later and concurrent ``close`` calls give."""

from __future__ import annotations

import threading

__all__ = ["CloseOnce", "wait_until_free"]


class CloseOnce:
    """Which ``close`` call closes, and what every other call returns.

    A second ``close`` used to return the first one's result as soon as the first had begun:
    ``True`` (nothing known yet) at once, from another thread (a watchdog, a callback) while
    the first was still delivering, even when the first then returned ``False``. Now a call
    made while the first is in progress waits (up to its own timeout) for the first's answer.
    """

    def __init__(self) -> None:
        # The first call's claim, (thread id, token), made by one dict.setdefault: a single C
        # call, so a signal handler cannot run inside it. With a lock held there, a SIGTERM
        # handler's close, run between two bytecodes of the first call's claim on the same
        # thread, waited for that lock, held by its own thread, forever.
        self._claim: dict[str, tuple[int, object]] = {}
        self._done = threading.Event()
        self._result = False

    @staticmethod
    def closer() -> tuple[int, object]:
        """A close call's own claim, to make before its ``try``: its thread and a fresh token."""
        return (threading.get_ident(), object())

    def begin(self, closer: tuple[int, object]) -> bool:
        """Whether the call with ``closer`` is the first, which closes (atomic: one thread wins).

        Call it inside the ``try`` whose handlers end the claim (``holds``, then ``end``): an
        exception raised right after the claim (a signal handler's ``KeyboardInterrupt`` or
        ``SystemExit``, run at the check Python makes once ``setdefault`` returns) skipped an
        ``end`` called only from a ``try`` entered after this returned, and every later close
        (another thread's, or the one at exit) waited for an answer that never came, or said
        ``False`` at once with the sinks never closed.
        """
        return self._claim.setdefault("closer", closer) is closer

    def holds(self, closer: tuple[int, object]) -> bool:
        """Whether the call with ``closer`` made the claim (so it must ``end`` it)."""
        return self._claim.get("closer") is closer

    def end(self, result: bool) -> None:
        """The first call's answer; wakes the calls waiting for it."""
        self._result = result
        self._done.set()

    def answer(self, timeout: float | None) -> bool:
        """What a call after the first returns: the first's answer, waited for up to ``timeout``.

        ``False`` if the first has not answered in time, or if this call runs inside the first
        on its own thread (a signal handler's close during it): nothing is delivered yet that
        it could vouch for, and waiting there would wait for itself.
        """
        if self._done.is_set():
            return self._result
        closer = self._claim.get("closer")
        if closer is not None and closer[0] == threading.get_ident():
            return False
        if not self._done.wait(timeout):
            return False
        return self._result


def wait_until_free(lock: threading.RLock, timeout: float | None) -> bool:
    """Wait up to ``timeout`` seconds (``None``: no limit) for a call holding ``lock`` to end.

    What a close does for a ``log`` or ``schedule_collection`` another thread is inside: that
    call checked "closed" before the close set it, so its values go out only if it finishes
    before the threads that deliver them stop. Re-entrant locks: a close run inside such a
    call on its own thread (a signal handler's) passes at once. Whether it had to wait.
    """
    if lock.acquire(blocking=False):
        lock.release()
        return False
    if lock.acquire(timeout=-1 if timeout is None else timeout):
        lock.release()
    return True
