"""The CUDA branch's event protocol, run on CPU with recording stand-ins for streams/events.

This does not prove anything about the GPU (test_gpu.py does, on a GPU); it checks, on every
machine, that the side-stream path orders its waits as documented and produces the same numbers.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, ClassVar

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


def test_slots_made_for_the_side_stream_at_bind_order_their_first_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tests above switch to the CUDA branch after bind, so their slots were laid out for
    # the CPU. A CUDA bind makes every slot on the side stream (pinned buffers sized by a
    # compute on the copy, a done event recorded there): the first staging into each slot
    # waits for that event, which was recorded before, and the numbers are the same.
    log, side = _stand_ins(monkeypatch)
    make_slot = AsyncMetricCollector._make_slot

    def on_the_side_stream(self: AsyncMetricCollector[Any], check: bool) -> Any:
        self._side = side  # as bind does on CUDA, before the first slot
        return make_slot(self, check)

    monkeypatch.setattr(AsyncMetricCollector, "_make_slot", on_the_side_stream)
    metric, sink = make_metric(), RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind("cpu")
    for window in range(6):
        feed(metric, window_data(4, window, 0))
        collector.schedule_collection(window + 1)
    assert collector.close()

    assert [report.step for report in sink.reports] == list(range(1, 7))
    for window, report in enumerate(sink.reports):
        expected = reference([window_data(4, window, 0)])
        assert report.values == {k: pytest.approx(v, rel=1e-12) for k, v in expected.items()}
    # Every event a stream or the host waits on was recorded before: on CUDA a wait on an
    # event never recorded passes at once (a race), unnoticed.
    recorded: set[int] = set()
    for kind, _, event in log:
        if kind == "record":
            recorded.add(event)
        elif kind in ("wait_event", "synchronize"):
            assert event in recorded, (kind, event)
    made_at_bind = [e for kind, s, e in log if kind == "record" and s == "side"][:1]
    current_waits = [e for kind, s, e in log if kind == "wait_event" and s == "current"]
    assert made_at_bind and current_waits[0] == made_at_bind[0]


class _OnCuda(torch.Tensor):
    """A CPU tensor that takes Run.log's CUDA branch (its copy on a side stream)."""

    streams: ClassVar[list[str]] = []

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        _OnCuda.streams.append(stream.label)


def test_run_log_copies_cuda_values_on_its_own_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # Run.log's CUDA branch had never run anywhere: a stream of its own waits for the caller's,
    # the values are copied into a pinned float64 buffer there, each input is kept alive for
    # that stream (record_stream), and the pipe's thread reads the buffer only after the
    # blocking done event recorded on that stream.
    from sidestream import Run

    log, side = _stand_ins(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    _OnCuda.streams = []
    sink = RecordingSink()
    run = Run([sink])
    for step in range(1, 6):
        value = torch.tensor(step * 0.25, dtype=torch.float32).as_subclass(_OnCuda)
        count = torch.tensor(step, dtype=torch.int64).as_subclass(_OnCuda)
        run.log(step, {"x": value, "n": count, "lr": 0.5})
    assert run.close(timeout=30)
    assert [report.values for report in sink.reports] == [
        {"lr": 0.5, "x": step * 0.25, "n": float(step)} for step in range(1, 6)
    ]
    assert _OnCuda.streams == ["side"] * 10
    assert [kind for kind, stream, _ in log if stream == "side"][:2] == ["wait_stream", "record"]
    done = [event for kind, stream, event in log if kind == "record" and stream == "side"]
    synchronized = [event for kind, _, event in log if kind == "synchronize"]
    assert len(done) == 5 and set(done) <= set(synchronized)
