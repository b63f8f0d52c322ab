"""``TrackerSink``: the delivery bookkeeping every sink that keeps a run shares."""

from __future__ import annotations

import abc
import collections
import dataclasses
import inspect
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar

from sidestream._logs import get_logger
from sidestream._threads import FirstTimes
from sidestream.sinks.base import Report, Sink
from sidestream.sinks.support import call_within, refuse_unknown_options

__all__ = ["TrackerSink", "UnconfirmedBacklogError", "parse_tracker_state", "signature_options"]

logger = get_logger("sidestream.sinks")

# Reports sent and not confirmed that a sink keeps to resend (a backend that never confirms
# must not grow memory without bound). With this many, the sink sends no more until the
# backend confirms some: its runner keeps the rest (queue, then spool), counting any it drops.
_MAX_UNCONFIRMED = 65_536


class UnconfirmedBacklogError(RuntimeError):
    """The backend has not confirmed ``_MAX_UNCONFIRMED`` reports: retried, sent once it does."""


class TrackerSink(Sink):
    """A sink that keeps one run of a tracker, resumable from a checkpoint, exactly once.

    It tracks, per ``Report.stream``, the last step the backend has, and skips any report at
    or below it, so streams may arrive in any order relative to each other and a resumed job
    never sends a step twice. Subclasses implement ``send`` (deliver fresh reports) and may
    override ``persist`` (push buffered data to the backend) and ``make_durable`` (make
    delivered data survive a machine crash, called when a checkpoint takes the state).

    The rule: a step counts as delivered only once the backend has it. If ``send`` returns
    only when the backend has the reports (``durable_on_send``, the default), they count at
    once; otherwise only after a ``persist`` that succeeded. ``state_dict`` holds delivered
    steps only.

    State: ``{identity_key: ..., "last_steps": [[stream, step], ...]}`` plus what the subclass
    adds with ``extra_state``. ``last_steps`` is a list of pairs, not a mapping, so that
    ``torch.distributed.checkpoint`` keeps it whole: it loads only the keys the state has at
    load time, and a sink that has not opened yet has no streams. A mapping (older
    checkpoints) is read too, and an older ``{identity_key: ..., "last_step": n}`` as ``n`` for
    every stream. A state without the identity key, or with a key neither this class nor
    ``extra_state`` writes, is refused: it is another sink's.

    Attributes:
        identity_key: The name of the run identity in the state (``"run_id"``, ``"log_dir"``).
        identity_is_path: Whether the identity names a file or folder this sink writes (then
            ``written_place`` gives it, and two sinks may not share it).
        durable_on_send: Whether ``send`` returning means the backend has the reports.
    """

    identity_key: ClassVar[str] = "run_id"
    identity_is_path: ClassVar[bool] = False
    durable_on_send: ClassVar[bool] = True
    #: Set by ``replay_spool`` before ``open``: the run given is the job's as a spool kept it
    #: (JSON: a tuple comes back a list), so it is no sign of another job or config.
    replaying: bool = False
    skips_values: ClassVar[bool] = False
    """Whether ``skip_value`` may leave values out: its state then always has
    ``skipped_values`` (torch.distributed.checkpoint loads only the keys a fresh state has)."""
    _own_locks: ClassVar[tuple[str, ...]] = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Held around ``send`` and ``persist``: a checkpoint's ``make_durable`` runs ``flush``
        # off the sink's thread, and a subclass written to the contract ("every method on the
        # sink's own thread") would otherwise persist a buffer while ``send`` fills it (rows
        # cleared unwritten, then counted delivered). Reentrant: ``send``'s backlog check and
        # ``close`` flush on the thread that may hold it.
        self._io_lock = threading.RLock()
        self._sent: dict[str, int] = {}
        self._delivered: dict[str, int] = {}
        # A state from before streams: one last step for all of them.
        self._sent_default: int | None = None
        self._delivered_default: int | None = None
        # The steps a loaded checkpoint had delivered (not those found in the backend since):
        # a report at or below one is a step counter gone back past the checkpoint.
        self._loaded: dict[str, int] = {}
        self._loaded_default: int | None = None
        # Sent and not counted as delivered yet (durable_on_send False): a checkpoint or a
        # close that times out keeps them, so a backend that lost them gets them again.
        self._unconfirmed: collections.deque[Report] = collections.deque()
        self._resumed = False
        self._warned = FirstTimes()
        self._skipped: set[str] = set()  # value names the backend could not take (skip_value)
        # Found on resume: the last step the backend holds of each value name (backend_name).
        self._backend_steps: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Picklable (ProcessSink sends sinks to a child process): its own locks are made anew.
        state = dict(self.__dict__)
        for key in self._own_locks:
            state.pop(key, None)
        state.pop("_io_lock", None)  # not in subclasses' _own_locks: this class's own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for key in self._own_locks:
            setattr(self, key, threading.Lock())
        self._io_lock = threading.RLock()

    # ------------------------------------------------------------------ subclass hooks

    @classmethod
    def check_available(cls) -> None:
        """Raise ``ImportError`` (with the install command) if the backend's client is missing.

        ``sinks_from_config`` calls it when it builds the sink, so a missing client is found
        at once on every rank, not at ``open`` on rank 0. The default checks nothing.
        """

    @classmethod
    def option_names(cls) -> set[str] | None:
        """The keyword options the constructor takes (``None``: any).

        The default reads the constructor's signature; a sink that forwards ``**kwargs`` to
        its client adds the client's names.
        """
        return signature_options(cls)

    @classmethod
    def refuse_unknown_options(cls, options: Mapping[str, Any]) -> None:
        """Raise ``TypeError`` for a keyword the sink and its client do not take (a typo).

        For constructors that forward ``**kwargs`` to their client; called when the sink is
        made, not at ``open`` on rank 0's sink thread. Without the client installed nothing is
        checked (``open`` says how to install it).
        """
        try:
            accepted = cls.option_names()
        except ImportError:
            return
        refuse_unknown_options(cls.__name__, options, accepted)

    @abc.abstractmethod
    def send(self, reports: Sequence[Report]) -> None:
        """Deliver ``reports`` (none of them delivered before) to the backend; raise on failure.

        A retry calls it again with the reports that did not count as sent; a subclass whose
        backend may have taken part of a failed call tracks that itself.
        """

    def persist(self, timeout: float | None) -> bool:
        """Push buffered data to the backend; whether that finished within ``timeout``."""
        del timeout
        return True

    def make_durable(self, timeout: float | None = None) -> bool:
        """Make what was sent durable, before a checkpoint takes ``state_dict``.

        Called from the training thread while the sink's thread may be writing, so it must be
        thread-safe. The default is ``flush`` (``persist``); a file sink also ``fsync``s.
        """
        return self.flush(timeout)

    @property
    def identity(self) -> str | None:
        """The run's identity (run id, log directory), once known."""
        return None

    @identity.setter
    def identity(self, value: str | None) -> None:
        del value

    def written_place(self) -> tuple[type, str, str] | None:
        """The file or folder this sink's identity names, if it is one.

        JSONL's path, TensorBoard's log_dir; ``None`` for a run id (not known before ``open``).
        """
        identity = self.identity
        if not self.identity_is_path or identity is None:
            return None
        return type(self), self.identity_key, os.path.realpath(identity)

    def extra_state(self) -> dict[str, Any]:
        """More state for ``state_dict`` (JSON-able); none by default."""
        return {}

    def load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        """Read back what ``extra_state`` wrote (called by ``load_state_dict``)."""
        del state_dict

    # ------------------------------------------------------------------ bookkeeping

    @property
    def resumed(self) -> bool:
        """Whether ``load_state_dict`` gave a state to continue from."""
        return self._resumed

    def last_step(self, stream: str) -> int | None:
        """The last step of ``stream`` the backend has (or that was sent, not yet persisted)."""
        return self._sent.get(stream, self._sent_default)

    def last_steps(self) -> dict[str, int]:
        """The last delivered step of each stream seen so far."""
        with self._lock:
            return dict(self._delivered)

    @property
    def all_delivered(self) -> bool:
        """Whether everything sent also counts as delivered (nothing waits for a ``persist``)."""
        with self._lock:
            return self._sent == self._delivered

    def is_delivered(self, report: Report) -> bool:
        """Whether ``report``'s step of its stream was already sent."""
        last = self._sent.get(report.stream, self._sent_default)
        return last is not None and report.step <= last

    def values_in_backend(self, report: Report) -> list[str]:
        """The names of ``report``'s values that ``write`` leaves out.

        Those the backend already holds at the report's step or later (found on resume): a
        value is never logged below the largest step the backend has of it, which is how a
        resumed job avoids duplicates, so such a value is not sent even if the backend lacks
        it at exactly this step (``held_values``).
        """
        return self._at_or_past(report, 0)

    def held_values(self, report: Report) -> list[str]:
        """The names of ``report``'s values left out that the backend may lack at its step.

        Those the backend holds at later steps: its largest step of the value is past the
        report's, so ``write`` leaves the value out, unless ``backend_has_step`` finds it at
        this very step. A value whose largest step is the report's is there.
        """
        later = self._at_or_past(report, 1)
        return [name for name in later if not self.backend_has_step(name, report.step)]

    def backend_has_step(self, name: str, step: int) -> bool:
        """Whether the backend holds value ``name`` at ``step``; ``False`` if it cannot tell.

        Asked only of values the backend holds at later steps (``held_values``: replaying a
        kept spool), so it may be slow. Override where the backend can answer.
        """
        return False

    def _at_or_past(self, report: Report, beyond: int) -> list[str]:
        """Names whose largest step in the backend is at least ``report.step + beyond``."""
        steps = self._backend_steps
        if not steps:
            return []
        least = report.step + beyond
        names = [*report.values, *report.histograms]
        return [n for n in names if steps.get(self.backend_name(n), least - 1) >= least]

    def found_in_backend(self, last_steps: Mapping[str, int]) -> None:
        """Count steps that the backend already holds (found on resume) as delivered."""
        with self._lock:
            for stream, step in last_steps.items():
                sent = self._sent.get(stream, self._sent_default)
                if sent is None or step > sent:
                    self._sent[stream] = step
        self.count_delivered(last_steps)

    def found_in_backend_for_every_stream(self, step: int) -> None:
        """Count ``step`` as held for every stream (found on resume in a backend without streams).

        What a backend written before streams existed holds, by an older sidestream whose
        checkpoint's ``"last_step"`` counts for every stream: so does the step found after it.
        """
        with self._lock:
            if self._sent_default is None or step > self._sent_default:
                self._sent_default = step
            if self._delivered_default is None or step > self._delivered_default:
                self._delivered_default = step
            for steps in (self._sent, self._delivered):
                for stream, last in steps.items():
                    steps[stream] = max(last, step)
            self._forget_confirmed()

    def count_delivered(self, last_steps: Mapping[str, int]) -> None:
        """Count each stream's steps up to ``last_steps[stream]`` as delivered.

        For a sink that learns that part of what it sent reached the backend without a whole
        ``persist`` (wandb's periodic write): steps never sent are not counted.
        """
        with self._lock:
            for stream, step in last_steps.items():
                sent = self._sent.get(stream, self._sent_default)
                if sent is None:
                    continue
                delivered = self._delivered.get(stream, self._delivered_default)
                reached = min(step, sent)
                if delivered is None or reached > delivered:
                    self._delivered[stream] = reached
            self._forget_confirmed()

    def found_values_in_backend(self, last_steps: Mapping[str, int]) -> None:
        """The last step of each value the backend holds, by its name there (found on resume).

        A report then sends only its values past their own last step. For backends that keep
        values by name alone (no stream): a stream guessed from a name's text goes wrong when a
        value is named like a stream (the value ``"train"`` of a ``"train"`` collector, or
        ``"train/lr"`` from ``Run.log``), and a stream's values need not all be at its last step.
        """
        for name, step in last_steps.items():
            if step > self._backend_steps.get(name, -1):
                self._backend_steps[name] = int(step)

    def backend_name(self, name: str) -> str:
        """The name a report's value ``name`` has in the backend (itself by default)."""
        return name

    def _past_backend(self, reports: Sequence[Report]) -> tuple[list[Report], set[str]]:
        """``reports`` less the values the backend already holds, and the names they pass.

        A report left empty counts as sent. The caller forgets the names passed once its send
        succeeded (a failed send is retried with the same batch), so a finished resume costs
        nothing.
        """
        steps, kept, passed = self._backend_steps, [], set()
        for report in reports:
            fresh: list[dict[str, Any]] = [{}, {}]
            for index, entries in enumerate((report.values, report.histograms)):
                for key, value in entries.items():
                    name = self.backend_name(key)
                    last = steps.get(name)
                    if last is None or report.step > last:
                        fresh[index][key] = value
                        if last is not None:
                            passed.add(name)
            if not fresh[0] and not fresh[1]:
                self.mark_sent(report)
            elif len(fresh[0]) + len(fresh[1]) == len(report.values) + len(report.histograms):
                kept.append(report)
            else:
                kept.append(dataclasses.replace(report, values=fresh[0], histograms=fresh[1]))
        return kept, passed

    def mark_sent(self, report: Report) -> None:
        """Count ``report`` as sent.

        ``send`` may call it after each report it completed, so that a retry after a failure
        later in the same call skips it.
        """
        with self._lock:
            last = self._sent.get(report.stream)
            if last is not None and report.step <= last:
                return  # marked by send already (a stream's steps only grow)
            self._sent[report.stream] = report.step
            if self.durable_on_send:
                self._delivered[report.stream] = report.step
                return
            self._unconfirmed.append(report)
            if len(self._unconfirmed) > _MAX_UNCONFIRMED:
                self._unconfirmed.popleft()
                self.warn_once(
                    "unconfirmed",
                    f"sink {self.name!r}: more than {_MAX_UNCONFIRMED} reports sent and not "
                    "confirmed by the backend; the oldest are no longer kept for a checkpoint "
                    "or close to resend",
                )

    def _check_unconfirmed_backlog(self, sending: int) -> None:
        """Raise ``UnconfirmedBacklogError`` if ``sending`` more would pass the unconfirmed cap.

        A backend that stalls (wandb's service stopped, its disk full) confirms nothing: the
        oldest of the reports kept to resend were forgotten, and lost with nothing counted.
        Instead the runner retries this write later, and its queue and spool keep the reports.
        """
        if self.durable_on_send:
            return  # nothing waits for a confirmation
        with self._lock:
            self._forget_confirmed()
            full = len(self._unconfirmed) + sending > _MAX_UNCONFIRMED
        if not full:
            return
        self.flush(0)  # what the backend has by now (wandb: the rows in its file)
        with self._lock:
            # All confirmed ones out, not only those at the front (another stream's report
            # there keeps them): at the cap only, so O(cap) now and then.
            kept = (report for report in self._unconfirmed if not self._confirmed(report))
            self._unconfirmed = collections.deque(kept)
            waiting = len(self._unconfirmed)
        if waiting + sending > _MAX_UNCONFIRMED:
            raise UnconfirmedBacklogError(
                f"sink {self.name!r}: its backend has not confirmed {waiting} reports sent; "
                "no more are sent until it does (they wait in the queue, then the spool)"
            )

    def pending_reports(self) -> list[Report]:
        """Reports sent that the backend has not confirmed yet (``durable_on_send`` False)."""
        with self._lock:
            return [report for report in self._unconfirmed if not self._confirmed(report)]

    def _confirmed(self, report: Report) -> bool:
        """Whether ``report``'s step of its stream counts as delivered (lock held)."""
        delivered = self._delivered.get(report.stream, self._delivered_default)
        return delivered is not None and report.step <= delivered

    def _forget_confirmed(self) -> None:
        """Drop the oldest reports while confirmed (lock held): O(1) per report over time.

        One stream's report left at the front keeps other streams' confirmed ones behind it
        until it is confirmed too; ``pending_reports`` leaves those out.
        """
        while self._unconfirmed and self._confirmed(self._unconfirmed[0]):
            self._unconfirmed.popleft()

    def write(self, report: Report) -> None:
        """Send ``report`` unless its step of its stream was delivered already."""
        self.write_batch([report])

    def write_batch(self, reports: Sequence[Report]) -> None:
        """Send the reports not delivered yet, in one ``send``.

        As if written one by one: a report at or below a step of its stream sent earlier in
        the same batch is skipped too (a resumed job's backlog, then its first steps again).
        """
        fresh: list[Report] = []
        newest: dict[str, int] = {}
        for report in reports:
            if self.is_delivered(report):
                self._warn_below_checkpoint(report)
                continue
            top = newest.get(report.stream)
            if top is not None and report.step <= top:
                continue
            newest[report.stream] = report.step
            fresh.append(report)
        passed: set[str] = set()
        if self._backend_steps:
            fresh, passed = self._past_backend(fresh)
        if not fresh:
            return
        self._check_unconfirmed_backlog(len(fresh))
        with self._io_lock:
            self.send(fresh)
        for name in passed:
            del self._backend_steps[name]
        for report in fresh:
            self.mark_sent(report)

    def flush(self, timeout: float | None = None) -> bool:
        """``persist``; what was sent before counts as delivered once it succeeded."""
        if type(self).persist is TrackerSink.persist:
            # Nothing buffered to persist (MLflow, a sink that writes in send): a send under
            # way loses nothing, and ``_sent`` counts it only once it returned. Waiting for it
            # held a checkpoint for a request to a slow server, and one that ran out of time
            # counted the sink as not durable: its state as of an older checkpoint (before the
            # first one, without the run id: the resumed job opened a new run).
            with self._lock:
                sent = dict(self._sent)
            self.count_delivered(sent)
            return True
        # After a send under way (a checkpoint's make_durable runs this off the sink's
        # thread): within the timeout, else it did not finish, as a persist cut short.
        began = time.monotonic()
        if not self._io_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            with self._lock:
                sent = dict(self._sent)
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - began))
            if not self.persist(left):
                return False
        finally:
            self._io_lock.release()
        self.count_delivered(sent)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush; subclasses release their backend after calling this."""
        return self.flush(timeout)

    def state_dict(self) -> dict[str, Any]:
        """The run identity and the last delivered step per stream. Never credentials."""
        # The extras first: a position in the backend (JSONL's offset) read before the steps
        # never runs ahead of them, so a resumed job never finds a step it must not repeat
        # below that position.
        extra = self.extra_state()
        with self._lock:
            steps = dict(self._delivered)
            default = self._delivered_default
        state: dict[str, Any] = {self.identity_key: self.identity, "last_steps": _pairs(steps)}
        if default is not None:
            state["last_step"] = default
        if self.skips_values or self._skipped:
            # The run lacks them for good: a resumed job's close must still say so.
            state[_SKIPPED_KEY] = sorted(self._skipped)
        state.update(extra)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the saved run at the next ``open``, after the saved steps.

        Raises:
            ValueError: If the state lacks the identity or the steps, or has wrong types.
        """
        # The keys this sink writes: another sink's state (W&B's run_dir in a TensorBoard
        # sink) would resume the wrong place, or skip steps this backend never had.
        identity, steps, default = parse_tracker_state(
            state_dict, self.identity_key, type(self).__name__, extra_keys=self.extra_state()
        )
        # Before any state changes: an override of ``identity`` without a setter failed at
        # ``self.identity = ...`` below, with the skipped values and extra state loaded already
        # and an AttributeError that did not say what to add (a type checker says it at once).
        own = inspect.getattr_static(type(self), "identity", None)
        if isinstance(own, property) and own.fset is None:
            raise TypeError(
                f"{type(self).__name__}.identity: a property without a setter; load_state_dict "
                "sets the identity of the run it resumes (here "
                f"{identity!r}): add an @identity.setter that keeps it for open"
            )
        skipped = state_dict.get(_SKIPPED_KEY, [])
        if not isinstance(skipped, list | tuple) or not all(isinstance(n, str) for n in skipped):
            raise ValueError(
                f"state_dict[{_SKIPPED_KEY!r}]: expected a list of value names, got {skipped!r}"
            )
        self.load_extra_state(state_dict)
        self._skipped = set(skipped)
        self.identity = identity
        with self._lock:
            self._sent, self._delivered = dict(steps), dict(steps)
            self._sent_default = self._delivered_default = default
        self._loaded, self._loaded_default = dict(steps), default
        self._resumed = True

    def _warn_below_checkpoint(self, report: Report) -> None:
        """Warn once per stream of a skipped report at or below its checkpoint's step.

        Steps a crashed job delivered after its checkpoint are skipped quietly (the resumed
        job repeats them); a step the checkpoint itself had means the job's step counter went
        back past it (it started again at 1?), and every report until it passes is lost.
        """
        last = self._loaded.get(report.stream, self._loaded_default)
        if last is not None and report.step <= last:
            stream = (
                f"stream {report.stream!r}"
                if report.stream
                else "the unnamed stream (Run.log's values, or a collector without prefix)"
            )
            self.warn_once(
                f"below-checkpoint:{report.stream}",
                f"{type(self).__name__}: {stream} step {report.step} is at or "
                f"below step {last}, which this run had delivered when its checkpoint was "
                f"taken: it is skipped, as is every report of the stream up to step {last}. A "
                "resumed job continues after its checkpoint's step; one whose step counter "
                "started again logs nothing until it passes it. After a rollback (a job "
                "resumed from a checkpoint older than the last one) the tracker already held "
                "the steps a later job delivered, and a checkpoint of the rolled-back job "
                "counts them: the tracker keeps those steps as they were",
            )

    # ------------------------------------------------------------------ helpers

    def warn_once(self, key: str, message: str) -> None:
        """Log ``message`` at WARNING the first time ``key`` is seen on this sink."""
        if self._warned.first(key):
            logger.warning("%s", message)

    def skip_value(self, name: str, message: str) -> None:
        """Leave out a value the backend cannot take, warning once per name.

        The report still counts as delivered (its other values are in the backend), but the
        run lacks this value: ``closed_with_every_value`` makes ``close`` say so.
        """
        self.warn_once(f"skipped:{name}", message)
        self._skipped.add(name)

    @property
    def skipped_values(self) -> list[str]:
        """The names of the values left out of the run for good (``skip_value``), sorted."""
        return sorted(self._skipped)

    # What the last close's backend answered (closed_with_every_value), None before one.
    _backend_confirmed: bool | None = None

    @property
    def backend_confirmed(self) -> bool | None:
        """Whether the last ``close``'s backend confirmed every report, whatever the run lacks.

        ``None`` if no close reported it (``closed_with_every_value``). ``close`` itself also
        returns ``False`` for a run that lacks values, on every later close too (they stay in
        the state): a replay asks this instead.
        """
        return self._backend_confirmed

    def closed_with_every_value(self, closed: bool) -> bool:
        """``closed``, but ``False`` (warned) if ``skip_value`` left values out of the run.

        ``closed`` itself is kept as ``backend_confirmed``.
        """
        self._backend_confirmed = closed
        if closed and self._skipped:
            logger.warning(
                "%s: closed, but the run lacks the values the backend could not take (%s; "
                "warned when first left out): close returns False",
                type(self).__name__,
                ", ".join(sorted(self._skipped)),
            )
            return False
        return closed

    def within(self, action: Callable[[], object], timeout: float | None, what: str) -> bool:
        """Run a backend call that may hang for at most ``timeout`` s; whether it succeeded.

        An overrun or an error is logged (once per call) as a warning naming ``what``.
        """
        finished, error = call_within(action, timeout, f"sidestream-{self.name}-{what}")
        if not finished:
            if timeout is not None and timeout <= 0:
                # A close after its caller's timeout ran out (the pipeline gave up): the call
                # goes on in the background, and "within 0.0 s" read as a second timeout.
                logger.warning(
                    "%s: %s had no time left (its caller's timeout had run out); it goes on "
                    "in the background",
                    type(self).__name__,
                    what,
                )
            else:
                logger.warning("%s: %s did not end within %s s", type(self).__name__, what, timeout)
            return False
        if error is not None:
            logger.warning(
                "%s: %s failed: %s", type(self).__name__, what, self.describe_error(error)
            )
            return False
        return True

    def describe_error(self, error: BaseException) -> str:
        """``error`` as text fit for a log (subclasses remove credentials)."""
        return f"{type(error).__name__}: {error}"


