"""The thread that turns ``Run.log`` values into reports, waiting on CUDA copies off the caller."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sidestream._host_events import wait_on_host
from sidestream.sinks.base import Report

__all__ = ["LogEntry", "LogPipe"]

logger = logging.getLogger("sidestream.run")


@dataclass
class LogEntry:
    """One ``Run.log`` call: numbers known now, and device values on their way to the host.

    ``host`` (pinned, float64) holds ``device_names``' values once ``done`` has completed.
    """

    step: int
    time: float
    numbers: dict[str, float]
    device_names: tuple[str, ...] = ()
    host: Tensor | None = None
    done: torch.cuda.Event | None = None


class LogPipe:
    """A bounded queue of ``LogEntry`` and one thread that makes each into a ``Report``.

    Policy when full (``capacity`` entries waiting, which only happens if CUDA copies stall):
    the new entry is dropped, counted in ``dropped`` and warned about once. The caller never
    waits.

    Args:
        deliver: Called with each report, in the order of the ``log`` calls.
        capacity: Entries that may wait.
    """

    def __init__(self, deliver: Callable[[Report], None], capacity: int = 4096) -> None:
        self._deliver = deliver
        self._capacity = capacity
        self._cond = threading.Condition()
        self._entries: deque[LogEntry] = deque()
        self._busy = False
        self._stopping = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._work, name="sidestream-log", daemon=True)
        self._thread.start()

    def put(self, entry: LogEntry) -> None:
        """Queue ``entry``; returns at once (drops it when the queue is full)."""
        with self._cond:
            if len(self._entries) >= self._capacity:
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning(
                        "Run.log: %d values wait for the GPU already; step %d dropped (drops "
                        "are counted in Run.log_dropped, not logged again)",
                        self._capacity,
                        entry.step,
                    )
                return
            self._entries.append(entry)
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until every queued entry is delivered; whether it happened in time."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._entries and not self._busy, timeout)

    def stop(self, timeout: float | None) -> bool:
        """Deliver what is queued, then end the thread; whether it ended in time."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._entries or self._stopping)
                if not self._entries:
                    return
                entry = self._entries.popleft()
                self._busy = True
            try:
                self._deliver(_report(entry))
            except Exception as error:  # a bad entry must not stop the others
                logger.error("Run.log at step %d failed: %s", entry.step, error)
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def _report(entry: LogEntry) -> Report:
    values = dict(entry.numbers)
    if entry.host is not None and entry.done is not None:
        wait_on_host(entry.done)
        values.update(zip(entry.device_names, entry.host.tolist(), strict=True))
    return Report(step=entry.step, values=values, time=entry.time, stream="")
