"""A job's process-wide settings that sidestream must survive: log handlers, a closed stdout."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidestream import Run
from sidestream.sinks import ConsoleSink, JsonlSink, Report, RunInfo, Sink
from sidestream.sinks.status import is_permanent


class _BuggySink(Sink):
    """A sink whose second write raises (a bug of its own: failed for good)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        self.writes += 1
        if self.writes >= 2:
            raise TypeError("bug in the sink")


class _RaisingHandler(logging.Handler):
    """A log shipper of one's own whose ``emit`` raises (no ``handleError``)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        raise RuntimeError("log shipper down")


@pytest.fixture
def raising_handler() -> Iterator[_RaisingHandler]:
    handler = _RaisingHandler()
    logger = logging.getLogger("sidestream")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_raising_log_handler_stops_no_sink_and_no_close(
    raising_handler: _RaisingHandler, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A handler that raises on sidestream's threads and in close is not sidestream's failure.

    It ended the failed sink's thread ("RuntimeError: log shipper down (an error in
    sidestream)" as its error) and made ``close()`` raise it on the training thread.
    """
    buggy = _BuggySink()
    run = Run([JsonlSink(tmp_path / "run.jsonl"), buggy], spool_dir=tmp_path)
    for step in range(1, 6):
        run.log(step, {"lr": 0.1 * step})
    assert run.close(timeout=10) is False  # the buggy sink failed: an answer, not a raise
    assert _steps(tmp_path / "run.jsonl") == [1, 2, 3, 4, 5]
    status = run.sink_status["sink"]
    assert status.state == "failed"
    assert "bug in the sink" in str(status.last_error)
    # Its reports are kept in a spool file, which the (failed) log record still names.
    (spool,) = tmp_path.glob("*.spool.jsonl")
    assert len(spool.read_text().splitlines()) == 4
    assert any(str(spool) in message for message in raising_handler.messages)
    # The handler's error and the record it lost are on stderr, as logging prints its own.
    err = capsys.readouterr().err
    assert "log shipper down" in err and str(spool) in err


def test_console_sink_without_stdout_fails_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A process started with fd 1 closed has ``sys.stdout = None``: the console sink fails.

    It raised AssertionError at every write, retried until the close ran out of time (and an
    AttributeError, failed at once, under ``python -O``).
    """
    monkeypatch.setattr(sys, "stdout", None)
    run = Run([JsonlSink(tmp_path / "run.jsonl"), ConsoleSink()], spool_dir=tmp_path)
    for step in range(1, 4):
        run.log(step, {"lr": 0.1})
    began = time.monotonic()
    assert run.close(timeout=5) is False
    assert time.monotonic() - began < 4  # not the whole timeout, spent on retries
    status = run.sink_status["console"]
    assert status.state == "failed"
    assert "sys.stdout is None" in str(status.last_error)
    assert _steps(tmp_path / "run.jsonl") == [1, 2, 3]


def test_an_assertion_error_is_permanent() -> None:
    """With and without ``-O`` a sink's own check fails it for good (AttributeError under -O)."""
    assert is_permanent(AssertionError())
