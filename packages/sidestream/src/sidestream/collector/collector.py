"""``AsyncMetricCollector``: logging windows that never make the training thread wait."""

from __future__ import annotations

import atexit
import logging
import queue
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import torch
import torch.distributed as dist

from sidestream._distributed import Group
from sidestream.collector._dispatcher import Dispatcher
from sidestream.collector._slot import Slot, clone_metric
from sidestream.collector._tree import flatten_tree
from sidestream.collector._window import Window, rejected_to_host
from sidestream.metric import Metric
from sidestream.sinks._spool import DEFAULT_SPOOL_MAX_BYTES
from sidestream.sinks.base import RunInfo, Sink
from sidestream.sinks.runner import SinkRunner
from sidestream.state import MetricAccumulator, reset_all

__all__ = ["AsyncMetricCollector"]

T = TypeVar("T")

logger = logging.getLogger("sidestream.collector")

# A few slots let new windows stage while older ones are still being published; more are made
# on demand, up to max_slots, if the dispatcher falls further behind.
_INITIAL_SLOTS = 3
DEFAULT_MAX_SLOTS = 8


class AsyncMetricCollector(Generic[T]):
    """Reduce, compute and log a metric every window without stalling the training thread.

    ``schedule_collection(step)`` copies the metric's local state into a private staging copy
    (and resets the local state when ``reset_each_window``), starts the coalesced reduction and
    returns. On CUDA the reduction, ``compute`` and the device-to-host copy are queued on a side
    stream; on CPU (gloo) the collectives run with ``async_op=True``. A dispatcher thread waits
    for each window, turns the result into Python numbers, flattens it to names (``loss``,
    ``f1/class_3``) and hands a ``Report`` to every sink, each on its own thread.

    Every rank computes; only global rank 0 opens and writes sinks. Collectives are issued by
    the calling (training) thread, in the same order on every rank, so every rank must call
    ``schedule_collection`` and ``state_dict`` the same number of times.

    Args:
        metric: The metric (or ``ComposeMetric``) to collect. Update it as usual.
        sinks: Where reports go (rank 0 only).
        group: The process group / 1-D device mesh to reduce over (default: the world).
        reset_each_window: Start every window from an empty state (per-window values); when
            ``False`` each window reports the cumulative value since the start.
        prefix: Put in front of every flat name (``"train"`` gives ``"train/loss"``).
        histograms: Paths of result leaves (``"scores"`` for ``ComposeMetric({"scores": ...})``,
            ``"val/scores"`` when nested) whose value is a histogram (1-D bin counts): they go
            to ``Report.histograms`` as CPU tensors, under the prefixed name, instead of one
            value per bin. ``collect_results`` is unaffected.
        run: Name, config and tags given to ``sink.open``.
        sink_capacity: Reports each sink keeps in memory before spooling to disk.
        sink_retry_initial_s: A sink's first wait after a failed write; doubles after each
            further failure, up to ``sink_retry_max_s``.
        sink_retry_max_s: A sink's longest wait between retries, so also how late a recovered
            backend may see its first retry.
        spool_dir: Directory for spool files (system temp dir by default).
        spool_max_bytes: Most bytes each sink's spool file holds; beyond it the oldest spooled
            reports are dropped, counted (``SinkRunner.dropped``) and logged.
        max_slots: Most staging copies of the metric (each window holds one from
            ``schedule_collection`` until its numbers are on the host; 8 by default). They also
            bound the windows waiting for the dispatcher. When all are taken,
            ``schedule_collection`` waits for the oldest window to finish (logged once, timed
            in ``slot_wait_s``); skipping the window instead would pair different collectives
            across ranks, whose dispatchers finish at different times. Slots made beyond the
            first three are freed once the backlog has drained.
        exit_timeout: Seconds ``close`` may take when called at interpreter exit.

    Example:
        >>> collector = AsyncMetricCollector(MeanMetric(), sinks=[ConsoleSink()])
        >>> collector.bind("cpu")
        >>> collector.metric.update(torch.tensor([1.0, 2.0]))
        >>> collector.schedule_collection(step=1)
        >>> collector.collect_results()
        1.5
        >>> collector.close()
    """

    def __init__(
        self,
        metric: Metric[T],
        sinks: Iterable[Sink] = (),
        group: Group = None,
        reset_each_window: bool = True,
        *,
        prefix: str = "",
        histograms: Iterable[str] = (),
        run: RunInfo | None = None,
        sink_capacity: int = 1024,
        sink_retry_initial_s: float = 0.1,
        sink_retry_max_s: float = 10.0,
        spool_dir: str | None = None,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        max_slots: int = DEFAULT_MAX_SLOTS,
        exit_timeout: float = 30.0,
    ) -> None:
        if not isinstance(metric, Metric):
            raise TypeError(f"metric: expected a sidestream Metric, got {type(metric)}")
        sink_list = list(sinks)
        for index, sink in enumerate(sink_list):
            if not isinstance(sink, Sink):
                raise TypeError(f"sinks[{index}]: expected a sidestream.sinks.Sink, got {sink!r}")
        if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
            raise ValueError(f"max_slots: expected an int >= 1, got {max_slots!r}")
        if spool_max_bytes < 1:
            raise ValueError(f"spool_max_bytes: expected >= 1, got {spool_max_bytes}")
        if sink_capacity < 1:
            raise ValueError(f"sink_capacity: expected >= 1, got {sink_capacity}")
        if not 0 < sink_retry_initial_s <= sink_retry_max_s:
            raise ValueError(
                "sink_retry_initial_s, sink_retry_max_s: expected 0 < initial <= max, got "
                f"{sink_retry_initial_s}, {sink_retry_max_s}"
            )
        histogram_paths = (histograms,) if isinstance(histograms, str) else tuple(histograms)
        for path in histogram_paths:
            if not isinstance(path, str) or not path.strip("/"):
                raise TypeError(f"histograms: expected non-empty leaf paths (str), got {path!r}")
        self._metric = metric
        # Checkpoints reduce over the collector's group, not whatever the metric last saw.
        metric.sync_group = group
        self._sinks = _keyed(sink_list)
        self._group = group
        self._reset_each_window = reset_each_window
        self._prefix = prefix.strip("/")
        self._histograms = frozenset(path.strip("/") for path in histogram_paths)
        self._run = run or RunInfo()
        self._sink_capacity = sink_capacity
        self._sink_retry = (sink_retry_initial_s, sink_retry_max_s)
        self._spool_dir = spool_dir
        self._spool_max_bytes = spool_max_bytes
        self._max_slots = max_slots
        self._slot_count = 0
        self._slot_wait_s = 0.0
        self._slot_wait_logged = False
        self._exit_timeout = exit_timeout
        self._resume_states: dict[str, Any] = {}
        self._device: torch.device | None = None
        self._side: torch.cuda.Stream | None = None
        self._free_slots: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        self._runners: list[SinkRunner] = []
        self._dispatcher: Dispatcher | None = None
        self._last_step: int | None = None
        self._live_accumulators: list[MetricAccumulator] = []
        self._closed = False

    # ------------------------------------------------------------------ properties

    @property
    def metric(self) -> Metric[T]:
        """The live metric: update it on the training thread."""
        return self._metric

    @property
    def side_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream reductions and compute run on (``None`` off CUDA or before bind)."""
        return self._side

    @property
    def is_writer(self) -> bool:
        """Whether this process opens and writes the sinks (global rank 0)."""
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    @property
    def sink_runners(self) -> list[SinkRunner]:
        """The running sink pipelines (empty before ``bind`` and on ranks other than 0)."""
        return list(self._runners)

    # ------------------------------------------------------------------ lifecycle

    def bind(self, device: torch.device | str | None = None) -> Self:
        """Move the metric to ``device`` (its current device by default) and start the threads.

        On CUDA this creates the side stream. On rank 0 it starts one thread per sink, which
        resumes (``load_state_dict``) and opens it. Registers ``close`` to run at exit.

        Blocking and a collective on multi-rank jobs: every rank calls it, and it checks once
        that all ranks hold the same metric structure (raising ``RankMismatchError`` naming the
        difference otherwise), so later windows never block on that check.

        Raises:
            RuntimeError: If already bound or closed.
        """
        if self._dispatcher is not None or self._closed:
            raise RuntimeError("bind: the collector is already bound (or closed)")
        target = torch.device(device) if device is not None else self._metric.device
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        self._metric.to(target)
        self._live_accumulators = [acc for _, acc in self._metric.named_accumulators()]
        self._device = target
        if target.type == "cuda":
            self._side = torch.cuda.Stream(device=target)  # type: ignore[no-untyped-call]
        # Making the first slot is the one blocking collective: it checks that every rank holds
        # the same state structure (when recording its sync), so no window ever blocks on that
        # check (or hangs on mismatched collectives) later.
        for index in range(min(_INITIAL_SLOTS, self._max_slots)):
            self._free_slots.put(self._new_slot(check=index == 0))
        if self.is_writer:
            for key, sink in self._sinks.items():
                runner = SinkRunner(
                    sink,
                    self._run,
                    key=key,
                    resume_state=self._resume_states.get(key),
                    capacity=self._sink_capacity,
                    spool_dir=self._spool_dir,
                    spool_max_bytes=self._spool_max_bytes,
                    retry_initial_s=self._sink_retry[0],
                    retry_max_s=self._sink_retry[1],
                )
                runner.start()
                self._runners.append(runner)
        self._dispatcher = Dispatcher(
            self._runners, self._free_slots.put, self._prefix, self._histograms
        )
        atexit.register(self._close_at_exit)
        return self

    def schedule_collection(self, step: int) -> None:
        """Start collecting the window that ends now, logged at ``step``; returns at once.

        Issues the window's collectives from this thread (every rank must call it, in the same
        order). No host sync on CUDA.

        Raises:
            RuntimeError: If not bound, or closed.
            ValueError: If ``step`` is not larger than the previous window's step.
        """
        if self._dispatcher is None or self._closed:
            raise RuntimeError("schedule_collection: call bind(device) first (and not after close)")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step: expected an int, got {type(step).__name__}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step: expected > the previous window's {self._last_step}, got {step}"
            )
        self._last_step = step
        slot = self._take_slot()
        window = Window(step=step, time=time.time(), slot=slot)
        if self._side is None:
            self._stage(slot)
            window.batch = slot.start_sync()
        else:
            self._schedule_on_side_stream(window)
        self._dispatcher.submit(window)

    def _schedule_on_side_stream(self, window: Window) -> None:
        assert self._side is not None
        slot, side = window.slot, self._side
        current = torch.cuda.current_stream(self._device)
        if slot.done is not None:
            # The slot came back from the dispatcher, so this wait is already satisfied; it
            # keeps staging ordered after the last reader of these buffers on the GPU too.
            current.wait_event(slot.done)
        self._stage(slot)
        staged = torch.cuda.Event()  # type: ignore[no-untyped-call]
        staged.record(current)
        with torch.cuda.stream(side):
            side.wait_event(staged)
            batch = slot.start_sync()
            batch.wait()  # NCCL: the side stream waits for the collectives; the host does not
            tree = flatten_tree(slot.metric.compute())
            window.host = slot.copy_to_host(tree.leaves)
            window.rejected = rejected_to_host(slot.metric)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        window.tree, window.done, slot.done = tree, done, done

    def _stage(self, slot: Slot) -> None:
        slot.stage()
        if self._reset_each_window:
            reset_all(self._live_accumulators)

    @property
    def slot_wait_s(self) -> float:
        """Seconds ``schedule_collection`` has waited for a free slot (``max_slots`` reached)."""
        return self._slot_wait_s

    def _take_slot(self) -> Slot:
        assert self._dispatcher is not None
        try:
            slot = self._free_slots.get_nowait()
        except queue.Empty:
            if self._slot_count < self._max_slots:
                return self._new_slot()
            return self._wait_for_slot()
        if self._slot_count > _INITIAL_SLOTS and self._dispatcher.unprocessed == 0:
            # The backlog has drained, so every slot is free: keep the first few only.
            while self._slot_count > _INITIAL_SLOTS:
                self._free_slots.get_nowait()
                self._slot_count -= 1
        return slot

    def _wait_for_slot(self) -> Slot:
        assert self._dispatcher is not None
        if not self._slot_wait_logged:
            self._slot_wait_logged = True
            logger.warning(
                "schedule_collection: all %d staging slots are in use (windows are scheduled "
                "faster than they are reduced and computed); waiting for the oldest window. "
                "Schedule less often or raise max_slots (logged once; see slot_wait_s)",
                self._max_slots,
            )
        start = time.monotonic()
        try:
            while True:
                try:
                    return self._free_slots.get(timeout=1.0)
                except queue.Empty:
                    if not self._dispatcher.alive:
                        raise RuntimeError(
                            "schedule_collection: the dispatcher thread has stopped"
                        ) from None
        finally:
            self._slot_wait_s += time.monotonic() - start

    def _new_slot(self, check: bool = False) -> Slot:
        self._slot_count += 1
        copied = clone_metric(self._metric)
        if self._side is None:
            return Slot(copied, self._metric, self._group, check=check)
        # Its sync buffers are made on the side stream, the only stream that uses them. Allocate
        # the pinned buffers now too (shapes from a compute on the copied state), and let the next
        # staging wait for this compute like for any window's.
        self._side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._side):
            slot = Slot(copied, self._metric, self._group, check=check)
            slot.copy_to_host(flatten_tree(slot.metric.compute()).leaves)
            slot.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            slot.done.record(self._side)
        return slot

    def collect_results(self, timeout: float | None = None) -> Any:
        """Wait for every scheduled window and return the latest one's value.

        Blocking. The value has the shape of ``metric.compute()`` with Python numbers (and
        nested lists for vectors) in place of tensors.

        Raises:
            RuntimeError: If nothing was scheduled, the latest window failed, or ``timeout``
                passed first.
        """
        if self._dispatcher is None or self._dispatcher.scheduled == 0:
            raise RuntimeError("collect_results: no window scheduled; call schedule_collection")
        if not self._dispatcher.wait_idle(timeout):
            raise RuntimeError(f"collect_results: windows still running after {timeout} s")
        return self._dispatcher.latest()[1]

    def close(self, timeout: float | None = 30.0) -> bool:
        """Finish every scheduled window, deliver and close every sink, stop the threads.

        Blocking, bounded by ``timeout`` seconds overall. Idempotent.

        Returns:
            Whether everything finished in time. If not, a warning says what is left; reports
            a sink could not take in time are kept in a spool file the warning names.
        """
        if self._closed:
            return True
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if self._dispatcher is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        complete = self._dispatcher.stop(remaining())
        if not complete:
            logger.warning(
                "close: %d window(s) not finished within %s s (a collective may be stuck); "
                "they are not reported",
                self._dispatcher.unprocessed,
                timeout,
            )
        # Every sink's close starts now, so their timeouts run side by side.
        deadline_left = remaining()
        for runner in self._runners:
            runner.begin_close(deadline_left)
        for runner in self._runners:
            if not runner.close(remaining()):
                complete = False
        return complete

    def _close_at_exit(self) -> None:
        self.close(self._exit_timeout)

    def __enter__(self) -> Self:
        if self._dispatcher is None:
            self.bind()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, timeout: float | None = 60.0) -> dict[str, Any]:
        """The metric's state (globally reduced: a collective) and every sink's state.

        Blocking. Every rank must call it. On rank 0 it first waits (up to ``timeout``) until
        every scheduled window is delivered, so the sinks' last steps match the metric state.
        """
        metric_state = self._metric.state_dict()
        sink_states: dict[str, Any] = {}
        if self._runners:
            deadline = None if timeout is None else time.monotonic() + timeout
            assert self._dispatcher is not None
            self._dispatcher.wait_idle(timeout)
            for runner in self._runners:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not runner.wait_delivered(left):
                    logger.warning(
                        "state_dict: sink %r still has %d undelivered report(s); its state is "
                        "as of its last delivered step",
                        runner.key,
                        runner.pending,
                    )
                sink_states[runner.key] = runner.sink_state()
        elif self.is_writer and self._dispatcher is None:
            sink_states = {
                key: self._resume_states.get(key, sink.state_dict())
                for key, sink in self._sinks.items()
            }
        return {"metric": metric_state, "sinks": sink_states}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` (any world size). Call before ``bind``.

        The metric continues the saved numbers; each sink gets its saved state before it
        opens, so it resumes the same run without repeating steps.

        Raises:
            RuntimeError: If the collector is already bound.
            KeyError: If ``state_dict`` lacks ``"metric"``.
        """
        if self._dispatcher is not None:
            raise RuntimeError(
                "load_state_dict: call it before bind (sinks resume their run when they open)"
            )
        self._metric.load_state_dict(state_dict["metric"])
        self._resume_states = dict(state_dict.get("sinks", {}))


def _keyed(sinks: list[Sink]) -> dict[str, Sink]:
    """Sinks by a stable key: the sink's name, ``name-2`` for a second sink of that name."""
    keyed: dict[str, Sink] = {}
    for sink in sinks:
        key, n = sink.name, 1
        while key in keyed:
            n += 1
            key = f"{sink.name}-{n}"
        keyed[key] = sink
    return keyed
