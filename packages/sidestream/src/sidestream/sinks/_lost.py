"""Which steps a sink lost: the messages that count dropped reports name them."""

from __future__ import annotations

from collections.abc import Iterable

from sidestream.sinks.base import Report

__all__ = ["LostSteps"]


class LostSteps:
    """The lowest and highest step of the reports lost in each stream, and how many.

    Three integers per stream however many reports are lost: an operator reads which steps
    are missing from a tracker (and whether they are a contiguous stretch) without the
    library keeping every lost step.
    """

    def __init__(self) -> None:
        self._streams: dict[str, list[int]] = {}  # stream: [lowest, highest, count]

    def add(self, stream: str, step: int) -> None:
        """Note one lost report of ``stream`` at ``step``."""
        self._note(stream, step, step, 1)

    def add_reports(self, reports: Iterable[Report]) -> None:
        """Note each of ``reports`` as lost."""
        for report in reports:
            self.add(report.stream, report.step)

    @classmethod
    def union(cls, *records: LostSteps) -> LostSteps:
        """A new record of the reports lost in every one of ``records``."""
        both = cls()
        for record in records:
            # A copy: another thread may note a new stream meanwhile.
            for stream, (low, high, count) in list(record._streams.items()):
                both._note(stream, low, high, count)
        return both

    def _note(self, stream: str, low: int, high: int, count: int) -> None:
        seen = self._streams.setdefault(stream, [low, high, 0])
        seen[0], seen[1] = min(seen[0], low), max(seen[1], high)
        seen[2] += count

    def describe(self) -> str:
        """``"train: 31 between steps 10 and 40; val: step 12"``; ``Run.log`` for its values.

        Empty when nothing was noted.
        """
        parts = []
        for stream, (low, high, count) in sorted(self._streams.items()):
            name = stream or "Run.log"
            if count == 1:
                parts.append(f"{name}: step {low}")
            elif low == high:
                parts.append(f"{name}: {count} at step {low}")
            else:
                parts.append(f"{name}: {count} between steps {low} and {high}")
        return "; ".join(parts)
