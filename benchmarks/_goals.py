"""Issue 12's goals, each stated under the table whose figures decide it, met or not.

A goal is a bound on a ratio or a time; the line names the figure measured in the same run, so
the page says both what was aimed for and whether this run reached it.
"""

from __future__ import annotations

import os

__all__ = ["IDLE_LOAD", "START_LOAD", "goal_line", "machine_note", "started_idle"]

START_LOAD = os.getloadavg()[0]
"""The 1-minute load average when the benchmarks were imported, before any of them ran: later
readings include the benchmarks' own earlier processes."""

IDLE_LOAD = 0.5
"""Below this ``START_LOAD`` the machine counts as idle (nothing else was running)."""


def started_idle() -> bool:
    """Whether the machine was idle before the benchmarks started (``START_LOAD``)."""
    return START_LOAD < IDLE_LOAD


def machine_note() -> str:
    """The machine's cores and load before the benchmarks, for a table's description."""
    state = "idle" if started_idle() else "shared and loaded"
    return (
        f"{os.cpu_count()} cores, {state} before the benchmarks (1-minute load average "
        f"{START_LOAD:.1f})"
    )


def goal_line(goal: str, figure: str, met: bool) -> str:
    """One markdown bullet: ``goal``, the measured ``figure`` and the verdict."""
    return f"- {goal}: {figure}. {'Met' if met else '**Not met**'}."
