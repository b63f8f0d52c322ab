"""``Run``: one tracker run per job, shared by every stream of that job."""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from numbers import Real
from types import TracebackType
from typing import Any, Self, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from sidestream._cells import note_made_in_cell
from sidestream._closing import CloseOnce, wait_until_free
from sidestream._dcp_guard import refuse_pickling
from sidestream._delivery import (
    OF_THE_RUN,
    CheckpointTimeout,
    Delivery,
    DeliveryOptions,
    check_timeout,
)
from sidestream._distributed import Group, check_process_group, group_ranks, mesh_ranks
from sidestream._eager import host_call
from sidestream._exit import (
    close_at_exit,
    ending_with,
    exit_time_left,
    forget_close_at_exit,
    forked_since,
    refuse_in_forked_child,
)
from sidestream._host_events import host_event
from sidestream._log_pipe import LogEntry, LogPipe
from sidestream._logs import get_logger
from sidestream._step import training_step
from sidestream._text import check_encodable
from sidestream._threads import refuse_on_own_thread
from sidestream._validation import refuse_distributed
from sidestream.collector._checkpoint_errors import naming_checkpoint_failures
from sidestream.collector.collector import DEFAULT_MAX_SLOTS, AsyncMetricCollector
from sidestream.metric import Metric
from sidestream.sinks._spool import DEFAULT_SPOOL_MAX_BYTES
from sidestream.sinks.base import RunInfo, Sink
from sidestream.sinks.runner import SinkRunner
from sidestream.sinks.status import SinkStatus
from sidestream.sinks.support import seconds_left
from sidestream.sync import check_same_setting

__all__ = ["Run"]

MetricT = TypeVar("MetricT", bound=Metric[Any])  # run.collector(m).metric is m's own class


logger = get_logger("sidestream.run")

_HAND_OVER_S = 1.0
"""How long a close or checkpoint that ran out of time (or was interrupted) waits to hand the
queued ``log`` values to the sinks (a delivery in progress, a CUDA copy)."""


