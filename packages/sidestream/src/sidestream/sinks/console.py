"""A readable line per report on the console."""

from __future__ import annotations

import math
import sys
from typing import TextIO

from sidestream.sinks.base import Report, RunInfo, Sink

__all__ = ["ConsoleSink"]


class ConsoleSink(Sink):
    """Print ``step 120 | train/loss 0.4321 | train/acc 0.912`` per report.

    Args:
        stream: Where to print (``sys.stdout`` by default, looked up when the sink opens).
        every: Print one report in ``every`` (the latest values; the others are skipped, as a
            progress display would).
        max_values: Show at most this many values per line, then ``... (+N more)``.
        digits: Significant digits per value.
    """

    name = "console"

    def __init__(
        self,
        stream: TextIO | None = None,
        every: int = 1,
        max_values: int = 12,
        digits: int = 4,
    ) -> None:
        if every < 1:
            raise ValueError(f"every: expected >= 1, got {every}")
        if max_values < 1:
            raise ValueError(f"max_values: expected >= 1, got {max_values}")
        self._stream = stream
        self._every = every
        self._max_values = max_values
        self._digits = digits
        self._seen = 0

    def open(self, run: RunInfo) -> None:
        """Print the run name, if any."""
        if self._stream is None:
            self._stream = sys.stdout
        if run.name:
            print(f"run {run.name}", file=self._stream, flush=True)

    def write(self, report: Report) -> None:
        """Print one line (one in ``every`` reports)."""
        self._seen += 1
        if (self._seen - 1) % self._every:
            return
        print(self.format(report), file=self._stream, flush=True)

    def format(self, report: Report) -> str:
        """The line printed for ``report``."""
        items = list(report.values.items())
        parts = [f"step {report.step}"]
        parts += [f"{name} {self._number(value)}" for name, value in items[: self._max_values]]
        if len(items) > self._max_values:
            parts.append(f"... (+{len(items) - self._max_values} more)")
        return " | ".join(parts)

    def _number(self, value: float) -> str:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return f"{value:.{self._digits}g}"
