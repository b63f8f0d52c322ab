"""A close run where a signal handler runs it: right after a close's claim, inside the sinks'
start, inside ``log`` / ``schedule_collection``; and the checkpoint's wait message."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from sidestream import AsyncMetricCollector, Run, SumMetric
from sidestream.sinks import JsonlSink, Report, read_jsonl, read_spool
from sidestream.sinks import runner as runner_module
from tests.collector.helpers import RecordingSink


class _InterruptingClaim(dict[str, Any]):
    """A claim whose setdefault claims, then raises: a signal at Python's check after it."""

    def setdefault(self, key: str, value: Any) -> Any:
        super().setdefault(key, value)
        raise KeyboardInterrupt


@pytest.mark.parametrize("kind", ["run", "collector"])
def test_an_interrupt_right_after_the_close_claim_ends_it(tmp_path: Path, kind: str) -> None:
    # Before: the claim was never ended, so close(None) on another thread waited forever and
    # the close at exit said False at once, closing no sink (10 logged values lost, no spool).
    path = tmp_path / "run.jsonl"
    closable: Any
    if kind == "run":
        closable = Run([JsonlSink(path)], spool_dir=str(tmp_path))
        closable.log(1, {"x": 1.0})
    else:
        closable = AsyncMetricCollector(
            SumMetric(), [JsonlSink(path)], prefix="c", spool_dir=str(tmp_path)
        ).bind("cpu")
        closable.metric.update(torch.tensor([1.0]))
        closable.schedule_collection(1)
        closable.wait_windows(10)
    closable._closing._claim = _InterruptingClaim()
    with pytest.raises(KeyboardInterrupt):
        closable.close(10)
    closable._closing._claim = dict(closable._closing._claim)
    answers: list[bool] = []
    other = threading.Thread(target=lambda: answers.append(closable.close(None)), daemon=True)
    other.start()
    other.join(10)
    assert not other.is_alive(), "a close after the interrupted claim waited forever"
    assert answers == [False]
    runners = closable._delivery.runners
    assert runners
    for runner in runners:
        # An interrupted close keeps the undelivered reports at once and lets the sink thread
        # close the sink on its own (close_now does not wait for it): given a moment for that.
        runner._thread.join(5.0)
    assert not any(r._thread.is_alive() for r in runners), "sinks left open"
    # The logged value is kept too (run.log's queue is handed to the sinks before they keep
    # what they hold): in the file, or in the spool file a later close or replay delivers.
    kept = {r["step"] for r in read_jsonl(path)} if path.exists() else set()
    kept |= {r.step for f in tmp_path.glob("*.spool.jsonl") for r in read_spool(f)}
    assert 1 in kept, "the logged or collected step reached neither the file nor a spool file"


def test_a_handlers_close_inside_the_sinks_start_is_refused_not_hung(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # The handler's close ran while its own thread held Delivery._lock (a plain lock) to start
    # the sinks: it waited for itself forever. Now refused at once, with nothing changed.
    run = Run([JsonlSink(tmp_path / "run.jsonl")])
    real_start = runner_module.SinkRunner.start
    handler_errors: list[BaseException] = []

    def start(self: Any) -> None:
        try:
            run.close(5)  # what a SIGTERM handler landing here runs
        except RuntimeError as error:
            handler_errors.append(error)
            raise
        real_start(self)

    monkeypatch.setattr(runner_module.SinkRunner, "start", start)
    errors: list[BaseException] = []

    def first_log() -> None:
        try:
            run.log(1, {"x": 1.0})
        except BaseException as error:  # checked below
            errors.append(error)

    logger = threading.Thread(target=first_log, daemon=True)
    logger.start()
    logger.join(20)
    assert not logger.is_alive(), "the handler's close waited for its own thread's lock"
    assert handler_errors and "starting this run's sinks" in str(handler_errors[0])
    assert errors and isinstance(errors[0], RuntimeError)
    monkeypatch.setattr(runner_module.SinkRunner, "start", real_start)
    run.log(1, {"x": 1.0})  # the run was left as it was: the call made again logs
    assert run.close(10) is True
    assert [record["step"] for record in read_jsonl(tmp_path / "run.jsonl")] == [1]


@pytest.mark.parametrize("first", [True, False])
def test_a_close_inside_log_makes_it_raise_not_drop(tmp_path: Path, first: bool) -> None:
    # The handler's close ran as log's start of the sinks returned: log returned normally,
    # close said True, and the step reached no sink.
    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)])
    if not first:
        run.log(1, {"x": 1.0})
    real_start = run._delivery.start
    answers: list[bool] = []

    def start(where: str) -> Any:
        started = real_start(where)
        answers.append(run.close(5))
        return started

    run._delivery.start = start  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"closed during this call.*step 2 reached no sink"):
        run.log(2, {"x": 2.0})
    assert answers == [True]
    assert [r["step"] for r in read_jsonl(path)] == ([] if first else [1])


def test_a_close_inside_schedule_collection_makes_it_raise_not_drop() -> None:
    sink = RecordingSink()
    run = Run([sink])
    train = run.collector(SumMetric(), prefix="train").bind("cpu")
    assert train._dispatcher is not None
    real_submit = train._dispatcher.submit

    def submit(window: Any) -> None:
        run.close(5)  # the handler's close, right before the window's hand-off
        real_submit(window)

    train._dispatcher.submit = submit  # type: ignore[method-assign]
    train.metric.update(torch.tensor([2.0]))
    with pytest.raises(RuntimeError, match=r"closed during this call.*step 1 is not reported"):
        train.schedule_collection(1)
    assert sink.reports == []


