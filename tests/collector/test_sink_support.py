"""The helpers tracker sinks share: bounded calls and resume-state parsing."""

from __future__ import annotations

import threading
import time

import pytest

from sidestream.sinks.support import call_within, parse_resume_state


def test_call_within_returns_on_time_even_if_the_call_hangs() -> None:
    release = threading.Event()
    started = time.monotonic()
    finished, error = call_within(release.wait, 0.2, "test-hang")
    assert (finished, error) == (False, None)
    assert time.monotonic() - started < 5
    release.set()


def test_call_within_reports_the_error_and_success() -> None:
    def fail() -> None:
        raise OSError("backend down")

    finished, error = call_within(fail, 5, "test-fail")
    assert finished and isinstance(error, OSError) and "backend down" in str(error)
    calls: list[int] = []
    assert call_within(lambda: calls.append(1), 5, "test-ok") == (True, None)
    assert calls == [1]


def test_parse_resume_state() -> None:
    assert parse_resume_state({"run_id": "abc", "last_step": 4}, "run_id", "S") == ("abc", 4)
    assert parse_resume_state({"run_id": None, "last_step": None}, "run_id", "S") == (None, None)
    with pytest.raises(ValueError, match="'run_id' and 'last_step'"):
        parse_resume_state({"last_step": 4}, "run_id", "S")
    with pytest.raises(ValueError, match="last_step"):
        parse_resume_state({"run_id": "a", "last_step": True}, "run_id", "S")
