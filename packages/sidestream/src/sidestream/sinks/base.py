"""The sink contract: what the collector hands to trackers, and what a tracker must implement.

Modelled on OpenTelemetry exporters: a narrow interface with explicit timeouts. The collector
calls every method of a sink from that sink's own thread on rank 0 only, so a sink may block
(network, disk) without delaying training or other sinks.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from sidestream._text import check_encodable

__all__ = ["Report", "RunInfo", "Sink"]


@dataclass(frozen=True)
class Report:
    """The finished values of one logging window.

    Attributes:
        step: The training step given to ``schedule_collection``.
        values: Flat names to Python floats (``"val/f1"``, ``"acc/class_3"``); one name per
            element of a per-class vector.
        time: Wall-clock time (``time.time()``) when the window was scheduled.
        histograms: Flat names to CPU tensors of histogram values (bin counts, or raw samples),
            for backends that draw histograms.
        stream: Which stream of the run the report belongs to: the collector's prefix
            (``"train"``, ``"val"``), or ``""`` for ``Run.log``. Steps increase within a
            stream; reports of different streams may reach a sink in any step order.
    """

    step: int
    values: Mapping[str, float]
    time: float
    histograms: Mapping[str, Tensor] = field(default_factory=dict)
    stream: str = ""


@dataclass(frozen=True)
class RunInfo:
    """What a sink needs to open (or resume) its run.

    Checked when made: a wrong type would otherwise fail only when rank 0 opens its sinks,
    after training started.

    Attributes:
        name: Human-readable run name, if any.
        config: Hyper-parameters; nested dicts allowed (sinks flatten them for their backend).
            Kept as a copy of its mappings and lists (nested dicts, an OmegaConf ``DictConfig``
            or ``ListConfig`` with its interpolations resolved), so a later change to the
            caller's config reaches no sink.
        tags: Tags as a mapping of names to values (``{"team": "vision"}``; a value ``""``
            for a tag that is only a name).

    Raises:
        TypeError: If ``name`` is not a str or None, ``config`` not a mapping, or ``tags``
            not a mapping with str keys (a list of tag names included: give
            ``dict.fromkeys(names, "")``).
        ValueError: If two entries of ``config`` flatten to one name (``{"opt.lr": 0.1,
            "opt": {"lr": 0.2}}``): a tracker would keep only one of them; a tag name is
            empty; or the name, a tag, or a key or value of ``config`` cannot be encoded as
            UTF-8 (a lone surrogate, as in a file name read with ``surrogateescape``).
    """

    name: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"name: expected a str or None, got {self.name!r}")
        if not isinstance(self.config, Mapping):
            raise TypeError(
                f"config: expected a mapping of hyper-parameters (nested dicts allowed), got "
                f"{self.config!r}"
            )
        from sidestream.sinks.support import flatten_config

        # Two names for one parameter: refused here, not at open (leaves kept as they are).
        flat = flatten_config(self.config, plain_types=(object,))
        if not isinstance(self.tags, Mapping) or not all(isinstance(k, str) for k in self.tags):
            raise TypeError(
                "tags: expected a mapping of tag names (str) to values, such as "
                f"{{'team': 'vision'}} (for bare names: dict.fromkeys(names, '')), got "
                f"{self.tags!r}"
            )
        if "" in self.tags:
            # A tracker refuses an empty tag (W&B) or key (MLflow) when rank 0 opens.
            raise ValueError(f"tags: a tag name must not be empty, got {dict(self.tags)!r}")
        self._check_encodable(flat)
        # A copy of what was checked: the caller's dict (or Hydra config) may change later,
        # while rank 0's sink thread reads it at open.
        object.__setattr__(self, "config", _copied(self.config))
        object.__setattr__(self, "tags", dict(self.tags))

    def _check_encodable(self, flat_config: Mapping[str, Any]) -> None:
        # Every tracker writes UTF-8: a lone surrogate would fail rank 0's open at every retry.
        if self.name is not None:
            check_encodable("name", self.name)
        for key, value in self.tags.items():
            check_encodable("tags: a tag name", key)
            check_encodable(f"tags[{key!r}]", str(value))
        for key, value in flat_config.items():
            check_encodable("config: a key", key)
            if not isinstance(value, int | float):  # sinks store other values as str(value)
                check_encodable(f"config[{key!r}]", str(value))


def _copied(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config``'s nested mappings as new dicts, and its lists as new lists (see ``_copy``)."""
    return {key: _copy(value) for key, value in config.items()}


def _copy(value: Any) -> Any:
    """``value`` as ``_copied`` keeps it: mappings and mutable sequences copied, all else as is.

    Lists too, not mappings alone: a list of the caller's (``betas``, ``milestones``) changed
    later reached the sinks changed, and an OmegaConf ``ListConfig`` kept a reference to its
    whole config, read at open with an interpolation in it unresolved (``"[0.9, '${lr}']"``).
    A ``ListConfig``'s items are resolved as it is read, as a ``DictConfig``'s are.
    """
    if isinstance(value, Mapping):
        return _copied(value)
    if isinstance(value, MutableSequence):
        return [_copy(item) for item in value]
    return value


