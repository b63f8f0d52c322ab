"""Built-in sinks, the per-sink runner and building sinks from a config."""

from __future__ import annotations

import errno
import io
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from sidestream.sinks import (
    ConsoleSink,
    JsonlSink,
    PermanentSinkError,
    Report,
    RunInfo,
    Sink,
    SinkRunner,
    available_sinks,
    is_permanent,
    jsonl,
    read_jsonl,
    read_spool,
    sinks_from_config,
)
from tests.collector.helpers import AlwaysFailingSink, BatchingSink, RecordingSink


def _report(step: int, **values: float) -> Report:
    return Report(step=step, values=values or {"loss": float(step)}, time=1000.0 + step)


def test_jsonl_writes_standard_json_and_resumes_without_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    sink = JsonlSink(path, flush_every=2)
    sink.open(RunInfo())
    sink.write(_report(1, loss=0.5, acc=float("nan"), up=float("inf"), down=float("-inf")))
    assert len(path.read_text().splitlines()) == 1, "delivered means in the file"
    sink.write(
        Report(step=2, values={"loss": 0.25}, time=0.0, histograms={"h": torch.tensor([1, 2])})
    )
    assert len(path.read_text().splitlines()) == 2
    saved = sink.state_dict()
    sink.close()

    resumed = JsonlSink(path)
    resumed.load_state_dict(saved)
    resumed.open(RunInfo())
    for step in (2, 3):  # step 2 was written before the checkpoint
        resumed.write(_report(step))
    resumed.close()

    # Standard JSON: a strict parser (no NaN / Infinity tokens) reads every line.
    def strict(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    lines = [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert lines[0]["values"] == {"loss": 0.5, "acc": "NaN", "up": "Infinity", "down": "-Infinity"}
    read = list(read_jsonl(path))
    assert math.isnan(read[0]["values"]["acc"]) and read[0]["values"]["up"] == math.inf
    assert read[0]["values"]["down"] == -math.inf
    assert lines[1]["histograms"] == {"h": [1, 2]}
    assert lines[2]["time"] == 1003.0
    try:
        import pandas
    except ImportError:
        return
    frame = pandas.read_json(path, lines=True)
    assert list(frame["step"]) == [1, 2, 3] and frame["values"][0]["acc"] == "NaN"


def test_a_step_at_or_below_the_checkpoints_is_skipped_with_a_warning_once_per_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A resumed job whose step counter started again lost every report, silently. Steps a
    crashed job delivered after its checkpoint are still skipped quietly."""
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.open(RunInfo())
    for step in range(1, 6):
        sink.write(Report(step=step, values={"x": 1.0}, time=0.0, stream="train"))
        if step == 3:
            saved = sink.state_dict()  # steps 4 and 5 land after the checkpoint
    sink.close()
    resumed = JsonlSink(path)
    resumed.load_state_dict(saved)
    resumed.open(RunInfo())
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        for step in (4, 5):  # the crashed job's steps after its checkpoint: no warning
            resumed.write(Report(step=step, values={"x": 2.0}, time=0.0, stream="train"))
        assert not caplog.records
        for step in (1, 2, 3, 6):
            resumed.write(Report(step=step, values={"x": 2.0}, time=0.0, stream="train"))
    resumed.close()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "stream 'train' step 1 is at or below step 3" in warning
    assert [line["step"] for line in read_jsonl(path)] == [1, 2, 3, 4, 5, 6]


def test_jsonl_writes_non_finite_values_of_a_2d_histogram_and_reads_them_back(
    tmp_path: Path,
) -> None:
    # A 2-D histogram is nested lists: non-finite values are text at any depth.
    path = tmp_path / "m.jsonl"
    hist = torch.tensor([[1.0, math.inf], [math.nan, -math.inf]], dtype=torch.float64)
    sink = JsonlSink(path)
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"x": math.nan}, time=0.0, histograms={"h": hist}))
    sink.write(Report(step=2, values={"x": 1.0}, time=0.0, histograms={"h": hist[:1, :1]}))
    assert sink.close()

    def strict(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    lines = [json.loads(line, parse_constant=strict) for line in path.read_text().splitlines()]
    assert lines[0]["histograms"] == {"h": [[1.0, "Infinity"], ["NaN", "-Infinity"]]}
    assert lines[1]["histograms"] == {"h": [[1.0]]}
    first, second = read_jsonl(path)
    assert math.isnan(first["values"]["x"])
    torch.testing.assert_close(
        torch.tensor(first["histograms"]["h"], dtype=torch.float64), hist, equal_nan=True
    )
    assert second["histograms"] == {"h": [[1.0]]}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_live_line_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 102.0, 103.0])
    monkeypatch.setattr("sidestream.sinks.console.time.monotonic", lambda: next(clock))
    stream = _Terminal()
    sink = ConsoleSink(stream=stream)
    sink.open(RunInfo())
    sink.write(Report(step=10, values={"train/loss": 0.5}, time=0.0, stream="train"))
    sink.write(Report(step=20, values={"train/loss": 0.25}, time=0.0, stream="train"))
    sink.write(Report(step=10, values={"val/f1": 0.75}, time=0.0, stream="val"))  # late
    assert sink.close()
    frames = stream.getvalue().split("\r")[1:]
    assert all(frame.endswith("\x1b[K") for frame in frames[:-1])
    assert frames[0] == "step 10 | train/loss 0.5\x1b[K"
    assert frames[1] == "step 20 | 5 steps/s | train/loss 0.25\x1b[K"
    # The latest values of every stream; the step stays the latest one, and an older value
    # says its own step.
    assert frames[2] == "step 20 | 5 steps/s | train/loss 0.25 | val/f1 0.75 @10\x1b[K\n"
    # Off a terminal: plain lines.
    plain = io.StringIO()
    sink = ConsoleSink(stream=plain)
    sink.open(RunInfo())
    sink.write(Report(step=10, values={"train/loss": 0.5}, time=0.0, stream="train"))
    assert plain.getvalue() == "step 10 | train/loss 0.5\n"


def test_console_line() -> None:
    stream = io.StringIO()
    sink = ConsoleSink(stream=stream, max_values=2, every=2)
    sink.open(RunInfo(name="demo"))
    for step in (1, 2, 3):
        sink.write(_report(step, **{"train/loss": 0.123456, "acc": float("inf"), "x": 1.0}))
    assert stream.getvalue().splitlines() == [
        "run demo",
        "step 1 | train/loss 0.1235 | acc inf | ... (+1 more)",
        "step 3 | train/loss 0.1235 | acc inf | ... (+1 more)",
    ]


def test_console_every_counts_each_stream_apart() -> None:
    # One count across streams: a train window and a run.log per step with every=2 printed
    # only the train lines, and lr never.
    stream = io.StringIO()
    sink = ConsoleSink(stream=stream, every=2, live=False)
    sink.open(RunInfo())
    for step in (1, 2, 3):
        sink.write(Report(step=step, values={"train/loss": 1.0}, time=0.0, stream="train"))
        sink.write(Report(step=step, values={"lr": 0.5}, time=0.0))
    assert stream.getvalue().splitlines() == [
        "step 1 | train/loss 1",
        "step 1 | lr 0.5",
        "step 3 | train/loss 1",
        "step 3 | lr 0.5",
    ]


def test_console_writes_each_line_with_its_newline_at_once() -> None:
    """A print of the training thread between a line and its newline split the line."""

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return super().write(text)

    stream = Writes()
    sink = ConsoleSink(stream=stream, live=False)
    sink.open(RunInfo(name="demo"))
    sink.write(_report(1, loss=0.5))
    assert stream.calls == ["run demo\n", "step 1 | loss 0.5\n"]


def test_sinks_from_config_by_entry_point(tmp_path: Path) -> None:
    assert {"jsonl", "console"} <= set(available_sinks())
    built = sinks_from_config({"jsonl": {"path": tmp_path / "a.jsonl"}, "console": None})
    assert [type(s) for s in built] == [JsonlSink, ConsoleSink]
    built = sinks_from_config(
        ["console", {"type": "jsonl", "path": tmp_path / "b.jsonl", "flush_every": 3}]
    )
    assert isinstance(built[1], JsonlSink) and built[1].path == tmp_path / "b.jsonl"


@pytest.mark.parametrize("name", ["mlflow", "wandb", "tensorboard"])
def test_missing_integration_names_the_extra(name: str) -> None:
    if name in available_sinks():
        pytest.skip(f"{name} integration installed here")
    with pytest.raises(LookupError, match=rf'pip install "sidestream\[{name}\]"'):
        sinks_from_config([name])


def test_unknown_sink_and_bad_options() -> None:
    with pytest.raises(LookupError, match=r"'nosuch' is unknown; installed sinks: .*jsonl"):
        sinks_from_config(["nosuch"])
    with pytest.raises(LookupError, match=r"'jsnol' is unknown \(did you mean 'jsonl'\?\)"):
        sinks_from_config(["jsnol"])
    with pytest.raises(LookupError, match=r"'JSONL' is unknown \(did you mean 'jsonl'\?\)"):
        sinks_from_config(["JSONL"])
    with pytest.raises(LookupError) as unknown:
        sinks_from_config(["nosuch"])
    offered = str(unknown.value).partition("(optional: ")[2].partition(" via ")[0].split(", ")
    missing = [
        extra for extra in ("mlflow", "tensorboard", "wandb") if extra not in available_sinks()
    ]
    assert [extra for extra in offered if extra] == missing  # installed ones are not offered
    with pytest.raises(TypeError, match="sink 'jsonl'"):
        sinks_from_config({"jsonl": {"paht": "x"}})
    with pytest.raises(TypeError, match="options of 'console' must be a dict"):
        sinks_from_config({"console": 3})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="names or dicts with a 'type'"):
        sinks_from_config([{"path": "x"}])
    # A required option left out is named with how to give it (Python's own error named
    # neither the sink nor the config: "__init__() missing 1 required positional argument").
    for config in ({"jsonl": {}}, {"jsonl": None}, ["jsonl"]):
        with pytest.raises(
            TypeError, match=r"sink 'jsonl': missing required option\(s\) \['path'\]"
        ):
            sinks_from_config(config)  # type: ignore[arg-type]


_FROM_ENV: Any = None


def test_a_factory_that_fills_a_required_option_itself_still_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """functools.wraps shows the class's signature, whose path the factory fills itself: only
    the factory's own refusal is explained as a missing option."""
    import functools
    from importlib.metadata import EntryPoint

    from sidestream.sinks import config

    @functools.wraps(JsonlSink)
    def from_env(**options: Any) -> JsonlSink:
        options.setdefault("path", str(tmp_path / "env.jsonl"))
        return JsonlSink(**options)

    monkeypatch.setitem(globals(), "_FROM_ENV", from_env)
    entry = EntryPoint("env_jsonl", f"{__name__}:_FROM_ENV", "sidestream.sinks")
    monkeypatch.setattr(config, "entry_points", lambda **_: [entry])
    (built,) = sinks_from_config({"env_jsonl": {}})
    assert isinstance(built, JsonlSink) and built.path == tmp_path / "env.jsonl"


def test_runner_spools_overflow_and_keeps_order(tmp_path: Path) -> None:
    import threading

    looked = threading.Event()  # a sink slower than the submits: none written until then

    class Held(RecordingSink):
        def write(self, report: Report) -> None:
            looked.wait(30)
            super().write(report)

    sink = Held()
    runner = SinkRunner(sink, capacity=2, spool_dir=str(tmp_path))
    runner.start()
    for step in range(1, 21):
        runner.submit(_report(step))
    deadline = time.monotonic() + 20
    while runner._waiting_in() and time.monotonic() < deadline:  # the intake thread spools
        time.sleep(0.01)
    assert runner.spooled > 0, "a full queue spills to disk instead of blocking or dropping"
    looked.set()
    assert runner.close(timeout=30) is True
    assert sink.steps == list(range(1, 21))
    assert sink.closed and len(sink.opened) == 1
    assert list(tmp_path.iterdir()) == [], "the spool file is removed once drained"


def test_runner_sends_a_backlog_in_batches_and_retries_them_whole(tmp_path: Path) -> None:
    sink = BatchingSink(failures=1)
    runner = SinkRunner(sink, capacity=4, spool_dir=str(tmp_path), retry_initial_s=0.01)
    for step in range(1, 13):  # a backlog before the thread starts: queue and spool
        runner.submit(_report(step))
    assert runner.spooled == 8
    runner.start()
    assert runner.close(timeout=30) is True
    assert sink.steps == list(range(1, 13))
    assert runner.delivered == 12
    # The first call took the oldest five, failed, and the same five were sent again.
    assert sink.calls[0] == sink.calls[1] == [1, 2, 3, 4, 5]
    assert all(1 <= len(call) <= BatchingSink.max_batch for call in sink.calls)
    assert len(sink.calls) <= 5, sink.calls


def test_retry_waits_past_a_day_are_refused_when_built() -> None:
    """A wait past threading.TIMEOUT_MAX ended the sink's thread at the first failure (an
    OverflowError), and close then lost its queued reports without a word."""
    from sidestream import Run

    with pytest.raises(ValueError, match=r"sink_retry_initial_s, sink_retry_max_s: .*\(a day\)"):
        Run(sink_retry_initial_s=1e11, sink_retry_max_s=1e11)
    with pytest.raises(ValueError, match=r"retry_initial_s, retry_max_s: expected 0 < initial"):
        SinkRunner(RecordingSink(), retry_max_s=float("inf"))
    with pytest.raises(TypeError, match="retry_initial_s: expected a number of seconds"):
        SinkRunner(RecordingSink(), retry_initial_s="1")  # type: ignore[arg-type]


def test_an_error_that_ends_the_sink_thread_keeps_its_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error in the thread (a bug of ours) fails the sink: its reports are kept
    in the spool at close, counted, and close returns False, instead of being taken for
    delivered."""
    sink = RecordingSink()
    runner = SinkRunner(sink, spool_dir=str(tmp_path))

    def broken(*args: Any) -> Any:
        raise OverflowError("timestamp out of range for platform time_t")

    monkeypatch.setattr(runner, "_next", broken)
    for step in range(1, 6):
        runner.submit(_report(step))
    runner.start()
    runner._thread.join(10)
    assert not runner._thread.is_alive()
    assert runner.status.state == "failed"
    assert "OverflowError" in (runner.status.last_error or "")
    assert runner.close(timeout=5) is False
    kept = sorted(tmp_path.glob("*.spool.jsonl"))
    assert len(kept) == 1
    assert [report.step for report in read_spool(kept[0])] == [1, 2, 3, 4, 5]
    assert sink.steps == []


def test_a_close_that_does_not_finish_in_time_leaves_the_sink_failed(tmp_path: Path) -> None:
    """Every report was delivered, but the sink's close hung: close returns False, and the
    status said "healthy" (its backend may lack what that close would have flushed)."""
    import threading

    release = threading.Event()

    class HangingClose(RecordingSink):
        def close(self, timeout: float | None = None) -> bool:
            release.wait(30)
            return super().close(timeout)

    runner = SinkRunner(HangingClose(), spool_dir=str(tmp_path))
    runner.start()
    runner.submit(_report(1))
    try:
        assert runner.close(timeout=0.5) is False
        assert runner.status.state == "failed"
        assert "close did not finish within 0.5 s" in (runner.status.last_error or "")
    finally:
        release.set()


def test_default_write_batch_writes_one_by_one() -> None:
    sink = RecordingSink()
    sink.write_batch([_report(1), _report(2)])
    assert sink.steps == [1, 2] and Sink.max_batch == 1


def test_a_sink_without_its_own_write_batch_gets_reports_one_at_a_time(tmp_path: Path) -> None:
    # max_batch > 1 with the default write_batch: a batch retried whole after a failure
    # part-way wrote the reports before the failure again (and a batch that failed somewhere
    # every time never got through).
    class Flaky(RecordingSink):
        max_batch = 8

        tries = 0

        def write(self, report: Report) -> None:
            self.tries += 1
            if self.tries % 3 == 0:
                raise ConnectionError("lost")
            super().write(report)

    sink = Flaky()
    runner = SinkRunner(sink, capacity=4, spool_dir=str(tmp_path), retry_initial_s=0.001)
    for step in range(1, 21):  # a backlog before the thread starts: queue and spool
        runner.submit(_report(step))
    runner.start()
    assert runner.close(timeout=30) is True
    assert sink.steps == list(range(1, 21)), "each step once, in order"
    assert runner.delivered == 20


def test_runner_keeps_undeliverable_reports_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = AlwaysFailingSink()
    runner = SinkRunner(sink, spool_dir=str(tmp_path), retry_initial_s=0.01, retry_max_s=0.02)
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        runner.start()
        for step in range(1, 6):
            runner.submit(_report(step))
        time.sleep(0.3)
        assert runner.close(timeout=0.2) is False
    assert sink.attempts > 5, "failed writes are retried"
    retry_warnings = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retry_warnings) == 1, "a failure streak is reported once, not per attempt"
    kept = [r for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(kept) == 1 and "5 report(s)" in kept[0].getMessage()
    (spool,) = tmp_path.glob("*.spool.jsonl")  # and its .state.json beside
    reports = list(read_spool(spool))
    assert [r.step for r in reports] == [1, 2, 3, 4, 5]


class _StalledFlushSink(RecordingSink):
    """A backend that stalls: its flushes do not finish until ``stalled`` is cleared, and
    raise ``OSError`` while ``raising`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled = True
        self.raising = False
        self.flushes = 0

    def flush(self, timeout: float | None = None) -> bool:
        # The flags are read before the count the test waits for: once it sees the count, it
        # may set them for the next flush, and must not change this one's outcome.
        raising, stalled = self.raising, self.stalled
        self.flushes += 1
        if raising:
            raise OSError("disk error")
        return not stalled


def test_a_stalled_flush_is_logged_once_per_streak_and_its_recovery_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = _StalledFlushSink()
    runner = SinkRunner(sink, flush_interval_s=0.001)

    def write_and_flush(step: int) -> None:
        flushes = sink.flushes
        runner.submit(_report(step))
        deadline = time.monotonic() + 10
        while sink.flushes == flushes and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sink.flushes > flushes, "each write is followed by an idle flush"

    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        runner.start()
        for step in range(1, 6):
            write_and_flush(step)
        sink.stalled = False
        write_and_flush(6)
        sink.stalled = True
        write_and_flush(7)
        sink.raising = True  # a failure of another kind within the streak is not hidden
        write_and_flush(8)
        write_and_flush(9)
        sink.stalled = sink.raising = False
        assert runner.close(10.0)
    messages = [r.getMessage() for r in caplog.records]
    stalls = [m for m in messages if "flush did not finish" in m]
    raised = [m for m in messages if "flush failed: OSError: disk error" in m]
    recoveries = [m for m in messages if "flush finished again" in m]
    assert len(stalls) == 2, messages  # one per streak, not one per flush
    assert len(raised) == 1, messages
    assert len(recoveries) == 1 and "after 5 failed" in recoveries[0], messages
    assert sink.steps == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_jsonl_resume_skips_steps_logged_after_the_checkpoint_and_heals_cut_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"step": 1, "time": 0, "values": {}}\n{"step": 4, "time": 0, "values": {}}\n{"st'
    )
    sink = JsonlSink(path)
    sink.load_state_dict({"path": str(path), "last_step": 1})  # the checkpoint: step 1
    sink.open(RunInfo())
    for step in (2, 4, 5):
        sink.write(_report(step))
    sink.close()
    lines = path.read_text().splitlines()  # the cut line is cut off: every line is JSON
    assert [json.loads(line)["step"] for line in lines] == [1, 4, 5]


def test_jsonl_resume_of_an_older_streamless_file_skips_each_streams_later_steps(
    tmp_path: Path,
) -> None:
    # A collector's file and checkpoint from before streams (an older sidestream): lines
    # without "stream", a state with one "last_step" for every stream. Its last line was read
    # as stream "", so the collector's stream "train" wrote steps 7 and 8 (delivered after
    # the checkpoint) again.
    path = tmp_path / "m.jsonl"
    path.write_text(
        "".join(
            f'{{"step": {step}, "time": 0, "values": {{"train/loss": 1.0}}}}\n'
            for step in range(1, 9)
        )
    )
    sink = JsonlSink(path)
    sink.load_state_dict({"path": str(path), "last_step": 6})  # the checkpoint: step 6
    sink.open(RunInfo())
    for step in range(7, 11):
        sink.write(Report(step=step, values={"train/loss": 2.0}, time=0.0, stream="train"))
    sink.write(Report(step=8, values={"lr": 0.1}, time=0.0))  # run.log's stream: 8 is there
    sink.write(Report(step=9, values={"lr": 0.1}, time=0.0))
    sink.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r.get("stream"), r["step"]) for r in records[8:]] == [
        ("train", 9),
        ("train", 10),
        ("", 9),
    ]
    assert sink.last_steps() == {"train": 10, "": 9}


def test_jsonl_keeps_a_whole_last_line_that_lacks_its_newline(tmp_path: Path) -> None:
    # A whole record with no newline (another tool wrote it, or a crash came just before the
    # newline) was deleted as a cut line.
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "time": 0, "values": {}}\n{"step": 4, "time": 0, "values": {}}')
    sink = JsonlSink(path)
    sink.load_state_dict({"path": str(path), "last_step": 1})
    sink.open(RunInfo())
    for step in (2, 4, 5):  # 4 is in the file already: skipped
        sink.write(_report(step))
    sink.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 4, 5]
    assert path.read_text().endswith("\n")


def test_jsonl_relative_path_resumes_the_same_file_from_another_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for folder in "ab":
        (tmp_path / folder).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first = JsonlSink("m.jsonl")
    first.open(RunInfo())
    for step in (1, 2, 3):
        first.write(_report(step))
        if step == 2:
            checkpoint = first.state_dict()
    first.close()
    monkeypatch.chdir(tmp_path / "b")  # the requeued job starts elsewhere
    (tmp_path / "b" / "m.jsonl").write_text('{"step": 9, "time": 0, "values": {}}\n')
    resumed = JsonlSink(tmp_path / "a" / "m.jsonl")
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo())
    for step in (3, 4):
        resumed.write(_report(step))
    resumed.close()
    lines = (tmp_path / "a" / "m.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_jsonl_cut_by_a_failed_write_is_cut_back_before_the_retry(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.open(RunInfo())
    sink.write(_report(1))
    assert sink._file is not None
    sink._file.write(b'{"step": 2, "ti')  # what a write cut by a full disk leaves
    sink._cut = True
    sink.write(_report(2))  # the pipeline's retry
    sink.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


class _FillingFile:
    """A file on a disk that fills up: the first write takes part of the data, then fails."""

    def __init__(self, file: Any, room: int) -> None:
        self._file, self._room = file, room

    def write(self, data: Any) -> int:
        if self._room <= 0:
            raise OSError(28, "No space left on device")
        taken = self._file.write(bytes(data[: self._room]))
        self._room -= taken
        return taken

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def test_jsonl_closed_on_a_full_disk_leaves_whole_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.open(RunInfo())
    sink.write(_report(1))
    sink._file = _FillingFile(sink._file, room=7)  # type: ignore[assignment]
    with pytest.raises(OSError, match="No space"):
        sink.write(_report(2))  # the disk stays full: no retry gets through before close
    sink.close()
    assert path.read_bytes().endswith(b"\n")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


def test_jsonl_checkpoint_of_another_file_gives_no_offset_into_this_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lines already in the new file (another job's steps 100-139) do not make the resumed
    sink skip its own steps."""
    first = JsonlSink(tmp_path / "a.jsonl")
    first.open(RunInfo())
    for step in range(1, 11):
        first.write(_report(step))
    checkpoint = first.state_dict()
    first.close()
    other = tmp_path / "b.jsonl"
    other.write_text(
        "".join(json.dumps({"step": s, "time": 0, "values": {}}) + "\n" for s in range(100, 140))
    )
    resumed = JsonlSink(other)
    resumed.load_state_dict(checkpoint)
    with caplog.at_level("WARNING", logger="sidestream.sinks"):
        resumed.open(RunInfo())
    for step in range(8, 21):
        resumed.write(_report(step))
    resumed.close()
    assert "a.jsonl" in caplog.text and "b.jsonl" in caplog.text
    steps = [record["step"] for record in read_jsonl(other)]
    assert steps == list(range(100, 140)) + list(range(11, 21))


def test_jsonl_file_shorter_than_its_checkpoint_says_so_on_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older copy of the file put back before resuming lacks lines the checkpoint counted
    as delivered: the resumed sink cannot bring them back, but says so (it said nothing)."""
    path = tmp_path / "m.jsonl"
    first = JsonlSink(path)
    first.open(RunInfo())
    for step in range(1, 6):
        first.write(_report(step))
    older = path.read_bytes()  # a backup taken at step 5
    for step in range(6, 11):
        first.write(_report(step))
    checkpoint = first.state_dict()
    first.close()
    path.write_bytes(older)
    resumed = JsonlSink(path)
    resumed.load_state_dict(checkpoint)
    with caplog.at_level("WARNING", logger="sidestream.sinks"):
        resumed.open(RunInfo())
    resumed.close()
    assert f"holds {len(older)} bytes, fewer than the" in caplog.text
    assert "an older copy put back, or the file cut" in caplog.text


def test_sink_whose_module_fails_to_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    import sidestream.sinks.config as config

    broken = EntryPoint(name="mlflow", value="no_such_module_xyz:Sink", group="sidestream.sinks")
    monkeypatch.setattr(config, "entry_points", lambda group: [broken])
    with pytest.raises(
        LookupError, match=r'could not be imported .*pip install "sidestream\[mlflow\]"'
    ):
        sinks_from_config(["mlflow"])


@pytest.mark.parametrize(
    ("value", "cause"),
    [
        ("sidestream.sinks.config:NoSuchSink", "AttributeError"),  # names no object
        (f"{__name__}:_PLUGIN_THAT_RAISES.sink", "AttributeError"),
    ],
)
def test_a_broken_third_party_sink_is_named_with_its_entry_point(
    monkeypatch: pytest.MonkeyPatch, value: str, cause: str
) -> None:
    """A plugin that fails to load raised its bare error (an AttributeError, a plugin's own
    RuntimeError or SyntaxError at import), naming neither the sink nor the entry point."""
    from importlib.metadata import EntryPoint

    import sidestream.sinks.config as config

    entry = EntryPoint(name="thirdparty", value=value, group="sidestream.sinks")
    monkeypatch.setattr(config, "entry_points", lambda group: [entry])
    with pytest.raises(
        LookupError, match=rf"sink 'thirdparty': loading its entry point '{value}' failed: {cause}"
    ):
        sinks_from_config(["thirdparty"])


def test_a_sink_module_raising_at_import_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from importlib.metadata import EntryPoint

    import sidestream.sinks.config as config

    (tmp_path / "plugin_that_breaks.py").write_text("raise RuntimeError('broke at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = EntryPoint("breaks", "plugin_that_breaks:Sink", "sidestream.sinks")
    monkeypatch.setattr(config, "entry_points", lambda group: [entry])
    with pytest.raises(LookupError, match=r"sink 'breaks': .*RuntimeError: broke at import"):
        sinks_from_config(["breaks"])


_PLUGIN_THAT_RAISES = object()


class _ClientCheckRaises:
    @staticmethod
    def check_available() -> None:
        raise RuntimeError("client 0.1 is too old")


def test_a_client_check_that_raises_otherwise_is_named_with_the_sink(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib.metadata import EntryPoint

    import sidestream.sinks.config as config

    entry = EntryPoint("oldclient", f"{__name__}:_ClientCheckRaises", "sidestream.sinks")
    monkeypatch.setattr(config, "entry_points", lambda group: [entry])
    with pytest.raises(
        LookupError, match="sink 'oldclient': checking its tracker client failed: RuntimeError"
    ):
        sinks_from_config(["oldclient"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fsync": "yes"}, "fsync: expected True or False, got 'yes'"),
        ({"flush_every": 2.5}, "flush_every: expected an int >= 1, got 2.5"),
    ],
)
def test_jsonl_options_of_the_wrong_type_are_refused(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        sinks_from_config({"jsonl": {"path": str(tmp_path / "m.jsonl"), **options}})


def test_console_output_closed_by_its_reader_fails_for_good_at_once() -> None:
    """``python train.py | head``: a closed pipe takes no later line, so nothing is retried or
    kept for 30 s at close."""
    import io

    from sidestream.sinks import ConsoleSink, PermanentSinkError

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    sink = ConsoleSink(stream=ClosedPipe())
    sink.open(RunInfo())
    with pytest.raises(PermanentSinkError, match="output was closed"):
        sink.write(_report(1))
    # A run with a name prints it at open: that BrokenPipeError (a ConnectionError) was
    # retried as transient until close, which then kept a spool file.
    named = ConsoleSink(stream=ClosedPipe())
    with pytest.raises(PermanentSinkError, match="output was closed"):
        named.open(RunInfo(name="exp1"))


def test_console_escapes_a_name_its_encoding_cannot_show() -> None:
    # On an ASCII (or cp1252) console a value named "λ" raised UnicodeEncodeError, a
    # ValueError, so the sink failed for good: no later line, and close() returned False.
    import io

    from sidestream.sinks import ConsoleSink

    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii", write_through=True)
    sink = ConsoleSink(stream=stream, live=False)
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"loss": 0.5, "λ": 0.1}, time=0.0))
    sink.write(Report(step=2, values={"loss": 0.4}, time=0.0))
    assert sink.close()
    assert raw.getvalue().decode("ascii").splitlines() == [
        "step 1 | loss 0.5 | \\u03bb 0.1",
        "step 2 | loss 0.4",
    ]


def test_console_escapes_control_characters_in_names() -> None:
    # A newline in a name broke a report's line in two (a live line scrolled at each redraw),
    # and an escape sequence or a right-to-left override in a name acted on the terminal.
    import io

    from sidestream.sinks import ConsoleSink

    stream = io.StringIO()
    sink = ConsoleSink(stream=stream, live=False)
    sink.open(RunInfo(name="exp\n1"))
    sink.write(Report(step=1, values={"new\nline": 0.5, "\x1b[31mred": 1.0}, time=0.0))
    sink.write(Report(step=2, values={"\u202eltr": 2.0, "tab\t": 3.0, "λ": 4.0}, time=0.0))
    assert stream.getvalue().splitlines() == [
        "run exp\\n1",
        "step 1 | new\\nline 0.5 | \\x1b[31mred 1",
        "step 2 | \\u202eltr 2 | tab\\t 3 | λ 4",
    ]
    live = io.StringIO()
    sink = ConsoleSink(stream=live, live=True)
    sink.open(RunInfo())
    sink.write(Report(step=1, values={"a\nb": 0.5}, time=0.0))
    assert "\n" not in live.getvalue() and "a\\nb 0.5" in live.getvalue()


def test_jsonl_to_a_pipe_with_fsync_writes_each_line_once(tmp_path: Path) -> None:
    # fsync fails on a pipe (EINVAL): the write was retried as transient, and each retry wrote
    # a newline and the line again, forever (invalid JSONL, close() False).
    import os
    import threading

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(fifo.open("rb").read().splitlines()))
    reader.start()
    runner = SinkRunner(JsonlSink(fifo, fsync=True))
    runner.start()
    for step in (1, 2):
        runner.submit(Report(step=step, values={"x": float(step)}, time=time.time()))
    assert runner.close(10.0)
    reader.join(10.0)
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_jsonl_to_a_fifo_with_no_reader_refuses_to_open_at_once(tmp_path: Path) -> None:
    # open() of a FIFO nobody reads waited for a reader for good: the sink's thread hung,
    # saying nothing, until close ran out its timeout.
    import threading

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    sink = JsonlSink(fifo)
    raised: list[BaseException] = []

    def open_sink() -> None:
        try:
            sink.open(RunInfo())
        except OSError as error:
            raised.append(error)

    opener = threading.Thread(target=open_sink, daemon=True)
    opener.start()
    opener.join(10.0)
    if opener.is_alive():  # the old behaviour: let the hung open go before failing
        with fifo.open("rb"):
            pass
        pytest.fail("JsonlSink.open waited for a reader of the FIFO")
    assert len(raised) == 1
    error = raised[0]
    assert isinstance(error, OSError) and error.errno == errno.ENXIO
    assert str(fifo) in str(error) and "no reader attached" in str(error)
    assert not is_permanent(error)  # a reader started later gets the reports


def test_jsonl_to_a_fifo_delivers_once_a_reader_attaches(tmp_path: Path) -> None:
    import threading

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    runner = SinkRunner(JsonlSink(fifo), retry_initial_s=0.05, retry_max_s=0.2)
    runner.start()
    for step in (1, 2, 3):
        runner.submit(Report(step=step, values={"x": float(step)}, time=time.time()))
    deadline = time.monotonic() + 30.0
    while runner.status.state != "retrying" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.status.state == "retrying", runner.status
    assert "no reader attached" in str(runner.status.last_error)
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(fifo.open("rb").read().splitlines()))
    reader.start()
    assert runner.close(30.0)
    reader.join(10.0)
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_a_sink_raising_a_base_exception_fails_for_good_and_keeps_its_reports(
    tmp_path: Path,
) -> None:
    """SystemExit from a tracker client ended the sink's thread: status healthy, close False
    with no warning, the spool file deleted, 36 of 40 reports gone without a count."""
    from sidestream import Run
    from sidestream.sinks import read_spool

    class Exiting(RecordingSink):
        def write(self, report: Report) -> None:
            if report.step >= 3:
                raise SystemExit("the client called sys.exit")
            super().write(report)

    sink = Exiting(name="exiting")
    run = Run([sink], spool_dir=str(tmp_path))
    for step in range(1, 9):
        run.log(step, {"x": float(step)})
    assert not run.close(timeout=30)
    status = run.sink_status["exiting"]
    assert status.state == "failed" and "SystemExit" in (status.last_error or "")
    assert [report.step for report in sink.reports] == [1, 2]
    (kept,) = tmp_path.glob("*.spool.jsonl")
    assert [report.step for report in read_spool(kept)] == list(range(3, 9))


def test_sinks_from_a_source_tree_without_entry_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PYTHONPATH on the src/ folders, nothing installed: no distribution declares entry points.
    from sidestream.sinks import config

    monkeypatch.setattr(config, "entry_points", lambda group: [])
    assert {"jsonl", "console"} <= set(available_sinks())
    built = sinks_from_config({"jsonl": {"path": tmp_path / "a.jsonl"}, "console": None})
    assert [type(s) for s in built] == [JsonlSink, ConsoleSink]
    with pytest.raises(LookupError, match=r"'jsnol' is unknown \(did you mean 'jsonl'\?\)"):
        sinks_from_config(["jsnol"])


class _NeedsClient(JsonlSink):
    message = ""

    @classmethod
    def check_available(cls) -> None:
        raise ImportError(cls.message)


@pytest.mark.parametrize(
    ("message", "hint_at_end"),
    [
        ('ThatSink needs thatclient: pip install "thatclient"', False),  # said once
        ("No module named 'thatclient'", True),
    ],
)
def test_a_missing_client_is_named_with_one_install_hint(
    monkeypatch: pytest.MonkeyPatch, message: str, hint_at_end: bool
) -> None:
    from importlib.metadata import EntryPoint

    from sidestream.sinks import config

    monkeypatch.setattr(_NeedsClient, "message", message)
    entry = EntryPoint("thattracker", f"{__name__}:_NeedsClient", config.ENTRY_POINT_GROUP)
    monkeypatch.setattr(config, "_sink_entry_points", lambda: {"thattracker": entry})
    with pytest.raises(LookupError) as error:
        sinks_from_config(["thattracker"])
    text = str(error.value)
    assert text.startswith(f"sink 'thattracker': {message}")
    assert text.endswith("(install the tracker's client)") == hint_at_end, text
    for name in ("mlflow", "tensorboard", "wandb"):  # the integrations say the core's hint
        module = pytest.importorskip(f"sidestream_{name}")
        assert config.install_hint(name) == module.sink.INSTALL


def test_a_module_stub_without_a_spec_does_not_break_sink_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    # find_spec raises ValueError for a module in sys.modules whose __spec__ is None.
    monkeypatch.setitem(sys.modules, "sidestream_wandb", types.ModuleType("sidestream_wandb"))
    assert {"jsonl", "console"} <= set(available_sinks())


@pytest.mark.parametrize(
    "content",
    [bytes(range(256)) * 400, b"step,loss\n1,0.5\n2,0.4", b"not json\n"],
    ids=["binary", "csv", "text"],
)
def test_jsonl_refuses_a_file_of_another_kind_instead_of_cutting_its_end(
    tmp_path: Path, content: bytes
) -> None:
    # A model file given as the path lost its end (cut off as a "torn line"): refused, whole.
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not JSON lines"):
        JsonlSink(path)
    sink = JsonlSink(tmp_path / "later.pt")  # made before the file appears: refused at open
    (tmp_path / "later.pt").write_bytes(content)
    with pytest.raises(ValueError, match="is not JSON lines"):
        sink.open(RunInfo())
    assert path.read_bytes() == content == (tmp_path / "later.pt").read_bytes()


def test_jsonl_cuts_a_torn_first_line_of_its_own_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "str')  # a crash during the very first write
    sink = JsonlSink(path)
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        sink.open(RunInfo())
    sink.write(_report(1))
    assert sink.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]
    assert "16 bytes of a line cut short" in caplog.text


def test_jsonl_checkpoint_before_open_points_where_lines_start_after_a_torn_line(
    tmp_path: Path,
) -> None:
    # The offset counted the torn bytes open then cut: a resumed job read from mid-line, missed
    # stream "a"'s line and wrote its step again.
    path = tmp_path / "m.jsonl"
    torn = '{"step": 2, "stream": "b", "values": {' + '"x": 1.0, ' * 6  # about 1.5 lines
    path.write_text('{"step": 1, "stream": "", "time": 0, "values": {}}\n' + torn)
    first = JsonlSink(path)
    checkpoint = first.state_dict()  # before open
    first.open(RunInfo())
    first.write(Report(step=2, values={"x": 1.0}, time=0.0, stream="a"))
    for step in (2, 3, 4):
        first.write(Report(step=step, values={"x": 1.0}, time=0.0, stream="b"))
    first.close()
    resumed = JsonlSink(path)
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo())
    resumed.write(Report(step=2, values={"x": 1.0}, time=0.0, stream="a"))
    resumed.write(Report(step=5, values={"x": 1.0}, time=0.0, stream="b"))
    resumed.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(row["stream"], row["step"]) for row in rows] == [
        ("", 1),
        ("a", 2),
        ("b", 2),
        ("b", 3),
        ("b", 4),
        ("b", 5),
    ]


_STDOUT_SINK = """
import sys
from sidestream.sinks import JsonlSink, Report, RunInfo
sink = JsonlSink(sys.argv[1])
sink.open(RunInfo())
sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
print("the trainer prints", flush=True)
sink.write(Report(step=2, values={"x": 2.0}, time=0.0))
print(sink.close(), flush=True)
"""


@pytest.mark.parametrize("earlier", ["", "epoch 0 starting\n"], ids=["empty", "text"])
@pytest.mark.parametrize("name", ["/dev/stdout", "link"])
def test_jsonl_to_stdout_shares_a_log_file_with_the_trainer(
    tmp_path: Path, name: str, earlier: str
) -> None:
    # stdout appended to a log (nohup, SLURM, >>): the log is a regular file, but the trainer's
    # own prints go there too; the sink took them for another writer and failed for good.
    # A log that held text before the sink was built was refused as "not JSON lines".
    path = name
    if name == "link":
        (tmp_path / "out.jsonl").symlink_to("/dev/stdout")
        path = str(tmp_path / "out.jsonl")
    log = tmp_path / "log.txt"
    log.write_text(earlier)
    with log.open("ab") as out:
        subprocess.run(
            [sys.executable, "-c", _STDOUT_SINK, path], stdout=out, check=True, timeout=60
        )
    lines = log.read_text().splitlines()[1 if earlier else 0 :]
    assert lines[1:] == ["the trainer prints", lines[2], "True"]
    assert [json.loads(lines[i])["step"] for i in (0, 2)] == [1, 2]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_jsonl_resumed_on_a_file_under_dev_shm_writes_each_step_once() -> None:
    # Any path under /dev or /proc was taken for a stream: a tmpfs file in /dev/shm had no
    # checkpoint offset, so the resumed job wrote its steps after the checkpoint again.
    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        path = folder / "m.jsonl"
        first = JsonlSink(path)
        first.open(RunInfo())
        for step in (1, 2, 3):
            first.write(_report(step))
        checkpoint = first.state_dict()
        for step in (4, 5):  # delivered after the checkpoint, then the job dies
            first.write(_report(step))
        first.close()
        assert checkpoint["offset"] > 0
        resumed = JsonlSink(path)
        resumed.load_state_dict(checkpoint)
        resumed.open(RunInfo())
        for step in (4, 5, 6):
            resumed.write(_report(step))
        resumed.close()
        with path.open() as file:
            assert [json.loads(line)["step"] for line in file] == [1, 2, 3, 4, 5, 6]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_jsonl_takes_descriptor_names_for_streams_and_other_paths_for_what_they_are(
    tmp_path: Path,
) -> None:
    # Streams by their exact names (and links to them), not by being under /dev or /proc;
    # everything else by what it is, so a pipe or a device is still no regular file.
    log = tmp_path / "log.txt"
    os.mkfifo(tmp_path / "out.fifo")
    (tmp_path / "fds").symlink_to("/dev/fd")  # a linked folder on the way
    with log.open("ab") as out:
        fd = out.fileno()
        streams = [f"/dev/fd/{fd}", f"/proc/self/fd/{fd}", f"{tmp_path}/fds/{fd}"]
        for name in ("/dev/stdout", "/dev/stderr"):
            if Path(name).is_symlink():  # where they exist as links
                streams.append(name)
        (tmp_path / "link").symlink_to(f"/proc/self/fd/{fd}")
        streams.append(str(tmp_path / "link"))
        for stream in streams:  # each leads to the regular log file
            assert not jsonl._is_regular(Path(stream)), stream
    assert not jsonl._is_regular(tmp_path / "out.fifo")
    assert not jsonl._is_regular(Path("/dev/null"))
    assert jsonl._is_regular(log)
    assert jsonl._is_regular(tmp_path / "new.jsonl")


@pytest.mark.parametrize("refusal", [errno.EACCES, errno.EROFS])
def test_jsonl_fails_at_open_for_good_where_it_may_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int
) -> None:
    # Retried with backoff until close before; a full disk (ENOSPC) still is.
    path = tmp_path / "ro" / "m.jsonl"
    sink = JsonlSink(path)

    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        raise OSError(refusal, os.strerror(refusal), str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(PermanentSinkError, match=r"m\.jsonl cannot be written .*a folder this"):
        sink.open(RunInfo())
    runner = SinkRunner(JsonlSink(path), capacity=4, spool_dir=str(tmp_path / "spool"))
    runner.submit(_report(1))
    runner.start()
    deadline = time.monotonic() + 10
    while runner.status.state != "failed" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.status.state == "failed" and "cannot be written" in runner.status.last_error
    assert not runner.close(timeout=5)


def test_jsonl_fails_when_another_writer_appends_to_its_file(tmp_path: Path) -> None:
    # Two sinks on one path mixed their lines, and a failed write's cut back to the last whole
    # line of one would have removed the other's lines written after it.
    path = tmp_path / "m.jsonl"
    first, second = JsonlSink(path), JsonlSink(path)
    first.open(RunInfo())
    first.write(_report(1))
    second.open(RunInfo())
    second.write(_report(2))  # opened after the first's line: it appends where the file ends
    with pytest.raises(PermanentSinkError, match="changed while this run wrote it"):
        first.write(_report(3))
    first.close()
    with path.open("ab") as other:  # any other writer, not only a sink
        other.write(b"{}\n")
    with pytest.raises(PermanentSinkError, match="another writer appends to it"):
        second.write(_report(4))
    second.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row.get("step") for row in rows] == [1, 2, None]  # nothing of step 3 or 4
    # A file cut while the run writes it (logrotate's copytruncate) is appended to where it
    # now ends (tests/collector/test_jsonl_faults.py).
    cut = JsonlSink(tmp_path / "cut.jsonl")
    cut.open(RunInfo())
    cut.write(_report(1))
    os.truncate(tmp_path / "cut.jsonl", 0)
    cut.write(_report(2))
    cut.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "cut.jsonl").open()] == [2]


@pytest.mark.parametrize("change", ["delete", "replace"])
def test_jsonl_never_writes_to_its_deleted_or_replaced_file_in_silence(
    tmp_path: Path, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Its lines went to the deleted file with no word, and close returned True. Deleted (or
    # rotated away), a new file is made at the path, with a warning; replaced by another file
    # with lines, the sink fails (tests/collector/test_jsonl_faults.py for rotation).
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.open(RunInfo())
    sink.write(_report(1))
    if change == "delete":
        path.unlink()
        with caplog.at_level("WARNING", logger="sidestream.sinks"):
            sink.write(_report(2))
        assert f"{path} was deleted while this run wrote it" in caplog.text
        assert [json.loads(line)["step"] for line in path.open()] == [2]
    else:
        (tmp_path / "other").write_text('{"step": 9}\n')
        os.replace(tmp_path / "other", path)
        with pytest.raises(PermanentSinkError, match="was replaced while this run wrote it"):
            sink.write(_report(2))
        assert path.read_text() == '{"step": 9}\n'
    sink.close()


class _GrowingState(RecordingSink):
    """Its state gains a key at open: a fresh run's state (DCP's template) lacks it."""

    def state_dict(self) -> dict[str, Any]:
        return {"steps": len(self.steps), **({"opened_at": 1} if self.opened else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_sink_whose_state_grows_at_open_is_warned_of_at_the_checkpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from sidestream import Run

    with caplog.at_level(logging.WARNING, logger="sidestream"):
        run = Run([_GrowingState()])
        run.log(1, {"lr": 0.1})
        run.state_dict()
        run.state_dict()  # warned once
        run.close()
    warnings = [r.getMessage() for r in caplog.records if "places it had not" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "sink 'recording'" in warnings[0] and "(['opened_at'])" in warnings[0]


def test_a_batch_holding_a_step_twice_writes_it_once(tmp_path: Path) -> None:
    # A resumed job's backlog (steps up to 100) and its first steps again (90 on) met in one
    # write_batch, filtered once against what was sent before it: 11 steps written twice.
    sink = JsonlSink(tmp_path / "m.jsonl")
    sink.open(RunInfo())
    steps = [1, 2, 3, 2, 3, 4, 1]
    sink.write_batch([Report(step=s, values={"x": float(s)}, time=0.0) for s in steps])
    other = Report(step=2, values={"y": 1.0}, time=0.0, stream="val")  # another stream's own
    sink.write_batch([Report(step=4, values={"x": 9.0}, time=0.0), other])
    assert sink.close(30)
    lines = list(read_jsonl(tmp_path / "m.jsonl"))
    assert [(line.get("stream", ""), line["step"]) for line in lines] == [
        ("", 1),
        ("", 2),
        ("", 3),
        ("", 4),
        ("val", 2),
    ]
    assert [line["values"]["x"] for line in lines[:4]] == [1.0, 2.0, 3.0, 4.0]  # the first ones


@pytest.mark.parametrize("delivered", [False, True])
def test_a_runner_that_gives_up_leaves_the_run_unfinished(tmp_path: Path, delivered: bool) -> None:
    """Its reports kept for a replay, a tracker must not mark the run finished at close."""
    calls: list[str] = []

    class Tracking(AlwaysFailingSink):
        def write(self, report: Report) -> None:
            if delivered:
                self.reports.append(report)
                return
            super().write(report)

        def leave_unfinished(self) -> None:
            calls.append("leave_unfinished")

        def close(self, timeout: float | None = None) -> bool:
            calls.append("close")
            return True

    runner = SinkRunner(Tracking(), spool_dir=str(tmp_path), retry_initial_s=0.01)
    runner.start()
    runner.submit(Report(step=1, values={"x": 1.0}, time=0.0))
    assert runner.close(timeout=0.5) is delivered
    # Past the timeout the sink thread ends the sink on its own (a loaded machine's thread may
    # still be in its last retry when close returns): waited for before looking.
    runner._thread.join(10.0)
    assert calls == (["close"] if delivered else ["leave_unfinished", "close"])


def test_a_rollback_chain_says_why_a_correctly_resumed_job_repeats_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Job 1 writes 1..11 (checkpoint at 3), job 2 rolls back to it and writes 4..8
    (checkpoint at 6), job 3 resumes from that one at step 7: every step once. Job 2's
    checkpoint counts the steps it found in the file (up to 11), so job 3's correct resume was
    told its step counter had started again, with no word of the rollback."""
    path = tmp_path / "m.jsonl"

    def job(saved: dict[str, object] | None, steps: range, save_at: int) -> dict[str, object]:
        sink = JsonlSink(path)
        if saved is not None:
            sink.load_state_dict(saved)
        sink.open(RunInfo())
        state: dict[str, object] = {}
        for step in steps:
            sink.write(Report(step=step, values={"x": float(step)}, time=0.0, stream="train"))
            if step == save_at:
                state = sink.state_dict()
        sink.close()
        return state

    third = job(job(job(None, range(1, 12), 3), range(4, 9), 6), range(7, 15), 0)
    assert third == {}
    steps = [line["step"] for line in read_jsonl(path)]
    assert steps == list(range(1, 15))  # exactly once, job 1's values up to 11
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step 7 is at or below step 11" in warning
    assert "rollback" in warning