def signature_options(*functions: Callable[..., Any]) -> set[str] | None:
    """Keyword names ``functions`` take together; ``None`` if one takes ``**kwargs``.

    ``**kwargs`` of the first function (a constructor that forwards them) do not count when
    later functions say where they go.
    """
    names: set[str] = set()
    for index, function in enumerate(functions):
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                if index == len(functions) - 1:
                    return None
            elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
                names.add(parameter.name)
    names.discard("self")
    return names


_SKIPPED_KEY = "skipped_values"
"""The state's key of the value names ``skip_value`` left out of the run (only when some were)."""


def parse_tracker_state(
    state_dict: Mapping[str, Any],
    identity_key: str,
    sink: str,
    *,
    extra_keys: Collection[str] | None = None,
) -> tuple[str | None, dict[str, int], int | None]:
    """Validate a tracker sink's state: ``(identity, last step per stream, default step)``.

    Args:
        state_dict: What the sink's ``state_dict`` returned.
        identity_key: The key of the run identity (``"run_id"``, ``"log_dir"``).
        sink: The sink's name, for messages.
        extra_keys: The other keys the sink writes. Given, any further key is refused: the
            state is another sink's.

    Raises:
        ValueError: Naming the key, if one is missing, unknown, or has the wrong type.
    """
    if (
        not isinstance(state_dict, Mapping)
        or identity_key not in state_dict
        or not {"last_steps", "last_step"} & set(state_dict)
    ):
        raise ValueError(
            f"state_dict: expected a mapping with {identity_key!r} and 'last_steps' (from "
            f"{sink}.state_dict), got {state_dict!r}"
        )
    if extra_keys is not None:
        known = {identity_key, "last_steps", "last_step", _SKIPPED_KEY, *extra_keys}
        unknown = sorted(set(state_dict) - known)
        if unknown:
            raise ValueError(
                f"state_dict: {sink}.state_dict writes no key {', '.join(map(repr, unknown))}: "
                f"is this the state of another sink? (got {state_dict!r})"
            )
    identity = state_dict.get(identity_key)
    if identity is not None and not isinstance(identity, str):
        raise ValueError(f"state_dict[{identity_key!r}]: expected a str or None, got {identity!r}")
    by_stream, default = _parse_steps(state_dict)
    return identity, by_stream, default