class _Held(RecordingSink):
    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.release = threading.Event()

    def write(self, report: Report) -> None:
        self.release.wait(30)
        super().write(report)


def test_a_checkpoint_says_a_later_sink_was_not_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Both sinks down: the second found the shared deadline passed and was said to have
    # waited "0.0 s".
    first, second = _Held("a"), _Held("b")
    run = Run([first, second], spool_dir=str(tmp_path))
    run.log(1, {"x": 1.0})
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        run.state_dict(timeout=0.5)
    first.release.set()
    second.release.set()
    messages = [r.getMessage() for r in caplog.records if "undelivered report" in r.getMessage()]
    assert len(messages) == 2
    assert re.search(
        r"after waiting \d+\.\d s of the checkpoint's time for its sinks, 0\.5 s", messages[0]
    )
    assert "after waiting 0.0 s" not in messages[1]
    assert "not waited for: the checkpoint's time for its sinks, 0.5 s" in messages[1]
    assert run.close(10) is True


def test_a_handlers_close_and_exit_after_the_windows_start_exits_not_crashes(
    monkeypatch: Any,
) -> None:
    # A SIGTERM handler `run.close(); sys.exit(0)` landing after the window's collectives
    # started (the CPU path's reset): the stopped dispatcher's refusal, raised from the
    # handler of the SystemExit, replaced it (the process crashed with a RuntimeError), under
    # a note that said the window was delivered. It reached no sink.
    from sidestream.collector import _slot

    sink = RecordingSink()
    run = Run([sink])
    train = run.collector(SumMetric(), prefix="train").bind("cpu")
    real_start = _slot.Slot.start_from_live
    answers: list[bool] = []

    def start_from_live(self: Any, step: int, window: Any) -> None:
        real_start(self, step, window)  # window.batch is set: its collectives started
        answers.append(run.close(5))  # the handler's close...
        raise SystemExit(0)  # ...and its sys.exit

    monkeypatch.setattr(_slot.Slot, "start_from_live", start_from_live)
    train.metric.update(torch.tensor([2.0]))
    with pytest.raises(SystemExit) as caught:
        train.schedule_collection(1)
    notes = getattr(caught.value, "__notes__", [])
    assert any("step 1 is not reported" in note for note in notes), notes
    assert not any("is delivered" in note for note in notes), notes
    assert answers == [True]
    assert sink.reports == []


def test_a_log_refused_after_another_threads_close_ran_out_says_so(tmp_path: Path) -> None:
    # Another thread's close(timeout) that ran out while a log call was in progress stopped
    # the log pipe; the call then raised saying a close ran "inside it on this thread, such as
    # a signal handler's", which sent the reader looking for a handler that was not there.
    run = Run([JsonlSink(tmp_path / "run.jsonl")])
    run.log(1, {"x": 1.0})
    real_start = run._delivery.start
    inside, release = threading.Event(), threading.Event()

    def held_start(where: str) -> Any:
        started = real_start(where)
        inside.set()
        release.wait(30)  # a slow call (a full queue drained by the caller)
        return started

    run._delivery.start = held_start  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def log() -> None:
        try:
            run.log(2, {"x": 2.0})
        except RuntimeError as error:
            errors.append(error)

    logging_thread = threading.Thread(target=log, daemon=True)
    logging_thread.start()
    assert inside.wait(10)
    run.close(0.1)  # waits 0.1 s for the log call, then closes without it
    release.set()
    logging_thread.join(10)
    assert len(errors) == 1
    message = str(errors[0])
    assert "closed during this call" in message and "step 2 reached no sink" in message
    assert "whose timeout ran out" in message


@pytest.mark.parametrize("kind", ["collector", "run"])
def test_a_close_interrupted_before_the_dispatcher_stops_ends_its_thread(
    tmp_path: Path, monkeypatch: Any, kind: str
) -> None:
    # The interrupt landed before the close stopped the dispatcher: its thread (and watcher)
    # waited for windows for the rest of the process.
    run = Run([JsonlSink(tmp_path / "run.jsonl")], spool_dir=str(tmp_path))
    train = run.collector(SumMetric(), prefix="train").bind("cpu")
    train.metric.update(torch.tensor([1.0]))
    train.schedule_collection(1)
    assert train.wait_windows(10)
    dispatcher = train._dispatcher
    assert dispatcher is not None

    def interrupted(*args: Any, **kwargs: Any) -> bool:
        raise KeyboardInterrupt

    monkeypatch.setattr(type(train), "_close_windows_and_sinks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        (train if kind == "collector" else run).close(10)
    dispatcher._thread.join(10)
    assert not dispatcher.alive, "the dispatcher thread outlived the interrupted close"
    monkeypatch.undo()
    run.close(10)


def test_a_collector_whose_run_close_was_interrupted_before_its_turn_refuses_windows_up_front(
    tmp_path: Path,
) -> None:
    # Run.close's interrupt handler stopped every collector's dispatcher but left the later
    # ones open: their next schedule_collection ran its collectives and reset the live state,
    # then the stopped dispatcher refused the window, saying a close ran "during this call".
    run = Run([JsonlSink(tmp_path / "run.jsonl")], spool_dir=str(tmp_path))
    first = run.collector(SumMetric(), prefix="a").bind("cpu")
    second = run.collector(SumMetric(), prefix="b").bind("cpu")

    def interrupted(*args: Any, **kwargs: Any) -> bool:
        raise KeyboardInterrupt

    first.close = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        run.close(10)
    second.metric.update(torch.tensor([5.0]))
    with pytest.raises(RuntimeError, match="schedule_collection: the collector is closed"):
        second.schedule_collection(1)
    assert second.metric.compute().item() == 5.0  # nothing was staged or reset
    assert second.close(5) is True
