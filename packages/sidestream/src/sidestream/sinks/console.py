"""Reports on the console: one live line on a terminal, plain lines elsewhere."""

from __future__ import annotations

import math
import shutil
import sys
import time
from typing import TextIO

from sidestream._text import printable
from sidestream._validation import check_int
from sidestream.sinks.base import Report, RunInfo, Sink
from sidestream.sinks.status import PermanentSinkError

__all__ = ["ConsoleSink"]


class ConsoleSink(Sink):
    """Show reports on the console.

    On a terminal (``stream.isatty()``) one line is redrawn in place: the latest step, the
    steps per second and the latest value of every name across all streams, with its own step
    when that is older than the line's
    (``step 120 | 4.1 steps/s | train/loss 0.4321 | val/f1 0.912 @100 | lr 0.0003``). Elsewhere (a
    log file, a pipe, a notebook) every report prints a line of its own
    (``step 120 | train/loss 0.4321 | train/acc 0.912``).

    Args:
        stream: Where to print (``sys.stdout`` by default, looked up when the sink opens).
        every: Print one report in ``every`` of each stream (the latest values; the others
            are skipped, as a progress display would). Plain lines only.
        max_values: Show at most this many values per line, then ``... (+N more)``.
        digits: Significant digits per value.
        live: Redraw one line (``True``), print a line per report (``False``), or decide by
            whether ``stream`` is a terminal (``None``, the default).
    """

    name = "console"

    def __repr__(self) -> str:
        return f"ConsoleSink(every={getattr(self, '_every', 1)})"

    def __init__(
        self,
        stream: TextIO | None = None,
        every: int = 1,
        max_values: int = 12,
        digits: int = 4,
        live: bool | None = None,
    ) -> None:
        check_int("every", every, 1)
        check_int("max_values", max_values, 1)
        check_int("digits", digits, 0)
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(
                f"stream: expected a text stream with write() (sys.stdout, an open file) or None, "
                f"got {stream!r}"
            )
        if live is not None and not isinstance(live, bool):
            raise TypeError(f"live: expected True, False or None, got {live!r}")
        self._stream = stream
        self._every = every
        self._max_values = max_values
        self._digits = digits
        self._live_option = live
        self._live = False
        # Reports seen per stream: one in every ``every`` of each stream prints, so a stream
        # that reports as often as another (a run.log per train window) is not always skipped.
        self._seen: dict[str, int] = {}
        self._latest: dict[str, tuple[float, int]] = {}  # name: (value, its step)
        self._step: int | None = None
        self._first: tuple[int, float] | None = None  # (step, time) of the first report
        self._rate: float | None = None
        self._drawn = False

    def open(self, run: RunInfo) -> None:
        """Print the run name, if any; decide between a live line and plain lines.

        Raises:
            PermanentSinkError: If the output is a pipe whose reader has exited, or there is no
                ``sys.stdout`` (a process started with its standard output closed).
        """
        if self._stream is None:
            if sys.stdout is None:
                # Python sets it to None for a closed fd 1 (`exec 1>&-`, some daemons). The
                # write's check then raised AssertionError (retried until close ran out of
                # time, and under -O an AttributeError): nothing can ever be printed.
                raise PermanentSinkError(
                    "ConsoleSink: sys.stdout is None (the process started with its standard "
                    "output closed); it prints nothing. Give it stream=, or leave it out"
                )
            self._stream = sys.stdout
        if self._live_option is None:
            isatty = getattr(self._stream, "isatty", None)
            self._live = bool(isatty()) if callable(isatty) else False
        else:
            self._live = self._live_option
        if run.name:
            self._print(f"run {printable(run.name)}")

    def write(self, report: Report) -> None:
        """Redraw the live line, or print one line (one in ``every`` reports).

        Raises:
            PermanentSinkError: If the output is a pipe whose reader has exited (``| head``):
                no later line could be printed, so there is nothing to retry or keep.
        """
        self._write(report)

    def _write(self, report: Report) -> None:
        if self._live:
            self._update(report, time.monotonic())
            self._draw()
            return
        seen = self._seen[report.stream] = self._seen.get(report.stream, 0) + 1
        if (seen - 1) % self._every:
            return
        self._print(self.format(report))

    def _print(self, line: str) -> None:
        # One write with its newline: print() writes the text and the newline apart, and a
        # print of the training thread could land between them.
        self._emit(line + "\n")

    def _emit(self, text: str) -> None:
        """Write ``text`` and flush: the one place the sink touches its stream.

        A character the stream's encoding lacks (a name such as "λ" on an ASCII or cp1252
        console) is escaped, not an error that ends the sink; a closed pipe ends it for good.
        """
        assert self._stream is not None
        try:
            try:
                self._stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(self._stream, "encoding", None) or "ascii"
                self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
            self._stream.flush()
        except BrokenPipeError:
            raise PermanentSinkError(
                "ConsoleSink: its output was closed (the reader of the pipe exited); "
                "it prints nothing more"
            ) from None

    def format(self, report: Report) -> str:
        """The plain line printed for ``report``."""
        return self._line([f"step {report.step}"], list(report.values.items()))

    def live_line(self) -> str:
        """The live line as it stands: latest step, steps per second, latest values.

        A value logged at an earlier step than the line's (a validation window, a stream that
        logs less often) shows its step after it: ``val/f1 0.912 @100``.
        """
        parts = [f"step {self._step}"]
        if self._rate is not None:
            parts.append(f"{self._rate:.3g} steps/s")
        items = [(name, value) for name, (value, _) in self._latest.items()]
        steps = [step for _, step in self._latest.values()]
        return self._line(parts, items, steps)

    def close(self, timeout: float | None = None) -> bool:
        """End the live line with a newline."""
        if self._drawn and self._stream is not None:
            self._drawn = False
            try:
                print(file=self._stream, flush=True)
            except BrokenPipeError:
                return False
        return True

    def _update(self, report: Report, now: float) -> None:
        for name, value in report.values.items():
            self._latest[name] = (value, report.step)
        if self._step is None or report.step > self._step:
            self._step = report.step
            if self._first is None:
                self._first = (report.step, now)
            elif now > self._first[1]:
                self._rate = (report.step - self._first[0]) / (now - self._first[1])

    def _draw(self) -> None:
        assert self._stream is not None
        width = shutil.get_terminal_size((120, 24)).columns
        line = self.live_line()
        if len(line) >= width:
            line = line[: max(0, width - 4)] + "..."
        # Carriage return, the line, then clear what a longer previous line left behind.
        self._emit(f"\r{line}\x1b[K")
        self._drawn = True

    def _line(
        self, parts: list[str], items: list[tuple[str, float]], steps: list[int] | None = None
    ) -> str:
        """``parts``, then ``name value`` per item; ``@step`` after one older than the line."""
        parts = list(parts)
        for index, (name, value) in enumerate(items[: self._max_values]):
            # Escaped: a newline in a name broke the report's line in two (and the live line
            # into a new line per redraw), an escape sequence recoloured the console.
            text = f"{printable(name)} {self._number(value)}"
            if steps is not None and self._step is not None and steps[index] < self._step:
                text += f" @{steps[index]}"
            parts.append(text)
        if len(items) > self._max_values:
            parts.append(f"... (+{len(items) - self._max_values} more)")
        return " | ".join(parts)

    def _number(self, value: float) -> str:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return f"{value:.{self._digits}g}"
