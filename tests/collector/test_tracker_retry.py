"""Resume into a backend that has some values: a failed send, retried, sends nothing twice."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from sidestream.sinks import Report
from sidestream.sinks.tracker import TrackerSink


class _Flaky(TrackerSink):
    """A backend that fails its first send and records every value it accepts."""

    name = "flaky"

    def __init__(self) -> None:
        super().__init__()
        self.failures = 1
        self.received: list[tuple[int, list[str]]] = []

    def open(self, run: object) -> None:
        del run

    def send(self, reports: Sequence[Report]) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("backend down")
        self.received += [(report.step, sorted(report.values)) for report in reports]


def test_a_retried_batch_skips_what_the_backend_holds() -> None:
    # The backend holds x up to step 7. The batch's step-8 report used to make the sink forget
    # x before the send was known to work, so the retry sent x at step 5 a second time.
    sink = _Flaky()
    sink.found_values_in_backend({"x": 7})
    batch = [
        Report(step=5, values={"x": 5.0, "y": 5.0}, time=0.0),
        Report(step=8, values={"x": 8.0, "y": 8.0}, time=0.0),
    ]
    with pytest.raises(ConnectionError):
        sink.write_batch(batch)
    sink.write_batch(batch)  # the runner's retry: the same batch
    assert sink.received == [(5, ["y"]), (8, ["x", "y"])]
    sink.write_batch([Report(step=9, values={"x": 9.0}, time=0.0)])
    assert sink.received[-1] == (9, ["x"])


def test_a_backend_call_given_no_time_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A close after the pipeline gave up (no time left) warned "did not end within 0.0 s",
    a second timeout figure next to the run's own close warning."""
    import logging
    import threading

    release = threading.Event()
    sink = _Flaky()
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        assert not sink.within(release.wait, 0.0, "close")
        assert not sink.within(release.wait, 0.05, "flush")
    release.set()
    assert "_Flaky: close had no time left (its caller's timeout had run out)" in caplog.text
    assert "within 0.0 s" not in caplog.text
    assert "_Flaky: flush did not end within 0.05 s" in caplog.text