class Run:
    """One tracker run per training job: every stream (train, validation, plain values) in it.

    The run owns its sinks and one delivery pipeline per sink. On global rank 0 it opens each
    sink once, when the first collector binds or at the first ``log``; other ranks never open
    them. Each collector made with ``collector`` is a stream named by its prefix; ``log`` is
    the stream ``""``. Reports of different streams reach the sinks in the order they finish
    (a validation window at step 500 may arrive after training windows up to 520); every sink
    takes them, and resume tracks the last delivered step per stream.

    Args:
        sinks: Where reports go (rank 0 only). A sink belongs to one run.
        info: Name, config and tags given to ``sink.open``.
        sink_capacity: Reports each sink keeps in memory before spooling to disk.
        sink_retry_initial_s: A sink's first wait after a transient failure; doubles (with
            jitter) after each further failure, up to ``sink_retry_max_s``.
        sink_retry_max_s: A sink's longest wait between retries.
        spool_dir: Directory for spool files (system temp dir by default); a relative one is
            taken from the working directory when this is made.
        exit_timeout: Seconds ``close`` may take when called at interpreter exit, counted from
            when the closes at exit begin (runs and collectors still open then share it, so
            they all end within the largest ``exit_timeout``). It bounds the closes only,
            not the interpreter's own teardown after them.
        spool_max_bytes: Most bytes of undelivered reports each sink's spool file holds (256
            MiB by default); beyond it the oldest spooled reports are dropped, counted and
            logged. The file on disk, whose delivered part is cut off once it outgrows the
            rest, stays within twice this.
        checkpoint_timeout: The timeout of ``state_dict()`` called without one, as
            ``torch.distributed.checkpoint`` calls it (``None``: no limit); a collector's
            ``state_dict()`` takes it too.

    Raises:
        TypeError: If a sink is not a ``Sink`` or ``info`` not a ``RunInfo``.
        ValueError: If a sink already belongs to another run, or an option is out of range.

    Example:
        >>> from sidestream import MeanMetric
        >>> from sidestream.sinks import JsonlSink, RunInfo
        >>> with Run([JsonlSink("runs/a.jsonl")], info=RunInfo(name="a")) as run:
        ...     train = run.collector(MeanMetric(), prefix="train").bind("cpu")
        ...     train.metric.update(torch.tensor([1.0, 2.0]))
        ...     train.schedule_collection(step=10)
        ...     run.log(10, {"lr": 3e-4})
    """

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused (threads, locks, sinks), with a message that says how to checkpoint it."""
        refuse_pickling(self, "Run")

    def __init__(
        self,
        sinks: Iterable[Sink] = (),
        *,
        info: RunInfo | None = None,
        sink_capacity: int = 1024,
        sink_retry_initial_s: float = 0.1,
        sink_retry_max_s: float = 10.0,
        spool_dir: str | None = None,
        exit_timeout: float = 30.0,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        checkpoint_timeout: float | None = 10.0,
    ) -> None:
        options = DeliveryOptions(
            sink_capacity,
            sink_retry_initial_s,
            sink_retry_max_s,
            spool_dir,
            exit_timeout,
            spool_max_bytes,
            checkpoint_timeout,
        )
        self._delivery = Delivery(sinks, info, options)
        # Whichever starts the sinks (a collector's bind, or log) registers the close at exit;
        # a weak reference, so a run that never starts is not kept alive by its delivery.
        self._delivery.on_start = functools.partial(_register_close_at_exit, weakref.ref(self))
        self._collectors: list[AsyncMetricCollector[Any]] = []
        self._metric_states: dict[str, Any] = {}
        # The global ranks of the loaded states' collectors that reduced over a group of
        # their own (a subgroup): a rank outside one neither claims nor warns about its state.
        self._metric_ranks: dict[str, list[int]] = {}
        # The loaded states of those collectors, on a rank that did not make them when they
        # were saved: claimed by a collector of that prefix made here (a job resumed on more
        # ranks, or over a larger group), otherwise neither warned about nor carried on.
        self._outside_states: dict[str, Any] = {}
        self._outside_ranks: dict[str, list[int]] = {}  # the ranks that saved each of them
        self._loaded = False  # load_state_dict was called
        self._warned_unclaimed = False
        self._log_pipe: LogPipe | None = None
        self._log_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last_log_step: int | None = None
        # Held by a log call from its step check to the step's hand-off: calls from several
        # threads (a data loader's throughput, a callback) take turns, so each sees the step
        # the previous one took and the pipe gets the steps in increasing order. Without it
        # two calls passed the check at once and a larger step reached the sinks first: the
        # tracker sinks then skipped the smaller one, silently, though its call had returned.
        # Re-entrant: a signal handler that logs, run inside a call, must not wait for itself.
        self._log_lock = threading.RLock()
        # The thread inside a log call's step check and hand-off: a log call run inside it on
        # that thread (a logging handler forwarding a warning the call logged, a signal
        # handler's) is refused. Let in, its step reached the sinks first (the tracker sinks
        # then skipped the smaller one of the call it ran inside), or the outer call then put
        # the previous step back below it, and the calls that followed were skipped: silently,
        # while close said True.
        self._logging_thread: int | None = None
        self._closed = False
        self._closing = CloseOnce()  # which close call closes, and its answer for the others
        note_made_in_cell(self, sys._getframe(1), "Run", _still_open, _CLOSE_ADVICE, logger)

    def __repr__(self) -> str:
        # getattr: a constructor that raised part-way leaves an object a debugger may print.
        delivery = getattr(self, "_delivery", None)
        sinks = list(delivery.sinks) if delivery is not None else []
        streams = [c.prefix for c in getattr(self, "_collectors", ())]
        return f"Run(sinks={sinks}, streams={streams}, closed={getattr(self, '_closed', False)})"

    # ------------------------------------------------------------------ properties

    @property
    def info(self) -> RunInfo:
        """Name, config and tags of the run."""
        return self._delivery.info

    @property
    def is_writer(self) -> bool:
        """Whether this process opens and writes the sinks (global rank 0)."""
        return self._delivery.is_writer

    @property
    def sink_runners(self) -> list[SinkRunner]:
        """The running sink pipelines (empty before the sinks start and off rank 0)."""
        return list(self._delivery.runners or ())

    @property
    def sink_status(self) -> dict[str, SinkStatus]:
        """Each sink's delivery status by key (its name; ``name-2`` for a second one)."""
        return self._delivery.status()

    @property
    def streams(self) -> list[str]:
        """The prefixes of this run's collectors, in the order they were made."""
        return [collector.prefix for collector in self._collectors]

    @property
    def log_dropped(self) -> int:
        """``log`` calls dropped because the queue was full while CUDA copies stalled.

        A queue full of host numbers (a burst of calls) is delivered by the caller instead:
        nothing dropped. A drop makes ``close`` return ``False``.
        """
        return 0 if self._log_pipe is None else self._log_pipe.dropped

    # ------------------------------------------------------------------ streams

    def collector(
        self,
        metric: MetricT,
        *,
        prefix: str,
        group: Group = None,
        reset_each_window: bool = True,
        histograms: Iterable[str] = (),
        max_slots: int = DEFAULT_MAX_SLOTS,
    ) -> AsyncMetricCollector[MetricT]:
        """A collector whose windows go to this run's sinks, as the stream ``prefix``.

        Bind it (``collector.bind(device)``) before its first window, like any collector.

        Args:
            metric: The metric (or ``ComposeMetric``) to collect.
            prefix: The stream's name, put in front of every value name (``"val"`` gives
                ``"val/f1"``). Unique within the run; ``""`` only if ``log`` is not used.
            group: The process group / 1-D device mesh to reduce over (default: the world).
            reset_each_window: Start every window from an empty state.
            histograms: Result leaves delivered as histograms (see ``AsyncMetricCollector``).
            max_slots: Most windows in flight, each with a staging copy of the metric (see
                ``AsyncMetricCollector``); more makes ``schedule_collection`` wait.

        Raises:
            RuntimeError: If the run is closed.
            ValueError: If another stream of this run already has ``prefix``.
        """
        if self._closed:
            raise RuntimeError("collector: the run is closed")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
        stream = prefix.strip("/")
        if stream in self.streams or (stream == "" and self._last_log_step is not None):
            raise ValueError(
                f"prefix: the run already has a stream {stream!r}"
                + (" (run.log's)" if stream == "" else "")
                + "; give each collector of a run its own prefix, and make each stream's "
                "collector once: a validation pass reuses it (update, then schedule_collection), "
                "since a stream's steps continue across passes"
            )
        collector = AsyncMetricCollector(
            metric,
            group=group,
            reset_each_window=reset_each_window,
            prefix=stream,
            histograms=histograms,
            max_slots=max_slots,
            _delivery=self._delivery,
        )
        # A state saved by ranks this one was not among (a job resumed on more ranks: mesh
        # (2, 1) on 2 ranks, then (2, 2) on 4) is this collector's too when its group holds
        # one of them: every rank of its group must load it, or bind fails with "different
        # checkpoint loads". Another subgroup's (new_subgroups: [0, 1] saved, this is [2, 3])
        # counted other data: not this collector's.
        if stream in self._metric_states:
            saved = self._metric_states
        elif stream in self._outside_states and self._holds_saving_rank(stream, collector):
            saved = self._outside_states
        else:
            saved = {}
        if stream in saved:
            # Dropped only once it loaded: a refused state (another metric) stays saved, and
            # goes on to the next checkpoint if no collector claims it.
            collector.load_metric_state(saved[stream])
            del saved[stream]
        elif self._loaded:
            logger.warning(
                "run.collector(prefix=%r): the state given to run.load_state_dict has no "
                "metric state for it, so it starts from zero (a checkpoint from before this "
                "collector existed? With torch.distributed.checkpoint, make every collector "
                "before dcp.load: it loads only the keys the run's state_dict() has then)",
                stream,
            )
        self._collectors.append(collector)
        return collector

    @host_call
    def log(self, step: int, values: Mapping[str, float | int | Tensor]) -> None:
        """Log plain values (learning rate, grad norm, tokens/s) at ``step``; returns at once.

        No collective: any rank may call it, and only global rank 0's values are written.
        Python numbers and CPU tensors are read at once. On CUDA the tensors are copied to
        pinned memory on a side stream and read by a background thread once that copy has
        completed, so the caller never waits for the GPU. Steps increase from call to call:
        log every value of a step in one call.

        Args:
            step: The training step; larger than the previous ``log`` call's.
            values: Names (``"lr"``, ``"grad_norm"``) to real numbers (Python or numpy) or
                0-dim tensors.

        Raises:
            TypeError: If ``step`` is not an integer (Python or numpy), or a name or value has
                the wrong type (a bool, a complex or meta tensor, or a DTensor, too).
            ValueError: If ``step`` does not increase or is outside [0, 2**63), a tensor is
                not 0-dim, CUDA tensors are on several devices, or a name is empty or cannot be
                encoded as UTF-8 (a lone surrogate); raised before the step counts, so the
                corrected call may log it.
            RuntimeError: If the run is closed (also by a close run inside this call on its
                thread, a signal handler's, or by another thread's close whose timeout ran out
                while it waited for this call, before the values were handed over: they reach
                no sink), or the job's process group is missing; or if called inside another
                ``log`` call on its thread, before that call handed its values over (a logging
                handler forwarding a warning the call logged, or a signal handler): the two
                steps could reach the sinks out of order, and trackers skip the smaller.
        """
        step = training_step(step)
        if self._logging_thread == threading.get_ident():
            raise RuntimeError(
                f"log: called inside a log call on the same thread (by a logging handler that "
                f"forwards a warning that call logged, or a signal handler); step {step} would "
                "reach the sinks out of order with that call's, and trackers skip the smaller: "
                "count the warnings (set a flag in a signal handler) and log them from the "
                "training loop"
            )
        with self._log_lock:
            try:
                # Inside the try: an interrupt right after it is set must not leave it set.
                self._logging_thread = threading.get_ident()
                drain = self._log(step, values)
            finally:
                self._logging_thread = None
        if drain:
            assert self._log_pipe is not None
            try:
                # Outside _log_lock: a logging handler run inside the delivery in progress (a
                # sink's warning on the Run.log thread) may log, and waiting for that delivery
                # with the lock held hung both threads for good.
                self._log_pipe.drain()
            except BaseException as error:
                error.add_note(f"log: the values of step {step} were logged before this error")
                raise

    def _log(self, step: int, values: Mapping[str, float | int | Tensor]) -> bool:
        """``log`` with ``_log_lock`` held (the step checked against the previous call's).

        Returns:
            Whether the queue was full: the caller delivers it (``LogPipe.drain``) once it let
            go of ``_log_lock``.
        """
        if self._last_log_step is not None and step <= self._last_log_step:
            raise ValueError(
                f"step: expected > the previous log call's {self._last_log_step}, got {step} "
                "(log every value of a step in one call)"
            )
        if not isinstance(values, Mapping):
            raise TypeError(f"values: expected a mapping of names to numbers, got {values!r}")
        numbers: dict[str, float] = {}
        on_gpu: list[tuple[str, Tensor]] = []
        for name, value in values.items():
            if not isinstance(name, str):
                raise TypeError(f"values: names must be non-empty str, got {name!r}")
            if not name:
                raise ValueError("values: names must be non-empty str, got ''")
            check_encodable("values: a name", name)
            if isinstance(value, Tensor):
                if type(value) is not Tensor:
                    refuse_distributed(f"values[{name!r}]", value)
                if value.dim() != 0:
                    raise ValueError(
                        f"values[{name!r}]: expected a 0-dim tensor, got shape {tuple(value.shape)}"
                    )
                if value.is_complex() or value.dtype == torch.bool:
                    # bool: as a Python bool is refused (a flag is not a value to chart).
                    raise TypeError(f"values[{name!r}]: expected a real tensor, got {value.dtype}")
                if value.is_meta:
                    raise TypeError(
                        f"values[{name!r}]: expected a tensor with data, got a meta tensor"
                    )
                if value.is_cuda:
                    on_gpu.append((name, value))
                else:
                    # detach: a loss that requires grad is read without torch's warning
                    numbers[name] = float(value.detach())
            elif isinstance(value, Real) and not isinstance(value, bool):
                # numbers.Real: Python numbers and numpy scalars (np.float32 is no float).
                try:
                    number: float | None = float(value)
                except OverflowError:
                    number = None
                # numpy's longdouble 1e400 becomes inf without an OverflowError.
                if number is None or (math.isinf(number) and value != number):
                    raise ValueError(
                        f"values[{name!r}]: too large for a float (trackers keep float64)"
                    )
                numbers[name] = number
            else:
                raise TypeError(
                    f"values[{name!r}]: expected a number or a 0-dim tensor, got "
                    f"{type(value).__name__}"
                )
        if len({tensor.device for _, tensor in on_gpu}) > 1:
            # Checked before the step is taken: the same call, fixed, may then log it.
            raise ValueError(
                f"values: CUDA tensors of one log call must be on one device, got "
                f"{sorted({str(t.device) for _, t in on_gpu})}"
            )
        if self._closed:
            raise RuntimeError("log: the run is closed")
        refuse_in_forked_child("log", self._delivery.started_in, "Run")
        if "" in self.streams:
            raise ValueError(
                "log: a collector of this run has the prefix '' (the stream of run.log); "
                "give it a prefix"
            )
        self._delivery.start("log")
        if not self.is_writer:
            self._last_log_step = step
            return False
        entry = LogEntry(step=step, time=time.time(), numbers=numbers)
        try:
            if on_gpu:
                self._copy_to_host(entry, on_gpu)
            if self._log_pipe is None:
                self._log_pipe = LogPipe(self._delivery.submit)
                if self._closed:
                    # Closed inside this call before the pipe existed (a signal handler's close
                    # on this thread): no close stops this one, so it is stopped here, and put
                    # refuses the entry (it would reach no sink) instead of taking it.
                    self._log_pipe.stop(0, refuse_later=True)
            drain = self._log_pipe.take(entry)
        except BaseException as error:
            # A Ctrl-C (or the exit of a SIGTERM handler) in the call: the step is used only if
            # its values were taken, so the call made again logs them once.
            if entry.queued:
                self._last_log_step = step
                error.add_note(f"log: the values of step {step} were logged before this error")
            raise
        self._last_log_step = step
        return drain

    def _copy_to_host(self, entry: LogEntry, tensors: list[tuple[str, Tensor]]) -> None:
        device = tensors[0][1].device  # one device: log checked it
        side = self._log_streams.get(device)
        if side is None:
            side = self._log_streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            flat = torch.stack([tensor.detach().to(torch.float64) for _, tensor in tensors])
            # device="cpu": under torch.set_default_device("cuda") a pinned tensor was asked
            # of CUDA, and every log of a CUDA value raised "Only dense CPU tensors can be
            # pinned".
            host = torch.empty(flat.shape, dtype=torch.float64, device="cpu", pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = host_event()
            done.record(side)
        for _, tensor in tensors:
            # Made on the caller's stream, read on ``side``: keep the allocator from reusing it
            # before the copy has run.
            tensor.record_stream(side)
        entry.device_names = tuple(name for name, _ in tensors)
        entry.host, entry.done = host, done

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout: float | None = 30.0) -> bool:
        """Finish every collector's windows and the logged values, then close each sink once.

        Blocking, bounded by ``timeout`` seconds overall. Idempotent: a later call returns what
        the first returned.

        Returns:
            Whether everything was delivered: ``False`` if windows were still running or
            failed, ``log`` calls were dropped (``log_dropped``), a sink could not take its
            reports in time (they are kept in a spool file a warning names) or a sink failed
            for good.

        Raises:
            RuntimeError: If called on one of sidestream's threads (from a sink's method, a
                metric's ``compute``, or a logging handler run there): it waits for them.
        """
        timeout = check_timeout("close: timeout", timeout)
        if forked_since(self._delivery.started_in, "close", "Run"):
            return False
        # Before the claim: a close from a sink's write waited for that write, gave up at
        # once, and left the reports still queued to die with the process, in no spool file.
        refuse_on_own_thread("close")
        # Before the claim: a signal handler's close run while this thread starts the sinks
        # (inside bind or the first log) is refused with nothing changed, not left waiting for
        # the lock its own thread holds; the run closes normally afterwards.
        self._delivery.refuse_inside_start("close")
        closer = CloseOnce.closer()
        complete = False  # the answer other calls get if an error escapes this one
        try:
            # Claimed inside the try: an interrupt landing right after the claim ends it below
            # (see CloseOnce.begin).
            if not self._closing.begin(closer):
                # Closed, or being closed by another call (another thread's): its answer,
                # once it has one, not True before anything was delivered.
                return self._closing.answer(timeout)
            self._closed = True
            forget_close_at_exit(self._close_at_exit)
            if self._metric_states:
                self._warn_unclaimed("close")
            deadline = None if timeout is None else time.monotonic() + timeout
            complete = self._close_all(deadline)
            return complete
        except BaseException:
            if self._closing.holds(closer):
                # Interrupted (Ctrl-C, a signal handler's SystemExit), from the claim on: the
                # sinks keep what they had not delivered in spool files at once (the exit would
                # lose it with their threads), and a later close says False. Windows not
                # processed yet are lost with the sinks: said per stream (the collector that
                # was closing said it already).
                self._closed = True
                try:
                    for collector in self._collectors:
                        collector.give_up_windows("Run.close was interrupted")
                    # Before the sinks keep what they hold: handed to them after that, the
                    # values still queued for them were dropped by the closed run (0 of 200
                    # kept).
                    self._hand_over_logged()
                finally:
                    # Also after a second Ctrl-C in the hand-over (it waits up to a second, for
                    # a CUDA copy or a delivery in progress): skipped, the sinks kept no spool
                    # file and the exit lost all they held (200 of 200 steps).
                    self._delivery.close_now()
            raise
        finally:
            if self._closing.holds(closer):
                self._closing.end(complete)

    def _hand_over_logged(self) -> None:
        """Give the sinks the ``log`` values still queued, at once (an interrupted close).

        Within ``_HAND_OVER_S``: the values whose CUDA copy did not complete by then (or all,
        if the delivery in progress did not end) reach no sink, which a warning says.
        Nothing to do once the sinks closed (an interrupt in their own close): the pipe was
        stopped before them, and a timeout there was warned about.
        """
        pipe = self._log_pipe
        if pipe is None or self._delivery.closed:
            return
        lost = pipe.hand_over(_HAND_OVER_S, refuse_later=True)
        if lost:
            logger.warning(
                "close was interrupted: %d Run.log call(s) could not be handed to the sinks "
                "within %.1f s (a CUDA copy not completed, or a sink's delivery in progress); "
                "their values reached no sink",
                lost,
                _HAND_OVER_S,
            )

    def _holds_saving_rank(self, stream: str, collector: AsyncMetricCollector[Any]) -> bool:
        """Whether ``collector``'s group holds a rank that saved ``stream``'s outside state."""
        return _group_holds(collector, self._outside_ranks.get(stream, ()))

    def _close_all(self, deadline: float | None) -> bool:
        complete = True
        # A log call in progress on another thread hands its values to the pipe before the
        # pipe stops: put in after its thread ended, they would reach no sink.
        wait_until_free(self._log_lock, seconds_left(deadline))
        for collector in self._collectors:
            if not collector.close(seconds_left(deadline)):
                complete = False
        if self._log_pipe is not None:
            # An idle thread not yet ended in a zero timeout lost nothing.
            # The values on the host that the pipe's thread had not handed on when the timeout
            # ran out go to the sinks' pipelines now, whose close below delivers them or keeps
            # them in a spool file; left in the pipe they reached no sink and no file.
            stopped = self._log_pipe.stop(seconds_left(deadline), refuse_later=True)
            lost = 0 if stopped else self._log_pipe.hand_over(_HAND_OVER_S)
            if lost:
                complete = False
                logger.warning(
                    "close: %d Run.log call(s) still waited for CUDA copies (or a delivery in "
                    "progress) %.1f s after the timeout ran out; their values reached no sink",
                    lost,
                    _HAND_OVER_S,
                )
            if self._log_pipe.dropped:
                complete = False
                logger.warning(
                    "close: %d Run.log call(s) were dropped while CUDA copies stalled "
                    "(Run.log_dropped); their values reached no sink",
                    self._log_pipe.dropped,
                )
        if not self._delivery.close(deadline):
            complete = False
        return complete

    def _warn_unclaimed(self, where: str) -> None:
        """Once per run: saved metric states no collector claimed (a renamed prefix?)."""
        if not self._warned_unclaimed:
            self._warned_unclaimed = True
            logger.warning(
                "%s: the loaded checkpoint has metric states for %s, which no collector of "
                "this run has claimed (a collector's prefix renamed or misspelled?); they "
                "are kept in state_dict() until a collector with that prefix is made. "
                "Collectors of this run: %s",
                where,
                sorted(self._metric_states),
                sorted(c.prefix for c in self._collectors),
            )

    def _close_at_exit(self) -> None:
        self.close(exit_time_left(self._delivery.options.exit_timeout))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Left by an exception: the sinks close before it is uncaught, and must say it failed.
        with ending_with(exc_type, exc):
            self.close()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self, timeout: float | CheckpointTimeout | None = OF_THE_RUN) -> dict[str, Any]:
        """Every collector's metric state and every sink's state.

        A collective (each collector's state is reduced over its group): every rank calls it,
        in the same order relative to other collectives. On rank 0 it then waits for the
        windows scheduled before it to be computed (past ``timeout`` if need be, see
        ``AsyncMetricCollector.wait_windows_for_checkpoint``), then up to ``timeout`` seconds
        in all (the run's ``checkpoint_timeout`` when not given, 10 s by default) for them and
        the logged values to be delivered
        (so the sinks' last steps match the metric states) and makes each sink's delivered
        data durable (``fsync`` for files). A sink still behind after ``timeout`` gives its
        state as of its last delivered step, with a warning; the reports it has not
        delivered (queued, spooled, or taken by its backend without confirmation) are in
        ``"undelivered"``, so a job resumed from this checkpoint delivers them first (the
        sink skips those its backend has by then).

        Raises:
            RankMismatchError: If a collector's window was paired with another call on some
                rank (one rank skipped a ``schedule_collection``), as ``collector.state_dict``.
            RuntimeError: If the environment says the job has several processes but no
                process group is initialized (every rank would save its own sink states as
                rank 0's); or if a checkpoint collective failed (a rank stopped: at the
                process group's timeout, not ``timeout``), naming the windows still running
                or failed; or if called on one of sidestream's threads (from a sink's
                method, a metric's ``compute``, or a logging handler run there).
        """
        # The collector's own state_dict first raises a rank mismatch its windows found (as
        # it does when called directly); a collector of this run holds no sink states.
        # In an order every rank agrees on, after checking that the ranks of each collector's
        # group hold the same collectors over it: ranks that made their collectors in another
        # order (or one rank an extra one) would otherwise reduce one collector's state against
        # another's.
        timeout = self._delivery.options.checkpoint_wait(timeout)
        # It waits for the sinks and the windows: on their threads it waits for itself.
        refuse_on_own_thread("state_dict")
        # It waits for the collectors' windows and the sinks, whose threads stay in the
        # process that started them: in a forked child it would wait for ever.
        refuse_in_forked_child("state_dict", self._delivery.started_in, "Run")
        for collector in self._collectors:
            refuse_in_forked_child("state_dict", collector._bound_in, "Run")
        check_process_group("state_dict")
        deadline = None if timeout is None else time.monotonic() + timeout
        ordered = sorted(self._collectors, key=lambda c: c.prefix)
        for collector in ordered:  # before this checkpoint's first collective (see there)
            collector.settle_windows(seconds_left(deadline))
        scopes = [c._checkpoint_scope() for c in ordered]
        collectors: dict[str, Any] = {}
        ranks = {
            prefix: ranks
            for prefix, ranks in self._metric_ranks.items()
            if prefix in self._metric_states
        }
        checked: set[int] = set()
        for collector, (group, device) in zip(ordered, scopes, strict=True):
            if group is not None:
                ranks[collector.prefix] = _holding_ranks(collector._group, group)
            if id(group) not in checked:
                checked.add(id(group))
                over = [c for c, (g, _) in zip(ordered, scopes, strict=True) if g is group]
                peers = [c.prefix for c in over]
                with naming_checkpoint_failures("run.state_dict", over):
                    check_same_setting(
                        group,
                        device,
                        "collectors",
                        repr(peers),
                        "make the same collectors (prefixes) on every rank before a checkpoint",
                    )
            # What collector.state_dict returns of it (it holds no sink states: see above).
            collectors[collector.prefix] = collector._checkpoint_metric(
                seconds_left(deadline), "run.state_dict"
            )
        if self._metric_states:
            # Loaded and not claimed by any collector yet (made later, or a renamed prefix):
            # carried on, so this checkpoint does not lose them.
            self._warn_unclaimed("state_dict")
            collectors = {**self._metric_states, **collectors}
        sinks: dict[str, Any] = {}
        undelivered: dict[str, str] = {}
        if self.is_writer:
            for collector in self._collectors:
                collector.wait_windows_for_checkpoint(seconds_left(deadline), timeout)
            if self._log_pipe is not None and not self._log_pipe.wait_idle(seconds_left(deadline)):
                # Out of time (a zero timeout, or windows that used it up): values still in the
                # pipe are in no sink's queue, so "undelivered" below would lack them and a job
                # resumed from this checkpoint would never log them. Handed over here, they are
                # in it.
                left = self._log_pipe.hand_over(_HAND_OVER_S)
                if left:
                    # Behind a CUDA copy not completed (or a delivery in progress): the pipe
                    # delivers them later, after this checkpoint read the sinks, so it lacks
                    # them. Said, not left for the resumed job's missing steps to tell.
                    logger.warning(
                        "state_dict: %d Run.log call(s) still waited for a CUDA copy (or a "
                        "delivery in progress) %.1f s after the checkpoint's time ran out; this "
                        "checkpoint lacks their values (a job resumed from it does not log "
                        "them), while this run still delivers them",
                        left,
                        _HAND_OVER_S,
                    )
            sinks, undelivered = self._delivery.sink_states(seconds_left(deadline))
        state = {"collectors": collectors, "sinks": sinks, "undelivered": undelivered}
        # Not in the state_dict of a run not started yet: that is the template
        # torch.distributed.checkpoint loads into, and a key there that an older checkpoint
        # lacks fails dcp.load ("Missing key"). DCP needs no record: it loads a collector's
        # state only into a run that made that collector before dcp.load.
        if ranks and self._delivery.started:
            state[_COLLECTOR_RANKS] = ranks
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` (any world size) before the first bind or log.

        Collectors made later get their saved metric state when ``collector`` makes them.

        Raises:
            RuntimeError: If a collector is bound or values were logged already.
            KeyError: If ``state_dict`` lacks ``"collectors"`` or ``"sinks"``.
            ValueError: If a sink refuses its saved state (the sink named), before anything is
                restored.
        """
        if self._delivery.started:
            raise RuntimeError(
                "load_state_dict: call it before the first bind or log (sinks resume their "
                "run when they open); with torch.distributed.checkpoint: make the run's "
                "collectors, dcp.load({'run': run}, ...), then bind"
            )
        if not isinstance(state_dict, Mapping) or not {"collectors", "sinks"} <= state_dict.keys():
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict)
            raise KeyError(
                "state_dict: expected run.state_dict()'s keys ['collectors', 'sinks', "
                f"'undelivered'] (a checkpoint of an earlier version may lack 'undelivered'), "
                f"got {keys} (a collector's own state_dict() goes to collector.load_state_dict)"
            )
        collectors = dict(state_dict["collectors"])
        sinks = state_dict["sinks"]
        # Before anything is restored.
        self._delivery.check_sink_states(sinks, state_dict.get("undelivered"))
        saved_ranks = dict(state_dict.get(_COLLECTOR_RANKS) or {})
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # Every collector's checkpoint is checked before any is restored: a job that catches a
        # refusal and starts fresh then counts no collector's saved numbers twice. A collector
        # made before the load takes a state saved by ranks this one was not among only as one
        # made after it does (see collector()): when its group holds one of them. Another
        # subgroup's collector of that prefix (new_subgroups: [0, 1] saved, this is [2, 3])
        # counted other data, and would continue from [0, 1]'s counts.
        restores = [
            collector.prepare_metric_load(collectors.pop(collector.prefix))
            for collector in self._collectors
            if collector.prefix in collectors
            and (
                rank in saved_ranks.get(collector.prefix, [rank])
                or _group_holds(collector, saved_ranks[collector.prefix])
            )
        ]
        for restore in restores:
            restore()
        outside = {
            prefix: collectors.pop(prefix)
            for prefix in [p for p in collectors if rank not in saved_ranks.get(p, [rank])]
        }
        # A subgroup's collector this rank was not in (made on its members only): its state
        # is theirs, not an unclaimed one, unless this rank makes that collector now.
        self._outside_states = outside
        self._outside_ranks = {p: list(saved_ranks[p]) for p in outside}
        self._metric_states = collectors
        self._metric_ranks = {p: list(saved_ranks[p]) for p in collectors if p in saved_ranks}
        self._loaded = True
        self._delivery.load_sink_states(sinks, state_dict.get("undelivered"))


_COLLECTOR_RANKS = "collector_ranks"
"""The key of the global ranks of each collector over a group of its own, in a checkpoint."""


def _holding_ranks(given: Group, group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks that make the collector over ``given`` (resolved to ``group``).

    A 1-D slice of a device mesh (``mesh["dp"]``) is made on every rank of the mesh, each
    rank's collector over its own slice (rank 0's writes): all of them claim its state, not
    only the members of the slice the saving rank is in.
    """
    return mesh_ranks(given) if isinstance(given, DeviceMesh) else list(group_ranks(group))


def _group_holds(collector: AsyncMetricCollector[Any], ranks: Iterable[int]) -> bool:
    """Whether ``collector``'s group holds one of the global ``ranks`` (that saved a state)."""
    group, _ = collector._checkpoint_scope()
    return not set(_holding_ranks(collector._group, group)).isdisjoint(ranks)


def _register_close_at_exit(run: weakref.ref[Run]) -> None:
    alive = run()
    if alive is not None:
        close_at_exit(alive._close_at_exit)


def _still_open(run: Run) -> bool:
    """Whether ``run`` holds sink threads, files or a tracker run (started, not closed)."""
    return not run._closed and run._delivery.started_in is not None


_CLOSE_ADVICE = (
    "Close it before making a new one (run.close()), or make the run with "
    "`with Run(...) as run:` in the cell that trains"
)
