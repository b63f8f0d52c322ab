"""A stand-in for the sink pipeline in these tests: a queue and a thread that retries writes.

The real pipeline (per-sink bounded queue, spool, retry with backoff) is built separately; the
sinks only promise that ``write`` raises on failure and is safe to call again with the same
report. This driver does exactly that and nothing more, so the fault scenarios run here.
"""

from __future__ import annotations

import queue
import threading
import time

from sidestream.sinks import Report, Sink


class RetryingDriver:
    """Hands reports to ``sink.write`` on a background thread, retrying each until it succeeds.

    Args:
        sink: An opened sink.
        initial_backoff: First wait after a failed write, in seconds; doubles up to
            ``max_backoff``.
    """

    def __init__(self, sink: Sink, initial_backoff: float = 0.05, max_backoff: float = 1.0) -> None:
        self._sink = sink
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._queue: queue.Queue[Report | None] = queue.Queue()
        self.failures = 0
        self.delivered: list[int] = []
        self.errors: list[str] = []
        self.submit_seconds: list[float] = []
        self._thread = threading.Thread(target=self._deliver, name="test-driver", daemon=True)
        self._thread.start()

    def submit(self, report: Report) -> None:
        """Queue ``report``; what the training thread pays is recorded in ``submit_seconds``."""
        started = time.perf_counter()
        self._queue.put(report)
        self.submit_seconds.append(time.perf_counter() - started)

    def _deliver(self) -> None:
        while True:
            report = self._queue.get()
            if report is None:
                self._queue.task_done()
                return
            backoff = self._initial_backoff
            while True:
                try:
                    self._sink.write(report)
                    break
                except Exception as error:
                    self.failures += 1
                    self.errors.append(str(error))
                    time.sleep(backoff)
                    backoff = min(self._max_backoff, backoff * 2)
            self.delivered.append(report.step)
            self._queue.task_done()

    def drain(self, timeout: float = 120.0) -> None:
        """Wait until every queued report is delivered; raise ``TimeoutError`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._queue.unfinished_tasks} reports undelivered")
            time.sleep(0.01)

    def stop(self, timeout: float = 120.0) -> None:
        """Deliver everything queued, then stop the thread."""
        self.drain(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
