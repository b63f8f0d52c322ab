"""The thread that waits for each window, turns it into numbers and hands it to the sinks."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from sidestream._host_events import host_event, wait_on_host
from sidestream._logs import get_logger
from sidestream._threads import FirstTimes, own_thread
from sidestream.collector._slot import Slot
from sidestream.collector._tree import FlatTree, flatten_tree
from sidestream.collector._window import (
    Window,
    rejected_names,
    rejected_on_host,
    rejected_to_host,
)
from sidestream.sinks.base import Report
from sidestream.sync import RankMismatchError

__all__ = ["Dispatcher"]

logger = get_logger("sidestream.collector")

_STOP = object()
_STEPS_NAMED = 8  # failed windows' steps a collect_results error lists
# Result layouts kept for reuse. A result whose names change over the run (a key per epoch, a
# vector whose length follows the data) makes a new layout per window; without a cap the cache
# held one for every window such a run ever reported.
_LAYOUTS_KEPT = 64
_IDLE_STOP_S = 1.0  # how long an idle dispatcher thread may take to see the stop
SLOW_WINDOW_S = 60.0
"""A window whose reduction has waited this long is named in a warning (once): a rank that
skipped its schedule_collection (a validation pass under ``if rank == 0:``) pairs the window
with another collective, such as DDP's all-reduce, and both wait for the process group's
timeout (30 minutes for gloo) without a word."""
_WATCH_EVERY_S = 5.0


class ReportTarget(Protocol):
    """Where finished reports go: a run's sinks (``submit`` never blocks)."""

    def submit(self, report: Report) -> None:
        """Hand over one report."""