class Sink(abc.ABC):
    """A destination for reports (a tracker, a file, the console).

    Lifecycle, all on the sink's own thread on rank 0: optionally ``load_state_dict`` (resume
    from a checkpoint), ``open`` once, ``write`` per report (or ``write_batch`` for several,
    when ``max_batch`` > 1), ``flush`` when asked, ``close`` once. Steps increase within each
    ``Report.stream``; reports of different streams arrive in the order they finished. A
    report counts as delivered once ``write`` returns, so ``write`` returns only when the
    backend has it. ``write`` may raise: the pipeline retries transient errors with backoff and
    keeps the report until it is delivered; permanent ones (``is_permanent``: ``ImportError``,
    ``TypeError``, ``ValueError``, an HTTP 4xx other than 408/429, ...) mark the sink failed.
    Sinks are never opened on other ranks. Tracker sinks that keep a run derive from
    ``sidestream.sinks.TrackerSink``, which does the per-stream resume bookkeeping.
    """

    #: Short name used in messages and as the entry-point name (``"jsonl"``, ``"mlflow"``).
    name: str = "sink"

    #: Most reports one ``write_batch`` call may get. With 1 (the default) the pipeline only
    #: calls ``write``; a sink whose backend takes many values per request (MLflow) sets more,
    #: so a backlog after an outage goes out in a few requests instead of one per report.
    #: It needs a ``write_batch`` of the sink's own: with the default one, reports come one at
    #: a time (``batch_size``), so a retry after a failure part-way never writes one twice.
    max_batch: int = 1

    @abc.abstractmethod
    def open(self, run: RunInfo) -> None:
        """Create or resume the run. Called once before the first ``write``."""

    @abc.abstractmethod
    def write(self, report: Report) -> None:
        """Deliver one report. Raise on failure; the pipeline retries it."""

    def write_batch(self, reports: Sequence[Report]) -> None:
        """Deliver consecutive reports (at most ``max_batch``, in delivery order) at once.

        Raise on failure: the pipeline retries the same batch, so a sink must not repeat what
        an earlier attempt delivered. Only called for a sink that overrides it (see
        ``max_batch``); the default writes them one by one.
        """
        for report in reports:
            self.write(report)

    def flush(self, timeout: float | None = None) -> bool:
        """Push buffered data out; return whether it finished within ``timeout`` seconds."""
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush and release the backend; return whether it finished within ``timeout``."""
        return self.flush(timeout)

    def leave_unfinished(self) -> None:
        """Let the next ``close`` leave the backend's run unfinished (the default: no-op).

        Called before a close when reports this sink was given are kept elsewhere for a replay
        (its pipeline gave up or failed, a replay stopped short): a tracker that marks a run
        as finished at close (MLflow) leaves it running instead, since it lacks them. A later
        ``open`` (a replay, a resumed job) continues it.
        """
        return None

    def keep_run_status(self) -> None:
        """Let the next ``open`` and ``close`` leave the run's status alone (default: no-op).

        Called before ``open`` by a replay of a spool file whose job never closed (no state
        file beside it: the job crashed or was killed). How that job ended is unknown, and a
        resumed job may be running its run, or may have ended it already: a tracker that keeps
        a run status (MLflow) neither sets it back to running at open nor ends it at close.
        """
        return None

    def pending_reports(self) -> list[Report]:
        """Reports ``write`` took that the backend may not hold yet (none by default).

        A runner whose close fails or runs out of time keeps them in its spool with the reports
        it still queues (a ``ProcessSink``: those sent to a child since its last flush).
        """
        return []

    def written_place(self) -> tuple[type, str, str] | None:
        """``(sink class, option name, real path)`` of the file or folder this sink writes.

        ``None`` (the default) for a sink that writes no named place. Two sinks of one run with
        the same place would interleave or repeat it, so a run refuses them.
        """
        return None

    def replay_options(self) -> dict[str, Any]:
        """Options (as ``sinks_from_config`` takes them) that name this sink's backend.

        Kept beside a spool file this sink's close keeps, so the replay command given only
        ``--sink`` delivers where the job did (MLflow's tracking URI, W&B's project). Plain
        JSON values, no secrets (a password hidden as ``***``). The default: none.
        """
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed job needs to continue the same run (run id, last delivered step).

        Keep the keys the same before ``open`` as after, and hold values whose keys vary
        (streams) in lists, not mappings: ``torch.distributed.checkpoint`` loads only the keys
        the state has at load time, before the sink opens.
        """
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore ``state_dict`` before ``open`` so ``open`` resumes the saved run."""
        del state_dict  # a sink without run identity has nothing to restore


def batch_size(sink: Sink) -> int:
    """Reports per delivery call: ``max_batch`` for a sink with its own ``write_batch``, else 1.

    The default ``write_batch`` writes one by one and cannot tell a retry from a new batch:
    retried whole after a failure part-way, it would write the reports before the failure
    again (and a batch that fails somewhere each time would never get through).
    """
    own = getattr(type(sink), "write_batch", Sink.write_batch) is not Sink.write_batch
    return int(getattr(sink, "max_batch", 1)) if own else 1
