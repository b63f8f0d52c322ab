"""A second interrupt while close keeps the undelivered reports does not abandon the keeping.

On Python 3.11 a ``join`` interrupted by a signal handler's exception (a second Ctrl-C, a
SIGTERM handler's ``SystemExit`` after Ctrl-C) marks the thread it waited for as stopped while
it still runs (threading's bpo-45274 handling). The close that followed (``close_now``) took the
spool keeper, still writing, for ended with nothing kept: it logged that the spool directory had
stopped answering (a hung disk that was not there), never named the kept file, and returned at
once, so the process's exit could kill the daemon keeper half-way through the file.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sidestream.sinks import Report, RunInfo, Sink, SinkRunner
from tests.reliability.interrupts import alarm_interrupts


class _HungWrite(Sink):
    """Its first write waits for ``gate`` (a tracker that stopped answering)."""

    name = "hungwrite"

    def __init__(self) -> None:
        self.gate = threading.Event()

    def open(self, run: RunInfo) -> None:
        del run

    def write(self, report: Report) -> None:
        del report
        self.gate.wait(30.0)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_an_interrupt_while_close_keeps_the_reports_waits_for_the_keeper(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = _HungWrite()
    runner = SinkRunner(sink, capacity=16, spool_dir=tmp_path)
    main = threading.get_ident()
    release = threading.Event()
    real_keep = runner._spool.keep

    def slow_keep(*args: Any, **kwargs: Any) -> Any:
        # A large spool on a slow disk: the second Ctrl-C lands in close's wait for it.
        time.sleep(0.35)  # close is in its join(0.1) loop by now
        signal.pthread_kill(main, signal.SIGALRM)
        release.wait(10.0)
        return real_keep(*args, **kwargs)

    runner._spool.keep = slow_keep  # type: ignore[method-assign]

    runner.start()
    try:
        for step in range(1, 4):
            runner.submit(Report(step=step, values={"x": float(step)}, time=time.time()))
        with caplog.at_level(logging.WARNING, logger="sidestream"), alarm_interrupts():
            with pytest.raises(KeyboardInterrupt):
                runner.close(0.2)  # the write hangs: its reports go to a kept spool file
            threading.Timer(0.5, release.set).start()  # the disk catches up
            assert runner.close_now() is False
    finally:
        release.set()
        sink.gate.set()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "stopped answering" in m], messages
    kept = [m for m in messages if "kept" in m and "spool" in m]
    assert kept, messages
    assert runner.status.last_error is not None
    assert "stopped answering" not in runner.status.last_error, runner.status
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert files, list(tmp_path.rglob("*"))
