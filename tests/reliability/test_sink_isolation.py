"""One sink's spool failing costs that sink only; the spool is bounded, readable, replayable."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sidestream import AsyncMetricCollector, MeanMetric, Run
from sidestream.collector._dispatcher import Dispatcher
from sidestream.sinks import (
    JsonlSink,
    Report,
    RunInfo,
    SinkRunner,
    read_jsonl,
    read_spool,
    replay_spool,
)
from sidestream.sinks._spool_format import encode_report
from tests.collector.helpers import RecordingSink
from tests.reliability.faults import GatedSink, SlowSink, tally


def _replay_command(spool: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``python -m sidestream.sinks.replay`` of ``spool`` into the JSONL file ``out``."""
    arguments = [str(spool), "--sink", "jsonl", "--option", f"path={out}"]
    return subprocess.run(
        [sys.executable, "-m", "sidestream.sinks.replay", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _report(step: int) -> Report:
    return Report(step=step, values={"loss": step / 4, "nan": float("nan")}, time=float(step))


def _wait(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_unusable_spool_dir_costs_only_the_sink_that_spools(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    healthy = JsonlSink(tmp_path / "m.jsonl")
    stuck = GatedSink()
    metric = MeanMetric()
    collector = AsyncMetricCollector(
        metric, sinks=[stuck, healthy], prefix="loss", spool_dir=str(not_a_dir), sink_capacity=16
    )
    collector.bind("cpu")
    not_a_dir.write_text("")  # once it runs: a file there already is refused when built
    runner, healthy_runner = collector.sink_runners
    with caplog.at_level(logging.WARNING):
        for step in range(1, 101):
            metric.update(torch.tensor([float(step)]))
            collector.schedule_collection(step)
            if step % 10 == 0:  # the healthy sink never needs its spool: it keeps up
                collector.collect_results(timeout=30)
                assert healthy_runner.wait_delivered(30)
        _wait(lambda: runner.dropped > 0)
        stuck.gate.set()
        assert collector.close(timeout=30) is False, "reports were lost: close says so"
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert tally(range(1, 101), [line["step"] for line in lines])["delivered"] == 100
    assert [line["values"]["loss"] for line in lines] == [float(s) for s in range(1, 101)]
    counts = tally(range(1, 101), stuck.steps)
    assert counts["duplicated"] == 0 and counts["unexpected"] == 0
    assert counts["lost"] == runner.dropped > 0
    assert counts["delivered"] + counts["lost"] == 100
    drops = [r for r in caplog.records if "could not spool" in r.getMessage()]
    assert len(drops) == 1, "a streak of drops is logged once"


def test_a_runner_that_raises_in_submit_does_not_skip_the_others() -> None:
    class Exploding(SinkRunner):
        def submit(self, report: Report) -> None:
            raise OSError("disk on fire")

    good, bad = RecordingSink(name="good"), RecordingSink(name="bad")
    runners = [Exploding(bad), SinkRunner(good)]
    for runner in runners:
        runner.start()
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric)
    collector.bind("cpu")
    assert collector._dispatcher is not None
    dispatcher = Dispatcher(runners, collector._free_slots.put, "")
    collector._dispatcher.stop(5)
    collector._dispatcher = dispatcher
    for step in range(1, 11):
        metric.update(torch.tensor([1.0]))
        collector.schedule_collection(step)
    assert collector.collect_results(timeout=20) == 1.0
    assert runners[1].close(10) is True
    assert good.steps == list(range(1, 11))
    dispatcher.stop(5)


def test_spool_is_bounded_drops_oldest_and_counts(tmp_path: Path) -> None:
    sink = GatedSink()
    line = len(json.dumps({"step": 10, "values": {"loss": 2.5, "nan": "NaN"}, "time": 10.0}))
    runner = SinkRunner(sink, capacity=2, spool_dir=str(tmp_path), spool_max_bytes=line * 10)
    for step in range(1, 201):
        runner.submit(_report(step))
    assert runner.spooled_bytes <= line * 10
    assert 0 < runner.spooled < 12
    assert runner.dropped == 198 - runner.spooled
    runner.start()
    sink.gate.set()
    assert runner.close(10) is False
    # The in-memory queue's two oldest, then the newest spooled ones, in order.
    kept = runner.spooled or len(sink.steps) - 2
    assert sink.steps == [1, 2, *range(201 - kept, 201)]
    assert list(tmp_path.iterdir()) == []


def test_the_drop_messages_name_the_lost_steps_of_each_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full spool's warning and close's summary gave counts only: an operator could not tell
    which steps a tracker lacks. They name each stream's lost steps now (lowest, highest, how
    many), which must be the steps the sink never received."""
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=2, spool_dir=str(tmp_path), spool_max_bytes=2048)
    sent: dict[str, set[int]] = {"train": set(), "val": set(), "": set()}
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        for step in range(1, 301):
            for stream in ("train", "val", "") if step % 10 == 0 else ("train",):
                runner.submit(Report(step=step, values={"loss": 0.5}, time=0.0, stream=stream))
                sent[stream].add(step)
        runner.start()
        sink.gate.set()
        assert runner.close(10) is False
    received: dict[str, set[int]] = {"train": set(), "val": set(), "": set()}
    for report in sink.reports:
        received[report.stream].add(report.step)
    said = [r.getMessage() for r in caplog.records]
    summary = next(m for m in said if "were dropped" in m)
    names = {"train": "train", "val": "val", "": "Run.log"}
    for stream, steps in sent.items():
        lost = sorted(steps - received[stream])
        assert lost, stream  # the cap is small enough to lose some of each
        expected = f"{names[stream]}: {len(lost)} between steps {lost[0]} and {lost[-1]}"
        assert expected in summary, (expected, summary)
    assert runner.dropped == sum(len(sent[s] - received[s]) for s in sent)
    full = next(m for m in said if "spool full" in m)
    assert "lost train: " in full


def test_a_spool_notes_the_steps_it_loses_itself(tmp_path: Path) -> None:
    """Steps lost inside the spool (a damaged line read back, reports a close could not keep)
    are noted there, so the runner's messages name them too."""
    from sidestream.sinks._spool import Spool

    spool = Spool(str(tmp_path), label="t")
    for step in (5, 6, 7):
        spool.append(Report(step=step, values={"x": 1.0}, time=0.0, stream="val"))
    assert spool.path is not None
    with open(spool.path, "r+b") as file:
        file.write(b"#")  # the first line is damaged now
    with pytest.raises(ValueError):
        spool.pop_oldest()
    assert spool.lost.describe() == "val: step 5"
    spool.discard(lost=True)
    assert spool.lost.describe() == "val: 3 between steps 5 and 7"
    assert len(spool) == 0


def test_the_lost_steps_records_are_never_written_by_two_threads_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submitter drops from the inbox holding _inbox_lock alone while the intake thread notes
    a failed spool write holding _cond alone: the one record both wrote lost counts (a GIL
    switch inside ``seen[2] += 1``, or two threads making a stream's first entry). Each record
    is written under one lock, as the counters beside it are."""
    from sidestream.sinks import runner as runner_module
    from sidestream.sinks._lost import LostSteps
    from sidestream.sinks._spool import Spool

    def slow_failing_append(self: Spool, report: Report) -> int:
        time.sleep(0.003)  # a slow disk, then full
        raise OSError(errno.ENOSPC, "No space left on device")

    overlaps: list[int] = []
    inside: set[int] = set()
    add = LostSteps.add

    def add_widened(self: LostSteps, stream: str, step: int) -> None:
        if id(self) in inside:
            overlaps.append(step)
        inside.add(id(self))
        try:
            time.sleep(0.0005)  # a thread switch inside add, widened
            add(self, stream, step)
        finally:
            inside.discard(id(self))

    monkeypatch.setattr(Spool, "append", slow_failing_append)
    monkeypatch.setattr(LostSteps, "add", add_widened)
    monkeypatch.setattr(runner_module, "INBOX_MIN_CAPACITY", 4)
    monkeypatch.setattr(runner_module, "INTAKE_STALL_S", 0.001)
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=1, spool_dir=str(tmp_path))
    runner.start()
    for step in range(1, 301):
        runner.submit(Report(step=step, values={"x": 1.0}, time=0.0, stream="train"))
    sink.gate.set()
    runner.close(20)
    assert runner._inbox_dropped > 0 and runner._dropped > 0  # both kinds of drop happened
    assert overlaps == []
    said = runner._lost_steps_said("")
    assert said.startswith(f"train: {runner.dropped} between steps "), (said, runner.dropped)


def test_damaged_and_unreadable_spool_lines_are_dropped_not_fatal(tmp_path: Path) -> None:
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=1, spool_dir=str(tmp_path))
    for step in range(1, 11):
        runner.submit(_report(step))
    path = runner._spool.path
    assert path is not None
    data = bytearray(Path(path).read_bytes())
    data[data.index(b'"step":4') : data.index(b'"step":4') + 8] = b"garbage!"
    Path(path).write_bytes(bytes(data))
    runner.start()
    sink.gate.set()
    assert runner.wait_delivered(10)
    assert sink.steps == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    # An unreadable file: everything in it is counted lost, and the thread goes on.
    sink.gate.clear()
    for step in range(11, 21):
        runner.submit(_report(step))
    _wait(lambda: runner.spooled > 0)
    assert runner._spool._file is not None
    runner._spool._file.close()  # reads now fail with an OSError (ValueError on a closed file)
    sink.gate.set()
    assert runner.wait_delivered(10)
    runner.submit(_report(21))
    assert runner.close(10) is False
    assert sink.steps[-1] == 21 and runner.dropped + len(sink.steps) == 21
    assert runner._thread.is_alive() is False


def test_kept_spool_is_private_readable_json_and_replays(tmp_path: Path) -> None:
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=2, spool_dir=str(tmp_path / "spool"))
    hist = torch.tensor([1.5, float("inf"), 0.0, -2.0], dtype=torch.float32)
    runner.start()
    for step in range(1, 8):
        runner.submit(
            Report(step=step, values={"a": step * 0.1}, time=1.0, histograms={"h": hist * step})
        )
    assert runner.close(timeout=0.3) is False, "the gate is shut: nothing delivered"
    (kept,) = (tmp_path / "spool").glob("*.spool.jsonl")  # with its .state.json beside
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "spool").stat().st_mode) == 0o700
    lines = [json.loads(line) for line in kept.read_text().splitlines()]  # standard JSON
    assert [line["step"] for line in lines] == list(range(1, 8))
    assert lines[0]["histograms"]["h"] == {
        "dtype": "float32",
        "shape": [4],
        "data": [1.5, "Infinity", 0.0, -2.0],
    }
    back = list(read_spool(kept))
    assert [r.values["a"] for r in back] == [step * 0.1 for step in range(1, 8)]
    assert torch.equal(back[2].histograms["h"], hist * 3)
    out = tmp_path / "replayed.jsonl"
    assert replay_spool(kept, JsonlSink(out)).written == 7
    assert [json.loads(x)["step"] for x in out.read_text().splitlines()] == list(range(1, 8))
    cli = _replay_command(kept, tmp_path / "cli.jsonl")
    assert cli.returncode == 0, cli.stderr
    assert "delivered 7 report(s)" in cli.stdout
    assert len((tmp_path / "cli.jsonl").read_text().splitlines()) == 7
    # Renamed once delivered: a second run cannot append every report again.
    assert not kept.exists() and Path(f"{kept}.replayed").exists()
    again = _replay_command(kept, tmp_path / "cli.jsonl")
    assert again.returncode != 0 and "it was replayed already" in again.stderr
    assert len((tmp_path / "cli.jsonl").read_text().splitlines()) == 7


def test_replay_skips_damaged_lines_when_asked_and_counts_steps_the_sink_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sidestream.sinks.replay import main

    spool = tmp_path / "kept.spool.jsonl"
    good = [encode_report(Report(step=s, values={"x": float(s)}, time=0.0)) for s in range(1, 6)]
    spool.write_bytes(b"".join(good[:2]) + b'{"step": 3, "val\n' + b"".join(good[3:]))
    out = tmp_path / "out.jsonl"
    arguments = [str(spool), "--sink", "jsonl", "--option", f"path={out}"]
    assert main(arguments) == 1  # stops at the damaged line 3, says how to go on
    assert "--skip-damaged" in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in out.read_text().splitlines()] == [1, 2]
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"path": str(out), "last_steps": {"": 2}}))
    assert main([*arguments, "--skip-damaged", "--resume-state", str(state)]) == 0
    printed = capsys.readouterr()
    assert "line 3" in printed.err
    assert "delivered 2 report(s)" in printed.out
    assert "2 the sink already had, 1 damaged line(s) skipped" in printed.out
    assert [json.loads(x)["step"] for x in out.read_text().splitlines()] == [1, 2, 4, 5]


class _UnconfirmedJsonlSink(JsonlSink):
    """Writes its file, but its close does not confirm delivery (a backend that timed out)."""

    def close(self, timeout: float | None = None) -> bool:
        super().close(timeout)
        return False


def test_a_replay_whose_sink_does_not_confirm_at_close_keeps_the_file_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a confirmed close means the backend has the reports: without one the replay was
    reported as delivered, and the file renamed as replayed (never delivered again)."""
    from sidestream.sinks import replay

    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(b"".join(encode_report(_report(step)) for step in range(1, 4)))
    out = tmp_path / "out.jsonl"
    result = replay_spool(spool, _UnconfirmedJsonlSink(str(out)))
    assert (result.written, result.closed) == (3, False)
    assert replay_spool(spool, JsonlSink(str(tmp_path / "other.jsonl"))).closed
    built: list[float | None] = []
    before_close: list[str] = []

    class Recording(_UnconfirmedJsonlSink):
        def close(self, timeout: float | None = None) -> bool:
            built.append(timeout)
            before_close.append(capsys.readouterr().err)
            return super().close(timeout)

    monkeypatch.setattr(replay, "_sink", lambda parser, name, options: Recording(str(out)))
    command = [str(spool), "--sink", "jsonl", "--option", f"path={out}", "--timeout", "7.5"]
    assert replay.main(command) == 1
    # Said before the close waits, so a replay that looks done does not look hung.
    assert before_close[0].splitlines()[-1] == (
        "read 3 reports (3 written, 0 the sink had); waiting up to 7.5 s for the jsonl sink "
        "to confirm delivery"
    )
    printed = capsys.readouterr()
    assert "wrote 3 report(s)" in printed.out and "delivered" not in printed.out
    assert "did not confirm" in printed.err and "--timeout 7.5 s" in printed.err
    assert "is kept" in printed.err
    assert built == [7.5]
    assert spool.exists() and not Path(f"{spool}.replayed").exists()


class _LackingJsonlSink(JsonlSink):
    """Closes as TensorBoard's and W&B's sinks do: ``False`` while the run lacks values."""

    def close(self, timeout: float | None = None) -> bool:
        return self.closed_with_every_value(super().close(timeout))


def test_a_replay_into_a_run_that_lacks_values_is_delivered_and_says_what_it_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The values a tracker left out stay in its state, so its close returns False on every
    later replay too: that alone must not keep the file (it would be kept forever)."""
    from sidestream.sinks import replay

    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(b"".join(encode_report(_report(step)) for step in range(1, 4)))
    out = tmp_path / "out.jsonl"
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"path": str(out), "last_steps": [], "skipped_values": ["h"]}))
    monkeypatch.setattr(replay, "_sink", lambda parser, name, options: _LackingJsonlSink(str(out)))
    arguments = [str(spool), "--sink", "jsonl", "--option", f"path={out}", "--resume-state"]
    arguments.append(str(state))
    assert replay.main(arguments) == 0
    printed = capsys.readouterr()
    assert "delivered 3 report(s)" in printed.out
    assert "the run lacks values the backend could not take: h" in printed.err
    assert "did not confirm" not in printed.err
    assert Path(f"{spool}.replayed").exists()
    sink = _LackingJsonlSink(str(tmp_path / "again.jsonl"))
    sink.load_state_dict(
        {"path": str(tmp_path / "again.jsonl"), "last_steps": [], "skipped_values": ["h"]}
    )
    result = replay_spool(f"{spool}.replayed", sink)
    assert (result.written, result.closed, result.lacking) == (3, True, ["h"])

    class Unconfirmed(_LackingJsonlSink):
        """Its backend did not confirm either; nothing is left pending in this sink."""

        def close(self, timeout: float | None = None) -> bool:
            JsonlSink.close(self, timeout)
            return self.closed_with_every_value(False)

    sink = Unconfirmed(str(tmp_path / "third.jsonl"))
    sink.load_state_dict(
        {"path": str(tmp_path / "third.jsonl"), "last_steps": [], "skipped_values": ["h"]}
    )
    result = replay_spool(f"{spool}.replayed", sink)
    assert (result.written, result.closed, result.lacking) == (3, False, ["h"])


def test_a_long_replay_shows_how_far_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sidestream.sinks.replay import _Progress

    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(b"".join(encode_report(_report(step)) for step in range(1, 6)))
    progress = _Progress(str(spool), "jsonl", 60.0, every=0.0)
    result = replay_spool(spool, JsonlSink(str(tmp_path / "out.jsonl")), progress=progress)
    assert result.closed
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "replayed 5 of about 5 reports (5 written, 0 the sink had)"
    assert len(lines) == 5


@pytest.mark.parametrize("timeout", ["0", "-1", "inf", "soon"])
def test_replay_timeout_must_be_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], timeout: str
) -> None:
    from sidestream.sinks.replay import main

    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(encode_report(_report(1)))
    with pytest.raises(SystemExit) as exited:
        main([str(spool), "--sink", "jsonl", "--timeout", timeout])
    assert exited.value.code == 2
    assert "--timeout: expected seconds (a finite number > 0)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["MISSING", "--print"], "MISSING: no such file"),
        (["SPOOL", "--sink", "nosuch"], "--sink nosuch: sink 'nosuch' is unknown"),
        (["SPOOL", "--sink", "jsonl", "--option", "pth=x"], "did you mean 'path'"),
        (["SPOOL", "--sink", "console", "--resume-state", "MISSING"], "--resume-state: "),
        # No sink named and no state file beside the spool (a crashed job writes none).
        (["SPOOL"], "--sink is required: SPOOL.state.json, which names the sink, is not there"),
        # A replayed file again: it opened the tracker's run again (an empty W&B directory).
        (["SPOOL.replayed", "--sink", "jsonl"], "SPOOL.replayed: replayed already"),
        # In a child process the sink could not say which reports its backend has.
        (
            ["SPOOL", "--sink", "jsonl", "--option", "child_process=true"],
            "--option child_process: a replay runs the sink in this process",
        ),
    ],
)
def test_replay_command_errors_are_one_line_not_tracebacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    from sidestream.sinks.replay import main

    spool = tmp_path / "kept.jsonl"
    spool.write_text("")
    (tmp_path / "kept.jsonl.replayed").write_text("")
    paths = {
        "SPOOL": str(spool),
        "SPOOL.replayed": f"{spool}.replayed",
        "MISSING": str(tmp_path / "missing"),
    }
    with pytest.raises(SystemExit) as exited:
        main([paths.get(argument, argument) for argument in arguments])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    expected = message.replace("MISSING", paths["MISSING"]).replace("SPOOL", str(spool))
    assert expected in error and "Traceback" not in error


def test_a_close_begun_earlier_names_the_time_the_sink_was_given(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A run begins every sink's close at once and then waits on each with what is left: the
    # warning named what was left (0.2 s), not what the sink had (1.5 s).
    sink = GatedSink()  # never lets a write through
    runner = SinkRunner(sink, capacity=4, spool_dir=str(tmp_path))
    runner.start()
    runner.submit(_report(1))
    runner.begin_close(1.5)
    time.sleep(1.3)
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        assert runner.close(0.2) is False
    (warning,) = [r.getMessage() for r in caplog.records if "undelivered" in r.getMessage()]
    assert "(not delivered within 1.5 s)" in warning, warning
    sink.gate.set()


def test_keep_failing_at_close_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool_dir = tmp_path / "spool"
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=1, spool_dir=str(spool_dir))
    runner.start()
    for step in range(1, 4):
        runner.submit(_report(step))
    _wait(lambda: runner.spooled >= 1)  # spooled by the runner's intake thread
    # The directory goes away and a file takes its place: the kept file cannot be made.
    spool_dir.rename(tmp_path / "moved")
    spool_dir.write_text("")
    with caplog.at_level(logging.ERROR, logger="sidestream.sinks"):
        assert runner.close(timeout=0.3) is False
    assert any("they are lost" in r.getMessage() for r in caplog.records)
    assert runner.dropped == 3
    # Status said "healthy", with no error, after a close that lost every undelivered report.
    assert runner.status.state == "failed", runner.status
    assert "3 report(s) lost" in (runner.status.last_error or ""), runner.status


_DISK_FULL = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
from sidestream.sinks import Report, SinkRunner
from tests.reliability.faults import GatedSink
sink = GatedSink()
runner = SinkRunner(sink, capacity=2, spool_dir=sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
for step in range(1, 101):
    runner.submit(Report(step=step, values={"loss": float(step)}, time=0.0))
runner.start()
sink.gate.set()
print(runner.close(20), runner.dropped, ",".join(map(str, sink.steps)))
"""


def _run_with_file_size_limit(script: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """``script`` (which sets RLIMIT_FSIZE itself) in a process of its own; it must succeed."""
    result = subprocess.run(
        [sys.executable, "-c", script, str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    return result


def test_disk_full_while_spooling_drops_counts_and_goes_on(tmp_path: Path) -> None:
    result = _run_with_file_size_limit(_DISK_FULL, tmp_path)
    complete, dropped, steps = result.stdout.split()
    delivered = [int(s) for s in steps.split(",")]
    assert complete == "False" and int(dropped) > 0
    counts = tally(range(1, 101), delivered)
    assert counts["duplicated"] == counts["unexpected"] == 0
    assert counts["delivered"] + int(dropped) == 100
    assert delivered == sorted(delivered) and delivered[:2] == [1, 2]


_KEEP_ON_A_FULL_DISK = r"""
import resource, signal, sys, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
from sidestream.sinks import Report, SinkRunner
from tests.reliability.faults import GatedSink
sink = GatedSink()
runner = SinkRunner(sink, capacity=3, spool_dir=sys.argv[1])
runner.start()
for step in range(1, 101):
    runner.submit(Report(step=step, values={"loss": float(step)}, time=0.0))
time.sleep(0.2)  # the sink thread holds one report in its write
# The spool file fits; a copy of it with the queued reports in front would not.
resource.setrlimit(resource.RLIMIT_FSIZE, (runner._spool.nbytes + 40, resource.RLIM_INFINITY))
print(runner.close(0.3), runner.dropped)
"""


def test_reports_spooled_before_close_stay_on_disk_when_the_disk_is_full_at_close(
    tmp_path: Path,
) -> None:
    # Keeping the undelivered reports copied the spool into a new file, which needs its size
    # again: on a full disk the copy failed and the spool file, holding them, was deleted too.
    result = _run_with_file_size_limit(_KEEP_ON_A_FULL_DISK, tmp_path)
    assert result.stdout.split() == ["False", "0"], result.stderr
    # The warning names the file of the reports held in memory, then the spool file itself.
    named = result.stderr.split("kept in ", 1)[1].split(" (one JSON", 1)[0].split(" and ")
    assert sorted(named) == sorted(str(path) for path in tmp_path.glob("*.spool.jsonl"))
    assert len(named) == 2, named
    steps = [report.step for path in named for report in read_spool(path)]
    assert steps == list(range(1, 101))  # every report once, oldest first


_KEEP_WHAT_FITS = r"""
import resource, signal, sys, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
from sidestream.sinks import Report, SinkRunner
from tests.reliability.faults import GatedSink
sink = GatedSink()
runner = SinkRunner(sink, capacity=60, spool_dir=sys.argv[1])  # all 50 stay in memory
runner.start()
for step in range(1, 51):
    runner.submit(Report(step=step, values={"loss": float(step)}, time=0.0))
time.sleep(0.2)  # the sink thread holds one report in its write
resource.setrlimit(resource.RLIMIT_FSIZE, (600, resource.RLIM_INFINITY))
print(runner.close(0.3), runner.dropped)
"""


def test_reports_in_memory_keep_the_oldest_that_fit_on_a_full_disk_at_close(
    tmp_path: Path,
) -> None:
    # Written all or none: a file the disk cut short was deleted, every report in it lost.
    result = _run_with_file_size_limit(_KEEP_WHAT_FITS, tmp_path)
    closed, dropped = result.stdout.split()
    (kept_file,) = tmp_path.glob("*.spool.jsonl")
    assert os.path.getsize(kept_file) <= 600
    steps = [report.step for report in read_spool(kept_file)]  # whole lines only
    assert closed == "False" and steps == list(range(1, len(steps) + 1)) and steps
    assert len(steps) + int(dropped) == 50  # every report kept or counted lost, once
    assert f"{dropped} of 50 report(s) not delivered" in result.stderr


_FULL_SPOOL_ON_A_FULL_DISK = r"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
from sidestream.sinks import Report
from sidestream.sinks._spool import Spool
spool = Spool(sys.argv[1], label="full", max_bytes=3000)
resource.setrlimit(resource.RLIMIT_FSIZE, (4000, resource.RLIM_INFINITY))
failed = []
for step in range(1, 121):
    try:
        spool.append(Report(step=step, values={"loss": float(step)}, time=0.0))
    except OSError:
        failed.append(step)
held = []
while len(spool):
    held.append(spool.pop_oldest().step)
print(";".join([",".join(map(str, failed)), ",".join(map(str, held)), str(spool.dropped)]))
"""


def test_a_full_spool_on_a_full_disk_counts_every_report_and_stays_usable(
    tmp_path: Path,
) -> None:
    """The oldest reports were dropped to make room before the write that then failed, and
    not counted; and the bytes the buffered file could not write were tried again by every
    later call, so the spool failed from then on (32 of 37 reports lost at close). Now the
    room is made for real (the file compacted) and the write tried once more."""
    result = _run_with_file_size_limit(_FULL_SPOOL_ON_A_FULL_DISK, tmp_path)
    failed_text, held_text, dropped = result.stdout.strip().split(";")
    failed = [int(s) for s in failed_text.split(",") if s]
    held = [int(s) for s in held_text.split(",")]
    assert len(failed) + len(held) + int(dropped) == 120  # every report counted once
    assert held == sorted(held) and held[-1] == 120  # the spool still takes reports
    assert not set(failed) & set(held)


def test_a_full_spool_is_logged_once_while_it_stays_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Reports of two sizes: a small one often fits where a large one was dropped, which ended
    # the streak and logged it again (894 warnings for 3,960 drops).
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=4, spool_dir=str(tmp_path), spool_max_bytes=4096)
    runner.start()
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        for step in range(1, 501):
            runner.submit(Report(step=step, values={"loss": 0.5}, time=0.0, stream="train"))
            runner.submit(Report(step=step, values={"a_much_longer_name/x": 1.0}, time=0.0))
        _wait(lambda: not runner._waiting_in())  # spooled by the runner's intake thread
        assert runner.dropped > 500
        full = [r for r in caplog.records if "spool full" in r.getMessage()]
        assert len(full) == 1, len(full)
        # The setting to raise, and from where on reports were lost.
        assert re.search(r"spool_max_bytes=4096\): the oldest .* step \d+", full[0].getMessage())
        sink.gate.set()
        runner.close(timeout=20)


def test_spool_file_on_disk_stays_bounded_under_steady_overflow(tmp_path: Path) -> None:
    from sidestream.sinks._spool import _CHUNK, Spool

    spool = Spool(str(tmp_path), label="t", max_bytes=4096)
    biggest = 0
    for step in range(30_000):
        spool.append(_report(step))
        if step % 7 == 0:
            spool.pop_oldest()
        assert spool.path is not None
        biggest = max(biggest, os.path.getsize(spool.path))
    assert spool.nbytes <= 4096
    # Dropped lines stay in the file until the dead prefix outgrows the live part and a chunk.
    assert biggest <= 4096 + _CHUNK + 200
    (path,), lost, _ = spool.keep([])
    assert lost == 0
    kept = list(read_spool(path))
    assert [r.step for r in kept] == sorted(r.step for r in kept)
    assert kept[-1].step == 29_999 and len(kept) == len(set(r.step for r in kept))


def test_replay_that_cannot_rename_the_spool_says_so_and_print_skips_damaged_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sidestream.sinks import replay

    spool = tmp_path / "kept.spool.jsonl"
    good = [encode_report(Report(step=s, values={"x": float(s)}, time=0.0)) for s in (1, 2, 3)]
    spool.write_bytes(good[0] + b"not json\n" + good[2])
    assert replay.main([str(spool), "--print"]) == 1  # no traceback: a message and the fix
    assert "--skip-damaged" in capsys.readouterr().err
    assert replay.main([str(spool), "--print", "--skip-damaged"]) == 0
    printed = capsys.readouterr()
    assert "line 2" in printed.err and printed.out.count("Report(") == 2

    def refuse(source: str, target: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(replay.os, "replace", refuse)
    out = tmp_path / "out.jsonl"
    arguments = [str(spool), "--sink", "jsonl", "--option", f"path={out}", "--skip-damaged"]
    assert replay.main(arguments) == 1
    assert "could not be renamed" in capsys.readouterr().err
    assert spool.exists() and len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("reads_every", [3, 2])
def test_a_small_spool_file_stays_within_twice_its_cap(tmp_path: Path, reads_every: int) -> None:
    """The read prefix is cut off once larger than the live part, also for caps under 1 MiB,
    and before a line would take the file past twice the cap (a probe found one line over)."""
    from sidestream.sinks._spool import Spool

    cap = 4096
    spool = Spool(str(tmp_path), label="small", max_bytes=cap)
    line = len(encode_report(Report(step=0, values={"x": 0.0}, time=0.0)))
    largest = 0
    for step in range(2000):
        spool.append(Report(step=step, values={"x": float(step)}, time=0.0))
        if step % reads_every:
            spool.pop_oldest()  # a slow reader: the live part stays near the cap
        assert spool.path is not None
        largest = max(largest, os.path.getsize(spool.path))
    assert 2 * cap - 4 * line < largest <= 2 * cap, largest
    spool.discard()


# Sink names that are no file name: a "/" (a directory that does not exist), one too long for
# the file system, and names that differ only where they are made safe.
_ODD_NAMES = ["team/tracker", "team_tracker", "../up", "x" * 300, "x" * 299 + "y"]

_KEEP_UNDER_ODD_NAMES = r"""
import json, sys
from sidestream.sinks import Report, SinkRunner
from tests.reliability.faults import GatedSink
dropped = {}
for name in json.loads(sys.argv[2]):
    runner = SinkRunner(GatedSink(name), capacity=1, spool_dir=sys.argv[1])
    runner.start()
    for step in (1, 2, 3):
        runner.submit(Report(step=step, values={"x": float(step)}, time=0.0))
    runner.close(timeout=0.3)  # the gate stays shut: every report is kept
    dropped[name] = runner.dropped
print(json.dumps(dropped))
"""


def test_a_sink_name_that_is_no_file_name_still_spools_and_its_file_is_found_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from sidestream.sinks import read_kept_state

    spool_dir = tmp_path / "spool"
    result = subprocess.run(
        [sys.executable, "-c", _KEEP_UNDER_ODD_NAMES, str(spool_dir), json.dumps(_ODD_NAMES)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == dict.fromkeys(_ODD_NAMES, 0), result.stderr
    kept = {}
    for path in spool_dir.glob("*.spool.jsonl"):  # in the spool folder, none outside it
        state = read_kept_state(path)
        assert state is not None
        kept[state.sink] = path
        assert [report.step for report in read_spool(path)] == [1, 2, 3]
    assert sorted(kept) == sorted(_ODD_NAMES)
    assert list(tmp_path.iterdir()) == [spool_dir]
    # A later job's sink of each name finds its own file only (that process has ended). Its
    # kept state names no run (GatedSink has no identity), so it cannot be told apart from
    # another job's: counted at INFO, not named again (its job named it when it closed).
    for name in kept:
        caplog.clear()
        runner = SinkRunner(GatedSink(name), spool_dir=str(spool_dir))
        with caplog.at_level(logging.INFO, logger="sidestream.sinks"):
            runner.start()
        assert runner.close(5.0) is True
        assert not [r for r in caplog.records if "earlier jobs" in r.getMessage()]
        (counted,) = [r.getMessage() for r in caplog.records if "other runs" in r.getMessage()]
        assert ": 1 spool file(s)" in counted
    # A crashed job's file (no state beside it) is named: it may be this job's.
    (name, path), *_ = kept.items()
    os.remove(str(path) + ".state.json")
    caplog.clear()
    runner = SinkRunner(GatedSink(name), spool_dir=str(spool_dir))
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        runner.start()
    assert runner.close(5.0) is True
    (warning,) = [r.getMessage() for r in caplog.records if "earlier jobs" in r.getMessage()]
    assert "1 spool file(s)" in warning and str(path) in warning


def _ended_process_id() -> int:
    """The id of a process that has ended (its spool files count as left behind)."""
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    return int(ended.stdout)


def test_a_spool_file_named_by_an_earlier_version_is_still_found(tmp_path: Path) -> None:
    # Before names were made safe, "my sink" was used as it is; such files of ended jobs are
    # still named in the warning.
    from sidestream.sinks._spool import leftover_spools

    old = tmp_path / f"sidestream-my sink@{_ended_process_id()}-abc.spool.jsonl"
    old.write_text('{"step": 1}\n')
    assert leftover_spools(str(tmp_path), "my sink") == [str(old)]
    assert leftover_spools(str(tmp_path), "other") == []


def test_an_empty_spool_file_of_an_ended_job_is_not_named(tmp_path: Path) -> None:
    # A spool read back to its end starts over empty: a job that crashed then left a file
    # that holds nothing, which no warning should call undelivered.
    from sidestream.sinks._spool import leftover_spools

    pid = _ended_process_id()
    empty = tmp_path / f"sidestream-tb@{pid}-a.spool.jsonl"
    empty.write_text("")
    kept = tmp_path / f"sidestream-tb@{pid}-b.spool.jsonl"
    kept.write_text("")
    beside = tmp_path / f"sidestream-tb@{pid}-b.spool.jsonl.state.json"
    beside.write_text("{}")
    mine = tmp_path / f"sidestream-tb@{os.getpid()}-c.spool.jsonl"
    mine.write_text("")
    assert leftover_spools(str(tmp_path), "tb") == []
    # Nothing is deleted: on a directory shared by machines the id may be another host's.
    assert empty.exists() and kept.exists() and beside.exists() and mine.exists()


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([1, 2], "--resume-state: expected a JSON object (the sink's state_dict"),
        ({"path": 3}, "--resume-state: state_dict: expected a mapping with 'path'"),
    ],
)
def test_replay_refuses_a_resume_state_the_sink_cannot_load_as_a_wrong_argument(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], state: object, message: str
) -> None:
    # Valid JSON, but no state of the sink: not a damaged line of the spool.
    from sidestream.sinks.replay import main

    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(encode_report(Report(step=1, values={"x": 1.0}, time=0.0)))
    resume = tmp_path / "state.json"
    resume.write_text(json.dumps(state))
    out = tmp_path / "out.jsonl"
    arguments = [str(spool), "--sink", "jsonl", "--option", f"path={out}"]
    with pytest.raises(SystemExit) as exited:
        main([*arguments, "--resume-state", str(resume)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert message in error and "damaged line" not in error and "Traceback" not in error
    assert spool.exists() and not out.exists(), "nothing is delivered"


@pytest.mark.parametrize(
    ("good", "bad"),
    [
        ('"step":2', '"step":"sixty"'),
        ('"step":2', '"step":true'),
        ('"time":0.0', '"time":"noon"'),
        ('"stream":"train"', '"stream":7'),
        ('"values":{"x":2.0}', '"values":{"x":[2.0]}'),
        ('"dtype":"float32"', '"dtype":"nn"'),
    ],
)
def test_a_spool_line_with_a_field_of_the_wrong_type_is_a_damaged_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], good: str, bad: str
) -> None:
    from sidestream.sinks.replay import main

    lines = [
        encode_report(
            Report(
                step=step,
                values={"x": float(step)},
                time=0.0,
                histograms={"h": torch.tensor([1.0, 2.0])},
                stream="train",
            )
        )
        for step in (1, 2, 3)
    ]
    assert good.encode() in lines[1]
    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(lines[0] + lines[1].replace(good.encode(), bad.encode()) + lines[2])
    stopped, skipped = tmp_path / "stopped.jsonl", tmp_path / "skipped.jsonl"
    assert main([str(spool), "--sink", "jsonl", "--option", f"path={stopped}"]) == 1
    error = capsys.readouterr().err
    assert "stopped at a damaged line" in error and "line 2" in error, error
    assert [json.loads(x)["step"] for x in stopped.read_text().splitlines()] == [1]
    arguments = [str(spool), "--sink", "jsonl", "--option", f"path={skipped}", "--skip-damaged"]
    assert main(arguments) == 0
    assert "skipped a damaged line" in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in skipped.read_text().splitlines()] == [1, 3]


def _spool_of_a_jsonl_sink_that_never_opened(log: Path, spool_dir: Path) -> Path:
    """The spool (and state) a JSONL sink of ``log`` kept of steps 1 to 3; ``log`` is free."""
    runner = SinkRunner(JsonlSink(log), spool_dir=str(spool_dir))
    log.mkdir(parents=True)  # the file's place is taken: opening fails for good
    runner.start()
    for step in range(1, 4):
        runner.submit(Report(step=step, values={"loss": float(step)}, time=1.0))
    assert runner.close(timeout=10) is False
    (kept,) = spool_dir.glob("*.spool.jsonl")
    log.rmdir()
    return kept


def test_a_jsonl_spool_replays_with_the_command_given_only_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its kept options were empty: the command given only the spool could not rebuild the sink
    # ("JsonlSink.__init__() missing 1 required positional argument: 'path'").
    from sidestream.sinks.replay import main

    log = tmp_path / "job" / "m.jsonl"
    kept = _spool_of_a_jsonl_sink_that_never_opened(log, tmp_path / "spool")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(kept)]) == 0
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]


def test_python_m_sidestream_replay_is_the_replay_command(tmp_path: Path) -> None:
    # A new user's trial typed it beside `python -m sidestream show`: argparse said only
    # "invalid choice: 'replay'".
    log = tmp_path / "job" / "m.jsonl"
    kept = _spool_of_a_jsonl_sink_that_never_opened(log, tmp_path / "spool")
    done = subprocess.run(
        [sys.executable, "-m", "sidestream", "replay", str(kept)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]
    assert Path(f"{kept}.replayed").is_file()


def test_a_replay_into_another_sink_keeps_the_spool_for_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Written out to read (the console here, a JSONL file in the docs), the reports were not
    # delivered where the job sent them: the file was renamed .replayed all the same, and a
    # replay into its own sink then refused it ("replayed already").
    from sidestream.sinks.replay import main

    log = tmp_path / "job" / "m.jsonl"
    kept = _spool_of_a_jsonl_sink_that_never_opened(log, tmp_path / "spool")
    monkeypatch.chdir(tmp_path)
    assert main([str(kept), "--sink", "console"]) == 0
    shown = capsys.readouterr()
    assert "loss" in shown.out
    assert f"{kept} is kept: its reports went into console, not into the jsonl sink" in shown.err
    assert kept.is_file() and not Path(f"{kept}.replayed").exists()
    assert main([str(kept)]) == 0  # into its own sink: delivered, then renamed
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]
    assert not kept.exists() and Path(f"{kept}.replayed").is_file()


def test_a_replay_into_another_file_keeps_the_spool_for_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The docs' `--sink jsonl --option path=out.jsonl` of a JSONL sink's spool wrote the copy,
    # then renamed the file .replayed: the job's own file never got the reports, and a replay
    # into it refused the spool ("replayed already").
    from sidestream.sinks.replay import main

    log = tmp_path / "job" / "m.jsonl"
    kept = _spool_of_a_jsonl_sink_that_never_opened(log, tmp_path / "spool")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.jsonl"
    assert main([str(kept), "--sink", "jsonl", "--option", f"path={out}"]) == 0
    assert f"{kept} is kept" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in out.read_text().splitlines()] == [1, 2, 3]
    assert kept.is_file() and not Path(f"{kept}.replayed").exists()
    assert main([str(kept), "--option", f"path={log}"]) == 0  # its own file, given: renamed
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]
    assert not kept.exists() and Path(f"{kept}.replayed").is_file()


def test_replay_spool_refuses_a_sink_in_a_child_process(tmp_path: Path) -> None:
    """The replay asks the sink which reports its backend has: a ProcessSink cannot say, so
    it is refused before anything is opened or written."""
    from sidestream.sinks.process import ProcessSink

    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(encode_report(_report(1)))
    out = tmp_path / "out.jsonl"
    with pytest.raises(TypeError, match=r"^sink: pass the sink itself, not a ProcessSink"):
        replay_spool(spool, ProcessSink(JsonlSink(str(out))))
    assert not out.exists() and spool.exists()


def test_a_failing_closing_callback_still_closes_the_sink(tmp_path: Path) -> None:
    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(encode_report(_report(1)))
    sink = JsonlSink(str(tmp_path / "out.jsonl"))

    def closing(result: object) -> None:
        raise OSError("stderr is gone")

    closed: list[float | None] = []
    original_close = sink.close

    def close(timeout: float | None = None) -> bool:
        closed.append(timeout)
        return original_close(timeout)

    sink.close = close  # type: ignore[method-assign]
    with pytest.raises(OSError, match="stderr is gone"):
        replay_spool(spool, sink, closing=closing, timeout=5.0)
    assert closed == [5.0]
    assert [
        json.loads(line)["step"] for line in (tmp_path / "out.jsonl").read_text().splitlines()
    ] == [1]


def test_a_checkpoint_behind_a_jsonl_pipe_nobody_reads_returns_within_its_timeout(
    tmp_path: Path,
) -> None:
    # A pipe whose reader stopped (a paused `| less`): the sink's write blocks holding the
    # file, and run.state_dict(timeout=2) waited for it without end.
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open, never read (until the end)
    run = Run([JsonlSink(fifo), JsonlSink(tmp_path / "ok.jsonl")], spool_dir=str(tmp_path))
    try:
        for step in range(1, 2001):  # about 100 B a line: past the pipe's 64 KiB buffer
            run.log(step, {"loss": step / 7, "lr": step / 11})
        done: dict[str, float] = {}

        def checkpoint() -> None:
            started = time.monotonic()
            run.state_dict(timeout=1.0)
            done["state_dict"] = time.monotonic() - started
            started = time.monotonic()
            done["closed"] = run.close(timeout=1.0)
            done["close"] = time.monotonic() - started

        waiting = threading.Thread(target=checkpoint, daemon=True)
        waiting.start()
        waiting.join(30)
        assert not waiting.is_alive(), "state_dict or close waited for the hung write"
        assert done["state_dict"] < 10 and done["close"] < 10
        assert done["closed"] is False  # the pipe's reports are kept in a spool, not lost
        assert len((tmp_path / "ok.jsonl").read_text().splitlines()) == 2000
    finally:
        deadline = time.monotonic() + 5  # let the abandoned write end
        while time.monotonic() < deadline:
            try:
                if not os.read(reader, 1 << 16):
                    break
            except BlockingIOError:
                time.sleep(0.01)
        os.close(reader)


def _before_spool_writes(monkeypatch: pytest.MonkeyPatch, wait: Callable[[str], object]) -> None:
    """Call ``wait(label)`` before every spool write: a slow or hung disk under ``spool_dir``."""
    from sidestream.sinks import _spool

    write_at_end = _spool.Spool._write_at_end

    def write(self: _spool.Spool, line: bytes) -> None:
        wait(self._label)
        write_at_end(self, line)

    monkeypatch.setattr(_spool.Spool, "_write_at_end", write)


def test_a_hung_spool_disk_holds_up_neither_the_training_thread_nor_other_sinks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A tracker down, its spool on a disk that stops answering: the spool was written on the
    # submitting thread (the dispatcher, the training thread in run.log), so every window
    # waited for the disk, the healthy sink got nothing more, and close never returned.
    disk = threading.Event()
    # Only the down tracker's spool hangs (the healthy one spools too).
    _before_spool_writes(monkeypatch, lambda label: label == "down" and disk.wait(60))
    down = GatedSink("down")  # never writes: its reports back up into the spool
    healthy = tmp_path / "healthy.jsonl"
    run = Run([JsonlSink(healthy), down], spool_dir=str(tmp_path), sink_capacity=2)
    collector = run.collector(MeanMetric(), prefix="train").bind("cpu")
    finished = threading.Event()

    def train() -> None:
        for step in range(1, 21):
            collector.metric.update(torch.tensor([float(step)]))
            collector.schedule_collection(step)
            run.log(step, {"lr": 0.1})
        finished.set()

    threading.Thread(target=train, daemon=True).start()
    try:
        assert finished.wait(30), "the training thread waited for the spool's disk"
        assert collector.collect_results(timeout=30) == 20.0
        _wait(lambda: healthy.exists() and len(list(read_jsonl(healthy))) >= 40)
        assert len(list(read_jsonl(healthy))) == 40  # every window and every log, once
        assert run.sink_status["down"].state == "healthy"  # in a write; asked without a wait
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
            state = run.state_dict(timeout=1.0)  # a checkpoint: bounded, and says what it lacks
        assert time.monotonic() - start < 10, "state_dict waited for the hung disk"
        # Nothing reached the spool file (its first write hangs), so every report is in memory
        # and in the checkpoint, in order: the one the hung write holds too.
        kept = [json.loads(line) for line in state["undelivered"]["down"].splitlines()]
        for stream in ("train", ""):
            steps = [r["step"] for r in kept if r.get("stream", "") == stream]
            assert steps == list(range(1, 21)), (stream, steps)
        assert any("the checkpoint lacks its 0 spooled" in r.getMessage() for r in caplog.records)
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="sidestream.sinks"):
            assert run.close(timeout=1.0) is False
        assert time.monotonic() - start < 10, "close waited for the hung disk"
        assert any("the spool did not answer" in r.getMessage() for r in caplog.records)
    finally:
        disk.set()
        down.gate.set()


def test_a_run_of_many_sinks_on_a_hung_spool_disk_closes_within_its_timeout_and_one_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each sink's close added its grace second to what was left of the run's timeout, one
    # after another: six sinks on one hung disk took the timeout and six seconds.
    disk = threading.Event()
    _before_spool_writes(monkeypatch, lambda label: disk.wait(60))
    sinks = [GatedSink(f"down{index}") for index in range(6)]  # none writes: all spool
    run = Run(sinks, spool_dir=str(tmp_path), sink_capacity=2)
    try:
        for step in range(1, 11):
            run.log(step, {"lr": 0.1})
        _wait(lambda: all(runner._waiting_in() for runner in run.sink_runners))
        start = time.monotonic()
        assert run.close(timeout=0.2) is False
        took = time.monotonic() - start
        assert took < 4.0, f"close(timeout=0.2) of 6 sinks on a hung disk took {took:.1f} s"
        # Not "healthy": what it had not delivered waits for the disk.
        assert {status.state for status in run.sink_status.values()} == {"failed"}
    finally:
        disk.set()
        for sink in sinks:
            sink.gate.set()


def _three_reports_waiting(spool_dir: Path) -> tuple[SinkRunner, GatedSink]:
    """A started runner whose sink never writes (until its gate opens), with 3 reports."""
    down = GatedSink("down")
    runner = SinkRunner(down, capacity=100, spool_dir=str(spool_dir))
    runner.start()
    for step in range(1, 4):
        runner.submit(_report(step))
    return runner, down


def _before_fsync_under(
    monkeypatch: pytest.MonkeyPatch, folder: Path, wait: Callable[[], object]
) -> None:
    """Call ``wait()`` before every ``fsync`` of a file under ``folder``: a slow or hung disk."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
            wait()
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_close_gives_up_keeping_reports_on_a_spool_disk_that_stopped_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The reports a close could not deliver are kept in a file in spool_dir: with that disk's
    # fsync hung (an NFS server gone) close waited without end, and so did the interpreter's
    # exit, which closes the same way.
    spool_dir = tmp_path / "spool"
    disk = threading.Event()
    runner, down = _three_reports_waiting(spool_dir)
    _before_fsync_under(monkeypatch, spool_dir, lambda: disk.wait(60))
    try:
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="sidestream.sinks"):
            assert runner.close(0.5) is False
        assert time.monotonic() - start < 10, "close waited for the hung disk"
        assert any("stopped answering" in r.getMessage() for r in caplog.records)
        assert runner.status.state == "failed"
    finally:
        disk.set()
        down.gate.set()


def test_a_keep_that_ends_after_close_gave_up_still_names_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An fsync that takes 3 s says nothing while it runs: close gives up on the disk after
    # 2 s without a word from it, and the file it then kept was named nowhere.
    runner, down = _three_reports_waiting(tmp_path)
    _before_fsync_under(monkeypatch, tmp_path, lambda: time.sleep(3))
    try:
        with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
            assert runner.close(0.2) is False
            assert any("stopped answering" in r.getMessage() for r in caplog.records)
            # Named by its folder: an earlier test's late keeper may log into this capture.
            _wait(lambda: any(str(tmp_path) in r.getMessage() for r in caplog.records))
        (kept,) = tmp_path.glob("*.spool.jsonl")
        assert [report.step for report in read_spool(kept)] == [1, 2, 3]
        assert (tmp_path / f"{kept.name}.state.json").exists()
        (said,) = [r.getMessage() for r in caplog.records if str(tmp_path) in r.getMessage()]
        assert "3 report(s) undelivered" in said and str(kept) in said
    finally:
        down.gate.set()


def test_close_keeps_reports_on_a_slow_spool_disk_past_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A disk that is slow but writes is waited for: what close keeps is all there.
    from sidestream.sinks import _spool

    write = _spool.Spool._write_with_spooled

    def slow(self: _spool.Spool, reports: list[Report], newer: Any = ()) -> str:
        for _ in range(30):  # 3 s in all, progress every 0.1 s
            time.sleep(0.1)
            self._progress()
        return write(self, reports, newer)

    monkeypatch.setattr(_spool.Spool, "_write_with_spooled", slow)
    runner, down = _three_reports_waiting(tmp_path)
    try:
        assert runner.close(0.2) is False
        (kept,) = tmp_path.glob("*.spool.jsonl")
        assert [report.step for report in read_spool(kept)] == [1, 2, 3]
    finally:
        down.gate.set()


@pytest.mark.parametrize("owner", ["run", "collector"])
def test_an_interrupted_close_keeps_the_undelivered_reports_and_says_false(
    tmp_path: Path, owner: str
) -> None:
    # Ctrl-C while close waited for a slow sink: the reports still queued died with the sink
    # thread at exit, with no warning and no kept file, and a second close returned True.
    sink = SlowSink(0.2)
    if owner == "run":
        closer: Run | AsyncMetricCollector = Run([sink], spool_dir=str(tmp_path))
        for step in range(1, 21):
            closer.log(step, {"x": float(step)})
    else:
        closer = AsyncMetricCollector(MeanMetric(), sinks=[sink], spool_dir=str(tmp_path))
        closer.bind("cpu")
        for step in range(1, 21):
            closer.metric.update(torch.tensor([float(step)]))
            closer.schedule_collection(step)
        assert closer.wait_windows(timeout=30)
    (runner,) = closer.sink_runners if isinstance(closer, Run) else closer._delivery.runners
    join = runner._thread.join
    calls: list[float | None] = []

    def interrupted(timeout: float | None = None) -> None:
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt  # as Ctrl-C does in the main thread's wait
        join(timeout)

    runner._thread.join = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        closer.close(timeout=30)
    assert closer.close(timeout=30) is False  # not True: reports were not delivered
    (kept,) = tmp_path.glob("*.spool.jsonl")
    time.sleep(0.5)  # the write in flight at close ends: the status still says what was kept
    assert (
        runner.status.state == "failed"
        and "kept in a spool file (close was interrupted)" in str(runner.status.last_error)
    )
    delivered = set(sink.steps)
    sink.gate.clear()  # the sink thread stops taking reports at its next write
    assert delivered | {r.step for r in read_spool(kept)} == set(range(1, 21))
    # A stopped job's code: a replay ends the tracker's run as killed, not finished (the kept
    # code was null, read as a success).
    from sidestream._exit import KILLED_EXIT_CODE
    from sidestream.sinks._spool_format import read_kept_state

    state = read_kept_state(str(kept))
    assert state is not None and state.exit_code == KILLED_EXIT_CODE


def test_a_checkpoint_of_a_busy_sink_holds_its_undelivered_reports(tmp_path: Path) -> None:
    # A checkpoint whose wait used up its timeout asks with 0 s left: a sink or spool thread
    # holding the lock for an instant made it hold none of the sink's reports.
    sink = SlowSink(0.0002)
    runner = SinkRunner(sink, capacity=1, spool_dir=str(tmp_path))
    runner.start()
    for step in range(1, 2001):
        runner.submit(_report(step))
    asked = 0
    while runner.pending > 50:
        steps = [json.loads(line)["step"] for line in runner.undelivered(0.0).splitlines()]
        # Every report still undelivered once it answered was undelivered when it looked (the
        # pending count read before the call raced the deliveries made during it).
        still = set(range(len(sink.steps) + 1, 2001))
        assert still and still <= set(steps) and steps == sorted(steps)
        asked += 1
        time.sleep(0.005)  # a few hundred checkpoints, not tens of thousands
    assert asked > 0
    assert runner.close(30) is True


def test_close_keeps_what_waits_for_a_slow_spool_disk_in_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reports the spool thread had not written yet were spooled one write each at close: on a
    # disk taking 2 ms a write, close(0.5) returned after 6 s.
    _before_spool_writes(monkeypatch, lambda label: time.sleep(0.002))
    sink, runner = _gated_runner_with(3000, tmp_path)
    start = time.monotonic()
    assert runner.close(0.5) is False
    assert time.monotonic() - start < 5
    # On a loaded machine the disk may not be done within close's 0.5 s: close then says so,
    # and what it had not written yet (the queued report too) is kept once the disk answers.
    steps = _kept_steps_once_done(tmp_path, 3000)
    assert steps == list(range(2, 3001)) or steps == list(range(1, 3001))  # 1 may be in a write
    sink.gate.set()


def _gated_runner_with(reports: int, spool_dir: Path) -> tuple[GatedSink, SinkRunner]:
    """A runner whose sink blocks in its first write, ``reports`` submitted (one queued)."""
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=1, spool_dir=str(spool_dir))
    runner.start()
    for step in range(1, reports + 1):
        runner.submit(_report(step))
    return sink, runner


def _kept_steps_once_done(spool_dir: Path, last: int) -> list[int]:
    """The steps of the kept spool file once it is done (its last step ``last``), or at 30 s.

    The kept file replaces the spool file: two files, with the same reports, while it is
    being written.
    """
    deadline, steps = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):  # being written
            files = [p for p in spool_dir.iterdir() if p.suffix != ".json"]
            if len(files) == 1:
                steps = [report.step for report in read_spool(str(files[0]))]
                if steps[-1:] == [last] and steps[:1] in ([1], [2]):
                    break
        time.sleep(0.05)
    return steps


def test_a_close_that_gave_up_on_a_hung_spool_disk_keeps_every_report_once_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # close gave up waiting for the disk and said the reports were kept "if the disk comes
    # back", but those still in memory (the queued one) never reached the file when it did.
    disk = threading.Event()
    _before_spool_writes(monkeypatch, lambda label: disk.wait(60))
    sink, runner = _gated_runner_with(50, tmp_path)
    assert runner.close(0.5) is False  # the spool thread holds the spool, its disk hung
    disk.set()
    steps = _kept_steps_once_done(tmp_path, 50)
    assert steps == list(range(2, 51)) or steps == list(range(1, 51))  # 1 may be in a write
    sink.gate.set()


def test_a_burst_faster_than_the_spool_disk_waits_for_it_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tight run.log loop outran the spool thread's writes on a local disk: once the reports
    # waiting for it were at their cap, every further one dropped the oldest (10,645 of
    # 20,000 lost with a healthy JSONL sink).
    from sidestream.sinks import runner as runner_module

    monkeypatch.setattr(runner_module, "INBOX_MIN_CAPACITY", 8)  # the cap, reached at once
    path = tmp_path / "burst.jsonl"
    run = Run([JsonlSink(path)], spool_dir=str(tmp_path), sink_capacity=4)
    for step in range(1, 3001):
        run.log(step, {"a": float(step), "b": 1.0})
    assert run.close(timeout=60) is True
    (runner,) = run.sink_runners
    assert runner.dropped == 0
    assert [record["step"] for record in read_jsonl(path)] == list(range(1, 3001))


def test_a_submitter_stops_waiting_for_a_spool_disk_that_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sidestream.sinks import runner as runner_module

    disk = threading.Event()
    _before_spool_writes(monkeypatch, lambda label: disk.wait(60))
    monkeypatch.setattr(runner_module, "INBOX_MIN_CAPACITY", 4)
    monkeypatch.setattr(runner_module, "INTAKE_STALL_S", 0.3)
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=1, spool_dir=str(tmp_path))
    runner.start()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        for step in range(1, 31):
            runner.submit(_report(step))
    assert time.monotonic() - start < 10  # one stall's wait, not one per report
    assert runner.dropped > 0
    said = [r.getMessage() for r in caplog.records if "wrote none for" in r.getMessage()]
    assert said and "dropped the oldest, Run.log step " in said[0]  # _report's stream is ""
    # The newest wait; the oldest of those waiting went first.
    waiting = [r.step for r in runner._inbox]
    assert waiting == list(range(31 - len(waiting), 31)), waiting
    disk.set()
    sink.gate.set()
    runner.close(10)


def test_a_burst_after_an_idle_spell_is_not_taken_for_a_hung_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stall clock must start when reports begin to wait, not at the intake thread's last
    # work before a quiet spell: else the first burst after it dropped at once.
    from sidestream.sinks import runner as runner_module

    monkeypatch.setattr(runner_module, "INBOX_MIN_CAPACITY", 4)
    monkeypatch.setattr(runner_module, "INTAKE_STALL_S", 0.2)
    sink = RecordingSink()
    runner = SinkRunner(sink, capacity=1, spool_dir=str(tmp_path))
    runner.start()
    for round_ in range(3):
        time.sleep(0.3)  # idle for longer than the stall limit
        for step in range(1, 201):
            runner.submit(_report(round_ * 1000 + step))
    assert runner.close(30) is True
    assert runner.dropped == 0
    assert len(sink.steps) == 600 and sink.steps == sorted(sink.steps)


class _InterruptedWhileAsked(GatedSink):
    """Stuck in its first write; Ctrl-C arrives while close asks for its pending reports."""

    asked = 0

    def pending_reports(self) -> list[Report]:
        self.asked += 1
        if self.asked == 1:
            raise KeyboardInterrupt
        return []


def test_ctrl_c_while_close_asks_the_sink_keeps_every_queued_report(tmp_path: Path) -> None:
    # close emptied the queue into local lists before the sink's pending_reports ran: Ctrl-C
    # there lost steps 1..9 (step 0, in flight, alone was kept), none counted or logged.
    sink = _InterruptedWhileAsked()
    runner = SinkRunner(sink, capacity=64, spool_dir=tmp_path, retry_initial_s=0.01)
    runner.start()
    for step in range(10):
        runner.submit(_report(step))
    _wait(lambda: runner.pending == 10 and runner.spooled == 0 and not runner._waiting_in())
    with pytest.raises(KeyboardInterrupt):
        runner.close(0.2)
    assert runner.close_now() is False
    kept = [report.step for path in tmp_path.glob("*.spool.jsonl") for report in read_spool(path)]
    assert sorted(kept) == list(range(10)) and runner.dropped == 0
    sink.gate.set()


class _SlowToSay(threading.Event):
    """An Event whose ``set`` is preempted first: a thread switch where it is called."""

    def set(self) -> None:
        time.sleep(0.3)
        super().set()


def test_a_sink_that_fails_for_good_wakes_a_checkpoint_waiting_on_it() -> None:
    # _fail woke the waiters before it set _abandon: one that checked in between waited out
    # its whole timeout (for good with checkpoint_timeout=None).
    class FailsForGood(GatedSink):
        def write(self, report: Report) -> None:
            self.gate.wait(30.0)
            raise ValueError("bad argument")  # permanent: the sink fails for good

    sink = FailsForGood()
    runner = SinkRunner(sink, retry_initial_s=0.01)
    runner._abandon = _SlowToSay()
    runner.start()
    runner.submit(_report(1))
    waited: list[float] = []

    def wait() -> None:
        began = time.monotonic()
        assert not runner.wait_delivered(10.0)
        waited.append(time.monotonic() - began)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)  # the waiter is in its wait
    sink.gate.set()
    waiter.join(15.0)
    assert waited and waited[0] < 5.0, waited
    assert runner.status.state == "failed"
    runner.close(1.0)


def test_a_resumed_run_closed_before_its_sinks_start_delivers_the_checkpoints_reports(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stuck = GatedSink()
    run = Run([stuck], spool_dir=tmp_path)
    for step in range(1, 6):
        run.log(step, {"x": float(step)})
    state = run.state_dict(timeout=0.5)
    assert len(state["undelivered"]["gated"].splitlines()) == 5
    stuck.gate.set()
    assert run.close(timeout=10)
    # The job resumes and ends at once (training was done): close returned True and the
    # checkpoint's five reports went nowhere.
    resumed_sink = GatedSink()
    resumed_sink.gate.set()

    class NewToTheJob(GatedSink):
        def open(self, run: Any) -> None:
            raise AssertionError("a sink with nothing to deliver was opened at close")

    resumed = Run([resumed_sink, NewToTheJob("new")], spool_dir=tmp_path)
    resumed.load_state_dict(state)
    assert resumed.close(timeout=10)
    assert resumed_sink.steps == [1, 2, 3, 4, 5]
    # That close is not registered to run again at exit (it kept the run alive until then).
    from sidestream import _exit

    assert not any(getattr(c, "__self__", None) is resumed for c in _exit._CLOSES)
    # A runner used by hand and closed before it started: its reports are counted and said,
    # each once (a damaged backlog line was counted already).
    runner = SinkRunner(GatedSink(), spool_dir=tmp_path)
    runner.submit_backlog(encode_report(_report(0)) + b"not a report\n")
    for step in range(1, 3):
        runner.submit(_report(step))
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        assert runner.close(1.0) is False
    assert runner.dropped == 4 and "closed before it was started" in caplog.text


def test_drops_from_a_spool_that_stays_full_are_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Every report the sink took from the full spool ended the streak: each later drop was
    # logged again, although the spool never got back to half full.
    class OneAtATime(GatedSink):
        def __init__(self) -> None:
            super().__init__("one")
            self.allowed = threading.Semaphore(0)
            self.wrote = threading.Semaphore(0)

        def write(self, report: Report) -> None:
            self.allowed.acquire()
            self.steps.append(report.step)
            self.wrote.release()

    sink = OneAtATime()
    runner = SinkRunner(sink, capacity=1, spool_dir=tmp_path, spool_max_bytes=2000)
    runner.start()
    step = iter(range(10**6))
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        for _ in range(100):
            runner.submit(_report(next(step)))
        _wait(lambda: not runner._waiting_in() and runner.dropped > 0)
        for _ in range(20):  # the sink takes one, the job logs two: the spool stays full
            sink.allowed.release()
            assert sink.wrote.acquire(timeout=10)
            runner.submit(_report(next(step)))
            runner.submit(_report(next(step)))
            _wait(lambda: not runner._waiting_in())
        assert runner.spooled_bytes > 1000
    drops = [
        r for r in caplog.records if "dropped" in r.getMessage() and "spool full" in r.getMessage()
    ]
    assert runner.dropped > 20 and len(drops) == 1, [r.getMessage()[:80] for r in drops]
    for _ in range(1000):
        sink.allowed.release()
    runner.close(10.0)


def test_a_report_larger_than_the_whole_spool_is_dropped_and_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # It was counted as a drop for a "spool full (0 bytes)": the spool was empty, and the
    # report dropped was the new one.
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=1, spool_dir=tmp_path, spool_max_bytes=400)
    runner.start()
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        runner.submit(_report(1))  # taken by the sink's write, which waits at the gate
        runner.submit(_report(2))  # queued
        values = {f"value_{index}": 1.0 for index in range(40)}
        runner.submit(Report(step=3, values=values, time=3.0))
        runner.submit(_report(4))  # spooled: the spool has room for it
        _wait(lambda: not runner._waiting_in())
    assert runner.dropped == 1
    [message] = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert "could not spool step 3" in message and "more than spool_max_bytes (400)" in message
    assert "spool full" not in message
    sink.gate.set()
    assert runner.close(10.0) is False  # a report was lost
    assert sink.steps == [1, 2, 4]


def test_a_checkpoint_before_the_sinks_start_takes_a_state_that_needs_an_open_backend() -> None:
    class NeedsOpen(GatedSink):
        def state_dict(self) -> dict[str, Any]:
            return {"last": self.last}  # type: ignore[attr-defined]  # set by open only

    run = Run([NeedsOpen()])
    assert run.state_dict()["sinks"] == {"gated": {}}  # it raised AttributeError
    assert run.close(timeout=5)


def test_a_close_interrupted_as_its_keeper_registers_keeps_each_report_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C after the keeper registered, before it emptied the inbox: the intake thread then
    # spooled step 4 behind the keeper's back, which kept it too ([1, 2, 3, 4, 4]).
    sink = GatedSink()
    runner = SinkRunner(sink, capacity=1, spool_dir=tmp_path)
    for step in (1, 2, 3):  # before start: 1 queued, 2 and 3 spooled
        runner.submit(_report(step))
    intake_may_run = threading.Event()
    take_in = runner._take_in

    def held_back() -> None:
        intake_may_run.wait(30.0)
        take_in()

    monkeypatch.setattr(runner, "_take_in", held_back)
    runner.start()
    _wait(lambda: runner.pending == 3 and len(runner._in_flight) == 1)  # step 1 being written
    runner.submit(_report(4))  # the spool is not empty: it waits in the inbox
    forget = runner._forget_queued
    interrupted: list[bool] = []

    def interrupted_once() -> None:
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        forget()

    monkeypatch.setattr(runner, "_forget_queued", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        runner.close(0.2)
    intake_may_run.set()  # it takes _cond now that close let go of it
    time.sleep(0.3)
    assert runner.close_now() is False
    kept = [report.step for path in tmp_path.glob("*.spool.jsonl") for report in read_spool(path)]
    assert kept == [1, 2, 3, 4]
    sink.gate.set()


def test_a_state_file_cut_by_a_full_disk_neither_stays_nor_stops_a_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The state file was truncated and rewritten in place: a full disk at close (the usual
    # reason a spool is kept) left a cut file, and every replay of the spool then failed on
    # it, even one given --sink, its options and --resume-state.
    from sidestream.sinks import _spool_format
    from sidestream.sinks.replay import main

    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(
        b"".join(encode_report(Report(step=s, values={"x": 1.0}, time=0.0)) for s in (1, 2))
    )
    real_replace = os.replace

    def full_disk(source: str, target: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_spool_format.os, "replace", full_disk)
    assert _spool_format.write_kept_state(str(spool), "jsonl", {}, RunInfo()) is None
    monkeypatch.setattr(_spool_format.os, "replace", real_replace)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.spool.jsonl"]  # none cut
    Path(f"{spool}{_spool_format.STATE_SUFFIX}").write_text('{"sink": "jsonl", "sta')
    out = tmp_path / "out.jsonl"
    assert main([str(spool), "--sink", "jsonl", "--option", f"path={out}"]) == 0
    assert "ignoring" in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in out.read_text().splitlines()] == [1, 2]


def test_a_huge_integer_in_a_spool_line_is_a_damaged_line() -> None:
    # float(10**400) raised OverflowError, which no caller took for a damaged line: the
    # replay crashed with a traceback, even with --skip-damaged.
    from sidestream.sinks._spool_format import decode_report

    with pytest.raises(ValueError, match="not a spooled report: OverflowError"):
        decode_report(b'{"step": 1, "values": {"x": 1' + b"0" * 400 + b'}, "time": 0.0}\n')


_HUNG_REPLAY = """
import sys, threading
from sidestream.sinks import jsonl
from sidestream.sinks.replay import main

hang = sys.argv.pop(1)
original = getattr(jsonl.JsonlSink, hang)
calls = []

def hung(self, *args, **kwargs):
    calls.append(1)
    if hang == "open" or len(calls) == 2:  # the open, or the second report's write
        threading.Event().wait()  # a backend call that never returns
    return original(self, *args, **kwargs)

setattr(jsonl.JsonlSink, hang, hung)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("hang", ["open", "send"])
def test_a_replay_whose_sink_never_returns_stops_at_its_timeout(tmp_path: Path, hang: str) -> None:
    # --timeout bounded only the close: a sink whose open (TensorBoard's first flush on a hung
    # disk) or a write never returned kept the command waiting for ever, printing nothing.
    spool = tmp_path / "kept.spool.jsonl"
    spool.write_bytes(b"".join(encode_report(_report(step)) for step in range(1, 4)))
    out = tmp_path / "out.jsonl"
    script = tmp_path / "hung_replay.py"
    script.write_text(_HUNG_REPLAY)
    arguments = [hang, str(spool), "--sink", "jsonl", "--option", f"path={out}", "--timeout", "2"]
    done = subprocess.run(
        [sys.executable, str(script), *arguments], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    waiting_for = "its open" if hang == "open" else "the write of report 2 (of the file's 3)"
    assert f"did not return from {waiting_for}" in done.stderr
    # A slow backend (not a down one) stops at the same call again: the remedy is named.
    assert "with a longer --timeout" in done.stderr
    assert spool.exists()  # kept for a later replay
