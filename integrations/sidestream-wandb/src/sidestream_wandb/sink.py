"""The Weights & Biases sink: one W&B run per training job, one history row per report."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sidestream.sinks import Report, RunInfo, Sink
from sidestream.sinks.support import (
    call_within,
    flatten_config,
    histogram_edges,
    parse_resume_state,
    redact,
    secrets_in,
    shorten,
)

__all__ = ["WandbSink"]

_log = logging.getLogger(__name__)

_SECRET_ENV = ("WANDB_API_KEY",)
_MAX_TAG_LENGTH = 64  # W&B rejects longer tags
_MAX_HISTOGRAM_BINS = 512  # wandb.Histogram's limit


class WandbSink(Sink):
    """Logs every report as one W&B history row at the report's step.

    ``open`` starts the run with ``wandb.init`` (its own run object, ``reinit="create_new"``,
    so a run the user started with ``wandb.init`` is left alone): the ``RunInfo`` name, its
    flattened hyper-parameters as the config and its tags as ``key:value`` W&B tags. ``write``
    logs scalars as they are and histograms (bin counts) as ``wandb.Histogram``. A step at or
    below the last delivered one is skipped: W&B itself drops steps that go backwards.

    Resume: ``state_dict()`` holds the run id and the last delivered step; after
    ``load_state_dict`` the next ``open`` passes that id with ``resume="allow"``. Online this
    continues the same run on the server. Offline, W&B writes a new ``offline-run-*-<id>``
    directory with the same run id; ``wandb sync`` the directories in order to join them.

    Args:
        project: W&B project.
        histogram_edges: Bin edges per histogram name (``num_bins + 1`` values); bins without
            edges span ``[i, i + 1)``.
        **init_kwargs: Passed to ``wandb.init`` under W&B's own names (``mode``, ``dir``,
            ``entity``, ``name``, ``id``, ``group``, ``settings``, ...). ``name``, ``config``
            and ``tags`` given here override / extend those from ``RunInfo``.

    Example:
        >>> sink = WandbSink(project="demo", mode="offline", dir="/tmp/wandb-demo")
    """

    name = "wandb"

    def __init__(
        self,
        project: str | None = None,
        *,
        histogram_edges: Mapping[str, Sequence[float]] | None = None,
        **init_kwargs: Any,
    ) -> None:
        self._init_kwargs = dict(init_kwargs)
        if project is not None:
            self._init_kwargs["project"] = project
        self._histogram_edges = dict(histogram_edges or {})
        self._run: Any = None
        self._run_id: str | None = self._init_kwargs.pop("id", None)
        self._last_step: int | None = None
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return (
            f"WandbSink(project={self._init_kwargs.get('project')!r}, "
            f"mode={self._init_kwargs.get('mode')!r}, run_id={self._run_id!r})"
        )

    @property
    def run_id(self) -> str | None:
        """The W&B run id once opened (or given / loaded from a state dict)."""
        return self._run_id

    @property
    def run_dir(self) -> str | None:
        """The local directory of the open run (where an offline run's ``.wandb`` file is)."""
        return None if self._run is None else str(self._run.dir).removesuffix("/files")

    def _failure(self, what: str, error: BaseException) -> RuntimeError:
        message = redact(f"{type(error).__name__}: {error}", secrets_in(_SECRET_ENV))
        return RuntimeError(f"WandbSink: {what} failed: {message}")

    def open(self, run: RunInfo) -> None:
        """Start the run, or continue the one from ``load_state_dict`` / ``id=``.

        Raises:
            RuntimeError: If ``wandb.init`` failed (message redacted of the API key).
        """
        import wandb

        kwargs = dict(self._init_kwargs)
        if run.name is not None:
            kwargs.setdefault("name", run.name)
        config = flatten_config(run.config)
        config.update(flatten_config(kwargs.pop("config", None) or {}))
        tags = [shorten(f"{k}:{v}" if v else str(k), _MAX_TAG_LENGTH) for k, v in run.tags.items()]
        tags += list(kwargs.pop("tags", None) or [])
        if self._run_id is not None:
            kwargs["id"] = self._run_id
            kwargs.setdefault("resume", "allow")
        kwargs.setdefault("reinit", "create_new")
        failure: RuntimeError | None = None
        try:
            self._run = wandb.init(config=config, tags=tags or None, **kwargs)
        except Exception as error:
            failure = self._failure("wandb.init", error)
        if failure is not None:
            raise failure  # outside the handler: the original is not chained as its context
        self._run_id = str(self._run.id)
        # Online, a resumed run starts after the last step the server holds, which may be
        # later than the checkpoint's; W&B would drop anything at or below it.
        next_step = int(getattr(self._run, "step", 0) or 0)
        if next_step > 0:
            self._last_step = max(next_step - 1, -1 if self._last_step is None else self._last_step)

    def write(self, report: Report) -> None:
        """Log the report as one history row at ``report.step`` (skipped if already delivered).

        Raises:
            RuntimeError: If the sink is not open or ``run.log`` failed (redacted message).
        """
        if self._run is None:
            raise RuntimeError("WandbSink.write: call open() first")
        if self._last_step is not None and report.step <= self._last_step:
            return
        import wandb

        row: dict[str, Any] = dict(report.values)
        for name, counts in report.histograms.items():
            histogram = self._histogram(wandb, name, counts)
            if histogram is not None:
                row[name] = histogram
        failure: RuntimeError | None = None
        try:
            self._run.log(row, step=report.step, commit=True)
        except Exception as error:
            failure = self._failure(f"log at step {report.step}", error)
        if failure is not None:
            raise failure  # outside the handler: the original is not chained as its context
        self._last_step = report.step

    def _histogram(self, wandb: Any, name: str, counts: Any) -> Any:
        flat = counts.detach().reshape(-1).double().cpu().numpy()
        if counts.dim() != 1 or not 1 <= flat.size <= _MAX_HISTOGRAM_BINS:
            self._warn_once(
                name,
                f"WandbSink: histogram {name!r} skipped: expected 1-D bin counts with 1 to "
                f"{_MAX_HISTOGRAM_BINS} bins, got shape {tuple(counts.shape)}",
            )
            return None
        try:
            edges = histogram_edges(flat.size, self._histogram_edges.get(name))
        except ValueError as error:
            self._warn_once(name, f"WandbSink: histogram {name!r} skipped: {error}")
            return None
        return wandb.Histogram(np_histogram=(flat.tolist(), edges))

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            _log.warning("%s", message)

    def flush(self, timeout: float | None = None) -> bool:
        """W&B hands rows to its own service process at once; nothing to push here."""
        return True

    def close(self, timeout: float | None = None) -> bool:
        """``run.finish()``; return whether it finished within ``timeout`` seconds."""
        if self._run is None:
            return True
        active, self._run = self._run, None
        finished, error = call_within(active.finish, timeout, "sidestream-wandb-close")
        if not finished:
            _log.warning("WandbSink.close: run.finish() did not end within %s s", timeout)
            return False
        if error is not None:
            _log.warning("%s", self._failure("finish", error))
            return False
        return True

    def state_dict(self) -> dict[str, Any]:
        """``{"run_id", "last_step"}``: enough to continue the same run. Never credentials."""
        return {"run_id": self._run_id, "last_step": self._last_step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the saved run at the next ``open``.

        Raises:
            ValueError: If ``state_dict`` lacks ``run_id`` / ``last_step`` or has wrong types.
        """
        run_id, last_step = parse_resume_state(state_dict, "run_id", "WandbSink")
        self._run_id, self._last_step = run_id, last_step
