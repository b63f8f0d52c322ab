"""The ``reliability`` marker: heavy fault runs, skipped unless SIDESTREAM_RELIABILITY=1.

``nox -s reliability`` runs their full versions (and writes docs/reliability.md); set the
variable to run these tests with pytest too.
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "reliability: heavy fault run; needs SIDESTREAM_RELIABILITY=1 (not in CI)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("SIDESTREAM_RELIABILITY") == "1":
        return
    skip = pytest.mark.skip(reason="heavy: set SIDESTREAM_RELIABILITY=1 or run nox -s reliability")
    for item in items:
        if item.get_closest_marker("reliability") is not None:
            item.add_marker(skip)
