"""A bind that fails part-way is undone: the collector and its metric are as before it.

It was not: sink threads kept running (a retry started and opened the sink again), slots laid
out for the failed attempt stayed in the pool, the call fingerprint grew a second
``after N call(s)``, and a loaded checkpoint's digest was used up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from sidestream import SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.collector import collector as collector_module
from sidestream.sinks import Report
from sidestream.sinks._spool_format import encode_report
from sidestream.sinks.runner import SinkRunner
from sidestream.sync import RankMismatchError
from tests.collector.helpers import RecordingSink

# Threads another test left running (a stalled window's dispatcher, say), before this one.
_EARLIER: set[int | None] = set()


def _threads() -> list[str]:
    """This test's sidestream threads still running."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("sidestream") and t.ident not in _EARLIER
    )


def _second_sink_fails_to_start() -> AbstractContextManager[Any]:
    real = SinkRunner.start

    def start(self: SinkRunner) -> None:
        if self.key == "b":
            raise RuntimeError("can't start new thread")
        real(self)

    return mock.patch.object(SinkRunner, "start", start)


def _second_sinks_thread_fails_to_start() -> AbstractContextManager[Any]:
    """Sink 'b's runner starts its spool intake thread, then fails to start its sink thread."""
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "sidestream-sink-b":
            raise RuntimeError("can't start new thread")
        real(self)

    return mock.patch.object(threading.Thread, "start", start)


def _interrupted_once_the_sinks_started() -> AbstractContextManager[Any]:
    """Ctrl-C after the sinks started, as bind registers its close at exit."""

    def close_at_exit(close: Callable[[], object]) -> None:
        raise KeyboardInterrupt

    return mock.patch.object(collector_module, "close_at_exit", close_at_exit)


def _sinks_differ_across_ranks() -> AbstractContextManager[Any]:
    real = collector_module.check_same_setting

    def check(group: Any, device: torch.device, what: str, *args: Any, **kwargs: Any) -> None:
        if what == "sinks":
            raise RankMismatchError("ranks hold different sinks")
        real(group, device, what, *args, **kwargs)

    return mock.patch.object(collector_module, "check_same_setting", check)