def delivered_steps(state: Any) -> tuple[dict[str, int], int | None]:
    """A tracker sink state's last delivered step per stream, and an older state's default.

    ``({}, None)`` for anything that is no tracker sink state (another sink's, a bad one:
    refused where it is loaded).
    """
    if not isinstance(state, Mapping) or not {"last_steps", "last_step"} & set(state):
        return {}, None
    try:
        return _parse_steps(state)
    except ValueError:
        return {}, None


def _parse_steps(state_dict: Mapping[str, Any]) -> tuple[dict[str, int], int | None]:
    """``parse_tracker_state``'s steps: the last step per stream, and the default step."""
    default = state_dict.get("last_step")
    if default is not None and not _is_int(default):
        raise ValueError(f"state_dict['last_step']: expected an int or None, got {default!r}")
    steps = state_dict.get("last_steps")
    pairs = [] if steps is None else list(steps.items()) if isinstance(steps, Mapping) else steps
    if not isinstance(pairs, list | tuple) or not all(
        isinstance(pair, list | tuple)
        and len(pair) == 2
        and isinstance(pair[0], str)
        and _is_int(pair[1])
        for pair in pairs
    ):
        raise ValueError(
            f"state_dict['last_steps']: expected [stream (str), step (int)] pairs (or a "
            f"mapping of stream to step), got {steps!r}"
        )
    by_stream = {stream: step for stream, step in pairs}
    if len(by_stream) != len(pairs):
        raise ValueError(f"state_dict['last_steps']: expected one pair per stream, got {steps!r}")
    return by_stream, default


def steps_as_pairs(state: Any) -> Any:
    """``state`` with a mapping ``last_steps`` (older states) as pairs; anything else as is.

    A pure data change (nothing is checked: a bad state still fails where it is loaded), so a
    state loaded from an older checkpoint and saved again before its sink opens is written in
    the current layout.
    """
    if isinstance(state, Mapping) and isinstance(state.get("last_steps"), Mapping):
        return {**state, "last_steps": _pairs(state["last_steps"])}
    return state


def _pairs(steps: Mapping[str, Any]) -> list[list[Any]]:
    """``{stream: step}`` as ``[[stream, step], ...]`` by stream: the saved layout.

    Sorted by the streams' text, so an unchecked older state with odd keys cannot fail here.
    """
    return [[stream, step] for stream, step in sorted(steps.items(), key=lambda i: str(i[0]))]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
