"""A sink of one's own written from docs/sinks.md: what the framework must do for it."""

from __future__ import annotations

import io
import logging
import pickle
import threading
import time
import urllib.error
from collections.abc import Sequence

import pytest

from sidestream.sinks import Report, RunInfo, TrackerSink, is_permanent
from sidestream.sinks._spool_format import read_kept_state, write_kept_state


@pytest.mark.parametrize(
    ("code", "permanent"),
    [(400, True), (404, True), (408, False), (429, False), (500, False), (503, False)],
)
def test_urllib_http_error_status_decides_permanence(code: int, permanent: bool) -> None:
    # A sink written with urllib.request.urlopen raises urllib's HTTPError: a 400 is as
    # permanent as requests' (the docs: HTTP 4xx other than 408 and 429), not retried forever.
    error = urllib.error.HTTPError("http://backend/log", code, "msg", {}, io.BytesIO(b""))
    assert is_permanent(error) is permanent


class _GatedSend(TrackerSink):
    """A sink with a run id whose ``send`` waits for ``release`` (a slow request)."""

    def __init__(self) -> None:
        super().__init__()
        self.run_id: str | None = None
        self.in_send = threading.Event()
        self.release = threading.Event()

    @property
    def identity(self) -> str | None:
        return self.run_id

    @identity.setter
    def identity(self, value: str | None) -> None:
        self.run_id = value

    def open(self, run: RunInfo) -> None:
        self.run_id = self.run_id or "run-1"

    def send(self, reports: Sequence[Report]) -> None:
        self.in_send.set()
        self.release.wait(5)
        self.in_send.clear()


class _BufferingSink(_GatedSend):
    """Buffers in send, writes the buffer out in persist: correct on one thread only."""

    name = "buffering"
    durable_on_send = False

    def __init__(self) -> None:
        super().__init__()
        self.overlapped = False

    def persist(self, timeout: float | None) -> bool:
        self.overlapped = self.overlapped or self.in_send.is_set()
        return True


def test_persist_from_a_checkpoint_thread_waits_for_send() -> None:
    # A checkpoint's make_durable (flush, persist) runs off the sink's thread: it must not
    # run while send is filling the buffer persist writes out and clears.
    sink = _BufferingSink()
    sink.open(RunInfo())
    report = Report(step=1, values={"x": 1.0}, time=0.0)
    writer = threading.Thread(target=sink.write, args=(report,))
    writer.start()
    assert sink.in_send.wait(5)
    assert sink.make_durable(0.2) is False  # send still under way: not durable in time
    assert not sink.overlapped
    sink.release.set()
    writer.join(5)
    assert sink.make_durable(1.0) is True
    assert not sink.overlapped
    assert sink.state_dict()["last_steps"] == [["", 1]]
    # Still picklable for a ProcessSink, its lock made anew.
    clone = pickle.loads(pickle.dumps(_Plain()))
    assert clone.flush(0) is True


class _Plain(TrackerSink):
    name = "plain"

    def open(self, run: RunInfo) -> None:
        del run

    def send(self, reports: Sequence[Report]) -> None:
        del reports


def test_kept_state_that_is_not_json_is_said(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    spool = str(tmp_path / "s.spool.jsonl")
    open(spool, "w").close()
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        write_kept_state(spool, "mine", {"seen": {1, 2}}, RunInfo())
    assert read_kept_state(spool).state is None
    assert any("not JSON" in r.getMessage() and "'mine'" in r.getMessage() for r in caplog.records)


class _SlowSend(_GatedSend):
    """Writes in send (durable on send, no persist of its own), like MLflow: one request."""

    name = "slow"


def test_make_durable_does_not_wait_for_a_send_with_nothing_to_persist() -> None:
    # Nothing is buffered, so a send under way loses nothing: a checkpoint's make_durable
    # waited for it, and one that ran out of time kept the sink's state of an older
    # checkpoint (before the first: no run id, so the resumed job opened a new run).
    sink = _SlowSend()
    sink.open(RunInfo())
    sink.release.set()
    sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
    sink.release.clear()
    second = Report(step=2, values={"x": 2.0}, time=0.0)
    writer = threading.Thread(target=sink.write, args=(second,))
    writer.start()
    try:
        assert sink.in_send.wait(5)
        assert sink.make_durable(0.2) is True
        # The step in flight is not counted before its send returned.
        assert sink.state_dict() == {"run_id": "run-1", "last_steps": [["", 1]]}
    finally:
        sink.release.set()
        writer.join(5)
    assert sink.state_dict()["last_steps"] == [["", 2]]


def test_checkpoint_while_a_durable_on_send_sink_is_behind_keeps_its_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from sidestream import Run

    sink = _SlowSend()
    run = Run([sink], checkpoint_timeout=0.5)
    try:
        sink.release.set()
        run.log(1, {"x": 1.0})
        for _ in range(500):  # step 1 delivered
            if sink.state_dict()["last_steps"]:
                break
            time.sleep(0.01)
        sink.release.clear()
        run.log(2, {"x": 2.0})
        assert sink.in_send.wait(5)
        with caplog.at_level(logging.WARNING):
            state = run.state_dict()
        assert state["sinks"]["slow"] == {"run_id": "run-1", "last_steps": [["", 1]]}
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        sink.release.set()
        run.close()
