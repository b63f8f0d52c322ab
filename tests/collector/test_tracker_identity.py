"""A tracker sink's ``identity`` needs a setter: ``load_state_dict`` sets the resumed run's.

docs/sinks.md showed a read-only ``identity`` property. ``mypy --strict`` refused it ("Read-only
property cannot override read-write property"), and at run time the resume failed at
``self.identity = ...`` with ``AttributeError: property 'identity' ... has no setter``, after
the skipped values and extra state were loaded already.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from sidestream.sinks import Report, RunInfo, TrackerSink


class ReadOnlyIdentity(TrackerSink):
    name = "read-only"
    identity_key = "run_id"

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, int]] = []
        self.extra_loaded: list[Mapping[str, Any]] = []

    @property
    def identity(self) -> str | None:  # type: ignore[override]  # the mistake under test
        return "run-1"

    def open(self, run: RunInfo) -> None:
        pass

    def send(self, reports: Sequence[Report]) -> None:
        self.rows += [(report.stream, report.step) for report in reports]

    def load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        self.extra_loaded.append(state_dict)


def test_a_read_only_identity_is_named_before_the_state_changes() -> None:
    sink = ReadOnlyIdentity()
    sink.open(RunInfo())
    sink.write(Report(step=10, values={"x": 1.0}, time=0.0, stream="train"))
    state = sink.state_dict()

    resumed = ReadOnlyIdentity()
    with pytest.raises(TypeError, match=r"ReadOnlyIdentity\.identity: a property without a setter"):
        resumed.load_state_dict(state)
    assert resumed.extra_loaded == []  # nothing loaded: the sink starts as it was
    resumed.open(RunInfo())
    resumed.write(Report(step=10, values={"x": 1.0}, time=0.0, stream="train"))
    assert resumed.rows == [("train", 10)]  # no steps taken from the refused state


class WithSetter(ReadOnlyIdentity):
    """As docs/sinks.md now shows: the setter keeps the identity for ``open``."""

    run_id: str | None = None

    @property
    def identity(self) -> str | None:
        return self.run_id

    @identity.setter
    def identity(self, value: str | None) -> None:
        self.run_id = value


def test_an_identity_with_a_setter_resumes() -> None:
    sink = WithSetter()
    sink.run_id = "run-7"
    sink.write(Report(step=10, values={"x": 1.0}, time=0.0, stream="train"))
    resumed = WithSetter()
    resumed.load_state_dict(sink.state_dict())
    assert resumed.identity == "run-7"
    resumed.write(Report(step=10, values={"x": 1.0}, time=0.0, stream="train"))
    resumed.write(Report(step=20, values={"x": 1.0}, time=0.0, stream="train"))
    assert resumed.rows == [("train", 20)]  # the delivered step skipped
