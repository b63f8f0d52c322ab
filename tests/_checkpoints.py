"""Checkpoint helpers for tests that look at a metric's states by name."""

from __future__ import annotations

from typing import Any

from sidestream.metric import DTYPES_KEY


def states_only(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` without the dtype record ``Metric.state_dict`` adds next to the states."""
    return {key: value for key, value in saved.items() if key != DTYPES_KEY}