def _dispatcher_fails_to_start() -> AbstractContextManager[Any]:
    def dispatcher(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("can't start new thread")

    return mock.patch.object(collector_module, "Dispatcher", dispatcher)


def _dispatchers_watcher_fails_to_start() -> AbstractContextManager[Any]:
    """The dispatcher starts its thread, then fails to start its watcher (a thread limit)."""
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "sidestream-dispatch-watch":
            raise RuntimeError("can't start new thread")
        real(self)

    return mock.patch.object(threading.Thread, "start", start)


def _interrupted_while_making_slots() -> AbstractContextManager[Any]:
    real = AsyncMetricCollector._new_slot
    made = [0]

    def new_slot(self: AsyncMetricCollector[Any], check: bool = False) -> Any:
        made[0] += 1
        if made[0] == 2:
            raise KeyboardInterrupt
        return real(self, check)

    return mock.patch.object(AsyncMetricCollector, "_new_slot", new_slot)


FAILURES: dict[str, tuple[Callable[[], AbstractContextManager[Any]], type[BaseException]]] = {
    "a sink's runner": (_second_sink_fails_to_start, RuntimeError),
    "a sink's second thread": (_second_sinks_thread_fails_to_start, RuntimeError),
    "an interrupt once the sinks started": (_interrupted_once_the_sinks_started, KeyboardInterrupt),
    "a rank check": (_sinks_differ_across_ranks, RankMismatchError),
    "the dispatcher": (_dispatcher_fails_to_start, RuntimeError),
    # The dispatcher's own thread was left waiting for windows for good: the constructor
    # raised, so no one held the dispatcher to stop it.
    "the dispatcher's watcher": (_dispatchers_watcher_fails_to_start, RuntimeError),
    "an interrupt": (_interrupted_while_making_slots, KeyboardInterrupt),
}


@pytest.fixture
def no_threads_left() -> Iterator[None]:
    _EARLIER.clear()
    _EARLIER.update(t.ident for t in threading.enumerate() if t.name.startswith("sidestream"))
    yield
    assert _threads() == []


def _used_metric() -> SumMetric:
    """A metric with a collective call behind it and a loaded checkpoint (its digest)."""
    source = SumMetric()
    source.update(torch.tensor([1.0]))
    metric = SumMetric()
    metric.load_state_dict(source.state_dict())
    metric.sync()  # one call: the collector's fingerprint names it
    metric.load_state_dict(source.state_dict())  # a digest the next bind checks
    return metric


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_failed_bind_is_undone_and_a_retry_works(failure: str, no_threads_left: None) -> None:
    patch, error = FAILURES[failure]
    metric = _used_metric()
    reference = AsyncMetricCollector(_used_metric()).bind("cpu")  # the same, bound at once
    expected_stream = reference._stream
    assert reference.close(timeout=30)
    first, second = RecordingSink(name="a"), RecordingSink(name="b")
    collector = AsyncMetricCollector(metric, sinks=[first, second])
    with patch(), pytest.raises(error):
        collector.bind("cpu")
    assert _threads() == []  # no sink or dispatcher thread left running
    assert collector._slot_count == 0 and collector._free_slots.empty()
    assert "_loaded_digest" in metric.__dict__  # the retry still checks the loaded checkpoint
    collector.bind("cpu")
    assert collector._stream == expected_stream
    metric.update(torch.tensor([2.0]))
    collector.schedule_collection(1)
    assert collector.collect_results(timeout=30) == 3.0  # the loaded 1 and the new 2
    assert collector.close(timeout=30)
    assert [report.values for report in first.reports] == [{"value": 3.0}]
    assert [report.values for report in second.reports] == [{"value": 3.0}]


def test_a_metric_whose_bind_failed_binds_to_another_collector(no_threads_left: None) -> None:
    metric = SumMetric()
    failed = AsyncMetricCollector(metric, sinks=[RecordingSink(name="a"), RecordingSink(name="b")])
    with _second_sink_fails_to_start(), pytest.raises(RuntimeError, match="new thread"):
        failed.bind("cpu")
    other = AsyncMetricCollector(metric, prefix="other").bind("cpu")
    metric.update(torch.tensor([5.0]))
    other.schedule_collection(1)
    assert other.collect_results(timeout=30) == 5.0
    assert other.close(timeout=30)
    assert failed.close(timeout=30)  # never bound: nothing to finish


SINK_FAILURES = ("a sink's runner", "a sink's second thread", "an interrupt once the sinks started")


@pytest.mark.parametrize("failure", SINK_FAILURES)
def test_a_failed_bind_keeps_the_checkpoints_undelivered_reports_for_the_retry(
    failure: str, no_threads_left: None, tmp_path: Path
) -> None:
    # The rollback closed the sinks it had started and dropped their backlog whether or not
    # the close delivered it: left in a spool file (the retry's runner then called it an
    # earlier job's, to delete), the retried bind never delivered it.
    patch, error = FAILURES[failure]
    saved = AsyncMetricCollector(SumMetric()).state_dict()
    report = Report(step=1, values={"value": 1.0}, time=0.0)
    saved["undelivered"] = {"a": encode_report(report).decode()}
    first, second = RecordingSink(name="a"), RecordingSink(name="b")
    collector = AsyncMetricCollector(
        SumMetric(), sinks=[first, second], spool_dir=str(tmp_path), exit_timeout=5.0
    )
    collector.load_state_dict(saved)
    backlogs = dict(collector._delivery.backlogs)
    with patch(), pytest.raises(error):
        collector.bind("cpu")
    assert _threads() == []
    if failure == "an interrupt once the sinks started":
        # Started, sink 'a' may have delivered the report before the interrupt: then it is
        # no backlog any more (delivered once), else it is one still.
        assert first.steps in ([], [1])
        assert collector._delivery.backlogs == ({} if first.steps else backlogs)
    else:
        assert collector._delivery.backlogs == backlogs  # as before the bind
        assert first.steps == []  # nothing was delivered by the bind that failed
    collector.bind("cpu")
    collector.metric.update(torch.tensor([2.0]))
    collector.schedule_collection(2)
    assert collector.collect_results(timeout=30) == 2.0
    assert collector.close(timeout=30)
    assert first.steps == [1, 2]  # the checkpoint's report, once, then the new window
    assert second.steps == [2]
    assert list(tmp_path.iterdir()) == []  # nothing left in a spool file


def test_a_sink_still_opening_after_an_interrupted_bind_is_not_closed_under_the_retry(
    no_threads_left: None, tmp_path: Path
) -> None:
    """The interrupted bind gave its sink thread 1 s; the sink's open took 2 s. The retried
    bind opened the same sink from a new runner meanwhile, and when the old open returned the
    old thread closed the sink under it: steps 6-10 failed "write before open" and ended in a
    spool file, close() False."""
    import json
    import time

    from sidestream.sinks import JsonlSink, RunInfo

    path = tmp_path / "run.jsonl"
    opens: list[int] = []  # how many opens ran at once, each time one started
    inside = [0]
    lock = threading.Lock()
    first_open_done = threading.Event()

    class SlowFirstOpen(JsonlSink):
        """A tracker whose first open is slow (a server connecting), later ones quick."""

        def open(self, run: RunInfo) -> None:
            with lock:
                inside[0] += 1
                opens.append(inside[0])
                slow = len(opens) == 1
            try:
                if slow:
                    time.sleep(2.0)
                super().open(run)
            finally:
                with lock:
                    inside[0] -= 1
                if slow:
                    first_open_done.set()

    sink = SlowFirstOpen(path)
    collector = AsyncMetricCollector(SumMetric(), sinks=[sink], spool_dir=str(tmp_path / "spool"))
    with _interrupted_once_the_sinks_started(), pytest.raises(KeyboardInterrupt):
        collector.bind("cpu")
    assert _threads() == ["sidestream-sink-jsonl"]  # still in the slow open
    collector.bind("cpu")
    for step in range(1, 11):
        if step == 6:  # the old open returns, and its thread ends, meanwhile
            assert first_open_done.wait(30)
            deadline = time.monotonic() + 30
            while _threads().count("sidestream-sink-jsonl") > 1:  # the old one ends
                assert time.monotonic() < deadline
                time.sleep(0.02)
        collector.metric.update(torch.tensor([1.0]))
        collector.schedule_collection(step)
    assert collector.close(timeout=30)
    assert max(opens) == 1  # never two opens of the sink at once
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, 11))  # what the file got: every step logged, once
    assert not list((tmp_path / "spool").glob("*.spool.jsonl"))  # nothing left undelivered


class _InterruptedOnRelease:
    """A lock whose first release raises ``KeyboardInterrupt`` (Ctrl-C right after it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = True

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if self._armed:
            self._armed = False
            raise KeyboardInterrupt


def test_a_runner_start_interrupted_once_registered_on_its_sink_does_not_block_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C between a runner's registration on its sink and its thread's start left it
    # registered for good: the runner made in its place waited for it and never opened the
    # sink (close False, the report only in a spool file).
    import json

    from sidestream.sinks import JsonlSink, Report
    from sidestream.sinks import runner as runner_module

    sink = JsonlSink(tmp_path / "run.jsonl")
    monkeypatch.setattr(runner_module, "_SINK_USERS_LOCK", _InterruptedOnRelease())
    first = SinkRunner(sink, spool_dir=str(tmp_path / "spool"))
    with pytest.raises(KeyboardInterrupt):
        first.start()
    first.withdraw(1.0)  # what a bind undone by the interrupt does
    monkeypatch.undo()
    second = SinkRunner(sink, spool_dir=str(tmp_path / "spool"))
    second.start()
    second.submit(Report(step=1, values={"x": 1.0}, time=1.0))
    assert second.close(10.0) is True
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]
