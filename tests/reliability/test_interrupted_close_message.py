"""A close cut short by an interrupt (Ctrl-C, a SIGTERM handler's SystemExit) says so.

Found by a new user's 2-rank torchrun job logging to W&B, MLflow and TensorBoard: when rank 1
died, torchrun's SIGTERM (turned into `sys.exit(143)` as docs/runs.md recommends) interrupted
rank 0's `with Run(...)` close a few seconds in, and the log said "sink 'mlflow': every report
was delivered, but flushing and closing the sink did not finish within 30.0 s of close" (and
`run.sink_status` the same): the close's timeout, which never ran out, sent the user looking
for a 30 s hang of the tracker. `Run.close` begins every runner's close with its timeout, then
closes them one by one; an interrupt during one of them makes it `close_now` every runner.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import pytest

from sidestream.sinks import Report, RunInfo, Sink, SinkRunner
from tests.reliability.interrupts import alarm_interrupts


class _SlowToClose(Sink):
    """Delivers at once; its close waits for ``gate`` (a tracker's finish taking a while)."""

    name = "slowclose"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.closing = threading.Event()
        self.steps: list[int] = []

    def open(self, run: RunInfo) -> None:
        del run

    def write(self, report: Report) -> None:
        self.steps.append(report.step)

    def close(self, timeout: float | None = None) -> bool:
        del timeout
        self.closing.set()
        self.gate.wait(30.0)
        return True


def test_close_now_after_an_interrupted_close_names_the_interrupt_not_the_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = _SlowToClose()
    runner = SinkRunner(sink, capacity=16, spool_dir=tmp_path)
    runner.start()
    try:
        for step in range(1, 4):
            runner.submit(Report(step=step, values={"x": float(step)}, time=time.time()))
        runner.begin_close(30.0)  # as Run.close does for every sink first
        assert sink.closing.wait(20.0)  # the sink is in its close, every report delivered
        assert sink.steps == [1, 2, 3]
        with caplog.at_level(logging.WARNING, logger="sidestream"):
            started = time.monotonic()
            assert runner.close_now() is False  # the interrupt came 0.x s into a 30 s close
            assert time.monotonic() - started < 5.0
    finally:
        sink.gate.set()
    said = [m for m in (r.getMessage() for r in caplog.records) if "every report was" in m]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "interrupted" in said[0] and "30.0 s" not in said[0], said[0]
    status = runner.status
    assert status.state == "failed"
    assert status.last_error is not None
    assert "interrupted" in status.last_error and "30.0 s" not in status.last_error


def test_a_close_whose_timeout_ran_out_still_names_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = _SlowToClose()
    runner = SinkRunner(sink, capacity=16, spool_dir=tmp_path)
    runner.start()
    try:
        runner.submit(Report(step=1, values={"x": 1.0}, time=time.time()))
        with caplog.at_level(logging.WARNING, logger="sidestream"):
            assert runner.close(0.5) is False
    finally:
        sink.gate.set()
    said = [m for m in (r.getMessage() for r in caplog.records) if "every report was" in m]
    assert len(said) == 1 and "within 0.5 s of close" in said[0], said
    assert runner.status.last_error == "close did not finish within 0.5 s"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_an_interrupt_in_close_s_join_does_not_pass_the_sink_thread_off_as_ended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The likeliest place for Ctrl-C to land in a close is its join of the sink thread. On
    # Python 3.11 an exception raised there marks the thread stopped while it still runs: the
    # runner then took the sink's unfinished close for ended, returned False without a word
    # and kept reading "healthy".
    sink = _SlowToClose()
    runner = SinkRunner(sink, capacity=16, spool_dir=tmp_path)
    runner.start()

    try:
        runner.submit(Report(step=1, values={"x": 1.0}, time=time.time()))
        deadline = time.monotonic() + 20
        while not sink.steps and time.monotonic() < deadline:
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="sidestream"), alarm_interrupts():
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # inside close's join: the sink is closing
            with pytest.raises(KeyboardInterrupt):
                runner.close(30.0)
            assert sink.closing.is_set()
            assert runner.close_now() is False
    finally:
        sink.gate.set()
    said = [m for m in (r.getMessage() for r in caplog.records) if "every report was" in m]
    assert len(said) == 1 and "interrupted" in said[0], [r.getMessage() for r in caplog.records]
    assert runner.status.state == "failed"
