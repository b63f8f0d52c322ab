"""An interrupted ``Run.close`` keeps the ``run.log`` values still queued for the sinks.

``Run.close``'s interrupt handler (Ctrl-C, a SIGTERM handler's ``SystemExit``) kept what the
sinks held in spool files at once (``Delivery.close_now``), but the values still queued in the
log pipe went to the sinks only afterwards, on the pipe's thread, where the closed delivery
dropped them with a DEBUG line: 0 of 200 logged steps in the file or a spool file. The pipe's
thread is held at its start here, as a busy machine's scheduler held it in the report's repro,
so what is queued at the interrupt is known.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sidestream import Run, SumMetric
from sidestream._log_pipe import LogEntry, LogPipe
from sidestream.sinks import JsonlSink, Report, read_jsonl, read_spool, replay_spool
from tests.collector.helpers import NeverCompletedCopy

_STEPS = 200


def _interrupt(*args: Any, **kwargs: Any) -> None:
    del args, kwargs
    raise KeyboardInterrupt


@pytest.fixture
def held_pipe(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every log pipe's thread before it takes an entry, until the event is set."""
    go = threading.Event()
    real_work = LogPipe._work

    def held_work(self: LogPipe) -> None:
        go.wait(30.0)
        real_work(self)

    monkeypatch.setattr(LogPipe, "_work", held_work)
    yield go
    go.set()


def _logged_steps(path: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(path) if r["stream"] == ""] if path.exists() else []


def _spool_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.spool.jsonl") if p.is_file())


@pytest.mark.parametrize("where", ["collector_close", "pipe_stop"])
def test_an_interrupted_close_keeps_the_queued_log_values(
    tmp_path: Path,
    held_pipe: threading.Event,
    where: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, spool = tmp_path / "run.jsonl", tmp_path / "spool"
    run = Run([JsonlSink(path)], spool_dir=str(spool))
    train = run.collector(SumMetric(), prefix="train").bind("cpu")
    train.metric.update(torch.tensor([1.0]))
    train.schedule_collection(1)
    train.collect_results(10)
    for step in range(1, _STEPS + 1):
        run.log(step, {"x": float(step)})
    pipe = run._log_pipe
    assert pipe is not None
    if where == "collector_close":
        train.close = _interrupt  # type: ignore[method-assign,assignment]  # Ctrl-C in its close
    else:
        pipe._thread.join = _interrupt  # type: ignore[method-assign]  # in the pipe's stop
    caplog.set_level(logging.DEBUG, logger="sidestream")
    with pytest.raises(KeyboardInterrupt):
        run.close(10)
    held_pipe.set()  # the pipe's thread runs only now, after the sinks kept what they had
    threading.Thread.join(pipe._thread, 5.0)  # what it delivers late, it delivers by then
    assert run.close(1) is False
    in_file = _logged_steps(path)
    files = _spool_files(spool)
    spooled = [r.step for f in files for r in _read_spool(f)]
    missing = sorted(set(range(1, _STEPS + 1)) - set(in_file) - set(spooled))
    late = [r.getMessage() for r in caplog.records if "finished after close" in r.getMessage()]
    assert not missing, (
        f"{len(missing)} logged steps in neither the file nor a spool file (file "
        f"{len(in_file)}, spool {len(spooled)}); {len(late)} dropped as late: {late[:1]}"
    )
    # A later delivery of the kept file gives the file every step, once.
    for file in files:
        replay_spool(file, JsonlSink(path))
    assert sorted(_logged_steps(path)) == list(range(1, _STEPS + 1))
    assert not pipe._thread.is_alive(), "the log pipe's thread was left running"


def _read_spool(path: Path) -> list[Report]:
    return list(read_spool(path))


def test_an_interrupted_close_names_the_log_values_it_could_not_hand_over(
    tmp_path: Path, held_pipe: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)], spool_dir=str(tmp_path / "spool"))
    run.log(1, {"x": 1.0})
    pipe = run._log_pipe
    assert pipe is not None
    # A value whose copy to the host stalls, then one with host numbers only, behind it.
    stalled = LogEntry(step=2, time=0.0, numbers={}, device_names=("y",))
    stalled.host, stalled.done = torch.zeros(1, dtype=torch.float64), NeverCompletedCopy()  # type: ignore[assignment]
    pipe.put(stalled)
    run.log(3, {"x": 3.0})
    pipe._thread.join = _interrupt  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="sidestream"), pytest.raises(KeyboardInterrupt):
        run.close(10)
    held_pipe.set()
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "1 Run.log call(s)" in m and "reached no sink" in m], messages
    kept = {r.step for f in _spool_files(tmp_path / "spool") for r in _read_spool(f)}
    assert {1, 3} <= kept | set(_logged_steps(path))


class _SecondCtrlC:
    """A CUDA copy's event still in flight, whose wait a second Ctrl-C interrupts."""

    def query(self) -> bool:
        raise KeyboardInterrupt


def test_a_second_ctrl_c_in_the_hand_over_still_keeps_what_the_sinks_hold(
    tmp_path: Path, held_pipe: threading.Event
) -> None:
    # The second Ctrl-C of a double Ctrl-C, landing while the interrupted close waited (up to
    # a second) to hand the queued values over, skipped the sinks' close_now: no spool file,
    # and the exit lost all they held (200 of 200 steps in neither the file nor a spool).
    path, spool = tmp_path / "run.jsonl", tmp_path / "spool"
    run = Run([JsonlSink(path)], spool_dir=str(spool))
    for step in range(1, _STEPS + 1):
        run.log(step, {"x": float(step)})
    pipe = run._log_pipe
    assert pipe is not None
    stalled = LogEntry(step=_STEPS + 1, time=0.0, numbers={}, device_names=("y",))
    stalled.host, stalled.done = torch.zeros(1, dtype=torch.float64), _SecondCtrlC()  # type: ignore[assignment]
    pipe.put(stalled)
    pipe._thread.join = _interrupt  # type: ignore[method-assign]  # the first Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        run.close(10)
    assert run._delivery.closed, "the sinks were left open, keeping nothing"
    kept = {r.step for f in _spool_files(spool) for r in _read_spool(f)}
    assert set(range(1, _STEPS + 1)) <= kept | set(_logged_steps(path))
