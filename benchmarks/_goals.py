"""Issue 12's goals, each stated under the table whose figures decide it, met or not.

A goal is a bound on a ratio or a time; the line names the figure measured in the same run, so
the page says both what was aimed for and whether this run reached it.
"""

from __future__ import annotations

__all__ = ["goal_line"]


def goal_line(goal: str, figure: str, met: bool) -> str:
    """One markdown bullet: ``goal``, the measured ``figure`` and the verdict."""
    return f"- {goal}: {figure}. {'Met' if met else '**Not met**'}."
