"""A window that fails while it is being started: no slot in flight is reused, none is lost.

Plain path: a Ctrl-C as the window's collectives had started, before the window held their
handle, gave its slot back to the pool while the collectives could still write into it, and
the step was free again. CUDA side stream: a window that failed after staging (which resets
the live state) lost its updates without a word.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest
import torch

from sidestream import Metric, SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.collector._slot import Slot
from sidestream.sync import RankMismatchError, SyncHandle, SyncProgram
from tests.collector.helpers import RecordingSink
from tests.collector.test_side_stream_protocol import _stand_ins


def _free_slots(collector: AsyncMetricCollector[Any]) -> list[Slot]:
    slots = []
    while not collector._free_slots.empty():
        slots.append(collector._free_slots.get_nowait())
    for slot in slots:
        collector._free_slots.put(slot)
    return slots


@pytest.mark.parametrize("reset_each_window", [True, False], ids=["window", "cumulative"])
def test_an_interrupt_as_the_collectives_start_keeps_their_slot_out_of_the_pool(
    monkeypatch: pytest.MonkeyPatch, reset_each_window: bool
) -> None:
    # The CPU path did not reset the live state of a window given up once its collectives
    # started: its updates, said to be "not delivered", were added into the next window
    # (update 1.0, interrupt at step 1, update 2.0: step 2 reported 3.0). CUDA resets at
    # staging, so the two paths disagreed.
    metric = SumMetric()
    sink = RecordingSink()
    collector = AsyncMetricCollector(
        metric, sinks=[sink], reset_each_window=reset_each_window
    ).bind("cpu")
    real = SyncProgram.start
    interrupted: list[SyncProgram] = []

    def start(self: SyncProgram, *args: Any, **kwargs: Any) -> SyncHandle:
        handle = real(self, *args, **kwargs)
        if kwargs.get("async_op") and not interrupted:
            interrupted.append(self)  # Ctrl-C as the window's start returns
            raise KeyboardInterrupt
        return handle

    monkeypatch.setattr(SyncProgram, "start", start)
    updates: dict[int, float] = {1: 1.0}
    metric.update(torch.tensor([updates[1]]))
    with pytest.raises(KeyboardInterrupt) as caught:
        collector.schedule_collection(1)
    note = caught.value.__notes__[0]
    assert "step 1" in note
    if reset_each_window:
        assert "its updates were not delivered" in note
    else:  # nothing is reset: the next (cumulative) window reports them
        assert "the next window's value includes them" in note
    slots = _free_slots(collector)
    assert all(slot._direct is not interrupted[0] for slot in slots)
    assert collector._slot_count == len(slots)  # a new slot is made in its place
    with pytest.raises(ValueError, match="expected > the previous window's 1"):
        collector.schedule_collection(1)  # its collectives may have gone out: the step is used
    with pytest.raises(RuntimeError, match=r"steps 1\).*KeyboardInterrupt"):
        collector.collect_results(timeout=30)
    for step in range(2, 12):  # more windows than slots: the pool serves them all
        updates[step] = float(step)
        metric.update(torch.tensor([updates[step]]))
        collector.schedule_collection(step)
    assert collector.collect_results(timeout=30) == _expected(updates, 11, reset_each_window)
    assert not collector.close(timeout=30)  # a window was lost
    # Every window's value, from the updates made: step 1's are in no window (window mode),
    # or in every later one (cumulative).
    assert {report.step: report.values["value"] for report in sink.reports} == {
        step: _expected(updates, step, reset_each_window) for step in range(2, 12)
    }


def _expected(updates: dict[int, float], step: int, reset_each_window: bool) -> float:
    """The sum a window at ``step`` reports when the window at step 1 was lost."""
    if reset_each_window:
        return updates[step]
    return sum(value for at, value in updates.items() if at <= step)


def test_windows_given_up_as_started_leave_their_slots_to_be_collected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The error kept on the window (and by the dispatcher until collect_results: up to 8
    # failures and the latest) held the traceback of the call that failed, whose frames held
    # the slot: 9 full copies of the metric alive with max_slots=3.
    made: list[weakref.ref[Slot]] = []
    real_new_slot = AsyncMetricCollector._new_slot

    def new_slot(self: AsyncMetricCollector[Any], check: bool = False) -> Slot:
        slot = real_new_slot(self, check)
        made.append(weakref.ref(slot))
        return slot

    monkeypatch.setattr(AsyncMetricCollector, "_new_slot", new_slot)
    metric = SumMetric()
    collector = AsyncMetricCollector(metric, max_slots=3).bind("cpu")
    real = SyncProgram.start

    def start(self: SyncProgram, *args: Any, **kwargs: Any) -> SyncHandle:
        handle = real(self, *args, **kwargs)
        if kwargs.get("async_op"):
            raise RuntimeError("process group error after the collective was issued")
        return handle

    monkeypatch.setattr(SyncProgram, "start", start)
    for step in range(1, 21):
        metric.update(torch.tensor([1.0]))
        try:
            collector.schedule_collection(step)
        except RuntimeError as error:
            assert "step" in error.__notes__[0]
    assert collector._dispatcher is not None and collector._dispatcher.wait_idle(30)
    gc.collect()
    assert len(made) == 20  # each window gave its slot up; a new one was made
    assert collector._slot_count == 0
    assert [ref for ref in made if ref() is not None] == []
    monkeypatch.setattr(SyncProgram, "start", real)
    with pytest.raises(RuntimeError, match=r"20 window\(s\) failed") as lost:
        collector.collect_results(timeout=30)
    # The failures still say what went wrong, with the training thread's error chained.
    assert "process group error" in str(lost.value)
    assert "process group error" in str(lost.value.__cause__.__cause__)
    metric.update(torch.tensor([5.0]))
    collector.schedule_collection(21)
    assert collector.collect_results(timeout=30) == 5.0
    assert not collector.close(timeout=30)


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


class _SumWithOwnSync(SumMetric):
    """A metric overriding sync: the collector calls it (blocking) every window."""

    def sync(self, group: Any = None, *, step: int | None = None) -> None:
        super().sync(group, step=step)


def test_a_mismatch_found_by_a_metrics_own_sync_is_reported_as_a_mismatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slow path's sync runs on the training thread after the window counts as started: a
    # RankMismatchError there was reported as a plain failure, so the dispatcher never knew
    # of the mismatch (collect_results raised RuntimeError, and later windows went on to
    # pair with calls of other windows).
    metric = _SumWithOwnSync()
    collector = AsyncMetricCollector(metric).bind("cpu")
    assert not _free_slots(collector)[0].replayable  # the slow path
    real = Metric.sync_as

    def sync_as(self: Metric[Any], *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        raise RankMismatchError("ranks of the group paired different calls: window #1 ...")

    monkeypatch.setattr(_SumWithOwnSync, "sync_as", sync_as)
    metric.update(torch.tensor([1.0]))
    with pytest.raises(RankMismatchError, match="paired different calls"):
        collector.schedule_collection(1)
    monkeypatch.undo()
    assert collector._dispatcher is not None
    collector._dispatcher.wait_idle(30)
    assert isinstance(collector._dispatcher.mismatch, RankMismatchError)
    with pytest.raises(RankMismatchError, match="window #1"):
        collector.collect_results(timeout=30)
    # Every later call says so at once, as for a mismatch the dispatcher found.
    metric.update(torch.tensor([2.0]))
    with pytest.raises(RankMismatchError, match="window #1"):
        collector.schedule_collection(2)
    assert not collector.close(timeout=30)


@pytest.mark.parametrize("where", ["as the hand-off begins", "as the hand-off ends"])
def test_a_ctrl_c_as_a_started_window_is_handed_on_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # A Ctrl-C in the dispatcher's submit, once the window's collectives had started, lost the
    # window without a word: step 3's 3.0 never reached the sink, its step could not be
    # scheduled again, close returned True, and (interrupted after the count) collect_results
    # waited for it until its timeout, blaming the other ranks.
    from sidestream.collector._dispatcher import Dispatcher

    metric = SumMetric()
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind("cpu")
    real = Dispatcher.submit
    interrupted: list[int] = []

    def submit(self: Dispatcher, window: Any) -> None:
        if window.step == 3 and not interrupted:
            interrupted.append(window.step)
            if where == "as the hand-off ends":
                real(self, window)
            raise KeyboardInterrupt
        real(self, window)

    monkeypatch.setattr(Dispatcher, "submit", submit)
    for step in (1, 2):
        metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
    metric.update(torch.tensor([3.0]))
    with pytest.raises(KeyboardInterrupt) as caught:
        collector.schedule_collection(3)
    assert "step 3 was scheduled before this error" in "".join(caught.value.__notes__)
    with pytest.raises(ValueError, match="previous window's 3"):
        collector.schedule_collection(3)
    metric.update(torch.tensor([4.0]))
    collector.schedule_collection(4)
    assert collector.collect_results(timeout=30) == 4.0
    assert collector.close(timeout=30)
    assert [(r.step, r.values["value"]) for r in sink.reports] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
    ]


def test_a_ctrl_c_before_the_window_exists_gives_the_slot_and_step_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Interrupted just after taking its slot, a call kept the slot and used the step: its
    # updates went into the next window, and eight such calls left the pool dry for good.
    import sidestream.collector.collector as collector_module

    metric = SumMetric()
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind("cpu")
    real = collector_module.Window

    def interrupted(**fields: Any) -> Any:
        raise KeyboardInterrupt

    metric.update(torch.tensor([1.0]))
    for _ in range(12):  # more than the pool's slots
        monkeypatch.setattr(collector_module, "Window", interrupted)
        with pytest.raises(KeyboardInterrupt):
            collector.schedule_collection(1)
        monkeypatch.setattr(collector_module, "Window", real)
    assert collector._slot_count == len(_free_slots(collector))
    collector.schedule_collection(1)  # the step is free, and its update still in the metric
    assert collector.collect_results(timeout=30) == 1.0
    assert collector.close(timeout=30)
    assert [(r.step, r.values["value"]) for r in sink.reports] == [(1, 1.0)]


def test_a_ctrl_c_while_a_slot_is_made_counts_no_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    # The slot was counted before its copy was made: a Ctrl-C there left a count for a slot
    # that did not exist, and enough of them left none to make.
    import sidestream.collector.collector as collector_module

    metric = SumMetric()
    collector = AsyncMetricCollector(metric, max_slots=4).bind("cpu")
    taken = [collector._free_slots.get_nowait() for _ in range(len(_free_slots(collector)))]
    count = collector._slot_count

    def interrupted(metric: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(collector_module, "clone_metric", interrupted)
    with pytest.raises(KeyboardInterrupt):
        collector.schedule_collection(1)
    assert collector._slot_count == count
    for slot in taken:
        collector._free_slots.put(slot)
    monkeypatch.undo()
    metric.update(torch.tensor([2.0]))
    collector.schedule_collection(1)
    assert collector.collect_results(timeout=30) == 2.0
    assert collector.close(timeout=30)


def test_a_ctrl_c_in_the_reset_after_the_start_delivers_the_window_with_a_note(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sidestream._arena import Arena

    metric = SumMetric()
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind("cpu")
    real = Arena.reset
    calls: list[int] = []

    def reset(self: Arena) -> None:
        if not calls:
            calls.append(1)
            raise KeyboardInterrupt
        real(self)

    metric.update(torch.tensor([3.0]))
    monkeypatch.setattr(Arena, "reset", reset)
    with pytest.raises(KeyboardInterrupt) as caught:
        collector.schedule_collection(1)
    monkeypatch.undo()
    assert "step 1 was scheduled before this error and is delivered" in "".join(
        caught.value.__notes__
    )
    metric.update(torch.tensor([4.0]))
    collector.schedule_collection(2)
    assert collector.collect_results(timeout=30) == 4.0  # the reset ran after the failure
    assert collector.close(timeout=30)
    assert [(r.step, r.values["value"]) for r in sink.reports] == [(1, 3.0), (2, 4.0)]


def test_slots_lost_to_an_interrupt_are_made_anew_instead_of_waited_for() -> None:
    # A Ctrl-C right as a call took its slot (before its window existed) dropped the slot:
    # once every slot was lost, schedule_collection waited for one forever.
    import threading

    metric = SumMetric()
    collector = AsyncMetricCollector(metric, max_slots=2).bind("cpu")
    while not collector._free_slots.empty():
        collector._free_slots.get_nowait()  # lost, as to an interrupt
    metric.update(torch.tensor([5.0]))
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (collector.schedule_collection(1), done.set()), daemon=True
    )
    worker.start()
    worker.join(timeout=30)
    assert done.is_set()
    assert collector.collect_results(timeout=30) == 5.0
    assert collector.close(timeout=30)


def test_a_call_made_inside_a_call_on_the_same_thread_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The lock that refuses a second call became re-entrant (a Ctrl-C between its acquire and
    # the try that releases it left it held by the training thread): a signal handler that
    # schedules a window, run inside a call, got in. Its window took the live updates first,
    # the outer window then reported 0.0 and set the last step back below the inner one's.
    metric = SumMetric()
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind("cpu")
    real = Slot.start_from_live
    refused: list[BaseException] = []

    def nested(self: Slot, step: int, window: Any) -> Any:
        if step == 1 and not refused:
            try:  # what a signal handler landing here would do
                collector.schedule_collection(2)
            except RuntimeError as error:
                refused.append(error)
            else:
                refused.append(AssertionError("the inner call was let in"))
        return real(self, step, window)

    monkeypatch.setattr(Slot, "start_from_live", nested)
    metric.update(torch.tensor([3.0]))
    collector.schedule_collection(1)
    monkeypatch.undo()
    assert isinstance(refused[0], RuntimeError), refused
    assert "while a call is in progress" in str(refused[0])
    metric.update(torch.tensor([4.0]))
    collector.schedule_collection(2)
    assert collector.collect_results(timeout=30) == 4.0
    assert collector.close(timeout=30)
    assert [(r.step, r.values["value"]) for r in sink.reports] == [(1, 3.0), (2, 4.0)]
