"""What an on-call engineer reads while a job's sinks are in trouble: bounded, with numbers.

A tracker back after an outage says how long it was away and what it catches up on; a close
that waits for a backlog, and a JSONL resume that reads a large file, say how far they are
instead of looking hung; every logger is under ``sidestream.*``.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest

from sidestream import Run
from sidestream._logs import SafeLogger
from sidestream.sinks import JsonlSink, Report, SinkRunner
from sidestream.sinks import jsonl as jsonl_module
from tests.collector.helpers import RecordingSink


def _report(step: int) -> Report:
    return Report(step=step, values={"x": float(step)}, time=0.0)


def test_a_recovery_names_how_long_the_backend_was_away_and_the_backlog(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    back = threading.Event()

    class Down(RecordingSink):
        def write(self, report: Report) -> None:
            self.attempts += 1
            if not back.is_set():
                raise ConnectionError("tracker unreachable")
            super().write(report)

    sink = Down()
    runner = SinkRunner(
        sink, capacity=4, spool_dir=str(tmp_path), retry_initial_s=0.01, retry_max_s=0.02
    )
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        runner.start()
        for step in range(1, 31):
            runner.submit(_report(step))
        deadline = time.monotonic() + 10
        while (sink.attempts < 3 or runner.spooled == 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # an outage of a measurable length
        back.set()
        assert runner.close(timeout=30) is True
    assert sink.steps == list(range(1, 31))
    (recovery,) = [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]
    match = re.search(
        r"recovered after (\d+) failed attempt\(s\) over ([\d.]+) s; (\d+) report\(s\) "
        r"waiting \((\d+) of them in the spool file\)",
        recovery,
    )
    assert match, recovery
    attempts, seconds, waiting, spooled = match.groups()
    assert int(attempts) >= 3 and float(seconds) >= 0.2
    # The write that recovered took one report; the other 29 waited, most of them on disk.
    assert int(waiting) == 29 and 0 < int(spooled) <= 29, recovery


def test_a_close_waiting_for_a_backlog_says_how_far_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # raising=False: on a sidestream without them the test fails on what is logged.
    monkeypatch.setattr("sidestream._delivery.CLOSE_PROGRESS_FIRST_S", 0.3, raising=False)
    monkeypatch.setattr("sidestream._delivery.CLOSE_PROGRESS_EVERY_S", 0.3, raising=False)
    slow = RecordingSink(delay_s=0.01, name="slow")
    run = Run([slow, JsonlSink(tmp_path / "ok.jsonl")], spool_dir=tmp_path)
    for step in range(1, 121):
        run.log(step, {"x": float(step)})
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        assert run.close(timeout=60) is True
    assert slow.steps == list(range(1, 121))
    lines = [r.getMessage() for r in caplog.records if "for the sinks' backlog" in r.getMessage()]
    assert 1 <= len(lines) <= 6, lines  # bounded: one per interval, not per report
    first = lines[0]
    assert first.startswith("close: waiting ") and "sink 'slow': " in first, first
    assert "'jsonl'" not in first, "a sink with nothing left is not named"
    left, delivered = (
        int(n.replace(",", "")) for n in re.findall(r"([\d,]+) (?:report|del)", first)
    )
    assert left > 0 and left + delivered <= 120, first
    assert re.search(r"\d+ s of the close's timeout left; what is left then is kept", first)


def test_a_close_that_ends_soon_says_nothing_of_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run([JsonlSink(tmp_path / "ok.jsonl")])
    for step in range(1, 51):
        run.log(step, {"x": float(step)})
    with caplog.at_level(logging.DEBUG, logger="sidestream"):
        assert run.close(timeout=30) is True
    assert not [r for r in caplog.records if "backlog" in r.getMessage()], caplog.text


def test_a_resume_that_reads_a_large_jsonl_file_says_how_far_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.jsonl"
    first = Run([JsonlSink(path)])
    first.log(1, {"x": 1.0})
    checkpoint = first.state_dict()
    first.close()
    # The job logged on long past its checkpoint, then died: every later line is read.
    with path.open("a") as file:
        for step in range(2, 20_002):
            file.write(json.dumps({"step": step, "stream": "", "time": 0.0, "values": {}}) + "\n")
    monkeypatch.setattr(jsonl_module, "READ_PROGRESS_FIRST_S", 0.0, raising=False)
    monkeypatch.setattr(jsonl_module, "READ_PROGRESS_EVERY_S", 3600.0, raising=False)
    monkeypatch.setattr(jsonl_module, "_LINES_PER_CLOCK_READ", 5000, raising=False)
    resumed = Run([JsonlSink(path)])
    resumed.load_state_dict(checkpoint)
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        resumed.log(20_001, {"x": 1.0})  # skipped: the file has it
        resumed.log(20_002, {"x": 2.0})
        assert resumed.close(timeout=30) is True
    messages = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    assert len(messages) == 2, messages  # one progress line (the next is an hour away), the end
    assert str(path) in messages[0] and re.search(r"[\d.]+ of [\d.]+ MiB read", messages[0])
    assert "read" in messages[1] and "delivering" in messages[1]
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, 20_003)), "the resume still skips what the file has"


@pytest.mark.parametrize(
    "module",
    ["sidestream_mlflow._http", "sidestream_mlflow.sink", "sidestream_tensorboard.sink"],
)
def test_every_logger_of_the_integrations_is_under_sidestream(module: str) -> None:
    # One logging.getLogger("sidestream") setting (a level, a handler) must reach them all.
    pytest.importorskip(module.split(".")[0])
    imported = importlib.import_module(module)
    kinds = (logging.Logger, SafeLogger)  # SafeLogger: sidestream's, over logging's own
    loggers = [value for value in vars(imported).values() if isinstance(value, kinds)]
    assert loggers, f"{module} has no module-level logger"
    for found in loggers:
        assert found.name == "sidestream" or found.name.startswith("sidestream."), found.name
