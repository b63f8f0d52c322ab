"""The CUDA branch's event protocol, run on CPU with recording stand-ins for streams/events.

This does not prove anything about the GPU (test_gpu.py does, on a GPU); it checks, on every
machine, that the side-stream path orders its waits as documented and produces the same numbers.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch

from sidestream import ComposeMetric
from sidestream.collector import AsyncMetricCollector
from tests.collector.helpers import RecordingSink, feed, make_metric, reference, window_data

Log = list[tuple[str, str, int]]


class _Event:
    count = 0

    def __init__(self, log: Log, blocking: bool = False) -> None:
        self.blocking = blocking
        _Event.count += 1
        self.id = _Event.count
        self._log = log

    def record(self, stream: Any = None) -> None:
        self._log.append(("record", stream.label, self.id))

    def synchronize(self) -> None:
        # A default event's synchronize spins a CPU core for as long as the window takes.
        assert self.blocking, "the host waits on an event made without blocking=True"
        self._log.append(("synchronize", "host", self.id))

    def query(self) -> bool:
        return True


class _Stream:
    def __init__(self, label: str, log: Log) -> None:
        self.label = label
        self._log = log

    def wait_event(self, event: _Event) -> None:
        self._log.append(("wait_event", self.label, event.id))

    def wait_stream(self, stream: _Stream) -> None:
        self._log.append(("wait_stream", self.label, 0))


def _stand_ins(monkeypatch: pytest.MonkeyPatch) -> tuple[Log, _Stream]:
    """Recording streams and events in place of CUDA's; returns the log and the side stream."""
    log: Log = []
    current, side = _Stream("current", log), _Stream("side", log)
    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "Event", lambda blocking=False: _Event(log, blocking))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(
        torch.cuda, "set_stream", lambda stream: log.append(("set_stream", stream.label, 0))
    )
    # The caller's current device (7) is not the collector's: it must be made current again.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 7)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda device: log.append(("set_device", "host", device))
    )
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    return log, side


def test_side_stream_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    log, side = _stand_ins(monkeypatch)
    metric, sink = make_metric(), RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind("cpu")
    collector._side = side  # take the CUDA branch from here on
    compute_threads: list[str] = []
    compose_compute = ComposeMetric.compute

    def compute(self: ComposeMetric) -> Any:
        compute_threads.append(threading.current_thread().name)
        return compose_compute(self)

    monkeypatch.setattr(ComposeMetric, "compute", compute)
    slots_used = []
    original_take = collector._take_slot

    def take() -> Any:
        slot = original_take()
        slots_used.append((slot, slot.done.id if slot.done is not None else None))
        return slot

    monkeypatch.setattr(collector, "_take_slot", take)
    for window in range(8):
        feed(metric, window_data(4, window, 0))
        collector.schedule_collection(window + 1)
        collector.collect_results()  # deterministic slot reuse: three slots, round robin
    assert collector.close()

    for window, report in enumerate(sink.reports):
        expected = reference([window_data(4, window, 0)])
        assert report.values == {k: pytest.approx(v, rel=1e-12) for k, v in expected.items()}

    # The training thread queues no compute(): its Python work grows with the metric tree.
    assert compute_threads == ["sidestream-dispatch"] * 8

    records = [(stream, event) for kind, stream, event in log if kind == "record"]
    staged = [event for stream, event in records if stream == "current"]
    done = [event for stream, event in records if stream == "side"]
    assert len(staged) == len(done) == 8
    side_waits = [event for kind, stream, event in log if kind == "wait_event" and stream == "side"]
    assert side_waits == staged, "the side stream starts every window after its staging"
    # The training thread makes the side stream current for the start only, then restores its
    # own: later updates must not queue behind the window's collectives.
    switches = [(kind, stream) for kind, stream, _ in log if kind.startswith("set_")]
    assert (
        switches == [("set_stream", "side"), ("set_stream", "current"), ("set_device", "host")] * 8
    )
    assert all(device == 7 for kind, _, device in log if kind == "set_device")
    for event in staged:
        wait = log.index(("wait_event", "side", event))
        assert log[wait - 1] == ("set_stream", "side", 0)
    synchronized = [event for kind, _, event in log if kind == "synchronize"]
    assert synchronized == done, "the dispatcher waits for every window's done event, in order"
    # A reused slot: the training stream waits (GPU-side) on that slot's last done event
    # before staging into it, and the host had already seen that event pass.
    current_waits = [e for kind, stream, e in log if kind == "wait_event" and stream == "current"]
    previous = [done_id for _, done_id in slots_used if done_id is not None]
    assert current_waits == previous and len(previous) == 5
    for event in previous:
        assert log.index(("synchronize", "host", event)) < log.index(
            ("wait_event", "current", event)
        )


def test_a_failed_window_still_records_its_done_event(monkeypatch: pytest.MonkeyPatch) -> None:
    # The slot is released either way: the next staging into it must wait for what the failed
    # window queued on the side stream, not for the window before it.
    log, side = _stand_ins(monkeypatch)
    metric = make_metric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    collector._side = side
    compose_compute = ComposeMetric.compute
    calls = []

    def compute(self: ComposeMetric) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("compute failed")
        return compose_compute(self)

    monkeypatch.setattr(ComposeMetric, "compute", compute)
    feed(metric, window_data(4, 0, 0))
    collector.schedule_collection(1)
    with pytest.raises(RuntimeError, match=r"window\(s\) failed since|latest window failed"):
        collector.collect_results()
    side_records = [event for kind, stream, event in log if kind == "record" and stream == "side"]
    assert len(side_records) == 1, "the failed window recorded its done event"
    slots = [collector._free_slots.get_nowait() for _ in range(collector._slot_count)]
    assert [slot.done.id for slot in slots if slot.done is not None] == side_records
    for slot in slots:
        collector._free_slots.put(slot)
    collector.close()
