"""The thread that turns ``Run.log`` values into reports, waiting on CUDA copies off the caller."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sidestream._host_events import wait_on_host
from sidestream._logs import get_logger
from sidestream._threads import own_thread
from sidestream.sinks.base import Report

__all__ = ["LogEntry", "LogPipe"]

logger = get_logger("sidestream.run")

_POLL_S = 0.001  # how often an interrupted close looks at a CUDA copy it waits for


@dataclass
class LogEntry:
    """One ``Run.log`` call: numbers known now, and device values on their way to the host.

    ``host`` (pinned, float64) holds ``device_names``' values once ``done`` has completed.
    ``queued``: taken by ``LogPipe.put`` (queued, delivered or dropped). ``given``: the sinks
    (runner keys) that have it, so a delivery cut short by Ctrl-C goes on with the others only.
    """

    step: int
    time: float
    numbers: dict[str, float]
    device_names: tuple[str, ...] = ()
    host: Tensor | None = None
    done: torch.cuda.Event | None = None
    queued: bool = False
    given: set[str] = field(default_factory=set)


class LogPipe:
    """A bounded queue of ``LogEntry`` and one thread that makes each into a ``Report``.

    Policy when full (``capacity`` entries waiting):

    - every waiting entry, and the new one, holds host numbers only (the thread is behind a
      burst of calls, not waiting for a GPU): the new one is queued all the same, and the
      caller then delivers the queue itself, in order (``drain``), and nothing is dropped;
      that call takes as long as the deliveries;
    - an entry waits for a CUDA copy (the copies stall): the new entry is dropped, counted in
      ``dropped`` and warned about once. The caller never waits for the GPU.

    Args:
        deliver: Called with each report, in the order of the ``log`` calls, and the set of
            sinks that have it already (it adds each sink it hands the report to).
        capacity: Entries that may wait.
    """

    def __init__(self, deliver: Callable[[Report, set[str]], None], capacity: int = 4096) -> None:
        self._deliver = deliver
        self._capacity = capacity
        # Entered as the lock itself (with self._lock), never as the Condition: its __enter__
        # is a Python frame, and a Ctrl-C there in a log call left the lock held, so the
        # thread never delivered another entry.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # Held around each delivery, by the thread or by a caller draining a full queue: one
        # delivery at a time, in the order of the calls.
        self._delivering = _OwnedLock()
        self._entries: deque[LogEntry] = deque()
        self._on_device = 0  # entries waiting for a CUDA copy, queued or being delivered
        self._busy = False
        self._stopping = False
        self._refusing = False  # stopped by a run's close: put refuses (_refuse_if_stopping)
        self.dropped = 0
        self._thread = own_thread(
            self._work, name="sidestream-log", role="Run.log thread (from a logging handler)"
        )
        self._thread.start()

    def put(self, entry: LogEntry) -> None:
        """Queue ``entry``; returns without waiting for the GPU (see the class's policy).

        ``take``, then ``drain`` if the queue was full.
        """
        if self.take(entry):
            self.drain()

    def take(self, entry: LogEntry) -> bool:
        """Queue ``entry``, or drop it (see the class's policy); never waits.

        Sets ``entry.queued`` once it is queued (or dropped): a Ctrl-C that interrupts this call
        finds it set or not, and the entry then queued or not.

        Returns:
            Whether the queue was full of host numbers: the caller should ``drain`` it, once it
            holds no lock a delivery may need (``Run.log``'s: a logging handler run inside the
            delivery in progress may log, and a caller that waited for that delivery holding
            it hung the job).
        """
        with self._lock:
            self._refuse_if_stopping(entry)
            if len(self._entries) < self._capacity:
                if entry.host is not None:
                    self._on_device += 1
                entry.queued = True
                self._entries.append(entry)
                self._cond.notify_all()
                return False
            if entry.host is not None or self._on_device:
                entry.queued = True
                self._drop(entry)
                return False
            # Queued one over capacity at once, with the flag: its place in the order of the
            # calls is taken here, and an interrupt from here on finds it queued.
            entry.queued = True
            self._entries.append(entry)
            self._cond.notify_all()
            return True

    def _drop(self, entry: LogEntry) -> None:
        self.dropped += 1
        if self.dropped == 1:
            logger.warning(
                "Run.log: %d values wait for the GPU already; step %d dropped (drops are "
                "counted in Run.log_dropped, not logged again, and make close() return False)",
                self._capacity,
                entry.step,
            )

    def drain(self) -> None:
        """Deliver every waiting entry on the calling thread, in order (after ``take`` said so).

        Left to the delivery in progress when this thread runs it (a logging handler's
        ``Run.log`` inside a delivery: waiting for it, this thread would wait for itself), and
        to the pipe's thread while an entry waits for a CUDA copy (the caller never waits for
        the GPU). An interrupt (Ctrl-C) leaves what was not delivered queued, in order.
        """
        # A logging handler run inside a delivery (a sink's warning) whose Run.log finds the
        # queue full must not wait for its own thread.
        if self._delivering.held_here():
            return
        with self._delivering:
            with self._lock:
                if self._on_device:  # queued meanwhile by another thread: it would wait
                    return
                # Those queued now (host numbers only: none waits for the GPU); later ones
                # are the pipe's thread's, or their own callers'.
                count = len(self._entries)
            for _ in range(count):
                with self._lock:
                    # Only holders of _delivering take entries off: this is still the head.
                    head = self._entries[0]
                # Delivered from the queue's head and taken off only once delivered, never
                # held aside: a close on another thread (which waits for the pipe's thread
                # to find the queue empty) or a checkpoint (wait_idle) then waits for it,
                # where entries held aside reached the sinks after they closed, lost while
                # close said True; and a Ctrl-C in the delivery (a sink's full queue
                # waiting for room) leaves it queued, for the sinks that lack it only.
                self._deliver_one(head)
                with self._lock:
                    self._entries.popleft()
                    self._cond.notify_all()

    def _refuse_if_stopping(self, entry: LogEntry) -> None:
        """Raise, leaving ``entry`` untaken, after ``stop(refuse_later=True)`` (lock held).

        A close run inside a ``log`` call on its own thread (a signal handler's) stops the pipe
        before the call hands its entry over: queued after that, it reached no sink, while the
        call returned as if it had and close said True. So does an interrupted close on another
        thread (``hand_over(refuse_later=True)``), which does not wait for log calls in
        progress, and a close on another thread whose timeout ran out while it waited for the
        call.
        """
        if self._refusing:
            raise RuntimeError(
                f"log: the run was closed during this call (by a close run inside it on this "
                f"thread, such as a signal handler's, or by a close on another thread that was "
                f"interrupted or whose timeout ran out while it waited for this call); the "
                f"values of step {entry.step} reached no sink"
            )

    def wait_idle(self, timeout: float | None) -> bool:
        """Block until every queued entry is delivered; whether it happened in time."""
        with self._lock:
            return self._cond.wait_for(lambda: not self._entries and not self._busy, timeout)

    def stop(self, timeout: float | None, *, refuse_later: bool = False) -> bool:
        """Deliver what is queued, then end the thread; whether it ended in time.

        When it did not (a CUDA copy still stalls), ``undelivered`` says how many entries
        reached no sink. ``refuse_later``: later ``put`` calls raise (a run's close: nothing
        would deliver them).
        """
        with self._lock:
            self._stopping = True
            self._refusing = self._refusing or refuse_later
            self._cond.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def hand_over(self, wait_s: float, *, refuse_later: bool = False) -> int:
        """Deliver the entries queued now on the calling thread, in order; how many are left.

        For a checkpoint or a close whose time ran out before this pipe's thread was idle, and
        for an interrupted close: entries still queued here are in no sink's queue, so neither
        a checkpoint's ``"undelivered"`` nor the spool file a close keeps would hold them (an
        interrupted close's sinks, closed next, dropped them with a DEBUG line). Handed to the
        sinks' pipelines, which never wait for the backend, they are in both. The delivery in
        progress (on the thread, or by a caller draining a full queue) and the CUDA copies are
        waited for up to ``wait_s`` seconds in all: what is left then reaches no sink from
        here, which the count tells the caller. ``refuse_later``: later ``put`` calls raise, as
        after ``stop(refuse_later=True)`` (a close: nothing would deliver them).

        Once stopped (a close), an entry whose copy has not completed is given up and the
        later ones are still handed over; before (a checkpoint), the hand-over ends there: a
        later step delivered first would make the sinks skip it as delivered.
        """
        deadline = time.monotonic() + wait_s
        with self._lock:
            if refuse_later:
                self._stopping = True
                self._refusing = True
                self._cond.notify_all()
            # Those queued now: another thread's later log calls are not this caller's. Known
            # by the last of them, not by their number: the pipe's thread (or a caller draining
            # a full queue) may deliver some before this call has the delivery lock, and a
            # count taken now then ran past the queue's end (IndexError out of a checkpoint or
            # a close, half the time after a burst of log calls).
            last = self._entries[-1] if self._entries else None
            count = len(self._entries)
            final = self._stopping
        # Behind the delivery in progress: the entries reach each sink in the order of calls.
        if not self._delivering.acquire(timeout=max(0.0, wait_s)):
            return count
        lost = 0
        try:
            with self._lock:
                # With _delivering held nothing leaves the queue's head: ours still queued lead
                # it, up to the last.
                count = self._queued_through(last)
            for handed in range(count):
                with self._lock:
                    # Only holders of _delivering take entries off: this is still the head.
                    head = self._entries[0]
                copied = head.done is None or _completed_by(head.done, deadline)
                if not copied and not final:
                    return count - handed
                if copied:
                    # Taken off only once delivered, as in drain: a second Ctrl-C in the
                    # delivery leaves it queued for the sinks that lack it.
                    self._deliver_one(head)
                else:
                    lost += 1
                with self._lock:
                    self._entries.popleft()
                    if head.host is not None:
                        self._on_device -= 1
                    self._cond.notify_all()
            return lost
        finally:
            self._delivering.release()

    def _queued_through(self, last: LogEntry | None) -> int:
        """How many entries lead the queue up to ``last`` (0 if it left it); lock held."""
        if last is None:
            return 0
        for index, entry in enumerate(self._entries):
            if entry is last:  # by identity: a LogEntry's == compares its fields
                return index + 1
        return 0

    @property
    def undelivered(self) -> int:
        """Entries queued or being delivered now (after a timed-out ``stop``: never delivered)."""
        with self._lock:
            return len(self._entries) + self._busy

    def _work(self) -> None:
        while True:
            with self._lock:
                self._cond.wait_for(lambda: self._entries or self._stopping)
                if not self._entries:
                    return
                head = self._entries[0]
            if head.done is not None:
                # Outside the locks: a caller draining a full queue never waits for the GPU
                # (none drains while this entry waits: it counts in _on_device). A failed wait
                # fails again in _deliver_one, which reports it and goes on.
                with contextlib.suppress(Exception):
                    wait_on_host(head.done)
            with self._delivering:
                with self._lock:
                    if not self._entries or self._entries[0] is not head:
                        continue  # a caller delivered it: look again
                    entry = self._entries.popleft()
                    self._busy = True
                self._deliver_one(entry)
                with self._lock:
                    self._busy = False
                    if entry.host is not None:
                        self._on_device -= 1
                    self._cond.notify_all()

    def _deliver_one(self, entry: LogEntry) -> None:
        try:
            self._deliver(_report(entry), entry.given)
        except Exception as error:  # a bad entry must not stop the others
            logger.error("Run.log at step %d failed: %s", entry.step, error)


def _completed_by(done: torch.cuda.Event, deadline: float) -> bool:
    """Whether the CUDA copy ``done`` marks completes by ``deadline`` (polled: never hangs)."""
    while not done.query():  # type: ignore[no-untyped-call]
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _report(entry: LogEntry) -> Report:
    values = dict(entry.numbers)
    if entry.host is not None and entry.done is not None:
        wait_on_host(entry.done)
        values.update(zip(entry.device_names, entry.host.tolist(), strict=True))
    return Report(step=entry.step, values=values, time=entry.time, stream="")


class _OwnedLock:
    """A lock that knows which thread holds it (``held_here``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def acquire(self, timeout: float = -1) -> bool:
        if not self._lock.acquire(timeout=timeout):
            return False
        self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def held_here(self) -> bool:
        """Whether the calling thread holds it."""
        return self._owner == threading.get_ident()

    def __enter__(self) -> _OwnedLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
