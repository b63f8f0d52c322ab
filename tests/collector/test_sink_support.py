"""The helpers tracker sinks share: bounded calls and resume-state parsing."""

from __future__ import annotations

import asyncio
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


@pytest.mark.parametrize("kind", [SystemExit, asyncio.CancelledError])
def test_call_within_reports_a_base_exception_as_a_failure(kind: type[BaseException]) -> None:
    # A client that raises SystemExit (sys.exit) or CancelledError (an asyncio layer): the
    # call did not succeed. It read as finished without error, so a close that never ended
    # the run or a flush that wrote nothing counted as done.
    def fail() -> None:
        raise kind("client gave up")

    finished, error = call_within(fail, 5, "test-base-exception")
    assert finished and isinstance(error, RuntimeError)
    assert kind.__name__ in str(error) and isinstance(error.__cause__, kind)


def test_parse_resume_state() -> None:
    assert parse_resume_state({"run_id": "abc", "last_step": 4}, "run_id", "S") == ("abc", 4)
    assert parse_resume_state({"run_id": None, "last_step": None}, "run_id", "S") == (None, None)
    with pytest.raises(ValueError, match="'run_id' and 'last_step'"):
        parse_resume_state({"last_step": 4}, "run_id", "S")
    with pytest.raises(ValueError, match="last_step"):
        parse_resume_state({"run_id": "a", "last_step": True}, "run_id", "S")
