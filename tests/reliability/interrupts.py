"""SIGALRM as Ctrl-C: a ``KeyboardInterrupt`` raised on the main thread where a signal lands."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


def _interrupt(signum: int, frame: object) -> None:
    del signum, frame
    raise KeyboardInterrupt


@contextmanager
def alarm_interrupts() -> Iterator[None]:
    """While inside, SIGALRM (``setitimer``, ``pthread_kill``) raises ``KeyboardInterrupt``.

    The previous handler is put back, and a pending timer cancelled, on the way out.
    """
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
