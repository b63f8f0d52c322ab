"""``AsyncMetricCollector``: logging windows that never make the training thread wait."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import torch
import torch.distributed as dist
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
from sidestream._digest import checkpoint_digest
from sidestream._distributed import (
    Group,
    check_cuda_available,
    check_device,
    check_process_group,
    group_size,
    mesh_ranks,
    resolve_device,
    resolve_group,
)
from sidestream._eager import host_call
from sidestream._exit import (
    close_at_exit,
    ending_with,
    exit_time_left,
    forget_close_at_exit,
    fork_mark,
    forked_since,
    refuse_in_forked_child,
)
from sidestream._logs import get_logger
from sidestream._step import training_step
from sidestream._text import check_encodable
from sidestream._threads import refuse_on_own_thread
from sidestream._validation import check_int
from sidestream.collector._checkpoint_errors import naming_checkpoint_failures
from sidestream.collector._dispatcher import Dispatcher
from sidestream.collector._slot import Slot, clone_metric
from sidestream.collector._tree import flatten_tree
from sidestream.collector._window import Window, without_frames
from sidestream.metric import DTYPES_KEY, Metric
from sidestream.metrics.compose import ComposeMetric
from sidestream.sinks._spool import DEFAULT_SPOOL_MAX_BYTES
from sidestream.sinks.base import RunInfo, Sink
from sidestream.sinks.runner import SinkRunner
from sidestream.sinks.status import SinkStatus
from sidestream.sinks.support import seconds_left
from sidestream.sync import RankMismatchError, check_same_setting

__all__ = ["AsyncMetricCollector"]

#: The collector's metric type: ``collector.metric`` is the metric given, as its own class
#: (``collector.metric["loss"]`` type-checks for a ``ComposeMetric``). Covariant (the collector
#: only hands its metric out): ``run.collector(MeanMetric(), prefix="train").bind(device)`` is
#: also an ``AsyncMetricCollector[Metric[Tensor]]``, as a trainer's attribute is annotated.
MetricT = TypeVar("MetricT", bound=Metric[Any], covariant=True)

logger = get_logger("sidestream.collector")

_DELIVERED = (
    "schedule_collection: the window at step {step} was scheduled before this error and is "
    "delivered; its step is used (do not schedule it again)"
)
_REFUSED = (
    "schedule_collection: the window at step {step} is not reported (the collector was closed "
    "during this call)"
)

WINDOW_COMPUTE_LIMIT_S = 300.0
"""How long a checkpoint waits, past its own timeout, for windows scheduled before it to be
computed and handed to the sinks (their collectives have ended by then: local work only)."""

# A few slots let new windows stage while older ones are still being published; more are made
# on demand, up to max_slots, if the dispatcher falls further behind.
_INITIAL_SLOTS = 3

# The collector each bound metric belongs to (by id: the collector keeps the metric alive).
_BOUND: weakref.WeakValueDictionary[int, AsyncMetricCollector[Any]] = weakref.WeakValueDictionary()
DEFAULT_MAX_SLOTS = 8


_CLOSED = (
    "the collector is closed (by close(), its Run's close(), or the end of a `with "
    "collector:` block) and cannot be used again; bind a collector once, outside the loop, "
    "and close it once at the end: a stream used in several passes (validation) keeps its "
    "collector"
)


class AsyncMetricCollector(Generic[MetricT]):
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

    A job with several streams (train, validation, plain values) makes one ``sidestream.Run``
    and its collectors with ``run.collector(metric, prefix=...)``, so they share one tracker
    run. ``AsyncMetricCollector(metric, sinks=...)`` is the shortcut for a collector with a
    run of its own (the delivery options below are that run's).

    Args:
        metric: The metric (or ``ComposeMetric``) to collect. Update it as usual.
        sinks: Where reports go (rank 0 only). A sink belongs to one run: to share sinks
            between collectors, use ``sidestream.Run``.
        group: The process group / 1-D device mesh to reduce over (default: the world).
        reset_each_window: Start every window from an empty state (per-window values); when
            ``False`` each window reports the cumulative value since the start.
        prefix: Put in front of every flat name (``"train"`` gives ``"train/loss"``).
        histograms: Paths of result leaves (``"scores"`` for ``ComposeMetric({"scores": ...})``,
            ``"val/scores"`` when nested) whose value is a histogram (1-D bin counts): they go
            to ``Report.histograms`` as CPU tensors, under the prefixed name, instead of one
            value per bin. ``collect_results`` is unaffected.
        run: Name, config and tags given to ``sink.open`` (a ``RunInfo``; the ``info`` of the
            collector's own run). A ``sidestream.Run`` is not accepted here: make the
            collector with ``run.collector(...)``.
        sink_capacity: Reports each sink keeps in memory before spooling to disk.
        sink_retry_initial_s: A sink's first wait after a failed write; doubles after each
            further failure, up to ``sink_retry_max_s``.
        sink_retry_max_s: A sink's longest wait between retries, so also how late a recovered
            backend may see its first retry.
        spool_dir: Directory for spool files (system temp dir by default); a relative one is
            taken from the working directory when this is made.
        spool_max_bytes: Most bytes of undelivered reports each sink's spool file holds (on
            disk within twice this); beyond it the oldest spooled reports are dropped, counted
            (``SinkRunner.dropped``) and logged.
        max_slots: Most staging copies of the metric (each window holds one from
            ``schedule_collection`` until its numbers are on the host; 8 by default). They also
            bound the windows waiting for the dispatcher. When all are taken,
            ``schedule_collection`` waits for the oldest window to finish (logged once, timed
            in ``slot_wait_s``); skipping the window instead would pair different collectives
            across ranks, whose dispatchers finish at different times. Slots made beyond the
            first three are freed once the backlog has drained.
        exit_timeout: Seconds ``close`` may take when called at interpreter exit, shared
            with the other closes at exit (see ``Run``).
        checkpoint_timeout: The timeout of ``state_dict()`` called without one, as
            ``torch.distributed.checkpoint`` calls it (``None``: no limit). A collector of a
            ``Run`` takes the run's.

    Raises:
        ValueError: If the metric, or one in or around it, is bound to another collector that
            is not closed, or shares its states with such a collector's metric (one is a
            ``copy.copy`` of the other); the metric is left as it was. Or an option is out of
            range.
        TypeError: If an argument is of the wrong type (``sinks``, ``prefix``, ``max_slots``...).

    Example:
        >>> from sidestream import MeanMetric
        >>> collector = AsyncMetricCollector(MeanMetric()).bind("cpu")
        >>> collector.metric.update(torch.tensor([1.0, 2.0]))
        >>> collector.schedule_collection(step=1)
        >>> collector.collect_results()
        1.5
        >>> collector.close()
        True
    """

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused (threads, locks, sinks), with a message that says how to checkpoint it."""
        refuse_pickling(self, "collector")

    def __init__(
        self,
        metric: MetricT,
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
        exit_timeout: float = 30.0,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        max_slots: int = DEFAULT_MAX_SLOTS,
        checkpoint_timeout: float | None = 10.0,
        _delivery: Delivery | None = None,
    ) -> None:
        if not isinstance(metric, Metric):
            raise TypeError(f"metric: expected a sidestream Metric, got {type(metric)}")
        check_int("max_slots", max_slots, 1)  # TypeError for "8", as the delivery options
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {prefix!r}")
        check_encodable("prefix", prefix)
        if not isinstance(reset_each_window, bool):
            raise TypeError(f"reset_each_window: expected a bool, got {reset_each_window!r}")
        if run is not None and not isinstance(run, RunInfo):
            if callable(getattr(run, "collector", None)):
                raise TypeError(
                    "run: got a sidestream.Run; make its collectors with "
                    "run.collector(metric, prefix=...)"
                )
            raise TypeError(f"run: expected a sidestream.sinks.RunInfo, got {run!r}")
        if isinstance(histograms, str):
            histogram_paths: tuple[str, ...] = (histograms,)
        else:
            try:
                paths = iter(histograms)
            except TypeError:
                # tuple() alone said "'int' object is not iterable", naming no argument.
                raise TypeError(
                    f"histograms: expected leaf paths (a str or a list of str), got {histograms!r}"
                ) from None
            histogram_paths = tuple(paths)
        for path in histogram_paths:
            if not isinstance(path, str) or not path.strip("/"):
                raise TypeError(f"histograms: expected non-empty leaf paths (str), got {path!r}")
        self._metric = metric
        self._closed = False
        self._bound_in: int | None = None  # fork_mark() where its dispatcher thread started
        # The default process group at bind, weakly (None: not distributed); see bind.
        self._bound_world: weakref.ref[dist.ProcessGroup] | None = None
        # Refused here too, not only at bind: a run's stream made for a metric another open
        # collector has would keep its prefix (and save that metric's state) for nothing.
        self._refuse_a_metric_bound_elsewhere("metric")
        resolve_group(group)  # a wrong type fails here, not at bind
        # No metric of the tree clears data of its own in reset: the arena's reset is all.
        self._plain_reset = all(type(m).reset is Metric.reset for m in metric._walk_metrics())
        self._readability_checked = metric._readability_checked()
        if _delivery is None:
            options = DeliveryOptions(
                sink_capacity,
                sink_retry_initial_s,
                sink_retry_max_s,
                spool_dir,
                exit_timeout,
                spool_max_bytes,
                checkpoint_timeout,
            )
            _delivery = Delivery(sinks, run, options)
            self._owns_delivery = True
        else:
            if list(sinks):
                raise TypeError("sinks: a collector of a Run delivers to the run's sinks")
            self._owns_delivery = False
        self._delivery = _delivery
        self._group = group
        self._reset_each_window = reset_each_window
        self._prefix = prefix.strip("/")
        # What every window's call fingerprint names: the prefix, and the mode, since a window
        # paired with a cumulative one on another rank would mix the two.
        self._stream = self._prefix if reset_each_window else f"{self._prefix} (cumulative)"
        self._histograms = frozenset(path.strip("/") for path in histogram_paths)
        self._checkpoint_loaded: str | None = None  # the loaded metric state's digest
        for path in sorted(self._histograms):
            _check_histogram_path(metric, path)
        self._device: torch.device | None = None
        self._side: torch.cuda.Stream | None = None
        self._free_slots: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        self._max_slots = max_slots
        self._slot_count = 0
        self._slot_wait_s = 0.0
        self._slot_wait_logged = False
        self._bound_at: float | None = None  # time.monotonic() at bind, for slot-wait shares
        self._dispatcher: Dispatcher | None = None
        self._last_step: int | None = None
        # Held by the call in progress: a second thread's call raises instead of staging the
        # same live state again (both copied it before either reset it: counted twice).
        # Re-entrant: a Ctrl-C between the acquire and the try that releases it leaves it held
        # by the training thread, whose later calls must still get in.
        self._scheduling = threading.RLock()
        # Set inside a call (in its try): a call on the same thread while it is set (a signal
        # handler that schedules a window, run inside the call) is refused as a second
        # thread's is, which the re-entrant lock alone lets in.
        self._in_schedule = False
        self._unreported_warned = False  # give_up_windows said it
        self._twin_index = 0  # set at bind: told apart from open collectors of this prefix
        self._closing = CloseOnce()  # which close call closes, and its answer for the others
        # Last, once nothing can be refused: checkpoints reduce over the collector's group,
        # not whatever the metric last saw (a refused collector leaves the metric as it was).
        metric.sync_group = group
        if self._owns_delivery and self._delivery.sinks:
            # A run's collector is made in Run.collector, never at a cell's top level.
            note_made_in_cell(
                self, sys._getframe(1), "AsyncMetricCollector", _still_open, _ADVICE, logger
            )

    def __repr__(self) -> str:
        # getattr: a constructor that raised part-way leaves an object a debugger may print.
        if getattr(self, "_closed", False):
            state = "closed"
        else:
            state = "bound" if getattr(self, "_device", None) is not None else "unbound"
        delivery = getattr(self, "_delivery", None)
        sinks = list(delivery.sinks) if delivery is not None else []
        return (
            f"AsyncMetricCollector(prefix={getattr(self, '_prefix', '')!r}, "
            f"metric={getattr(self, '_metric', None)!r}, sinks={sinks}, {state})"
        )

    # ------------------------------------------------------------------ properties

    @property
    def metric(self) -> MetricT:
        """The live metric: update it on the training thread."""
        return self._metric

    @property
    def side_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream reductions and compute run on (``None`` off CUDA or before bind)."""
        return self._side

    @property
    def prefix(self) -> str:
        """The prefix of every value name: the collector's stream in its run."""
        return self._prefix

    def _checkpoint_scope(self) -> tuple[dist.ProcessGroup | None, torch.device]:
        """The process group ``state_dict`` reduces over, and the device its collectives use."""
        device = self._device if self._device is not None else self._metric.device
        return resolve_group(self._group), device

    @property
    def is_writer(self) -> bool:
        """Whether this process opens and writes the sinks (global rank 0)."""
        return self._delivery.is_writer

    @property
    def sink_runners(self) -> list[SinkRunner]:
        """The sink pipelines of the collector's run (none before they start, or off rank 0)."""
        return list(self._delivery.runners or ())

    @property
    def sink_status(self) -> dict[str, SinkStatus]:
        """Each sink's delivery status by key (healthy, retrying or failed; the last error)."""
        return self._delivery.status()

    # ------------------------------------------------------------------ lifecycle

    def bind(self, device: torch.device | str | int | None = None) -> Self:
        """Move the metric to ``device`` (its current device by default) and start the threads.

        On CUDA this creates the side stream. On rank 0 it starts one thread per sink, which
        resumes (``load_state_dict``) and opens it. Registers ``close`` to run at exit.

        Blocking and a collective on multi-rank jobs: every rank calls it, and it checks once
        that all ranks hold the same metric structure, classes and sinks (raising
        ``RankMismatchError`` naming the difference otherwise), so later windows never block on
        that check.

        All or nothing: a bind that raises part-way stops the threads it started and leaves the
        collector and the metric as they were, so a corrected bind (on every rank) works.

        Raises:
            RankMismatchError: If ranks hold different metric states or different sinks (only
                rank 0 writes: a sink built on another rank alone would be dropped silently).
            RuntimeError: If already bound or closed; if ``device`` is CUDA and CUDA is not
                available; if the environment (``WORLD_SIZE``/``RANK``) says the job has
                several processes but no process group is initialized, or one of this
                process alone.
            ValueError: If the metric is bound to another collector that is not closed, the
                collector has sinks and its group leaves out global rank 0 (their writer),
                ``device`` is ``"meta"``, or a str torch cannot parse or a negative index.
        """
        check_device("bind", device, allow_none=True)
        if self._closed:
            raise RuntimeError(f"bind: {_CLOSED}")
        if self._dispatcher is not None:
            raise RuntimeError("bind: the collector is already bound")
        # A collector of a run whose sinks started in the process this one was forked from:
        # its windows would go to sink threads that stay there (nothing delivered here).
        refuse_in_forked_child("bind", self._delivery.started_in, "Run")
        self._refuse_a_metric_bound_elsewhere("bind")
        target = torch.device(device) if device is not None else self._metric.device
        check_cuda_available("bind", target)
        if target.type == "meta":
            raise ValueError(
                "bind: device 'meta' holds no values, so no window could be reduced or "
                "reported; bind to the device the metric is updated on ('cpu', 'cuda:0', ...)"
            )
        check_process_group("bind")
        self._refuse_group_without_writer()
        # The default process group it binds under: a job restarted in its process
        # (destroy_process_group, then a new init_process_group) has a new one, which a
        # collector of the failed attempt would otherwise reduce over unsaid, pairing its
        # collectives with the new attempt's.
        # Weakly, and in no local of this frame: held, it kept the group alive through a
        # mismatch error's traceback, and gloo aborted the process at exit after
        # destroy_process_group().
        self._bound_world = _weak_world()
        target = resolve_device(target)  # cuda -> cuda:N, cpu:0 -> cpu
        # All or nothing: a bind that fails part-way (a sink, a device move, a rank check) is
        # undone, so a corrected bind, or another collector's of this metric, starts afresh
        # instead of finding threads started, slots of another layout or a longer fingerprint.
        undo = self._bind_undo()
        try:
            self._bind_to(target)
        except BaseException as error:
            undo(error)
            raise
        return self

    def _bind_undo(self) -> Callable[[BaseException], None]:
        """A call that puts the collector and its metric back as they are now (before bind)."""
        device, stream, twin_index = self._metric.device, self._stream, self._twin_index
        sinks_started = self._delivery.started
        # A failed bind must not use up the loaded checkpoint's digests: the retry sends them.
        digests = [
            (metric, metric.__dict__["_loaded_digest"])
            for metric in self._metric._walk_metrics()
            if "_loaded_digest" in metric.__dict__
        ]

        def undo(error: BaseException) -> None:
            dispatcher, self._dispatcher = self._dispatcher, None
            if dispatcher is not None:
                dispatcher.stop(None)  # no window was submitted: it ends at once
            if not sinks_started and self._delivery.started:
                # Failed (an interrupt) once this bind had started the sinks: they stop, and
                # what they had not delivered of the checkpoint's backlog is kept for the retry.
                self._delivery.unstart(interrupted=not isinstance(error, Exception))
            if _BOUND.get(id(self._metric)) is self:
                del _BOUND[id(self._metric)]
            for metric in self._metric._walk_metrics():
                metric.__dict__.pop("_bound_prefix", None)
            if self._owns_delivery:
                forget_close_at_exit(self._close_at_exit)
            # The slots were copies laid out for this bind's device and arena: none is kept.
            self._free_slots = queue.SimpleQueue()
            self._slot_count = 0
            self._side = None
            self._device = None
            self._stream, self._twin_index = stream, twin_index
            for metric, digest in digests:
                metric.__dict__.setdefault("_loaded_digest", digest)
            if self._metric.device != device:
                try:
                    self._metric.to(device)
                except Exception as error:  # the bind's own error is the one raised
                    logger.error(
                        "bind failed, and moving the metric back to %s failed too: %s: %s",
                        device,
                        type(error).__name__,
                        error,
                    )

        return undo

    def _bind_to(self, target: torch.device) -> None:
        """``bind``'s work once its arguments were checked; undone by ``_bind_undo`` on failure."""
        self._twin_index = self._next_twin_index()
        self._metric.to(target)
        self._device = target
        # And the metric's count of collective calls so far, a load_state_dict included: a rank
        # that skipped one (rank 0 skipping the load loses the checkpoint, since only the
        # group's first rank takes the saved numbers) fails the first window on every rank.
        calls = self._metric.call_counter.count
        if calls:
            self._stream += f" after {calls} call(s)"
        if self._twin_index:
            # Another bound collector pairs its windows by the same prefix and mode: this one's
            # fingerprints differ from it, so ranks scheduling the two in another order fail
            # (with RankMismatchError) instead of reducing one's window with the other's.
            self._stream += f" (twin {self._twin_index})"
        if target.type == "cuda":
            self._side = torch.cuda.Stream(device=target)  # type: ignore[no-untyped-call]
        # Making the first slot is the one blocking collective: it checks that every rank holds
        # the same state structure (when recording its sync), so no window ever blocks on that
        # check (or hangs on mismatched collectives) later.
        for index in range(min(_INITIAL_SLOTS, self._max_slots)):
            self._free_slots.put(self._new_slot(check=index == 0))
        # The live metric's own sync (state_dict's) has the structure just checked: laid out
        # here, on every rank, so a state_dict never runs the check where another rank may be
        # reducing a window instead (the check would meet the window's collective and hang).
        self._metric.prepare_sync(self._group, check=False)
        # States of the same layout can mean other results (an MSE and an RMSE metric): the
        # windows would be reduced alike, and each rank would compute its own kind of value.
        check_same_setting(
            self._group,
            target,
            "metric classes",
            ", ".join(  # sorted: children are reduced by name, in any order
                sorted(
                    f"{prefix.rstrip('.') or 'the metric'} {type(metric).__qualname__}"
                    for prefix, metric in self._metric._named_metrics()
                )
            ),
            "bind the same metric, of the same classes, on every rank",
        )
        # A checkpoint loaded on some ranks only: every window's call check would fail later,
        # naming a differing state hash; said here, with the fix. Loaded into the metric itself
        # (metric.load_state_dict before bind) too: its windows never send that digest, so
        # ranks given different files would report the first rank's numbers.
        loaded = self._metric._take_load_digests()
        check_same_setting(
            self._group,
            target,
            "checkpoint loads",
            f"a checkpoint loaded (digest {self._checkpoint_loaded or loaded})"
            if self._checkpoint_loaded or loaded
            else "none loaded",
            "call load_state_dict with the same checkpoint on every rank before bind: the "
            "group's first rank takes its numbers, the others start from zero",
        )
        # Only rank 0 writes: sinks configured on another rank alone would be dropped silently.
        sinks = ", ".join(self._delivery.sinks) or "none"
        check_same_setting(
            self._group,
            target,
            "sinks",
            f"[{sinks}]",
            "build the same sinks on every rank: building one opens nothing, and only rank 0 "
            "opens and writes them",
        )
        # The dispatcher before the sinks: starting them (which opens them) is the last step
        # that can fail, so a failed bind never leaves a tracker run opened for nothing.
        writes = self._delivery.is_writer and bool(self._delivery.sinks)
        self._bound_in = fork_mark()
        self._bound_at = time.monotonic()
        self._dispatcher = Dispatcher(
            [self._delivery] if writes else [],
            self._free_slots.put,
            self._prefix,
            self._histograms,
        )
        self._delivery.start("bind")
        _BOUND[id(self._metric)] = self
        # Loading a checkpoint into a bound metric on some ranks only would drop it silently
        # (only the group's first rank takes saved numbers): Metric.load_state_dict refuses.
        for metric in self._metric._walk_metrics():
            metric.__dict__["_bound_prefix"] = self._prefix
        if self._owns_delivery:
            close_at_exit(self._close_at_exit)

    def _next_twin_index(self) -> int:
        """0, or above every index of the open collectors with this prefix, mode and group.

        The same on every rank (binds and closes run in program order), and never an index an
        open twin holds, so twins' call fingerprints differ. Warned: ranks that bind twins in
        different orders pair them undetected; a distinct prefix avoids that.
        """
        mine = (self._prefix, self._reset_each_window, _reduced_over(self._group))
        taken = [
            other._twin_index
            for other in list(_BOUND.values())  # one entry per bound collector (its metric)
            if other is not self
            and not other._closed
            and (other._prefix, other._reset_each_window, _reduced_over(other._group)) == mine
        ]
        if not taken:
            return 0
        # Warned: twins are told apart only by their bind order on each rank. Ranks that bind
        # them in different orders and schedule each in that order pair one twin's windows
        # with the other's, with equal fingerprints: wrong numbers, no error.
        logger.warning(
            "bind: %d other bound collector(s) have the prefix %r, so this one is told apart "
            "from them only by the order of the binds: bind and schedule them in the same "
            "order on every rank (a rank that binds them in another order reduces one's "
            "windows with the other's, undetected); give each collector a prefix of its own",
            len(taken),
            self._prefix,
        )
        return max(taken) + 1

    def _refuse_group_without_writer(self) -> None:
        """Sinks are written by global rank 0: a group without it would deliver nothing."""
        process_group = resolve_group(self._group)
        if process_group is None or not self._delivery.sinks:
            return
        ranks = dist.get_process_group_ranks(process_group)
        if 0 in ranks:
            return
        if isinstance(self._group, DeviceMesh) and 0 in mesh_ranks(self._group):
            # One slice of a mesh dimension (mesh["dp"] on a tensor-parallel rank): global
            # rank 0 reduces the same stream over its own slice and writes it; this slice's
            # windows are reduced (collect_results works) and written by no one, as a replica's.
            logger.info(
                "bind: the collector's group %s is a slice of a device mesh dimension without "
                "global rank 0; rank 0's slice writes the stream, this one's windows are only "
                "reduced",
                ranks,
            )
            return
        raise ValueError(
            f"group: the collector's group holds global ranks {ranks}, but the sinks are "
            "written by global rank 0, which is not in it, so no window would reach them; "
            "reduce over a group with rank 0 (or gather the value to rank 0's group), or "
            "use a collector without sinks and read collect_results on these ranks. For one "
            "dimension of a DeviceMesh (data-parallel replicas under tensor parallelism) pass "
            "the mesh dimension itself (mesh['dp']), not its process group"
        )

    @host_call
    def schedule_collection(self, step: int) -> None:
        """Start collecting the window that ends now, logged at ``step``; returns at once.

        Issues the window's collectives from this thread (every rank must call it, in the same
        order). No host sync on CUDA.

        A call that raises before the window's first collective leaves the step free and the
        updates in the live metric (on CUDA the staged copy is put back). Once the collectives
        may have been issued the step stays used and the window is reported as failed
        (``collect_results`` raises naming the step; the exception carries a note saying so);
        with ``reset_each_window`` the live state is reset as for a window that succeeded (its
        updates went to the other ranks with the window), else the next window's cumulative
        value includes them. A ``RankMismatchError`` there (a metric's own sync) is reported
        as a mismatch, as one found later is.

        Raises:
            RuntimeError: If not bound, or closed (also by a close run inside this call on its
                thread, a signal handler's, or by another thread's close whose timeout ran out
                while it waited for this call, before the window was handed over: it is not
                reported); if called on one of sidestream's threads (from a sink's method, a
                metric's ``compute``, or a logging handler run there); or if a metric of the
                tree says its states cannot be read as they are (``Metric._check_readable``:
                the torchmetrics bridge's wrapped object updated directly), before anything
                is staged.
            TypeError: If ``step`` is not an integer (Python or numpy).
            ValueError: If ``step`` is not larger than the previous window's step, or not in
                ``[0, 2**63)`` (it travels as an int64); or a wrapped torchmetrics metric's
                setting changed after ``wrap()``.
        """
        if self._closed:
            raise RuntimeError(f"schedule_collection: {_CLOSED}")
        if self._dispatcher is None:
            raise RuntimeError("schedule_collection: call bind(device) first")
        self._refuse_replaced_group("schedule_collection")
        # It may wait for a staging slot, which the dispatcher frees: from a metric's compute
        # with every slot in use it waited for ever for the window it was computing.
        refuse_on_own_thread("schedule_collection")
        refuse_in_forked_child("schedule_collection", self._bound_in, "collector")
        refuse_in_forked_child("schedule_collection", self._delivery.started_in, "Run")
        acquired = self._scheduling.acquire(blocking=False)
        if not acquired or self._in_schedule:
            if acquired:  # this thread, inside its own call (a signal handler's)
                self._scheduling.release()
            raise RuntimeError(
                "schedule_collection: called from another thread while a call is in progress "
                "(or from a signal handler run inside it); schedule (and update the metrics) "
                "from one thread, the training loop's: two calls at once would stage the same "
                "updates into two windows"
            )
        before = self._last_step
        try:
            self._in_schedule = True
            if self._closed:
                # Closed by another thread since the check above: close waits for the call
                # that holds this lock, so a call let in here would queue its window after
                # the dispatcher stopped (lost, while close returned True).
                raise RuntimeError(f"schedule_collection: {_CLOSED}")
            self._schedule(step)
        except BaseException as error:
            if self._last_step != before and not getattr(error, "__notes__", None):
                # The step was taken and nothing failed: a Ctrl-C as the call returned.
                error.add_note(_DELIVERED.format(step=self._last_step))
            raise
        finally:
            self._in_schedule = False
            self._scheduling.release()

    def _schedule(self, step: int) -> None:
        assert self._dispatcher is not None
        step = training_step(step)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step: expected > the previous window's {self._last_step}, got {step}"
            )
        if self._dispatcher.mismatch is not None:
            self._raise_mismatch()
        for inner in self._readability_checked:  # before anything is staged or counted
            inner._check_readable("schedule_collection")
        # The step counts as used once its window exists: a wait for a slot that was
        # interrupted (Ctrl-C) leaves it free for the call made again, and so does a Ctrl-C
        # before the window exists (the slot comes back: eight such and the pool ran dry).
        previous_step = self._last_step
        slot = self._take_slot()
        window: Window | None = None
        reset = False  # the CPU path's reset of the live state ran to its end
        try:
            window = Window(step=step, time=time.time(), slot=slot)
            self._last_step = step
            if self._side is None:
                slot.start_from_live(step, window)
                if self._reset_each_window:
                    # The live state was copied out; start_from_live checked that its arena is
                    # the one bound, so unless a subclass resets differently, reset that arena
                    # at once (one copy). Inlined: _reset_live is this, for a failed window.
                    if self._plain_reset:
                        slot.live_arena.reset()
                    else:
                        self._metric.reset()
                    reset = True
            else:
                self._schedule_on_side_stream(window)
        except BaseException as error:
            if window is None:
                self._free_slots.put(slot)
                self._last_step = previous_step
                raise
            if window.started and self._side is None and self._reset_each_window and not reset:
                # Its updates went (or may have gone) to the other ranks with this window: kept
                # in the live state, the next window would count them again, so reset it as a
                # window that succeeded does (the side stream's staging has reset it already).
                self._reset_after_failure(window)
            if window.batch is not None:
                # In flight: the dispatcher hands it back, and delivers it (an error after the
                # start, such as a Ctrl-C in the reset, fails no window). Unless the collector
                # was closed inside this call (a signal handler's close, then its sys.exit):
                # the stopped dispatcher refuses the window, and that refusal raised here hid
                # the handler's SystemExit (the process crashed instead of exiting) under a
                # note that said the window was delivered.
                try:
                    self._dispatcher.submit(window)
                except RuntimeError:
                    if not self._dispatcher.stopped:
                        raise
                    error.add_note(_REFUSED.format(step=step))
                else:
                    error.add_note(_DELIVERED.format(step=step))
            elif window.started:
                self._give_up_started(window, error)
            else:
                # No collective writes into its buffers: the slot comes back, or the pool runs
                # dry and a later call waits forever.
                self._free_slots.put(slot)
                if self._keep_updates(window, error):
                    self._last_step = previous_step  # the call made again reports them
            raise
        try:
            self._dispatcher.submit(window)
        except BaseException as error:
            # A Ctrl-C as the hand-off began queued nothing: its collectives were started, so
            # the window is queued now (else its report was lost without a word, while close
            # returned True and collect_results waited for it forever). One as it ended left
            # it queued. Either way it is delivered, and its step is used.
            if not window.queued and self._dispatcher.stopped:
                # Refused: the collector was closed inside this call (a signal handler's close
                # on this thread). Not delivered, which the note says (not _DELIVERED's).
                error.add_note(_REFUSED.format(step=step))
                raise
            if not window.queued:
                self._dispatcher.submit(window)
            error.add_note(_DELIVERED.format(step=step))
            raise

    def _reset_live(self, slot: Slot) -> None:
        """Reset the live state after its window took it (the CPU path, window mode)."""
        if self._plain_reset:
            slot.live_arena.reset()
        else:
            self._metric.reset()

    def _reset_after_failure(self, window: Window) -> None:
        """``_reset_live`` for a window that failed once its updates were handed over."""
        try:
            self._reset_live(window.slot)
        except Exception as reset_error:  # the window's own error is the one raised
            window.kept_updates = True
            logger.error(
                "schedule_collection: the window at step %d failed, and resetting the metric "
                "after it failed too: %s: %s; its updates stay in the live metric and are "
                "counted again by the next window",
                window.step,
                type(reset_error).__name__,
                reset_error,
            )

    def _give_up_started(self, window: Window, error: BaseException) -> None:
        """A window whose collectives may be in flight, with no handle to wait on, failed.

        Its slot is never reused: the collectives may still write into its buffers. Its step
        stays used (the other ranks' windows may pair with what was issued), and it is handed
        to the dispatcher as failed, so ``collect_results`` and ``close`` say it was lost. In
        window mode the live state was reset (as for a window that succeeded, on CPU as on
        CUDA), so its updates are in no later window; cumulative, they stay in the live state
        and the next window's value includes them. A ``RankMismatchError`` (a metric's own
        sync, which is blocking, found that ranks paired different calls) is reported as a
        mismatch.
        """
        self._slot_count -= 1  # a new slot is made in its place when needed
        if self._reset_each_window and not window.kept_updates:
            fate = "its updates were not delivered (the window is reported as failed)"
        else:
            fate = (
                "the window is reported as failed; its updates stay in the live metric, so "
                "the next window's value includes them"
            )
        error.add_note(
            f"schedule_collection: the window at step {window.step} failed while its reduction "
            f"was starting; {fate}"
        )
        self._submit_failed(window, error)

    def _submit_failed(self, window: Window, error: BaseException) -> None:
        """Hand ``window`` to the dispatcher as failed on this thread with ``error``.

        The window keeps a copy of the error without its traceback: the frames of this call
        hold the window's slot, and the dispatcher keeps failures until ``collect_results``
        (so a slot given up would outlive ``max_slots``, a full copy of the metric each).
        """
        window.error = without_frames(error)
        assert self._dispatcher is not None
        self._dispatcher.submit(window)

    def _keep_updates(self, window: Window, error: BaseException) -> bool:
        """Whether the live metric still holds the failed window's updates (none started).

        Staging on the side stream resets the live state before the reduction starts: its
        copy is put back (queued on the current stream, after the staging and the reset).
        If that fails too, the updates are lost: the window is handed to the dispatcher as
        failed, naming its step, and the step stays used.
        """
        if not window.staged or not self._reset_each_window:
            return True
        try:
            window.slot.unstage()
        except Exception as unstage_error:
            logger.error(
                "schedule_collection: putting the staged state of the window at step %d back "
                "failed: %s: %s",
                window.step,
                type(unstage_error).__name__,
                unstage_error,
            )
            error.add_note(
                f"schedule_collection: the window at step {window.step} failed after its "
                "updates were taken from the live metric; they were not delivered (the "
                "window is reported as failed)"
            )
            self._submit_failed(window, error)
            return False
        return True

    def _refuse_a_metric_bound_elsewhere(self, where: str) -> None:
        """Raise ``ValueError`` if the metric, or one in or around it, has an open collector."""
        for other, relation in self._related_metrics():
            owner = _BOUND.get(id(other))
            if owner is not None and owner is not self and not owner._closed:
                raise ValueError(
                    f"{where}: {relation} is bound to another collector (prefix "
                    f"{owner.prefix!r}) that is not closed; a metric belongs to one collector, "
                    "whose windows stage and reset it (its children included): give each "
                    "collector its own metric"
                )
        ours = {id(state) for _, state in self._metric.named_accumulators()}
        for owner in list(_BOUND.values()):
            if owner is self or owner._closed:
                continue
            if any(id(state) in ours for _, state in owner._metric.named_accumulators()):
                # A shallow copy (copy.copy) holds its original's state objects (in either
                # order of binding, and after either's arena was rebuilt): two collectors
                # would stage and reset the same storage, each window taking the other's
                # updates. (A metric and one in or around it are refused above.)
                raise ValueError(
                    f"{where}: this metric shares its states with the metric of another "
                    f"collector (prefix {owner.prefix!r}) that is not closed: one is a copy.copy "
                    "of the other (copy.deepcopy makes a metric of its own)"
                )

    def _related_metrics(self) -> Iterator[tuple[Metric[Any], str]]:
        """The metric, the metrics inside it and those it is inside, each described.

        A collector stages and resets its metric's whole tree, so none of these may belong to
        another collector (siblings in a composition may).
        """
        metric = self._metric
        yield metric, "this metric"
        for inner in metric._walk_metrics():
            if inner is not metric:
                yield inner, f"a {type(inner).__name__} inside this metric"
        home = metric.__dict__.get("_state_arena")
        if home is not None and home.alive and home.root is not metric:
            for outer in home.root._walk_metrics():
                if outer is not metric and any(m is metric for m in outer._walk_metrics()):
                    yield outer, f"the {type(outer).__name__} this metric is part of"

    def _schedule_on_side_stream(self, window: Window) -> None:
        assert self._side is not None and self._device is not None
        slot, side = window.slot, self._side
        # By index: looking a torch.device up costs more than the rest of this call's Python.
        current = torch.cuda.current_stream(self._device.index)
        if slot.done is not None:
            # The slot came back from the dispatcher, so this wait is already satisfied; it
            # keeps staging ordered after the last reader of these buffers on the GPU too.
            current.wait_event(slot.done)
        slot.stage(window.step)
        # From here until the start, a failure puts the staged copy back (_keep_updates).
        window.staged = True
        if self._reset_each_window:
            self._metric.reset()  # one copy from the arena's initial values
        staged = torch.cuda.Event()  # type: ignore[no-untyped-call]
        staged.record(current)
        # torch.cuda.stream(side) without its context manager, which looks the device up twice.
        # set_stream also makes the side stream's device current: the caller's comes back.
        caller_device = torch.cuda.current_device()
        torch.cuda.set_stream(side)
        try:
            side.wait_event(staged)
            window.started = True
            batch = slot.start_sync(window.step)
            batch.wait()  # NCCL: the side stream waits for the collectives; the host does not
            # compute() is queued on the side stream by the dispatcher thread: its Python work
            # grows with the metric tree, and the training thread's must not. Only once the
            # side stream waits for the collectives: a window without that wait is not computed.
            window.batch, window.side = batch, side
        finally:
            torch.cuda.set_stream(current)
            if caller_device != self._device.index:
                torch.cuda.set_device(caller_device)

    def settle_windows(self, timeout: float | None) -> None:
        """Wait at most ``timeout`` s for the scheduled windows; raise a mismatch one found.

        Called before a checkpoint's own collective. A rank that skipped a window pairs its
        peers' pending window with that collective: the peers see the mismatch only when that
        window ends, and a collective they started first would wait for a partner that never
        comes, until the process group's timeout. The wait ends as soon as a mismatch is
        found; windows still computing after ``timeout`` are left to the checkpoint's own
        wait (and its warning).

        Raises:
            RankMismatchError: If a window was paired with another call on some rank.
        """
        if self._dispatcher is not None:
            self._dispatcher.wait_idle(timeout, until_mismatch=True)
        self._raise_mismatch()

    def _own_group(self) -> None:
        """Make the collector's group the metric's ``sync_group`` again, for a checkpoint.

        The live metric's state is what no window reduced yet, so it is saved reduced over
        the windows' group and placed for it at load. A ``metric.sync()`` of the live metric
        over another group (a look at its numbers over the default group) had made that its
        group: the checkpoint of a collector over ``mesh["dp"]`` then counted the
        tensor-parallel replicas twice. The whole tree's, not the root's alone: a look at one
        child (``metric["loss"].sync()``) left the root's group as it was, and the child's
        other group then made the checkpoint refuse the tree as synced over mixed groups.
        """
        self._metric._give_group(self._group)

    def _checkpoint_metric(self, timeout: float | None, where: str) -> dict[str, Any]:
        """The metric's reduced state for a checkpoint (``where``: the call, for errors)."""
        self.settle_windows(timeout)
        self._own_group()
        saved = self._metric._reduced_state(
            self._prefix or "(no prefix)", naming_checkpoint_failures(where, [self])
        )
        return _with_window_mode(saved, self._reset_each_window)

    def _mismatch_found(self) -> BaseException | None:
        """The rank mismatch a window found, if any (what ``_raise_mismatch`` raises)."""
        return None if self._dispatcher is None else self._dispatcher.mismatch

    def _windows_waiting(self) -> int:
        """Windows scheduled and not processed yet (0 when not bound)."""
        return 0 if self._dispatcher is None else self._dispatcher.unprocessed

    def _windows_failed(self) -> list[int]:
        """Steps of windows that failed and ``collect_results`` has not raised yet."""
        return [] if self._dispatcher is None else self._dispatcher.failed_steps

    def _raise_mismatch(self) -> None:
        # A window paired with another call on some rank: every rank fails the same way.
        error = self._mismatch_found()
        if error is not None:
            # The fingerprints name collectors by hash only: say which stream this one is.
            raise RankMismatchError(
                f"{error} [raised by this rank's collector with prefix {self._prefix!r}]"
            ) from error

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
                try:
                    self._free_slots.get_nowait()
                except queue.Empty:  # a slot is still out: shrink later
                    break
                self._slot_count -= 1
        return slot

    def _wait_for_slot(self) -> Slot:
        slot = self._wait_for_free_slot()
        self._refuse_if_closed_meanwhile()  # the slot may be one a window gave back since
        return slot

    def _refuse_replaced_group(self, call: str) -> None:
        """Raise if the default process group this collector bound under was destroyed.

        Raises:
            RuntimeError: If ``destroy_process_group`` ran since ``bind`` (and maybe a new
                ``init_process_group``): the collector's group is gone.
        """
        bound = self._bound_world
        if bound is None or (dist.is_initialized() and dist.group.WORLD is bound()):
            return
        raise RuntimeError(
            f"{call}: the process group this collector was bound under was destroyed "
            "(torch.distributed.destroy_process_group, as an in-process restart does); its "
            "collectives would run over the new group, paired with the new attempt's. Close "
            "the failed attempt's run (or collector) and make new collectors after the new "
            "init_process_group"
        )

    def _refuse_if_closed_meanwhile(self) -> None:
        """Raise the closed collector's error if a close ran inside this call.

        A signal handler's close while the call waited for a slot: the wait then met the stopped
        dispatcher ("the dispatcher thread has stopped") or took the slots the close dropped for
        lost ones (and warned so).
        """
        if self._closed:
            raise RuntimeError(f"schedule_collection: {_CLOSED}")

    def _wait_for_free_slot(self) -> Slot:
        assert self._dispatcher is not None
        start = time.monotonic()
        try:
            try:
                # A burst of windows (a toy loop, the first windows while a sink opens) frees
                # a slot within moments: said only when the wait is longer.
                return self._free_slots.get(timeout=_SLOT_WAIT_QUIET_S)
            except queue.Empty:
                pass
            replaced = self._replace_lost_slots()
            if replaced is not None:
                return replaced
            if not self._slot_wait_logged:
                self._slot_wait_logged = True
                ranks = group_size(resolve_group(self._group))
                logger.warning(
                    "schedule_collection: all %d staging slots have been in use for %.1f s "
                    "(windows are scheduled faster than they are reduced and computed%s); "
                    "waiting for the oldest window. Schedule less often or raise max_slots "
                    "(logged once; see slot_wait_s)",
                    self._max_slots,
                    _SLOT_WAIT_QUIET_S,
                    ", or another rank stopped scheduling them" if ranks > 1 else "",
                )
            while True:
                try:
                    return self._free_slots.get(timeout=1.0)
                except queue.Empty:
                    self._refuse_if_closed_meanwhile()
                    if not self._dispatcher.alive:
                        raise RuntimeError(
                            "schedule_collection: the dispatcher thread has stopped"
                        ) from None
                    replaced = self._replace_lost_slots()
                    if replaced is not None:
                        return replaced
        finally:
            self._slot_wait_s += time.monotonic() - start
            self._note_short_slot_waits()

    def _note_short_slot_waits(self) -> None:
        """Warn once when many short slot waits add up to a share of the training time.

        Waits under ``_SLOT_WAIT_QUIET_S`` each are not logged, yet they add up: on 16 ranks
        sharing 2 cores every rank waited 13.6 s of a 17 s loop, without a word.
        """
        if self._slot_wait_logged or self._bound_at is None:
            return
        waited = self._slot_wait_s
        elapsed = time.monotonic() - self._bound_at
        if waited < _SLOT_WAIT_TOTAL_S or waited < _SLOT_WAIT_SHARE * elapsed:
            return
        self._slot_wait_logged = True
        logger.warning(
            "schedule_collection: waited %.1f s of the %.1f s since bind for a free staging "
            "slot (all %d in use), in waits shorter than %.1f s each: windows are scheduled "
            "faster than they are reduced and computed. Schedule less often or raise "
            "max_slots (logged once; see slot_wait_s)",
            waited,
            elapsed,
            self._max_slots,
            _SLOT_WAIT_QUIET_S,
        )

    def _replace_lost_slots(self) -> Slot | None:
        """A new slot if slots were lost: none is free, yet no window holds one.

        A Ctrl-C (or a SIGTERM handler's exit) right as a call took its slot, before its window
        existed, can drop the slot; enough such calls and every later call would wait for a
        slot forever. Every window processed has given its slot back (before it counts as
        processed), so every slot counted is then lost.
        """
        assert self._dispatcher is not None
        self._refuse_if_closed_meanwhile()
        if self._dispatcher.unprocessed or not self._free_slots.empty():
            return None
        logger.warning(
            "schedule_collection: %d staging slot(s) lost to an interrupted call; made anew",
            self._slot_count,
        )
        self._slot_count = 0
        return self._new_slot()

    def _new_slot(self, check: bool = False) -> Slot:
        slot = self._make_slot(check)
        # Counted once it exists: a Ctrl-C while it was made would count a slot that is not.
        self._slot_count += 1
        return slot

    def _make_slot(self, check: bool) -> Slot:
        copied = clone_metric(self._metric)
        if self._side is None:
            return Slot(
                copied, self._metric, self._group, check=check, direct=True, stream=self._stream
            )
        # Its sync buffers are made on the side stream, the only stream that uses them. Allocate
        # the pinned buffers now too (shapes from a compute on the copied state), and let the next
        # staging wait for this compute like for any window's.
        self._side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._side):
            slot = Slot(copied, self._metric, self._group, check=check, stream=self._stream)
            slot.copy_to_host(flatten_tree(slot.metric.compute()).leaves)
            slot.done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            slot.done.record(self._side)
        return slot

    @host_call
    def collect_results(self, timeout: float | None = None) -> Any:
        """Wait for every scheduled window and return the latest one's value.

        Blocking. The value has the shape of ``metric.compute()`` with Python numbers (and
        nested lists for vectors) in place of tensors.

        Raises:
            RankMismatchError: As soon as a window found that ranks paired different calls (a
                rank skipped one), without waiting for the windows left with no partner.
            RuntimeError: If nothing was scheduled, a window failed since the last call (or the
                latest window failed), or ``timeout`` passed first; or in a child made by
                ``os.fork`` after ``bind`` (the dispatcher thread stays in the parent); or
                on one of sidestream's threads (from a sink's method, a metric's
                ``compute``, or a logging handler run there): it waits for the windows.
        """
        timeout = check_timeout("collect_results: timeout", timeout)
        refuse_on_own_thread("collect_results")
        # The dispatcher thread stays in the parent: a window in flight at the fork would be
        # waited for forever (or, with a timeout, blamed on a rank that is behind).
        refuse_in_forked_child("collect_results", self._bound_in, "collector")
        if self._dispatcher is None or self._dispatcher.scheduled == 0:
            raise RuntimeError("collect_results: no window scheduled; call schedule_collection")
        idle = self._dispatcher.wait_idle(timeout, until_mismatch=True)
        self._raise_mismatch()  # at once: a mismatch leaves windows waiting for no partner
        if not idle:
            raise RuntimeError(
                f"collect_results: {self._dispatcher.unprocessed} window(s) still running after "
                f"{timeout} s: a window's collective waits until every rank of the group has "
                "scheduled it (is a rank behind, or did one skip a schedule_collection?), or "
                "compute is slow; call it again with a longer timeout, or close()"
            )
        try:
            return self._dispatcher.latest()[1]
        except RuntimeError as failed:
            # A window's copy of the metric was made at bind: a state put in a container of
            # the live metric since then is in no window, and compute fails on the copy (an
            # IndexError) without saying why. Looked for only now, off the hot path.
            try:
                self._metric._refuse_hidden_in_tree()
            except TypeError as hidden:
                raise RuntimeError(f"{failed}; likely cause: {hidden}") from failed
            raise

    def close(self, timeout: float | None = 30.0) -> bool:
        """Finish every scheduled window and stop the threads (and the sinks of its own run).

        With a run of its own it also delivers to and closes every sink. Blocking, bounded by
        ``timeout`` seconds overall. Idempotent: a later call returns what the first returned
        (so ``run.close`` reports a collector closed before it). A collector of a shared ``Run``
        leaves the sinks open (``run.close`` closes them).

        Returns:
            Whether everything finished and was delivered: ``False`` if windows were still
            running or failed, if a sink could not take its reports in time (they are kept
            in a spool file a warning names) or if a sink failed for good.

        Raises:
            RuntimeError: If called on one of sidestream's threads (from a sink's method, a
                metric's ``compute``, or a logging handler run there): it waits for them.
        """
        timeout = check_timeout("close: timeout", timeout)
        if forked_since(self._bound_in, "close", "collector"):
            return False
        # Before the claim: from a metric's compute it waited for the window it computed.
        refuse_on_own_thread("close")
        if self._owns_delivery:
            # Before the claim, as Run.close: not inside this thread's start of the sinks.
            self._delivery.refuse_inside_start("close")
        closer = CloseOnce.closer()
        complete = False  # the answer other calls get if an error escapes this one
        try:
            # Claimed inside the try: an interrupt landing right after the claim ends it below
            # (see CloseOnce.begin).
            if not self._closing.begin(closer):
                # Closed, or being closed by another call (another thread's, or Run.close's):
                # its answer, once it has one, not True before its windows were delivered.
                return self._closing.answer(timeout)
            self._closed = True
            if _BOUND.get(id(self._metric)) is self:  # this collector bound it (not another)
                for metric in self._metric._walk_metrics():
                    metric.__dict__.pop("_bound_prefix", None)
            if self._owns_delivery:
                forget_close_at_exit(self._close_at_exit)
            deadline = None if timeout is None else time.monotonic() + timeout
            # A schedule_collection in progress on another thread hands its window to the
            # dispatcher before it stops: queued after that, it would never be processed.
            # Calls that take the lock after this see _closed and raise.
            if wait_until_free(self._scheduling, timeout):
                timeout = seconds_left(deadline)  # what the wait left of it
            complete = self._close_windows_and_sinks(timeout, deadline)
            if complete:
                # Every window is done: its staging copies (a copy of the metric each, up to
                # max_slots) are no longer needed, and a Run keeps its closed streams'
                # collectors (one per evaluation set kept 24 MB for a 500-class confusion
                # matrix).
                self._drop_free_slots()
            return complete
        except BaseException:
            if self._closing.holds(closer):
                # Interrupted (Ctrl-C), from the claim on: as Run.close, keep what the sinks
                # had not delivered.
                self._closed = True
                self.give_up_windows("close was interrupted")
                if self._owns_delivery:
                    self._delivery.close_now()
            raise
        finally:
            if self._closing.holds(closer):
                self._closing.end(complete)

    def _drop_free_slots(self) -> None:
        while True:
            try:
                self._free_slots.get_nowait()
            except queue.Empty:
                return
            self._slot_count -= 1

    def give_up_windows(self, why: str) -> None:
        """For a close that ends early: warn (once) how many windows will not be reported.

        Their reports never reach a sink or a spool file (the sinks are closing), so only this
        says they are missing. The dispatcher is told to stop once it has processed what it
        holds, not waited for: a close interrupted before it stopped the dispatcher left the
        thread waiting for windows for the rest of the process.
        """
        if self._dispatcher is None:
            return
        unprocessed = self._dispatcher.unprocessed
        if not self._dispatcher.stopped:
            self._dispatcher.request_stop()
        # Nothing processes a window from here (a Run's close interrupted before this
        # collector's turn closed it no other way): a later schedule_collection is refused up
        # front, with the closed collector's message, not by the stopped dispatcher once its
        # collectives had run and the live state was reset ("closed during this call").
        self._closed = True
        if unprocessed and not self._unreported_warned:
            self._unreported_warned = True
            logger.warning(
                "%s: %d window(s) of stream %r not finished; they are not reported",
                why,
                unprocessed,
                self._prefix,
            )

    def _close_windows_and_sinks(self, timeout: float | None, deadline: float | None) -> bool:
        complete = True
        if self._dispatcher is not None:
            complete = self._dispatcher.stop(timeout)
            if not complete:
                try:
                    group = resolve_group(self._group)
                    alone = not dist.is_initialized() or dist.get_world_size(group) == 1
                except Exception:  # a group destroyed before close: say both
                    alone = False
                logger.warning(
                    "close: %d window(s) not finished within %s s; they are not reported. %s",
                    self._dispatcher.unprocessed,
                    timeout,
                    "A window waits for its compute(): is it slower than the timeout?"
                    if alone
                    else "A window's collective waits for every rank of the group: did a rank "
                    "skip the last schedule_collection, stop early, or close before scheduling "
                    "it? (Or a compute() slower than the timeout.)",
                )
            if self._dispatcher.failed_windows:
                logger.warning(
                    "close: %d window(s) of stream %r failed (the first failure was logged)",
                    self._dispatcher.failed_windows,
                    self._prefix,
                )
                complete = False
        if self._owns_delivery and not self._delivery.close(deadline):
            complete = False
        return complete

    def wait_windows(self, timeout: float | None) -> bool:
        """Block until every scheduled window was handed to the sinks; whether in time."""
        timeout = check_timeout("wait_windows: timeout", timeout)
        return self._dispatcher is None or self._dispatcher.wait_idle(timeout)

    def wait_windows_for_checkpoint(
        self, timeout: float | None, given: float | None = None
    ) -> None:
        """Block until every scheduled window was handed to the sinks, for a checkpoint.

        Called after the checkpoint's own collective over the collector's group: the windows'
        collectives were started before it by the training thread, so they have ended too, and
        what is left of a window is local (its compute and the hand-off). A checkpoint must hold
        every window scheduled before it (their states were staged and reset, so only their
        reports carry them): that local work is waited for past ``timeout``, which bounds the
        waits on the sinks' backends, up to ``WINDOW_COMPUTE_LIMIT_S`` more, with a warning.

        Args:
            timeout: Seconds left of the checkpoint's timeout.
            given: The checkpoint's whole timeout, for the warnings (``timeout`` if ``None``).
        """
        if self._dispatcher is None or self.wait_windows(timeout):
            return
        given = timeout if given is None else given
        logger.warning(
            "state_dict: %d window(s) of the collector %r were still being computed when the "
            "checkpoint's timeout (%s s) ran out; waiting up to %s s more for them, so that "
            "this checkpoint holds their reports (a slow compute makes every checkpoint wait)",
            self._dispatcher.unprocessed,
            self._prefix,
            given,
            WINDOW_COMPUTE_LIMIT_S,
        )
        if not self.wait_windows(WINDOW_COMPUTE_LIMIT_S):
            logger.warning(
                "state_dict: %d window(s) of the collector %r were still being computed %s s "
                "after the checkpoint's timeout (%s s); they are not in this checkpoint, so a "
                "job resumed from it would not log them",
                self._dispatcher.unprocessed,
                self._prefix,
                WINDOW_COMPUTE_LIMIT_S,
                given,
            )

    def _close_at_exit(self) -> None:
        self.close(exit_time_left(self._delivery.options.exit_timeout))

    def __enter__(self) -> Self:
        if self._closed:
            raise RuntimeError(f"with collector: {_CLOSED}")
        if self._dispatcher is None:
            self.bind()
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
        """The metric's state (globally reduced: a collective) and the sinks' of its own run.

        Blocking. Every rank must call it. On rank 0 it then waits for the windows scheduled
        before it to be computed (past ``timeout`` if need be: ``wait_windows_for_checkpoint``),
        and at most ``timeout`` seconds in all (``checkpoint_timeout`` when not given) until
        every scheduled window is delivered (so the sinks' last steps match the metric state)
        and makes the sinks' data durable. A sink still behind after
        ``timeout`` gives its state as of its last delivered step (a warning says so), and its
        undelivered reports go into ``"undelivered"``: a job resumed from this checkpoint
        delivers them first. A collector of a shared ``Run`` has no sink states
        (``run.state_dict()`` holds them).

        Raises:
            RankMismatchError: If a window was paired with another call on some rank.
            RuntimeError: If the checkpoint's collective failed (a rank stopped: at the
                process group's timeout, not ``timeout``), naming the windows still running
                or failed; or if called on one of sidestream's threads (from a sink's
                method, a metric's ``compute``, or a logging handler run there).
        """
        timeout = self._delivery.options.checkpoint_wait(timeout)
        refuse_on_own_thread("state_dict")  # it waits for the dispatcher and sink threads
        # It waits for the windows, which the dispatcher thread of the parent computes.
        refuse_in_forked_child("state_dict", self._bound_in, "collector")
        deadline = None if timeout is None else time.monotonic() + timeout
        metric_state = self._checkpoint_metric(timeout, "state_dict")
        sink_states: dict[str, Any] = {}
        undelivered: dict[str, str] = {}
        if self._owns_delivery and self.is_writer:
            self.wait_windows_for_checkpoint(seconds_left(deadline), timeout)
            sink_states, undelivered = self._delivery.sink_states(seconds_left(deadline))
        return {"metric": metric_state, "sinks": sink_states, "undelivered": undelivered}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a ``state_dict`` (any world size). Call before ``bind``.

        The metric continues the saved numbers; each sink gets its saved state before it
        opens, so it resumes the same run without repeating steps.

        Raises:
            RuntimeError: If the collector is already bound.
            KeyError: If ``state_dict`` lacks ``"metric"``.
            ValueError: If a sink refuses its saved state, before anything is restored.
        """
        if self._dispatcher is not None:
            raise RuntimeError(
                "load_state_dict: call it before bind (sinks resume their run when they open); "
                f"{_DCP_ORDER}"
            )
        if not isinstance(state_dict, Mapping) or "metric" not in state_dict:
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict)
            raise KeyError(
                f"state_dict: expected collector.state_dict()'s keys ['metric', 'sinks', "
                f"'undelivered'], got {keys} (a Run's state_dict() goes to run.load_state_dict)"
            )
        # Nothing is restored unless everything loads: a job that catches the error and starts
        # fresh then skips no step (resumed sinks) and counts nothing twice (a loaded metric).
        if self._owns_delivery:
            self._delivery.check_sink_states(
                state_dict.get("sinks", {}), state_dict.get("undelivered")
            )
        self.prepare_metric_load(state_dict["metric"])()
        if self._owns_delivery:
            self._delivery.load_sink_states(
                state_dict.get("sinks", {}), state_dict.get("undelivered")
            )

    def load_metric_state(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the metric's part of a checkpoint (``Run.collector`` calls it).

        Raises:
            RuntimeError: If the collector is already bound.
        """
        self.prepare_metric_load(state_dict)()

    def prepare_metric_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None]:
        """Check the metric's part of a checkpoint; return the call that restores it.

        ``Run.load_state_dict`` checks every collector's before it restores any.

        Raises:
            RuntimeError: If the collector is already bound.
        """
        if self._dispatcher is not None:
            raise RuntimeError(f"load_state_dict: call it before bind; {_DCP_ORDER}")
        self._check_window_mode(state_dict)
        self._own_group()  # placed for the windows' group, whatever the metric synced over
        try:
            restore = self._metric._prepare_load(dict(state_dict))
        except (KeyError, TypeError, ValueError) as error:
            if type(error) not in (KeyError, TypeError, ValueError):
                raise  # a subclass of its own may take other arguments
            # The stream the checkpoint names: a run has several collectors of one metric type.
            detail = error.args[0] if len(error.args) == 1 else str(error)
            raise type(error)(f"collector {self.prefix!r}: {detail}") from error

        digest = checkpoint_digest(state_dict)

        def restore_and_note() -> None:
            restore()
            # bind checks that every rank loaded one, and the same one: the group's first rank
            # alone takes its numbers, so another file on another rank went unnoticed.
            self._checkpoint_loaded = digest

        return restore_and_note

    def _check_window_mode(self, state_dict: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` if the state was saved by a collector of the other window mode.

        A per-window collector's state holds the updates since its last window, a cumulative
        one's every update since the run started: loaded into the other mode, the first window
        would report the whole run as one window, or the cumulative values would leave out
        every window before the checkpoint, with no error.
        """
        saved = _saved_window_mode(state_dict)
        if saved is None or saved == self._reset_each_window:
            return  # a checkpoint from before the record, or of this mode
        held = {
            True: "per-window values: it holds only the updates since the last window",
            False: "cumulative values: it holds every update since the run started",
        }
        wrong = {
            True: "its first window would report every update since the run started",
            False: "its values would leave out every window before the checkpoint",
        }
        raise ValueError(
            f"collector {self.prefix!r}: the checkpoint's metric state was saved with "
            f"reset_each_window={saved} ({held[saved]}), this collector has "
            f"reset_each_window={self._reset_each_window}, so {wrong[self._reset_each_window]}. "
            f"Make the collector with reset_each_window={saved} to resume it; to change the "
            "mode, give the stream a new prefix (it starts from zero; a Run keeps the saved "
            "state in its checkpoints)"
        )


_DCP_ORDER = "with torch.distributed.checkpoint: make the collectors, dcp.load, then bind"
"""The order a checkpoint loads in, said when a load comes after bind."""

_WINDOW_MODE = "sidestream/reset_each_window"
"""The entry of a collector's window mode in its metric state's dtype record.

In the record (JSON text) rather than a key of its own: ``torch.distributed.checkpoint`` loads
the text whole, and a key that an older checkpoint lacks would fail its ``dcp.load``. No state
name holds a ``/``, so the metric's own check of the record passes it by.
"""


def _with_window_mode(saved: dict[str, Any], reset_each_window: bool) -> dict[str, Any]:
    """``saved`` (a metric's checkpoint) with the collector's window mode in its dtype record.

    A metric without states has no record, and nothing a mode could count wrongly.
    """
    record = saved.get(DTYPES_KEY)
    if not isinstance(record, str):
        return saved
    entries = json.loads(record)
    entries[_WINDOW_MODE] = reset_each_window
    saved[DTYPES_KEY] = json.dumps(entries)
    return saved


def _saved_window_mode(state_dict: Mapping[str, Any]) -> bool | None:
    """The window mode a metric state's record names (``None``: saved before it was kept).

    A record that is not JSON of a mapping is the metric's to refuse, as it was before.
    """
    record = state_dict.get(DTYPES_KEY)
    try:
        entries = json.loads(record) if isinstance(record, str | bytes) else None
    except ValueError:
        return None
    mode = entries.get(_WINDOW_MODE) if isinstance(entries, dict) else None
    return mode if isinstance(mode, bool) else None


_SLOT_WAIT_QUIET_S = 0.5
"""How long ``schedule_collection`` waits for a staging slot before it says so (once)."""
_SLOT_WAIT_TOTAL_S = 5.0
"""Shorter slot waits are logged once they add up to this many seconds..."""
_SLOT_WAIT_SHARE = 0.2
"""...and to this share of the time since bind (a slow start alone is not worth a warning)."""


def _check_histogram_path(metric: Metric[Any], path: str) -> None:
    """Raise ``ValueError`` if ``path`` names no leaf of the compositions it passes through.

    A ``ComposeMetric``'s result has one key per child, known now; a typo would otherwise fail
    every window, on the dispatcher's thread, scalars included. Past a metric of another kind
    (its own result dict) the path is checked against the first window's result instead.
    """
    node: Metric[Any] = metric
    walked: list[str] = []
    for part in path.split("/"):
        if not _plain_compose(node):
            return
        assert isinstance(node, ComposeMetric)
        if part not in node:
            where = f"'{'/'.join(walked)}'" if walked else "the metric"
            raise ValueError(
                f"histograms: {path!r} is not a leaf of the compute() result: {where} has the "
                f"parts {list(node)}"
            )
        node = node[part]
        walked.append(part)
    if _plain_compose(node):
        raise ValueError(
            f"histograms: {path!r} names a ComposeMetric (a mapping of results), not a leaf "
            f"of bin counts; its parts are {list(node)}"  # type: ignore[call-overload, unused-ignore]
        )


def _plain_compose(metric: Metric[Any]) -> bool:
    """Whether ``metric`` is a ``ComposeMetric`` whose result is ``{name: child.compute()}``."""
    return isinstance(metric, ComposeMetric) and type(metric).compute is ComposeMetric.compute


def _reduced_over(group: Group) -> dist.ProcessGroup | None:
    """The process group ``group`` reduces over.

    ``None`` for the default one, however it is named (``None``, ``dist.group.WORLD``, a device
    mesh over it).
    """
    resolved = resolve_group(group)
    return None if resolved is None or resolved is dist.group.WORLD else resolved


def _weak_world() -> weakref.ref[dist.ProcessGroup] | None:
    """A weak reference to the default process group, or None when not distributed."""
    if not dist.is_initialized() or dist.group.WORLD is None:
        return None
    return weakref.ref(dist.group.WORLD)


def _still_open(collector: AsyncMetricCollector[Any]) -> bool:
    """Whether ``collector`` holds sink threads, files or a tracker run (bound, not closed)."""
    return not collector._closed and collector._delivery.started_in is not None


_ADVICE = (
    "Close it before making a new one (collector.close()), or give the sinks to a "
    "`with Run(...) as run:` block in the cell that trains"
)
