"""Closing where no thread can start: CPython 3.12.0 and 3.12.1 refuse every new thread once
the interpreter's exit has begun, and a Run left open is closed in an atexit hook there.

The refusal is made here by patching ``threading.Thread.start`` (so these run on any Python):
what it exercises is the code path, not the interpreter version.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidestream import Run
from sidestream.sinks import Sink
from sidestream.sinks.support import call_within


@pytest.fixture
def no_new_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", refuse)
        yield


def test_call_within_counts_a_thread_that_cannot_start_as_not_ended(
    no_new_threads: None,
) -> None:
    called = []
    # Run on the caller's thread instead, a hung backend would hold the exit without bound.
    assert call_within(lambda: called.append(1), 1.0, "sidestream-test") == (False, None)
    assert called == []


class _Hung(Sink):
    """A tracker that stopped answering: a write never returns."""

    def __init__(self) -> None:
        self.writing = threading.Event()
        self.release = threading.Event()

    def open(self, run: object) -> None:
        pass

    def write(self, report: object) -> None:
        self.writing.set()
        self.release.wait()

    def close(self, timeout: float | None = None) -> bool:
        return True


def test_a_close_where_no_thread_can_start_still_keeps_the_undelivered(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    sink = _Hung()
    run = Run([sink], exit_timeout=1.0, spool_dir=tmp_path)
    for step in range(3):
        run.log(step, {"x": float(step)})
    assert sink.writing.wait(10)  # the sink thread holds the first report in its write
    try:
        # The spool keeper's thread cannot start: the reports were lost ("close failed").
        request.getfixturevalue("no_new_threads")
        assert run.close(timeout=0.5) is False
    finally:
        sink.release.set()
    (spool,) = tmp_path.glob("*.spool.jsonl")
    lines = [json.loads(line) for line in spool.read_text().splitlines()]
    assert [(line["step"], line["values"]) for line in lines] == [
        (step, {"x": float(step)}) for step in range(3)
    ]


@pytest.mark.parametrize(
    ("refusal", "hint"),
    [
        ("can't create new thread at interpreter shutdown", "Python 3.12.0 and 3.12.1"),
        ("can't start new thread", "limit of threads"),
    ],
)
def test_the_warning_names_the_cause_the_refusal_gives(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, refusal: str, hint: str
) -> None:
    # The 3.12.0/3.12.1 advice was given for a thread limit reached as well.
    import sidestream.sinks.support as support

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError(refusal)

    monkeypatch.setattr(support, "_no_thread_warned", False)
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with caplog.at_level("WARNING", logger="sidestream.sinks"):
        assert call_within(lambda: None, 1.0, "flush") == (False, None)
    monkeypatch.undo()
    assert hint in caplog.text, caplog.text
    other = "limit of threads" if hint.startswith("Python") else "Python 3.12.0"
    assert other not in caplog.text, caplog.text
