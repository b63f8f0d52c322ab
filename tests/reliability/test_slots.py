"""Staging slots are capped, given back when a window fails, and freed after a backlog drains."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from torch import Tensor

import sidestream.collector.collector as collector_module
from sidestream import AsyncMetricCollector, Metric
from sidestream.state import MetricAccumulator
from tests.collector.helpers import RecordingSink


class _Control:
    """Shared by the metric and its staging copies (deepcopy returns the same object)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.delay_s = 0.0  # each compute sleeps this long (a dispatcher a little too slow)

    def __deepcopy__(self, memo: dict[int, object]) -> _Control:
        return self


class Lagging(Metric[Tensor]):
    """A sum whose ``compute`` waits on ``gate`` (a dispatcher that falls behind) or raises."""

    def __init__(self, size: int = 1) -> None:
        self._total = MetricAccumulator(torch.zeros(size, dtype=torch.float64))
        self.control = _Control()

    @property
    def gate(self) -> threading.Event:
        return self.control.gate

    def update(self, values: Tensor) -> None:
        self._total.accumulate(values.to(torch.float64))

    def compute(self) -> Tensor:
        if self.control.fail:
            raise ArithmeticError("compute failed")
        if not self.gate.wait(30):
            raise TimeoutError("gate never opened")
        time.sleep(self.control.delay_s)
        return self._total.value[:1]


@pytest.fixture
def clones(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts staging copies made (one per slot)."""
    made: list[int] = []
    original = collector_module.clone_metric

    def counting(metric):  # type: ignore[no-untyped-def]
        made.append(1)
        return original(metric)

    monkeypatch.setattr(collector_module, "clone_metric", counting)
    return made


def test_failing_compute_gives_the_slot_back(clones: list[int]) -> None:
    metric = Lagging()
    metric.control.fail = True
    collector = AsyncMetricCollector(metric, max_slots=8)
    collector.bind("cpu")
    for step in range(1, 41):
        metric.update(torch.ones(1))
        collector.schedule_collection(step)
        with pytest.raises(RuntimeError, match=r"window\(s\) failed since|latest window failed"):
            collector.collect_results(timeout=20)
    assert len(clones) == 3, "every failed window returned its slot: no new copies"
    collector.close(10)


def test_slots_are_capped_queue_bounded_values_right_and_extra_slots_freed(
    clones: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    metric = Lagging()
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink], max_slots=5, reset_each_window=True)
    collector.bind("cpu")
    metric.gate.clear()  # the dispatcher stalls on the first window

    def open_when_full() -> None:
        # Opened only once every slot is taken and then some: the training thread must wait.
        deadline = time.monotonic() + 60
        while collector._slot_count < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)  # well past the 0.2 s the test requires the training thread to wait
        metric.gate.set()

    opened = threading.Thread(target=open_when_full, daemon=True)
    opened.start()
    assert collector._dispatcher is not None
    most_waiting = most_slots = 0
    with caplog.at_level(logging.WARNING, logger="sidestream.collector"):
        for step in range(1, 31):
            metric.update(torch.full((1,), float(step)))
            collector.schedule_collection(step)
            most_waiting = max(most_waiting, collector._dispatcher.unprocessed)
            most_slots = max(most_slots, collector._slot_count)
    opened.join()
    assert collector.collect_results(timeout=30) == [30.0]
    assert most_slots == 5, "never more than max_slots staging copies at once"
    assert len(clones) >= 5
    # Each waiting window holds a slot; one more may have just handed its slot back.
    assert most_waiting <= 5 + 1, "the windows waiting for the dispatcher are bounded"
    assert collector.slot_wait_s > 0.2, "the training thread waited for the stalled window"
    assert sum("staging slots have been in use" in r.getMessage() for r in caplog.records) == 1
    # The backlog has drained: the next window keeps only the first three slots.
    metric.update(torch.ones(1))
    collector.schedule_collection(31)
    assert collector._slot_count == 3 and collector._free_slots.qsize() == 2
    assert collector.close(10) is True
    # Nothing skipped, nothing merged: each window reports exactly its own value.
    assert sink.steps == list(range(1, 32))
    assert [
        r.values["value"] if "value" in r.values else next(iter(r.values.values()))
        for r in sink.reports
    ] == [float(s) for s in range(1, 31)] + [1.0]


def test_short_slot_waits_that_add_up_are_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: only a single wait past 0.5 s was logged; many shorter ones (16 ranks on 2
    # cores waited 13.6 s of a 17 s loop) said nothing. Scaled down: waits of about 0.1 s
    # that add up to 0.5 s, most of the loop's time.
    monkeypatch.setattr(collector_module, "_SLOT_WAIT_TOTAL_S", 0.5)
    metric = Lagging()
    metric.control.delay_s = 0.1
    collector = AsyncMetricCollector(metric, max_slots=1)
    collector.bind("cpu")
    with caplog.at_level(logging.WARNING, logger="sidestream.collector"):
        for step in range(1, 13):
            metric.update(torch.ones(1))
            collector.schedule_collection(step)
    collector.close(10)
    messages = [r.getMessage() for r in caplog.records]
    assert collector.slot_wait_s >= 0.5
    assert sum("in waits shorter than 0.5 s each" in m for m in messages) == 1, messages
    assert not any("have been in use for" in m for m in messages), "no single wait was long"


def test_max_slots_is_checked() -> None:
    with pytest.raises(ValueError, match=r"^max_slots: expected an int >= 1, got 0"):
        AsyncMetricCollector(Lagging(), max_slots=0)
    # A wrong type is a TypeError, as for the delivery options (sink_capacity="10").
    with pytest.raises(TypeError, match=r"^max_slots: expected an int >= 1, got '8' \(str\)"):
        AsyncMetricCollector(Lagging(), max_slots="8")  # type: ignore[arg-type]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * 4096


def test_memory_stays_bounded_when_windows_outrun_the_dispatcher() -> None:
    # 8 MB of state; before the cap, a stalled dispatcher made one copy per window.
    metric = Lagging(size=1024 * 1024)
    collector = AsyncMetricCollector(metric, max_slots=4)
    collector.bind("cpu")
    metric.gate.clear()
    threading.Timer(1.0, metric.gate.set).start()
    before = _rss_bytes()
    start = time.monotonic()
    for step in range(1, 41):
        collector.schedule_collection(step)
    collector.collect_results(timeout=60)
    grown = _rss_bytes() - before
    # A slot holds a few copies of the state (staged, initial, sync buffers): at most 4 slots
    # of 5 copies, where one copy per window would be 40 x 8 MiB and more.
    assert grown < 4 * 5 * 8 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB for 40 windows"
    assert time.monotonic() - start < 30
    collector.close(10)
