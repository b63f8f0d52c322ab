"""The TensorBoard sink: event files in one log directory per training job."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sidestream.sinks import Report, RunInfo, Sink
from sidestream.sinks.support import (
    call_within,
    flatten_config,
    histogram_edges,
    parse_resume_state,
)

__all__ = ["TensorBoardSink"]

_log = logging.getLogger(__name__)

_HPARAM_TYPES = (bool, int, float, str)


class TensorBoardSink(Sink):
    """Writes every report to TensorBoard event files with ``SummaryWriter``.

    ``open`` creates the writer on ``log_dir`` and, for a new run, records the flattened
    hyper-parameters in TensorBoard's HPARAMS tab (values it cannot show become strings) and
    the tags as a text summary. ``write`` adds each value with ``add_scalar`` and each histogram
    (bin counts) with ``add_histogram_raw`` at the report's step and wall time. Nothing is
    flushed per step: the writer flushes every ``flush_secs`` and on ``flush`` / ``close``.

    Resume: ``state_dict()`` holds the log directory and the last delivered step; after
    ``load_state_dict`` the next ``open`` appends a new event file to the same directory and
    skips reports at or below that step (or the largest step already in the directory, if
    later), so TensorBoard never sees a step twice.

    Args:
        log_dir: The run's directory; ``None`` takes the saved one on resume, else
            SummaryWriter's default (``runs/<date>_<host>``).
        histogram_edges: Bin edges per histogram name (``num_bins + 1`` values); bins without
            edges span ``[i, i + 1)``.
        **writer_kwargs: Passed to ``SummaryWriter`` under its own names (``flush_secs``,
            ``max_queue``, ``filename_suffix``).

    Example:
        >>> sink = TensorBoardSink(log_dir="runs/demo")
    """

    name = "tensorboard"

    def __init__(
        self,
        log_dir: str | os.PathLike[str] | None = None,
        *,
        histogram_edges: Mapping[str, Sequence[float]] | None = None,
        **writer_kwargs: Any,
    ) -> None:
        self._log_dir = None if log_dir is None else os.fspath(log_dir)
        self._histogram_edges = dict(histogram_edges or {})
        self._writer_kwargs = writer_kwargs
        self._writer: Any = None
        self._last_step: int | None = None
        self._resumed = False
        # Progress through the report being written: its step and how many entries went out.
        self._pending_step: int | None = None
        self._entries_done = 0
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"TensorBoardSink(log_dir={self._log_dir!r})"

    @property
    def log_dir(self) -> str | None:
        """The run's directory (known once opened, given, or loaded from a state dict)."""
        return self._log_dir

    def open(self, run: RunInfo) -> None:
        """Create the writer; for a new run, record hyper-parameters and tags."""
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=self._log_dir, **self._writer_kwargs)
        self._log_dir = str(self._writer.log_dir)
        if self._resumed:
            # Reports delivered after the checkpoint was taken are already in the directory.
            on_disk = _last_step_on_disk(self._log_dir)
            if on_disk is not None and (self._last_step is None or on_disk > self._last_step):
                self._last_step = on_disk
            return
        if run.config:
            self._write_hparams(flatten_config(run.config, plain_types=_HPARAM_TYPES))
        if run.tags:
            lines = [f"| {key} | {value} |" for key, value in run.tags.items()]
            self._writer.add_text("tags", "\n".join(["| tag | value |", "|---|---|", *lines]), 0)
        if run.name:
            self._writer.add_text("run_name", run.name, 0)

    def _write_hparams(self, hparams: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # Written into this run's own event file (SummaryWriter.add_hparams would open a
        # separate sub-run directory for them).
        summaries = hparams_summary(hparams, {})  # type: ignore[no-untyped-call]
        file_writer = self._writer._get_file_writer()
        for summary in summaries:
            file_writer.add_summary(summary)

    def write(self, report: Report) -> None:
        """Add the report's scalars and histograms at its step (skipped if already delivered).

        Raises:
            RuntimeError: If the sink is not open. Entries written before a failure are not
                written again when the same report is retried.
        """
        if self._writer is None:
            raise RuntimeError("TensorBoardSink.write: call open() first")
        if self._last_step is not None and report.step <= self._last_step:
            return
        if self._pending_step != report.step:
            self._pending_step, self._entries_done = report.step, 0
        entries: list[tuple[str, Any]] = [*report.values.items(), *report.histograms.items()]
        num_values = len(report.values)
        while self._entries_done < len(entries):
            index = self._entries_done
            tag, value = entries[index]
            if index < num_values:
                self._writer.add_scalar(
                    tag, float(value), global_step=report.step, walltime=report.time
                )
            else:
                self._add_histogram(tag, value, report)
            self._entries_done += 1
        self._last_step, self._pending_step = report.step, None

    def _add_histogram(self, tag: str, counts: Any, report: Report) -> None:
        if counts.dim() != 1 or counts.numel() == 0:
            self._warn_once(
                tag,
                f"TensorBoardSink: histogram {tag!r} skipped: expected 1-D bin counts, got "
                f"shape {tuple(counts.shape)}",
            )
            return
        bin_counts = counts.detach().double().cpu()
        try:
            edges = histogram_edges(bin_counts.numel(), self._histogram_edges.get(tag))
        except ValueError as error:
            self._warn_once(tag, f"TensorBoardSink: histogram {tag!r} skipped: {error}")
            return
        centers = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
        weights = bin_counts.tolist()
        occupied = [i for i, weight in enumerate(weights) if weight > 0]
        total = sum(weights)
        # Samples are known only by bin: min / max are the outer edges of the occupied bins and
        # the sums use bin centres.
        self._writer.add_histogram_raw(
            tag,
            min=edges[occupied[0]] if occupied else edges[0],
            max=edges[occupied[-1] + 1] if occupied else edges[0],
            num=total,
            sum=sum(w * c for w, c in zip(weights, centers, strict=True)),
            sum_squares=sum(w * c * c for w, c in zip(weights, centers, strict=True)),
            bucket_limits=edges[1:],
            bucket_counts=weights,
            global_step=report.step,
            walltime=report.time,
        )

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            _log.warning("%s", message)

    def flush(self, timeout: float | None = None) -> bool:
        """Write pending events to disk; return whether that ended within ``timeout`` s."""
        if self._writer is None:
            return True
        return _within(self._writer.flush, timeout, "flush")

    def close(self, timeout: float | None = None) -> bool:
        """Flush and close the event file; return whether that ended within ``timeout`` s."""
        if self._writer is None:
            return True
        writer, self._writer = self._writer, None
        return _within(writer.close, timeout, "close")

    def state_dict(self) -> dict[str, Any]:
        """``{"log_dir", "last_step"}``: enough to continue the same directory."""
        return {"log_dir": self._log_dir, "last_step": self._last_step}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the saved directory (unless ``log_dir`` was given) at the next ``open``.

        Raises:
            ValueError: If ``state_dict`` lacks ``log_dir`` / ``last_step`` or has wrong types.
        """
        log_dir, last_step = parse_resume_state(state_dict, "log_dir", "TensorBoardSink")
        if self._log_dir is None:
            self._log_dir = log_dir
        self._last_step = last_step
        self._resumed = True


def _within(action: Any, timeout: float | None, what: str) -> bool:
    finished, error = call_within(action, timeout, f"sidestream-tensorboard-{what}")
    if not finished:
        _log.warning("TensorBoardSink.%s did not end within %s s", what, timeout)
        return False
    if error is not None:
        _log.warning("TensorBoardSink.%s failed: %s", what, error)
        return False
    return True


def _last_step_on_disk(log_dir: str) -> int | None:
    """The largest step of a scalar or histogram in the event files of ``log_dir``, if any."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    last: int | None = None
    for path in sorted(Path(log_dir).glob("*tfevents*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            if event.step <= (-1 if last is None else last):
                continue
            # Only what write() adds counts, not the hparams / text summaries of open().
            values = event.summary.value
            if any(v.HasField("simple_value") or v.HasField("histo") for v in values):
                last = int(event.step)
    return last