class Dispatcher:
    """Processes windows in the order they were scheduled, on one background thread.

    It only waits (on collective work handles or CUDA events) and never issues a collective.

    Args:
        runners: Where to publish reports (the run's sinks; empty on ranks other than 0).
        release: Called with a window's slot once its numbers are on the host.
        prefix: Put in front of every flat name.
        histograms: Paths of result leaves (``"scores"``, ``"val/scores"``) delivered as
            ``Report.histograms`` instead of values.
    """

    def __init__(
        self,
        runners: Sequence[ReportTarget],
        release: Callable[[Slot], None],
        prefix: str,
        histograms: Collection[str] = (),
    ) -> None:
        self._runners = list(runners)
        self._release = release
        self._prefix = prefix
        self._histograms = frozenset(histograms)
        self._windows: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Entered as the lock itself (with self._lock), never as the Condition: its __enter__
        # is a Python frame, and a Ctrl-C there on the training thread left the lock held, so
        # this thread stopped for good.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._scheduled = 0
        self._processed = 0
        self._latest: tuple[int, Any] | None = None
        self._latest_error: BaseException | None = None
        # Failed since latest() last ran: the first few (step, error), and how many in all.
        self._unreported: list[tuple[int, BaseException]] = []
        self._unreported_count = 0
        self._errors = 0
        self._mismatch: RankMismatchError | None = None
        self._layouts: dict[Any, _Layout] = {}
        self._failed_submits = FirstTimes()
        self._waiting: tuple[int, float] | None = None  # (step, since): a reduction waited for
        self._watch_stop = threading.Event()  # set when the dispatcher thread ends
        self._stopped = False  # stop was called: submit refuses (see there)
        self._thread = own_thread(
            self._work,
            name="sidestream-dispatch",
            role="dispatcher thread of a collector (from a metric's sync or compute, or a logging "
            "handler)",
        )
        self._thread.start()
        self._watch_thread = own_thread(
            self._watch,
            name="sidestream-dispatch-watch",
            role="watch thread of a collector (from a logging handler)",
        )
        try:
            self._watch_thread.start()
        except BaseException:
            # "can't start new thread" (a thread limit reached): the constructor raises, so no
            # one holds this dispatcher to stop it, and its thread waited for windows for the
            # rest of the process, one more at every retried bind.
            self.request_stop()
            self._thread.join(_IDLE_STOP_S)  # nothing was submitted: it sees the stop at once
            raise

    def submit(self, window: Window) -> None:
        """Queue ``window`` (returns at once).

        A Ctrl-C on the calling thread finds the window either queued and counted (then
        ``window.queued`` is set) or neither.
        """
        # Under the lock: a close or checkpoint waiting on another thread must see every window.
        # No Python code runs from the count to the put, so an interrupt comes before or after
        # both.
        with self._lock:
            if self._stopped:
                # Stopped by a close run inside the scheduling call on its own thread (a signal
                # handler's close), or by another thread's close whose timeout ran out while it
                # waited for the call: queued behind the stop, the window was never processed,
                # while the call returned and close said True.
                raise RuntimeError(
                    f"schedule_collection: the collector was closed during this call (by a "
                    f"close on another thread whose timeout ran out while it waited for this "
                    f"call, or by one run inside it on this thread, such as a signal handler's); "
                    f"the window at step {window.step} is not reported"
                )
            self._scheduled += 1
            window.queued = True
            self._windows.put(window)

    @property
    def scheduled(self) -> int:
        """Windows submitted so far."""
        with self._lock:
            return self._scheduled

    def wait_idle(self, timeout: float | None, *, until_mismatch: bool = False) -> bool:
        """Block until every submitted window is processed; whether it happened in time.

        With ``until_mismatch`` it also returns (false, unless idle) once a window found that
        ranks paired different calls: a later window of this rank then waits for a partner
        that never comes, until the collective's timeout.
        """
        with self._lock:
            idle = self._cond.wait_for(
                lambda: (
                    self._processed == self._scheduled
                    or (until_mismatch and self._mismatch is not None)
                ),
                timeout,
            )
            return bool(idle) and self._processed == self._scheduled

    def latest(self) -> tuple[int, Any]:
        """``(step, result)`` of the last processed window.

        Raises:
            RuntimeError: If a window failed since the last call (naming their steps, the
                first failure chained), if the last window failed, or if none was processed.
        """
        with self._lock:
            unreported, self._unreported = self._unreported, []
            count, self._unreported_count = self._unreported_count, 0
            if unreported:
                steps = ", ".join(str(step) for step, _ in unreported)
                more = ", ..." if count > len(unreported) else ""
                first = unreported[0][1]
                raise RuntimeError(
                    f"{count} window(s) failed since the last collect_results (steps "
                    f"{steps}{more}); the first: {type(first).__name__}: {first}"
                ) from first
            if self._latest_error is not None:
                raise RuntimeError("the latest window failed") from self._latest_error
            if self._latest is None:
                raise RuntimeError("no window has been processed")
            return self._latest

    def stop(self, timeout: float | None) -> bool:
        """Process what was submitted, then end the thread; whether it ended within timeout.

        With every window processed the thread only has to see the stop: it gets a moment
        for that even when ``timeout`` is 0, so a close after ``collect_results`` succeeds.
        """
        idle = self.unprocessed == 0
        self.request_stop()
        if idle and timeout is not None:
            timeout = max(timeout, _IDLE_STOP_S)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._watch_thread.join(_IDLE_STOP_S)  # sees the stop at once
        return True

    def request_stop(self) -> None:
        """Have the thread end once it has processed what was submitted; no wait for it.

        For an interrupted close, which does not wait for windows: without it the thread (and
        its watcher) waited for windows for the rest of the process.
        """
        with self._lock:  # with submit's check: a window is refused, or queued before the stop
            self._stopped = True
        self._windows.put(_STOP)

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` was called (windows submitted since are refused)."""
        return self._stopped

    @property
    def alive(self) -> bool:
        """Whether the thread is still running."""
        return self._thread.is_alive()

    @property
    def mismatch(self) -> RankMismatchError | None:
        """The first window that found ranks paired with different calls, if any."""
        return self._mismatch  # one attribute read: no lock on the training thread's path

    @property
    def failed_windows(self) -> int:
        """Windows whose processing raised."""
        with self._lock:
            return self._errors

    @property
    def failed_steps(self) -> list[int]:
        """Steps of the windows that failed since ``latest`` last reported them (the first few)."""
        with self._lock:
            return [step for step, _ in self._unreported]

    @property
    def unprocessed(self) -> int:
        """Windows submitted and not processed yet."""
        with self._lock:
            return self._scheduled - self._processed

    def _work(self) -> None:
        try:
            self._work_until_stop()
        finally:
            self._watch_stop.set()

    def _work_until_stop(self) -> None:
        while True:
            window = self._windows.get()
            if window is _STOP:
                return
            if window.error is not None:
                # Failed on the training thread: made here, not raised, so that what is kept
                # until collect_results holds no frame (whose locals would hold the slot).
                self._failed(window.step, _failed_on_training_thread(window))
                window = None  # nor does this thread, while it waits for the next one
                continue
            try:
                step, result = self._process(window)
            except BaseException as caught:
                # A BaseException (SystemExit, CancelledError from a compute) would end this
                # thread: collect_results would wait for good and close would say all is done.
                self._failed(
                    window.step, caught if isinstance(caught, Exception) else _wrapped(caught)
                )
                window = None
                continue
            window = None
            with self._lock:
                self._latest = (step, result)
                self._latest_error = None
                self._processed += 1
                self._cond.notify_all()

    def _watch(self) -> None:
        """Warn once per window whose reduction waits longer than ``SLOW_WINDOW_S``."""
        warned: int | None = None
        while not self._watch_stop.wait(_WATCH_EVERY_S):
            waiting = self._waiting  # one read: set and cleared by the dispatcher thread
            if waiting is None or waiting[0] == warned:
                continue
            step, since = waiting
            waited = time.monotonic() - since
            if waited >= SLOW_WINDOW_S:
                warned = step
                logger.warning(
                    "window at step %d of %s has waited %.0f s for its reduction across "
                    "ranks: is a rank slow (a long rank-0-only pass or checkpoint write), "
                    "stopped or gone, or did one not call schedule_collection for it (a "
                    "validation pass under `if rank == 0:`)? Every rank must schedule every "
                    "window of every stream, in the same order; a window no rank pairs fails "
                    "at the process group's timeout",
                    step,
                    f"stream {self._prefix!r}" if self._prefix else "the unnamed stream",
                    waited,
                )

    def _failed(self, step: int, error: Exception) -> None:
        """Count, keep and (the first) log the failure of the window at ``step``."""
        with self._lock:
            self._errors += 1
        if self._errors == 1:
            logger.error(
                "window at step %d failed: %s: %s (later failures are counted, not "
                "logged; collect_results raises them)",
                step,
                type(error).__name__,
                error,
            )
        with self._lock:
            self._latest_error = error
            self._unreported_count += 1
            if len(self._unreported) < _STEPS_NAMED:
                self._unreported.append((step, error))
            if isinstance(error, RankMismatchError) and self._mismatch is None:
                self._mismatch = error
            self._processed += 1
            self._cond.notify_all()

    def _process(self, window: Window) -> tuple[int, Any]:
        try:
            self._waiting = (window.step, time.monotonic())
            if window.side is not None:
                tree, leaves = _finish_on_side_stream(window)
            else:
                assert window.batch is not None
                window.batch.wait()
                tree = flatten_tree(window.slot.metric.compute())
                leaves = list(tree.leaves)
            # One tolist per leaf and plain Python after it: every torch call here lets the
            # training thread's GIL requests in and out, so keep them few.
            python_leaves = [leaf.tolist() if isinstance(leaf, Tensor) else leaf for leaf in leaves]
            rejected = rejected_on_host(window)
        finally:
            self._waiting = None
            # Also when the reduction or compute() failed: the slot is free either way, and
            # the training thread may be waiting for one (see AsyncMetricCollector max_slots).
            self._release(window.slot)
        # On every rank, so a histogram path that names no leaf fails the window everywhere.
        layout = self._layout_of(tree, leaves, window)
        if self._runners:
            numbers = itertools.chain.from_iterable(
                _floats(python_leaves[i]) for i in layout.value_leaves
            )
            values = dict(zip(layout.value_names, numbers, strict=True))
            # New CPU tensors: on CUDA the leaves are pinned buffers the next window reuses.
            histograms = {
                name: torch.tensor(python_leaves[i], dtype=_dtype(leaves[i]), device="cpu")
                for i, name in layout.histograms
            }
            if any(rejected):
                # Batches dropped on the device for bad values (CUDA) and NaN elements left out
                # or replaced: reported with the window they came from, only when there were
                # some.
                names = rejected_names(window.slot.metric, self._prefix)
                values.update((n, float(c)) for n, c in zip(names, rejected, strict=True) if c)
            report = Report(
                step=window.step,
                values=values,
                time=window.time,
                histograms=histograms,
                stream=self._prefix,
            )
            for runner in self._runners:
                self._submit(runner, report)
        return window.step, tree.rebuild(python_leaves)

    def _submit(self, runner: ReportTarget, report: Report) -> None:
        """Hand ``report`` to one sink; its failure is that sink's alone (logged once)."""
        try:
            runner.submit(report)
        except Exception as error:
            key = str(getattr(runner, "key", runner))
            if self._failed_submits.first(key):
                logger.error(
                    "sink %r: submit failed: %s: %s; this sink misses the report of step %d "
                    "(other sinks are unaffected; later failures are not logged)",
                    key,
                    type(error).__name__,
                    error,
                    report.step,
                )

    def _layout_of(self, tree: FlatTree, leaves: list[Any], window: Window) -> _Layout:
        key = (tree.paths, tuple(tuple(t.shape) if isinstance(t, Tensor) else () for t in leaves))
        layout = self._layouts.get(key)
        if layout is None:
            counts = rejected_names(window.slot.metric, self._prefix)
            layout = _Layout.of(tree, self._prefix, self._histograms, counts)
            if len(self._layouts) >= _LAYOUTS_KEPT:
                # The oldest first (dicts keep insertion order): a steady result's layout is
                # made again at once if it was among them.
                del self._layouts[next(iter(self._layouts))]
            self._layouts[key] = layout
        return layout


@dataclass(frozen=True)
class _Layout:
    """Where each leaf of a result goes in a report: value names, or one histogram name."""

    value_leaves: tuple[int, ...]
    value_names: tuple[str, ...]
    histograms: tuple[tuple[int, str], ...]

    @classmethod
    def of(
        cls, tree: FlatTree, prefix: str, histograms: frozenset[str], counts: Sequence[str] = ()
    ) -> _Layout:
        """Split ``tree``'s leaves by path.

        Args:
            tree: The flattened result of a window.
            prefix: Put in front of every name.
            histograms: Leaf paths delivered as histograms.
            counts: The report names of the metric's dropped-batch and NaN counts
                (``rejected_names``), which no value or histogram may have.

        Raises:
            ValueError: If a histogram path names no leaf, or a scalar one; or a value or
                histogram has the name of one of ``counts``.
        """
        missing = sorted(histograms - set(tree.paths))
        if missing:
            raise ValueError(
                f"histograms: {missing} are not leaves of the compute() result; its leaves are "
                f"{list(tree.paths)}"
            )
        scalars = sorted(
            path
            for path, leaf in zip(tree.paths, tree.leaves, strict=True)
            if path in histograms and not (isinstance(leaf, Tensor) and leaf.dim() >= 1)
        )
        if scalars:
            # A sink would skip it as no histogram, so the value would be logged nowhere.
            raise ValueError(
                f"histograms: {scalars} are scalars, not bin counts (tensors of at least one "
                "dimension): leave them out of histograms= to log them as values"
            )
        names = tree.element_names(prefix)
        value_leaves: list[int] = []
        value_names: list[str] = []
        hist: list[tuple[int, str]] = []
        start = 0
        for index, (path, leaf) in enumerate(zip(tree.paths, tree.leaves, strict=True)):
            count = leaf.numel() if isinstance(leaf, Tensor) else 1
            if path in histograms:
                hist.append((index, "/".join(part for part in (prefix, path) if part)))
            else:
                value_leaves.append(index)
                value_names.extend(names[start : start + count])
            start += count
        # Checked whether or not a count is non-zero in this window: a count added to the
        # report only when some batch was dropped would overwrite the value then, unseen.
        taken = sorted(set(counts) & {*value_names, *(name for _, name in hist)})
        if taken:
            raise ValueError(
                f"compute() result: {taken} are also the names the collector reports the "
                "metric's counts under (rejected_updates: batches dropped for bad values; "
                "nan_count: NaN elements left out or replaced), so one would overwrite the "
                "other; rename those keys of the result (the counts are reported for you)"
            )
        return cls(tuple(value_leaves), tuple(value_names), tuple(hist))


def _dtype(leaf: Any) -> torch.dtype | None:
    return leaf.dtype if isinstance(leaf, Tensor) else None


def _floats(value: Any) -> list[float]:
    """A leaf's numbers (a number or nested lists of them) as a flat list of floats."""
    if isinstance(value, list):
        return [number for item in value for number in _floats(item)]
    return [float(value)]


def _finish_on_side_stream(window: Window) -> tuple[FlatTree, list[Any]]:
    """Queue a CUDA window's compute and host copies on its side stream, then wait for them.

    The side stream already waits for the window's collectives; this thread only queues work
    behind them, then blocks on the ``done`` event (not the training thread).
    """
    slot, side = window.slot, window.side
    assert side is not None and window.batch is not None
    with torch.cuda.stream(side):
        try:
            tree = flatten_tree(slot.metric.compute())
            host = slot.copy_to_host(tree.leaves)
            window.rejected = rejected_to_host(slot.metric)
        finally:
            # Recorded even if compute failed, and before the slot is released: the next
            # staging into the slot waits (on the GPU) for all this window queued on the side.
            done = host_event()
            done.record(side)
            window.done = slot.done = done
    wait_on_host(done)
    window.batch.verify()  # the fingerprints, on the host now that done passed
    if not slot.replayable:
        # The slow path's syncs left their checks (the window's fingerprint among them) with
        # the metrics that ran them: all reached now, so none waits.
        for metric in slot.metric._walk_metrics():
            metric.verify_sync()
    return tree, host


def _failed_on_training_thread(window: Window) -> Exception:
    """The error a window that failed on the training thread is reported with (not raised).

    Its slot was kept out of the pool, or went back to it. A ``RankMismatchError`` (a metric's
    own sync, blocking, found that ranks paired different calls) stays one, so that every
    later call raises it as for a mismatch found here; anything else is reported like a window
    that failed here, with its step.
    """
    cause = window.error
    assert cause is not None
    if isinstance(cause, RankMismatchError):
        error: Exception = RankMismatchError(str(cause))
    else:
        error = RuntimeError(
            f"the window at step {window.step} failed on the training thread while it was "
            f"being started ({type(cause).__name__}: {cause}); its values were not delivered"
        )
    error.__cause__ = cause
    return error


def _wrapped(caught: BaseException) -> RuntimeError:
    """``caught`` as an error ``collect_results`` may raise in the training thread."""
    error = RuntimeError(f"{type(caught).__name__} in the window: {caught}")
    error.__cause__ = caught
    return error
