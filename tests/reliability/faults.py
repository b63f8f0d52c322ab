"""Sinks and counters shared by the reliability tests and the docs/reliability.md generator."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable

from sidestream.sinks import Report, RunInfo, Sink


class GatedSink(Sink):
    """Writes only while ``gate`` is set, so a test decides when the queue backs up."""

    name = "gated"

    def __init__(self, name: str = "gated") -> None:
        self.name = name
        self.gate = threading.Event()
        self.steps: list[int] = []
        self.reports: list[Report] = []

    def open(self, run: RunInfo) -> None:
        del run

    def write(self, report: Report) -> None:
        if not self.gate.wait(30.0):
            raise TimeoutError("gate never opened")
        self.steps.append(report.step)
        self.reports.append(report)


class SlowSink(GatedSink):
    """Sleeps ``delay_s`` per write."""

    def __init__(self, delay_s: float, name: str = "slow") -> None:
        super().__init__(name)
        self.gate.set()
        self.delay_s = delay_s

    def write(self, report: Report) -> None:
        time.sleep(self.delay_s)
        super().write(report)


def tally(expected: Iterable[int], delivered: Iterable[int]) -> dict[str, int]:
    """Delivered / lost / duplicated steps of one sink against the steps that were expected."""
    want = set(expected)
    counts = Counter(delivered)
    return {
        "delivered": len(want & set(counts)),
        "lost": len(want - set(counts)),
        "duplicated": sum(n - 1 for step, n in counts.items() if n > 1 and step in want),
        "unexpected": sum(n for step, n in counts.items() if step not in want),
    }


def listening_addresses(port: int) -> set[str]:
    """Local addresses of sockets in LISTEN state on ``port`` (from /proc/net/tcp*)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as file:
            next(file)
            for line in file:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found
