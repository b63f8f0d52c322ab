"""A window that fails while it is being started: no slot in flight is reused, none is lost.

Plain path: a Ctrl-C as the window's collectives had started, before the window held their
handle, gave its slot back to the pool while the collectives could still write into it, and
the step was free again. CUDA side stream: a window that failed after staging (which resets
the live state) lost its updates without a word.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from sidestream import SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.collector._slot import Slot
from sidestream.sync import SyncHandle, SyncProgram
from tests.collector.test_side_stream_protocol import _stand_ins


def _free_slots(collector: AsyncMetricCollector[Any]) -> list[Slot]:
    slots = []
    while not collector._free_slots.empty():
        slots.append(collector._free_slots.get_nowait())
    for slot in slots:
        collector._free_slots.put(slot)
    return slots


def test_an_interrupt_as_the_collectives_start_keeps_their_slot_out_of_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metric = SumMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    real = SyncProgram.start
    interrupted: list[SyncProgram] = []

    def start(self: SyncProgram, *args: Any, **kwargs: Any) -> SyncHandle:
        handle = real(self, *args, **kwargs)
        if kwargs.get("async_op") and not interrupted:
            interrupted.append(self)  # Ctrl-C as the window's start returns
            raise KeyboardInterrupt
        return handle

    monkeypatch.setattr(SyncProgram, "start", start)
    metric.update(torch.tensor([1.0]))
    with pytest.raises(KeyboardInterrupt) as caught:
        collector.schedule_collection(1)
    assert "step 1" in caught.value.__notes__[0]
    slots = _free_slots(collector)
    assert all(slot._direct is not interrupted[0] for slot in slots)
    assert collector._slot_count == len(slots)  # a new slot is made in its place
    with pytest.raises(ValueError, match="expected > the previous window's 1"):
        collector.schedule_collection(1)  # its collectives may have gone out: the step is used
    with pytest.raises(RuntimeError, match=r"steps 1\).*KeyboardInterrupt"):
        collector.collect_results(timeout=30)
    for step in range(2, 12):  # more windows than slots: the pool serves them all
        metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
    assert collector.collect_results(timeout=30) == 11.0
    assert not collector.close(timeout=30)  # a window was lost


def test_a_window_whose_start_raised_before_any_collective_leaves_its_step_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metric = SumMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")

    def interrupted(self: Slot) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Slot, "_mark_once", interrupted)  # just before the start
    metric.update(torch.tensor([3.0]))
    with pytest.raises(KeyboardInterrupt):
        collector.schedule_collection(1)
    monkeypatch.undo()
    assert len(_free_slots(collector)) == collector._slot_count
    collector.schedule_collection(1)
    assert collector.collect_results(timeout=30) == 3.0
    assert collector.close(timeout=30)


def test_a_side_stream_window_failing_before_its_start_puts_the_staged_updates_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, side = _stand_ins(monkeypatch)
    metric = SumMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    collector._side = side  # the CUDA branch
    metric.update(torch.tensor([4.0]))

    def fails(event: Any) -> None:
        raise RuntimeError("CUDA error")

    monkeypatch.setattr(side, "wait_event", fails)  # after staging reset the live state
    with pytest.raises(RuntimeError, match="CUDA error"):
        collector.schedule_collection(1)
    monkeypatch.undo()
    _, side = _stand_ins(monkeypatch)
    collector._side = side
    assert float(metric.compute()) == 4.0  # staged, reset, and put back
    metric.update(torch.tensor([0.5]))
    collector.schedule_collection(1)  # the same step again, with every update
    assert collector.collect_results(timeout=30) == 4.5
    assert collector.close(timeout=30)


def test_a_side_stream_window_failing_in_its_start_is_reported_as_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, side = _stand_ins(monkeypatch)
    metric = SumMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    collector._side = side
    metric.update(torch.tensor([4.0]))
    real = Slot.start_sync
    failed: list[Slot] = []

    def start_sync(self: Slot, step: int) -> SyncHandle:
        if not failed:
            failed.append(self)
            raise RuntimeError("NCCL error")
        return real(self, step)

    monkeypatch.setattr(Slot, "start_sync", start_sync)
    with pytest.raises(RuntimeError, match="NCCL error") as caught:
        collector.schedule_collection(1)
    assert "step 1" in caught.value.__notes__[0]
    assert "not delivered" in caught.value.__notes__[0]
    assert failed[0] not in _free_slots(collector)  # collectives may still write into it
    with caplog.at_level(logging.ERROR), pytest.raises(RuntimeError) as lost:
        collector.collect_results(timeout=30)
    assert "steps 1)" in str(lost.value)
    assert "window at step 1 failed on the training thread" in str(lost.value)
    assert any("step 1" in record.getMessage() for record in caplog.records)
    metric.update(torch.tensor([0.5]))
    collector.schedule_collection(2)
    assert collector.collect_results(timeout=30) == 0.5
    assert not collector.close(timeout=30)  # close says a window was lost
