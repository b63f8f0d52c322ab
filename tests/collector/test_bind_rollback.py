"""A bind that fails part-way is undone: the collector and its metric are as before it.

It was not: sink threads kept running (a retry started and opened the sink again), slots laid
out for the failed attempt stayed in the pool, the call fingerprint grew a second
``after N call(s)``, and a loaded checkpoint's digest was used up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any
from unittest import mock

import pytest
import torch

from sidestream import SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.collector import collector as collector_module
from sidestream.sinks.runner import SinkRunner
from sidestream.sync import RankMismatchError
from tests.collector.helpers import RecordingSink


def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("sidestream"))


def _second_sink_fails_to_start() -> AbstractContextManager[Any]:
    real = SinkRunner.start

    def start(self: SinkRunner) -> None:
        if self.key == "b":
            raise RuntimeError("can't start new thread")
        real(self)

    return mock.patch.object(SinkRunner, "start", start)


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
    "a rank check": (_sinks_differ_across_ranks, RankMismatchError),
    "the dispatcher": (_dispatcher_fails_to_start, RuntimeError),
    "an interrupt": (_interrupted_while_making_slots, KeyboardInterrupt),
}


@pytest.fixture
def no_threads_left() -> Iterator[None]:
    assert _threads() == []
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
