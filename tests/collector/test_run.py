"""``Run``: several streams in one tracker run, plain values, checkpoints, misuse (one process)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sidestream import MaxMetric, MeanMetric, Run, SumMetric
from sidestream.__main__ import main as cli
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import JsonlSink, RunInfo, read_jsonl
from tests.collector.helpers import RecordingSink

ROOT = Path(__file__).resolve().parents[2]


def _losses(step: int) -> np.ndarray:
    return np.random.default_rng([7, step]).gamma(2.0, 0.5, 3 + step % 5)


def _train(run: Run, steps: range, val: AsyncMetricCollector[object] | None = None) -> None:
    """Train collector every 10 steps; validation at 50 and 100 scheduled after later windows."""
    train = next(c for c in run._collectors if c.prefix == "train")
    for step in steps:
        train.metric.update(torch.from_numpy(_losses(step)))
        if val is not None and step in (50, 100):
            val.metric.update(torch.from_numpy(_losses(1000 + step)))
        if step % 10 == 0:
            train.schedule_collection(step)
            run.log(step, {"lr": 1.0 / step, "seen": torch.tensor(float(step))})
        if val is not None and step - 10 in (50, 100):
            # Only after the training window of a later step was scheduled.
            val.schedule_collection(step - 10)


def _expected_train(step: int) -> float:
    return float(np.concatenate([_losses(s) for s in range(step - 9, step + 1)]).mean())


def test_streams_share_one_run_in_delivery_order(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    recording = RecordingSink()
    with Run([JsonlSink(path), recording], info=RunInfo(name="r")) as run:
        train = run.collector(MeanMetric(), prefix="train").bind("cpu")
        val = run.collector(MeanMetric(), prefix="val").bind("cpu")
        assert run.streams == ["train", "val"]
        _train(run, range(1, 111), val)
    assert run.close() is True  # idempotent
    assert len(recording.opened) == 1, "one run, opened once"
    records = list(read_jsonl(path))
    by_stream: dict[str, list[dict[str, object]]] = {}
    for record in records:
        by_stream.setdefault(str(record["stream"]), []).append(record)
    assert [r["step"] for r in by_stream["train"]] == list(range(10, 111, 10))
    assert [r["step"] for r in by_stream["val"]] == [50, 100]
    assert [r["step"] for r in by_stream[""]] == list(range(10, 111, 10))
    for record in by_stream["train"]:
        assert record["values"] == {"train": pytest.approx(_expected_train(record["step"]))}
    for record in by_stream["val"]:
        expected = float(_losses(1000 + record["step"]).mean())
        assert record["values"] == {"val": pytest.approx(expected)}
    for record in by_stream[""]:
        assert record["values"] == {"lr": 1.0 / record["step"], "seen": float(record["step"])}
    assert {r.stream for r in recording.reports} == {"train", "val", ""}
    del train


def test_a_late_stream_window_is_written_after_later_steps(tmp_path: Path) -> None:
    # Two dispatchers race, so force the order: train's windows up to 60 are delivered before
    # validation's window at 50 is even scheduled.
    path = tmp_path / "run.jsonl"
    with Run([JsonlSink(path)]) as run:
        train = run.collector(MeanMetric(), prefix="train").bind("cpu")
        val = run.collector(MeanMetric(), prefix="val").bind("cpu")
        for step in range(10, 61, 10):
            train.metric.update(torch.tensor([float(step)]))
            train.schedule_collection(step)
        train.collect_results()
        run.state_dict()  # waits until everything scheduled so far is delivered
        val.metric.update(torch.tensor([5.0]))
        val.schedule_collection(50)
    order = [(r["stream"], r["step"]) for r in read_jsonl(path)]
    assert order == [*(("train", s) for s in range(10, 61, 10)), ("val", 50)]


def test_checkpoint_and_resume_every_stream_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)])
    train = run.collector(SumMetric(), prefix="train").bind("cpu")
    for step in range(1, 8):
        train.metric.update(torch.tensor([float(step)]))
        train.schedule_collection(step)
        run.log(step, {"lr": float(step)})
    state = run.state_dict()
    # The job logs past its checkpoint, then dies: steps 8 and 9 are in the file already.
    for step in (8, 9):
        train.metric.update(torch.tensor([float(step)]))
        train.schedule_collection(step)
        run.log(step, {"lr": float(step)})
    assert run.close()
    json.dumps(state["sinks"])  # sink states are plain data

    resumed = Run([JsonlSink(path)])
    resumed.load_state_dict(state)
    again = resumed.collector(SumMetric(), prefix="train").bind("cpu")
    for step in range(8, 12):
        again.metric.update(torch.tensor([float(step)]))
        again.schedule_collection(step)
        resumed.log(step, {"lr": float(step)})
    assert resumed.close()
    records = list(read_jsonl(path))
    for stream in ("train", ""):
        steps = [r["step"] for r in records if r["stream"] == stream]
        assert steps == list(range(1, 12)), stream
    # The resumed metric continued the saved sum (window mode resets; the checkpoint holds
    # the state after step 7's window, which is empty, so step 8 starts from 0).
    train_values = {r["step"]: r["values"]["train"] for r in records if r["stream"] == "train"}
    assert train_values[10] == 10.0 and train_values[11] == 11.0


def test_a_load_after_bind_is_refused_naming_the_order(tmp_path: Path) -> None:
    # A new user's trial: with dcp the error did not say the order (collectors, load, bind).
    run = Run([JsonlSink(tmp_path / "a.jsonl")])
    run.collector(SumMetric(), prefix="train").bind("cpu")
    state = run.state_dict()
    assert run.close()
    late = Run([JsonlSink(tmp_path / "b.jsonl")])
    collector = late.collector(SumMetric(), prefix="train").bind("cpu")
    with pytest.raises(RuntimeError, match=r"before the first bind.*collectors, dcp.load"):
        late.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"before bind.*collectors, dcp.load, then bind"):
        collector.load_state_dict({"metric": state["collectors"]["train"]})
    with pytest.raises(RuntimeError, match=r"before bind.*collectors, dcp.load, then bind"):
        collector.load_metric_state(state["collectors"]["train"])
    assert late.close()


def test_one_sink_belongs_to_one_run(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "a.jsonl")
    first = AsyncMetricCollector(MeanMetric(), sinks=[sink])
    with pytest.raises(ValueError, match=r"already belongs to a run.*sidestream\.Run\(sinks\)"):
        AsyncMetricCollector(MeanMetric(), sinks=[sink])
    with pytest.raises(ValueError, match="already belongs to a run"):
        Run([sink])
    with pytest.raises(ValueError, match="is given twice"):
        Run([RecordingSink(), *[JsonlSink(tmp_path / "b.jsonl")] * 2])
    AsyncMetricCollector(MeanMetric(), sinks=[free := RecordingSink()])  # gone unclosed
    AsyncMetricCollector(MeanMetric(), sinks=[free]).close()  # so the sink is free again
    assert first.close()
    with pytest.raises(ValueError, match="belonged to a run that is closed"):
        Run([sink])  # closed, it retired: a sink is not opened again
    with pytest.raises(TypeError, match=r"run: got a sidestream\.Run; .*run\.collector"):
        AsyncMetricCollector(MeanMetric(), run=Run())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sinks\[0\]: expected a sidestream"):
        Run(["jsonl"])  # type: ignore[list-item]


@pytest.mark.filterwarnings("error")
def test_log_reads_a_tensor_that_requires_grad_without_a_warning(tmp_path: Path) -> None:
    """A loss straight from the graph logs as the GPU path does: detached, no UserWarning."""
    path = tmp_path / "run.jsonl"
    with Run([JsonlSink(path)]) as run:
        loss = torch.tensor(1.5, requires_grad=True) * 2
        run.log(1, {"loss": loss})
    assert [r["values"] for r in read_jsonl(path)] == [{"loss": 3.0}]


def test_numpy_integer_steps_are_taken_and_tensor_steps_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with Run([JsonlSink(path)]) as run:
        collector = run.collector(SumMetric(), prefix="train").bind("cpu")
        for step in np.arange(1, 3, dtype=np.int64):
            collector.metric.update(torch.tensor(2.0))
            collector.schedule_collection(step)
            run.log(np.uint32(step), {"lr": 0.5})
        with pytest.raises(TypeError, match=r"step: expected an int, got Tensor .*host sync"):
            run.log(torch.tensor(7), {"lr": 0.5})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="step: expected an int, got Tensor"):
            collector.schedule_collection(torch.tensor(7))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"step: expected an int in \[0, 2\*\*63\), got -1"):
            run.log(np.int8(-1), {"lr": 0.5})
    records = read_jsonl(path)
    steps = sorted((r["stream"], r["step"]) for r in records)
    assert steps == [("", 1), ("", 2), ("train", 1), ("train", 2)]
    assert all(type(r["step"]) is int for r in records)


def test_stream_names_and_log_arguments_are_checked() -> None:
    run = Run([RecordingSink()])
    run.collector(MeanMetric(), prefix="train")
    with pytest.raises(ValueError, match="already has a stream 'train'"):
        run.collector(MeanMetric(), prefix="train/")
    with pytest.raises(TypeError, match="step: expected an int"):
        run.log(1.0, {"lr": 1.0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"values\['lr'\]: expected a number or a 0-dim tensor"):
        run.log(1, {"lr": "high"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"values\['lr'\]: expected a 0-dim tensor, got shape"):
        run.log(1, {"lr": torch.ones(2)})
    with pytest.raises(ValueError, match="names must be non-empty str, got ''"):
        run.log(1, {"": 1.0})  # a value error (a str of the wrong value), as RunInfo's
    with pytest.raises(TypeError, match="names must be non-empty str, got 3"):
        run.log(1, {3: 1.0})  # type: ignore[dict-item]
    run.log(5, {"lr": 1.0})
    with pytest.raises(ValueError, match="expected > the previous log call's 5"):
        run.log(5, {"grad_norm": 1.0})
    with pytest.raises(ValueError, match=r"already has a stream ''"):
        run.collector(MeanMetric(), prefix="")
    assert run.close()
    with pytest.raises(RuntimeError, match="closed"):
        run.log(6, {"lr": 1.0})


def test_collector_close_is_false_when_windows_failed() -> None:
    class Exploding(MeanMetric):
        def compute(self) -> torch.Tensor:
            if self._fail:
                raise ArithmeticError("boom")
            return super().compute()

        _fail = False

    metric = Exploding()
    collector = AsyncMetricCollector(metric, sinks=[RecordingSink()]).bind("cpu")
    metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    collector.collect_results()
    Exploding._fail = True
    collector.schedule_collection(2)
    assert collector.close() is False


def test_show_prints_each_streams_latest_values_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")  # --plot's extra; the GPU machines lack it
    path = tmp_path / "run.jsonl"
    with Run([JsonlSink(path)]) as run:
        train = run.collector(MeanMetric(), prefix="train").bind("cpu")
        for step in (10, 20):
            train.metric.update(torch.tensor([float(step)]))
            train.schedule_collection(step)
            run.log(step, {"lr": float("nan") if step == 20 else 0.5})
    assert cli(["show", str(path), "--plot", str(tmp_path / "plot.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["stream", "step", "name", "value"]
    assert lines[1].split() == ["(log)", "20", "lr", "nan"]
    assert lines[2].split() == ["train", "20", "train", "20"]
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # And as a module, the way the docs say.
    shown = subprocess.run(
        [sys.executable, "-m", "sidestream", "show", str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert "train" in shown.stdout.splitlines()[-1]


def test_show_takes_the_value_written_last_and_skips_lines_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "odd.jsonl"
    lines = [
        {"step": 1, "stream": "", "time": 0, "values": {"loss": 5.0}},
        {"step": 1, "stream": "", "time": 0, "values": {"loss": 2.0}},  # replayed twice
        {"step": 2, "stream": "", "time": 0, "values": {"loss": "abc"}},
        {"step": 2, "stream": "", "time": 0, "values": [1, 2]},
        {"step": 2, "stream": "", "time": 0, "values": {"flag": True}},
        # No float holds it: show raised OverflowError.
        {"step": 3, "stream": "", "time": 0, "values": {"loss": 10**400}},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    path.write_text(text + "[" * 200_000 + "\n")  # json raised RecursionError
    assert [record["step"] for record in read_jsonl(path)] == [1, 1, 2]  # four lines skipped
    assert cli(["show", str(path)]) == 0
    shown = capsys.readouterr()
    assert shown.out.splitlines()[1:] == ["(log)   1     loss  2"]  # a bool is no number
    assert shown.err == (
        f"warning: 4 line(s) of {path} are no JsonlSink records (cut short, or not written by "
        "a JsonlSink); skipped\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        cli(["show", str(tmp_path)])  # it exists, as no file: not "no such file"
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{tmp_path}: not a regular file" in error
    # The usage of show, not of the whole command (python -m sidestream [-h] {replay,show}).
    assert error.startswith("usage: python -m sidestream show [-h] [--plot OUT.png] path")
    # --version printed the usage error; it says which sidestream this is.
    import sidestream

    with pytest.raises(SystemExit) as exit_info:
        cli(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"sidestream {sidestream.__version__}\n"


def test_show_escapes_unprintable_characters_in_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A newline in a name made a row of its own; a tab or carriage return broke the columns.
    path = tmp_path / "names.jsonl"
    lines = [
        {"step": 4, "stream": "va\tl", "time": 0, "values": {"a\nb": 1.5, "c\rd": 2.0}},
        {"step": 4, "stream": "", "time": 0, "values": {"température": 3.0}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli(["show", str(path)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1:] == [
        "(log)   4     température  3",
        "va\\tl   4     a\\nb         1.5",
        "va\\tl   4     c\\rd         2",
    ]


def test_show_without_a_plot_keeps_one_point_per_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tracemalloc

    path = tmp_path / "long.jsonl"
    record = '{{"step": {}, "stream": "train", "time": 0, "values": {{"a": {}, "b": 1.5}}}}\n'
    with path.open("w") as file:
        file.write(record.format(7, 70.0))  # the largest step comes first: lines go out of order
        file.writelines(record.format(step, float(step)) for step in range(100_000) if step != 7)
        file.write(record.format(7, 71.0))  # written last of step 7... still not the largest
        file.write(record.format(99_999, -1.0))  # of the largest step, the value written last
    tracemalloc.start()
    try:
        assert cli(["show", str(path)]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines[1:]] == [
        ["train", "99999", "a", "-1"],
        ["train", "99999", "b", "1.5"],
    ]
    # Every point of 200,000 kept would take tens of MB.
    assert peak < 4_000_000, peak


def test_read_jsonl_keeps_integer_counts_and_skips_values_nested_past_the_stack(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.jsonl"
    counts = [3, 5, 2**53 + 1]  # a float would round the last
    # Parses, but its conversion recursed past the stack (3.12 gives comprehensions no frame).
    depth = 900 if sys.version_info < (3, 12) else sys.getrecursionlimit() + 100
    nested = json.loads("[" * depth + "]" * depth)
    lines = [
        {"step": 0, "stream": "", "time": 0, "values": {"a": 1.0}, "histograms": {"h": counts}},
        {"step": 1, "stream": "", "time": 0, "values": {"x": nested}},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (record,) = read_jsonl(path)
    assert record["histograms"]["h"] == counts and isinstance(record["histograms"]["h"][2], int)


def test_show_plots_at_most_twelve_streams_and_names_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "many.jsonl"
    streams = [f"s{index:03d}" for index in range(40)]  # 40 plots of 3 inches: 12000 pixels
    lines = [{"step": 1, "stream": stream, "time": 0, "values": {"x": 1.0}} for stream in streams]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli(["show", str(path), "--plot", str(tmp_path / "many.png")]) == 0
    shown = capsys.readouterr()
    assert len(shown.out.splitlines()) == 1 + 40 + 1  # the table has every stream
    assert shown.err == (
        "note: --plot drew the first 12 streams by name; left out: "
        + ", ".join(streams[12:])
        + "\n"
    )
    from PIL import Image

    with Image.open(tmp_path / "many.png") as image:
        assert image.size[1] == 12 * 3 * 100  # 12 plots of 3 inches at matplotlib's 100 dpi


def test_show_escapes_control_characters_in_the_streams_the_plot_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The table escaped them; the note naming the streams --plot left out printed them as
    # they are (an escape sequence cleared the terminal, a newline made a fake line).
    pytest.importorskip("matplotlib")
    path = tmp_path / "odd.jsonl"
    streams = [f"s{index:02d}" for index in range(12)] + ["zz\x1b[2J\nfake"]
    lines = [{"step": 1, "stream": stream, "time": 0, "values": {"x": 1.0}} for stream in streams]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli(["show", str(path), "--plot", str(tmp_path / "odd.png")]) == 0
    shown = capsys.readouterr()
    assert shown.err == (
        "note: --plot drew the first 12 streams by name; left out: zz\\x1b[2J\\nfake\n"
    )


def test_show_skips_lines_that_are_not_utf8_and_names_bad_plot_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")  # --plot's extra
    path = tmp_path / "mixed.jsonl"
    good = json.dumps({"step": 3, "stream": "", "time": 0, "values": {"loss": 1.5}})
    path.write_bytes(b'{"step": 1, "values": {"\xff": 1.0}}\n' + good.encode() + b"\n")
    assert [record["step"] for record in read_jsonl(path)] == [3]
    assert cli(["show", str(path), "--plot", str(tmp_path / "curves")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["(log)", "3", "loss", "1.5"]
    # matplotlib adds .png to a name without a suffix: the message names the file written.
    assert out.splitlines()[-1] == f"plot written to {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").is_file()
    assert cli(["show", str(path), "--plot", str(tmp_path / "p.xyz")]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning.startswith("warning: 1 line(s) of ")
    assert error.startswith("error: --plot ") and "'xyz' is not supported" in error
    with pytest.raises(SystemExit) as exit_info:
        cli(["show", str(path), "--plot", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "is a directory" in capsys.readouterr().err
    checkpoint = tmp_path / "ckpt.pt"  # a checkpoint holds JSON lines of its undelivered reports
    torch.save({"undelivered": {"jsonl": good + "\n"}, "weights": torch.zeros(64)}, checkpoint)
    assert cli(["show", str(checkpoint)]) == 1
    assert "a binary file" in capsys.readouterr().err
    crashed = tmp_path / "crashed.jsonl"  # a crash may leave NUL bytes at the file's end
    crashed.write_bytes(good.encode() + b"\n" + b"\0" * 512)
    assert cli(["show", str(crashed)]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["(log)", "3", "loss", "1.5"]
    only_text = tmp_path / "text.jsonl"
    only_text.write_text(json.dumps({"step": 1, "values": {"note": "abc-not-a-number"}}) + "\n")
    assert cli(["show", str(only_text)]) == 1
    assert "no records with numeric values" in capsys.readouterr().err


def test_checkpoint_makes_the_jsonl_lines_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    run = Run([JsonlSink(tmp_path / "run.jsonl")])
    run.log(1, {"lr": 0.1})
    monkeypatch.setattr(os, "fsync", fsync)
    state = run.state_dict()
    assert synced, "the checkpoint fsyncs the file before reporting its steps"
    assert state["sinks"]["jsonl"]["last_steps"] == [["", 1]]
    assert run.close()


def _wait_for_lines(path: Path, count: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while not (path.exists() and len(list(read_jsonl(path))) >= count):
        assert time.monotonic() < deadline, f"{path} never had {count} lines"
        time.sleep(0.01)


@pytest.mark.parametrize("resumed_order", ["same", "swapped", "first_left_out"])
def test_sinks_of_one_kind_resume_their_own_state_whatever_their_order(
    tmp_path: Path, resumed_order: str
) -> None:
    # Sink states are keyed by order ("jsonl", "jsonl-2"): a job listing the two JSONL sinks
    # the other way round gave each the other's state and undelivered reports (one file had
    # steps twice, the other lacked them).
    import errno

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    down = JsonlSink(b)
    send = down.send

    def full_disk(reports: Any) -> Any:
        if down_now:
            raise OSError(errno.ENOSPC, "No space left on device")
        return send(reports)

    down.send = full_disk  # type: ignore[method-assign]
    run = Run([JsonlSink(a), down], spool_dir=str(tmp_path / "spool"), sink_retry_max_s=0.2)
    down_now = False
    for step in range(1, 6):
        run.log(step, {"x": float(step)})
    _wait_for_lines(b, 5)
    down_now = True  # b takes steps 1 to 5 only: 6 to 10 are in the checkpoint
    for step in range(6, 11):
        run.log(step, {"x": float(step)})
    _wait_for_lines(a, 10)
    state = run.state_dict(timeout=1.0)
    assert len(state["undelivered"]["jsonl-2"].splitlines()) == 5
    run.close(timeout=1.0)
    for kept in (tmp_path / "spool").glob("*"):  # as the close warning says for a resumed job
        kept.unlink()
    down_now = False
    sinks = {
        "same": [JsonlSink(a), JsonlSink(b)],
        "swapped": [JsonlSink(b), JsonlSink(a)],
        "first_left_out": [JsonlSink(b)],
    }[resumed_order]
    resumed = Run(sinks, spool_dir=str(tmp_path / "spool"))
    resumed.load_state_dict(state)
    for step in range(11, 16):
        resumed.log(step, {"x": float(step)})
    assert resumed.close(timeout=30)
    files = {"a": a, "b": b} if resumed_order != "first_left_out" else {"b": b}
    for name, path in files.items():
        steps = [record["step"] for record in read_jsonl(path)]
        assert steps == list(range(1, 16)), (name, steps)
    if resumed_order == "first_left_out":
        # a's state is carried on: a later job with a's sink again resumes a's file.
        assert [s["path"] for s in resumed.state_dict()["sinks"].values()].count(str(a)) == 1


def test_a_checkpoint_does_not_wait_for_a_hung_jsonl_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file's writes went through, its fsync hung (an NFS server gone): with no write
    # under way the checkpoint called fsync on the training thread and waited 60 s.
    import os
    import threading
    import time

    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)])
    run.log(1, {"lr": 0.1})
    (runner,) = run.sink_runners
    assert run._log_pipe is not None and run._log_pipe.wait_idle(10)  # handed to the runner
    assert runner.wait_delivered(timeout=10)
    disk = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            disk.wait(60)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        start = time.monotonic()
        state = run.state_dict(timeout=0.5)
        assert time.monotonic() - start < 10, "the checkpoint waited for the hung fsync"
        # Step 1 was written but its fsync never finished: not durable, so not counted (the
        # state the sink started from); a job resumed from it finds step 1 in the file.
        assert state["sinks"]["jsonl"]["last_steps"] == []
    finally:
        disk.set()
    assert run.close()


def test_a_checkpoint_names_a_failed_sink_without_waiting_for_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sink that failed for good takes nothing more: the checkpoint says so and goes on."""
    import time

    from sidestream.sinks import PermanentSinkError

    class Refused(RecordingSink):
        def write(self, report: object) -> None:
            raise PermanentSinkError("project not found")

    with Run([Refused(name="refused")]) as run:
        run.log(1, {"x": 1.0})
        deadline = time.monotonic() + 30
        while run.sink_status["refused"].state != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        run.log(2, {"x": 2.0})
        began = time.monotonic()
        with caplog.at_level("WARNING", logger="sidestream"):
            run.state_dict(timeout=10)
        assert time.monotonic() - began < 5
    assert "'refused'" in caplog.text and "failed for good" in caplog.text


def test_saved_metric_states_no_collector_claims_are_kept_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A collector made under another prefix than the saved one (a typo): the saved state is
    not silently lost from the next checkpoint, and the warning names both prefixes."""
    with Run([RecordingSink()]) as first:
        train = first.collector(SumMetric(), prefix="train")
        train.metric.update(torch.tensor([5.0]))
        saved = first.state_dict()
    with Run([RecordingSink()]) as resumed:
        resumed.load_state_dict(saved)
        typo = resumed.collector(SumMetric(), prefix="trian")
        typo.metric.update(torch.tensor([1.0]))
        with caplog.at_level("WARNING", logger="sidestream.run"):
            again = resumed.state_dict()
    assert "'train'" in caplog.text and "'trian'" in caplog.text
    assert set(again["collectors"]) == {"train", "trian"}
    with Run([RecordingSink()]) as fixed:  # the next job spells it right: nothing was lost
        fixed.load_state_dict(again)
        train = fixed.collector(SumMetric(), prefix="train")
        assert float(train.metric.compute()) == 5.0


def test_a_saved_state_a_collector_refused_stays_in_the_next_checkpoint() -> None:
    """A collector made with another metric than the saved one is refused; the saved state
    is not consumed by the refusal, so the right collector (or the next checkpoint) has it."""
    with Run([RecordingSink()]) as first:
        first.collector(SumMetric(), prefix="train").metric.update(torch.tensor([5.0]))
        saved = first.state_dict()
    with Run([RecordingSink()]) as resumed:
        resumed.load_state_dict(saved)
        with pytest.raises(KeyError):
            resumed.collector(MeanMetric(), prefix="train")
        again = resumed.state_dict()
        assert set(again["collectors"]) == {"train"}
        retried = resumed.collector(SumMetric(), prefix="train")
        assert float(retried.metric.compute()) == 5.0


def test_a_checkpoint_waits_at_most_its_timeout_in_all() -> None:
    """A sink still sending when the wait ends gets what is left of the timeout to make its
    data durable, not the timeout again."""
    import threading
    import time

    from sidestream.sinks import TrackerSink

    sending = threading.Event()

    class Slow(TrackerSink):
        name = "slow"

        def open(self, run: RunInfo) -> None:
            del run

        def send(self, reports: object) -> None:
            sending.set()
            time.sleep(3.0)

        def make_durable(self, timeout: float | None = None) -> bool:
            given.append(timeout)
            time.sleep(timeout or 0.0)  # as a sink waiting for its busy writer
            return False

    given: list[float | None] = []
    with Run([Slow()]) as run:
        run.log(1, {"x": 1.0})
        assert sending.wait(30)  # the sink's thread is inside send (opened: make_durable runs)
        began = time.monotonic()
        run.state_dict(timeout=1.0)
        took = time.monotonic() - began
    # The wait for the send used up the timeout: the sink got next to nothing more.
    assert given and all(t is not None and t < 0.5 for t in given), given
    assert took < 5.0, took  # loose (a loaded machine): the timeouts given are the check


def test_a_checkpoint_without_a_timeout_waits_the_runs_checkpoint_timeout(tmp_path: Path) -> None:
    """torch.distributed.checkpoint calls state_dict() with no argument: with a tracker down,
    each such checkpoint waited the 10 s default, which the job had no way to shorten."""
    import threading
    import time

    import torch.distributed.checkpoint as dcp

    gate = threading.Event()

    class Stuck(JsonlSink):
        def send(self, reports: Any) -> None:
            gate.wait(30)  # a backend that does not answer
            super().send(reports)

    with pytest.raises(ValueError, match="checkpoint_timeout"):
        Run(checkpoint_timeout=-1.0)
    run = Run([Stuck(tmp_path / "a.jsonl")], checkpoint_timeout=0.3)
    try:
        run.log(1, {"x": 1.0})
        began = time.monotonic()
        dcp.save({"run": run}, checkpoint_id=tmp_path / "checkpoint")  # no_dist: one process
        assert time.monotonic() - began < 5.0
        began = time.monotonic()
        saved = run.state_dict()
        assert time.monotonic() - began < 5.0
        assert '"step":1' in saved["undelivered"]["jsonl"]  # carried, not lost
        collector = run.collector(SumMetric(), prefix="t")  # takes the run's option
        began = time.monotonic()
        collector.state_dict()
        assert time.monotonic() - began < 5.0
    finally:
        gate.set()
        assert run.close(timeout=30)
    own = AsyncMetricCollector(SumMetric(), [Stuck(tmp_path / "b.jsonl")], checkpoint_timeout=0.3)
    gate.clear()
    try:
        own.bind("cpu")
        own.metric.update(torch.tensor([1.0]))
        own.schedule_collection(1)
        began = time.monotonic()
        dcp.save({"collector": own}, checkpoint_id=tmp_path / "own")
        assert time.monotonic() - began < 5.0
    finally:
        gate.set()
        assert own.close(timeout=30)


def test_a_checkpoint_takes_what_a_tracker_delivered_even_when_make_durable_fell_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tracker whose make_durable could not make everything durable in time may still have
    counted part of it (wandb's rows already written): the checkpoint takes the tracker's own
    state, which holds delivered steps only, not the copy from its last send."""
    from sidestream.sinks import TrackerSink

    class Partial(TrackerSink):
        name = "partial"
        durable_on_send = False  # steps count only once the backend confirms them

        def open(self, run: RunInfo) -> None:
            del run

        def send(self, reports: object) -> None:
            pass

        def persist(self, timeout: float | None) -> bool:
            return False  # never all of it in time

        def make_durable(self, timeout: float | None = None) -> bool:
            self.count_delivered({"": 2})  # the backend confirmed steps up to 2 meanwhile
            return False

    sink = Partial()
    with Run([sink]) as run:
        for step in (1, 2, 3):
            run.log(step, {"x": float(step)})
        with caplog.at_level(logging.WARNING, logger="sidestream"):
            saved = run.state_dict(timeout=5.0)
        assert sink.last_steps() == {"": 2}
        # Every report was handed to the sink (none queued), but not all confirmed: said.
        assert "'partial': its backend has not confirmed every report" in caplog.text
        # The time the sink waited, apart from its budget (a W&B sink that gave up after 3 s
        # was said to have waited its whole 7.5 s).
        waited = re.search(r"it waited (\d+\.\d) s; it was given (\d+\.\d) s", caplog.text)
        assert waited is not None and float(waited[1]) < float(waited[2]), caplog.text
    assert saved["sinks"]["partial"]["last_steps"] == [["", 2]]
    sink.count_delivered({"": 99, "val": 5})  # never past what was sent, nor a stream unsent
    assert sink.last_steps() == {"": 3}


def _log_the_repeated_window_and_the_next(train: AsyncMetricCollector) -> None:
    """Step 1 again (5.0, which the sink skips) and step 2 (7.0), as a resumed job logs them."""
    train.metric.update(torch.tensor([5.0]))
    train.schedule_collection(1)
    train.metric.update(torch.tensor([7.0]))
    train.schedule_collection(2)


@pytest.mark.parametrize("checkpoint", ["run.state_dict", "dcp", "dcp, child process"])
def test_a_resumed_job_repeating_a_step_logs_it_once_whatever_the_checkpoint(
    tmp_path: Path, checkpoint: str
) -> None:
    """dcp.load fills only the keys the resumed run's state has at load time: each sink's
    delivered steps must be one value (a list of pairs), not keys a fresh sink lacks, and a
    sink in a child process must have its keys before its child starts."""
    import torch.distributed.checkpoint as dcp

    from sidestream.sinks import ProcessSink

    path = tmp_path / "run.jsonl"

    def sink() -> JsonlSink | ProcessSink:
        return ProcessSink(JsonlSink(path)) if "child" in checkpoint else JsonlSink(path)

    with Run([sink()]) as first:
        train = first.collector(MeanMetric(), prefix="train").bind("cpu")
        first.log(1, {"lr": 0.1})
        train.metric.update(torch.tensor([1.0, 2.0]))
        train.schedule_collection(1)
        train.metric.update(torch.tensor([3.0]))  # mid-window at the checkpoint
        if checkpoint.startswith("dcp"):
            dcp.save({"run": first}, checkpoint_id=tmp_path / "ckpt")
        else:
            saved = first.state_dict()
    with Run([sink()]) as resumed:
        train = resumed.collector(MeanMetric(), prefix="train")  # made before the load
        if checkpoint.startswith("dcp"):
            dcp.load({"run": resumed}, checkpoint_id=tmp_path / "ckpt")
        else:
            resumed.load_state_dict(saved)
        train.bind("cpu")
        resumed.log(1, {"lr": 0.1})  # the job repeats step 1 of both streams
        _log_the_repeated_window_and_the_next(train)
        resumed.log(2, {"lr": 0.2})
    rows = sorted((r["stream"], r["step"], r["values"]) for r in read_jsonl(path))
    assert rows == [
        ("", 1, {"lr": 0.1}),
        ("", 2, {"lr": 0.2}),
        ("train", 1, {"train": 1.5}),
        ("train", 2, {"train": 7.0}),  # the repeated step 1 (3 and 5) is not logged again
    ]


def test_an_older_state_loaded_and_saved_again_before_the_sinks_open_is_in_pairs(
    tmp_path: Path,
) -> None:
    """A checkpoint in the older layout (last_steps a mapping), loaded and saved again before
    any sink opened, is written in the current one: DCP could not load it otherwise."""
    with Run([JsonlSink(tmp_path / "run.jsonl")]) as run:
        run.load_state_dict(
            {"collectors": {}, "sinks": {"jsonl": {"path": "x", "last_steps": {"train": 5}}}}
        )
        assert run.state_dict()["sinks"]["jsonl"]["last_steps"] == [["train", 5]]


def test_a_collector_the_loaded_state_lacks_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """dcp.load into a run made without its collectors loads none of their state: the
    collectors made afterwards say so instead of silently starting from zero."""
    import torch.distributed.checkpoint as dcp

    with Run([RecordingSink()]) as first:
        train = first.collector(SumMetric(), prefix="train")
        train.metric.update(torch.tensor([5.0]))
        dcp.save({"run": first}, checkpoint_id=tmp_path / "ckpt")
    with Run([RecordingSink()]) as too_early:
        dcp.load({"run": too_early}, checkpoint_id=tmp_path / "ckpt")
        with caplog.at_level("WARNING", logger="sidestream.run"):
            lost = too_early.collector(SumMetric(), prefix="train")
        assert float(lost.metric.compute()) == 0.0
    assert "run.collector(prefix='train')" in caplog.text and "dcp.load" in caplog.text
    with Run([RecordingSink()]) as in_order:
        kept = in_order.collector(SumMetric(), prefix="train")
        dcp.load({"run": in_order}, checkpoint_id=tmp_path / "ckpt")
        assert float(kept.metric.compute()) == 5.0


def test_a_sink_whose_state_gains_places_at_open_is_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """torch.distributed.checkpoint restores only the places a fresh run's sink state has: a
    custom sink that adds a key (or grows a mapping) at open is warned about, the built-in
    sinks are not."""
    import logging

    from sidestream.sinks import Report, Sink, sinks_from_config

    class Growing(Sink):
        def __init__(self) -> None:
            self.state: dict[str, object] = {"run_id": None}

        def open(self, run: RunInfo) -> None:
            self.state = {"run_id": "r1", "steps": {"train": 0}}

        def write(self, report: Report) -> None:
            assert isinstance(self.state["steps"], dict)
            self.state["steps"][report.stream] = report.step

        def state_dict(self) -> dict[str, object]:
            return dict(self.state)

    caplog.set_level(logging.WARNING, logger="sidestream.sinks")
    config = [
        {"type": "jsonl", "path": str(tmp_path / "m.jsonl")},
        {"type": "jsonl", "path": str(tmp_path / "c.jsonl"), "child_process": True},
        "console",
    ]
    with Run(sinks=sinks_from_config(config)) as steady:
        steady.log(1, {"lr": 0.1})
        steady.state_dict()
    assert "places" not in caplog.text
    with Run(sinks=[Growing()]) as run:
        run.log(1, {"lr": 0.1})
        run.state_dict()
        run.state_dict()
    warnings = [r.getMessage() for r in caplog.records if "places" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'steps.train'" in warnings[0] and "torch.distributed.checkpoint" in warnings[0]


def test_a_checkpoint_keeps_the_state_of_a_sink_that_never_opened(tmp_path: Path) -> None:
    """A sink that fails for good at open (or has delivered nothing yet) keeps the state it
    resumed from in the next checkpoint, not {}: the run id and steps are not lost."""
    from sidestream.sinks import PermanentSinkError, Report, Sink

    class Unreachable(Sink):
        def __init__(self) -> None:
            self.run_id: str | None = None

        def open(self, run: RunInfo) -> None:
            raise PermanentSinkError("backend refuses this run")

        def write(self, report: Report) -> None:
            raise AssertionError("never opened")

        def state_dict(self) -> dict[str, object]:
            return {"run_id": self.run_id, "last_steps": []}

        def load_state_dict(self, state_dict: Any) -> None:
            self.run_id = state_dict["run_id"]

    saved = {"run_id": "r1", "last_steps": [["", 5]]}
    with Run(sinks=[Unreachable()]) as run:
        run.load_state_dict({"collectors": {}, "sinks": {"sink": saved}})
        run.log(6, {"lr": 0.1})
        assert run.state_dict(timeout=5)["sinks"]["sink"] == saved
    assert run.close(timeout=5) is False  # the first close's result, kept
    with Run(sinks=[Unreachable()]) as fresh:
        fresh.log(1, {"lr": 0.1})
        assert fresh.state_dict(timeout=5)["sinks"]["sink"] == {"run_id": None, "last_steps": []}


def test_a_name_two_streams_report_is_named_once_per_stream(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trackers keep values by name: a run.log name equal to a collector's value name, or
    nested prefixes that meet, would merge two series; the run says so once per name and stream."""
    import logging

    from sidestream import ComposeMetric

    caplog.set_level(logging.WARNING, logger="sidestream.sinks")
    with Run([JsonlSink(tmp_path / "ok.jsonl")]) as run:
        collector = run.collector(ComposeMetric({"loss": MeanMetric()}), prefix="train")
        collector.bind("cpu")
        for step in (1, 2):
            collector.metric["loss"].update(torch.tensor([1.0]))
            collector.schedule_collection(step)
            run.log(step, {"lr": 0.1, "train_lr": 0.2})
    assert "two streams" not in caplog.text
    with Run([JsonlSink(tmp_path / "clash.jsonl")]) as run:
        collector = run.collector(ComposeMetric({"loss": MeanMetric()}), prefix="train")
        nested = run.collector(MeanMetric(), prefix="train/loss").bind("cpu")
        collector.bind("cpu")
        for step in (1, 2, 3):
            collector.metric["loss"].update(torch.tensor([1.0]))
            nested.metric.update(torch.tensor([2.0]))
            collector.schedule_collection(step)
            nested.schedule_collection(step)
            run.log(step, {"train/loss": 99.0})
    warnings = [r.getMessage() for r in caplog.records if "two streams" in r.getMessage()]
    # Once per stream that joins the name, each with the stream that reported it first (which
    # one that is depends on threads): all three are named.
    pattern = re.compile(
        r"'train/loss' is reported by two streams of this run, '(.+)' and '(.+)': trackers "
        r"keep values by name, so they would show one series with the values of both; give one "
        r"of them another name \(a collector's prefix, or the name passed to run.log\)"
    )
    pairs = [pattern.fullmatch(warning) for warning in warnings]
    assert len(pairs) == 2 and all(pairs), warnings
    first = {pair.group(1) for pair in pairs if pair}
    joined = {pair.group(2) for pair in pairs if pair}
    assert len(first) == 1 and first | joined == {"train", "train/loss", "run.log"}, warnings


def test_the_name_check_walks_a_streams_names_once_not_every_window(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The run checks each report's names against the other streams' (the warning above). It
    walked every name of every report in Python, on the dispatcher's thread: with 2,000
    per-class names, 0.5 ms of the GIL each window, taken from the training thread. A stream
    reports the same names every window, so each is checked once per stream; a name new to a
    stream, even late in the run, is still checked."""
    from sidestream import ComposeMetric

    class Owners(dict):  # type: ignore[type-arg]
        looked_up = 0

        def setdefault(self, key: Any, default: Any = None) -> Any:
            Owners.looked_up += 1
            return super().setdefault(key, default)

    caplog.set_level(logging.WARNING, logger="sidestream.sinks")
    per_class = {f"c{i}": MeanMetric() for i in range(500)}
    with Run([JsonlSink(tmp_path / "m.jsonl")]) as run:
        run._delivery._name_streams = Owners()
        collector = run.collector(ComposeMetric(per_class), prefix="train").bind("cpu")
        for step in range(1, 11):
            collector.metric["c0"].update(torch.tensor([1.0]))
            collector.schedule_collection(step)
            collector.collect_results()
        run.log(1, {"lr": 0.1})
        run.log(2, {"lr": 0.1, "train/c7": 5.0})  # a name new to this stream, a clash
        run.log(3, {"lr": 0.1, "train/c7": 5.0})
    assert Owners.looked_up == 500 + 2, Owners.looked_up  # each (stream, name) once
    warnings = [r.getMessage() for r in caplog.records if "two streams" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("'train/c7' is reported by two"), warnings


def test_a_checkpoint_while_a_resumed_sink_opens_keeps_its_resume_state(tmp_path: Path) -> None:
    """Before its open finished a resumed JSONL sink had no offset yet: the checkpoint took its
    live state and lost the offset the next resume reads the file from."""
    import copy
    import threading

    may_open = threading.Event()

    class SlowOpen(JsonlSink):  # a slow mount, say: opens once the test lets it
        def open(self, run: RunInfo) -> None:
            may_open.wait(30)
            super().open(run)

    path = tmp_path / "m.jsonl"
    with Run([JsonlSink(path)]) as first:
        for step in (1, 2, 3):
            first.log(step, {"lr": 1.0})
        saved = first.state_dict()["sinks"]["jsonl"]
    assert isinstance(saved["offset"], int) and saved["offset"] > 0
    resumed = Run([SlowOpen(path)])
    try:
        resumed.load_state_dict({"collectors": {}, "sinks": {"jsonl": copy.deepcopy(saved)}})
        resumed.log(4, {"lr": 1.0})
        assert resumed.state_dict(timeout=0.2)["sinks"]["jsonl"] == saved
    finally:
        may_open.set()
        assert resumed.close(timeout=30)
    assert [record["step"] for record in read_jsonl(path)] == [1, 2, 3, 4]


def test_checkpoints_share_no_lists_and_carry_the_state_of_a_sink_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checkpoints before the sinks deliver again were views of one resume state (an edit of
    one changed the next); a sink left out of this job's config lost its state silently."""
    import copy
    import logging

    caplog.set_level(logging.WARNING, logger="sidestream.sinks")
    with Run([JsonlSink(tmp_path / "a.jsonl"), JsonlSink(tmp_path / "b.jsonl")]) as first:
        first.log(1, {"lr": 1.0})
        saved = first.state_dict()
    assert sorted(saved["sinks"]) == ["jsonl", "jsonl-2"]
    want = copy.deepcopy(saved["sinks"])  # what was saved, before anything is edited
    with Run([JsonlSink(tmp_path / "a.jsonl")]) as resumed:
        resumed.load_state_dict(saved)
        assert "sink(s) ['jsonl-2'], which this run does not have" in caplog.text
        before_start = resumed.state_dict()
        before_start["sinks"]["jsonl"]["last_steps"][0][1] = 999
        saved["sinks"]["jsonl"]["last_steps"][0][1] = 998
        assert resumed.state_dict()["sinks"] == want
        resumed.log(2, {"lr": 1.0})
    after = resumed.state_dict()["sinks"]
    assert after["jsonl"]["last_steps"] == [["", 2]]
    assert after["jsonl-2"] == want["jsonl-2"]


class _SlowMean(MeanMetric):
    def compute(self) -> torch.Tensor:
        import time

        time.sleep(0.4)
        return super().compute()


def test_a_checkpoint_waits_past_its_timeout_for_the_windows_being_computed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The windows were staged and reset, so only their reports carry them: a checkpoint that
    stopped waiting at its timeout lacked them, and a job killed after it and resumed logged
    steps 4, 5, 6 and not 1 to 3 (found by a probe with SIGKILL). Their collectives have ended
    by then (local work is left), so the checkpoint waits for them past its timeout."""
    run = Run([JsonlSink(tmp_path / "m.jsonl")])
    collector = run.collector(_SlowMean(), prefix="t").bind("cpu")
    for step in (1, 2, 3):
        collector.metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
    saved = run.state_dict(timeout=0.2)
    # 3, or fewer on a loaded machine whose first 0.4 s compute ended within the timeout.
    assert re.search(r"[123] window\(s\) of the collector 't' were still being", caplog.text)
    assert "timeout (0.2 s) ran out; waiting up to 300.0 s more" in caplog.text
    # What a job resumed from this checkpoint has: the steps the sink had delivered, and the
    # reports the checkpoint carries for it.
    (stream, last), *_ = saved["sinks"]["jsonl"]["last_steps"] or [("t", 0)]
    carried = [json.loads(line) for line in saved["undelivered"].get("jsonl", "").splitlines()]
    assert stream == "t"
    assert set(range(1, last + 1)) | {report["step"] for report in carried} == {1, 2, 3}
    assert "not in this checkpoint" not in caplog.text
    caplog.clear()
    assert run.close(timeout=30)
    run = Run([JsonlSink(tmp_path / "n.jsonl")])
    collector = run.collector(_SlowMean(), prefix="t").bind("cpu")
    collector.metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    run.state_dict(timeout=30)  # time enough: no warning
    assert "still being computed" not in caplog.text
    assert run.close(timeout=30)


@pytest.mark.parametrize("child", [False, True])
def test_a_checkpoint_taken_before_the_sink_opened_resumes_without_repeating_a_stream(
    tmp_path: Path, child: bool
) -> None:
    """The sink opened only after the checkpoint (a busy host, a slow child process): the
    checkpoint named no offset into the file, so the resumed JSONL sink looked at the last line
    alone and logged the other stream's steps again."""
    from sidestream.sinks import ProcessSink
    from tests.collector.child_sinks import SlowOpenSink

    path = tmp_path / "run.jsonl"

    def sink(seconds: float) -> JsonlSink | ProcessSink:
        made = SlowOpenSink(path, seconds)
        return ProcessSink(made) if child else made

    with Run([sink(2.0)]) as first:
        train = first.collector(MeanMetric(), prefix="train").bind("cpu")
        first.log(1, {"lr": 0.1})
        train.metric.update(torch.tensor([1.0, 2.0]))
        train.schedule_collection(1)
        saved = first.state_dict(timeout=0.2)  # before the sink opened
    assert saved["sinks"]["jsonl"]["last_steps"] == []
    with Run([sink(0.0)]) as resumed:
        train = resumed.collector(MeanMetric(), prefix="train")
        resumed.load_state_dict(saved)
        train.bind("cpu")
        resumed.log(1, {"lr": 0.1})  # the job repeats step 1 of both streams
        _log_the_repeated_window_and_the_next(train)
    rows = sorted((r["stream"], r["step"], r["values"]) for r in read_jsonl(path))
    assert rows == [
        ("", 1, {"lr": 0.1}),
        ("train", 1, {"train": 1.5}),
        ("train", 2, {"train": 7.0}),
    ]


def test_a_checkpoint_of_another_metric_names_the_collector_it_was_loaded_into(
    tmp_path: Path,
) -> None:
    # "missing keys ['max'] ... for MaxMetric" named no stream, in a run of several collectors.
    with Run([JsonlSink(tmp_path / "a.jsonl")]) as run:
        train = run.collector(MeanMetric(), prefix="train").bind("cpu")
        train.metric.update(torch.tensor([1.0]))
        train.schedule_collection(1)
        saved = run.state_dict()
    later = Run([JsonlSink(tmp_path / "b.jsonl")])
    later.load_state_dict(saved)
    with pytest.raises(KeyError, match=r"collector 'train': state_dict: missing keys \['max'\]"):
        later.collector(MaxMetric(), prefix="train")
    assert later.close()
    first = Run([JsonlSink(tmp_path / "c.jsonl")])
    first.collector(MaxMetric(), prefix="train")
    with pytest.raises(KeyError, match=r"collector 'train': state_dict: missing keys"):
        first.load_state_dict(saved)
    assert first.close()


def test_a_run_resumes_without_numpy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # numpy is no dependency of the core; loading a checkpoint read tensors through it and
    # failed with "Numpy is not available" where it was not installed.
    def no_numpy(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        raise RuntimeError("Numpy is not available")

    run = Run([JsonlSink(tmp_path / "a.jsonl")])
    metric = SumMetric()
    collector = run.collector(metric, prefix="train").bind("cpu")
    metric.update(torch.tensor([2.0, 3.0]))
    collector.schedule_collection(1)
    state = run.state_dict()
    assert run.close()
    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    resumed = Run([JsonlSink(tmp_path / "a.jsonl")])
    again = SumMetric()
    continued = resumed.collector(again, prefix="train")
    resumed.load_state_dict(state)
    continued.bind("cpu")
    again.update(torch.tensor([4.0]))
    continued.schedule_collection(2)
    assert resumed.close()
    values = {r["step"]: r["values"]["train"] for r in read_jsonl(tmp_path / "a.jsonl")}
    assert values == {1: 5.0, 2: 4.0}


def test_a_closed_stream_lets_go_of_its_staging_copies() -> None:
    # A Run keeps every stream's collector (for state_dict and close); each kept its staging
    # copies of the metric (a 500-class confusion matrix: 24 MB per closed evaluation stream).
    import gc
    import weakref

    sink = RecordingSink()
    run = Run([sink])
    kept: list[weakref.ref[Any]] = []
    for name in ("val_a", "val_b"):
        with run.collector(MeanMetric(), prefix=name) as collector:
            for step in range(1, 4):
                collector.metric.update(torch.tensor([float(step)]))
                collector.schedule_collection(step)
            assert collector.wait_windows(timeout=30)
            slot = collector._free_slots.get_nowait()
            kept.append(weakref.ref(slot))
            collector._free_slots.put(slot)
            del slot
        assert collector._slot_count == 0 and collector._free_slots.empty()
    gc.collect()
    assert [ref() for ref in kept] == [None, None]
    run.state_dict()  # reads no staging copy
    assert run.close()
    delivered = [(r.stream, r.step, r.values) for r in sink.reports if r.stream == "val_b"]
    assert delivered == [("val_b", step, {"val_b": float(step)}) for step in (1, 2, 3)]


def test_the_sinks_open_with_the_config_as_it_was_when_the_run_info_was_made() -> None:
    # A Hydra config or a dict changed after the RunInfo was made (a key filled in, a value
    # overwritten) reached the sinks as changed, unchecked, and read by rank 0's sink thread
    # while the training thread could be writing it.
    config: dict[str, Any] = {"lr": 0.1, "opt": {"betas": [0.9, 0.99]}}
    tags = {"team": "vision"}
    info = RunInfo(name="job", config=config, tags=tags)
    config["lr"] = 5.0
    config["opt"]["eps"] = 1e-8
    config["opt.eps"] = 1e-6  # would collide with opt.eps once flattened
    tags["owner"] = "someone"
    sink = RecordingSink()
    with Run([sink], info=info) as run:
        run.log(1, {"loss": 1.0})
    assert sink.opened == [info]
    assert sink.opened[0].config == {"lr": 0.1, "opt": {"betas": [0.9, 0.99]}}
    assert sink.opened[0].tags == {"team": "vision"}


def test_the_sinks_open_with_the_config_lists_as_they_were_when_the_run_info_was_made() -> None:
    # RunInfo copied the config's mappings but kept its lists: a list appended to after the
    # RunInfo was made reached the sinks changed (an OmegaConf ListConfig, its interpolations
    # unresolved, too).
    config: dict[str, Any] = {"opt": {"betas": [0.9, 0.99]}, "milestones": [[10, 20]]}
    info = RunInfo(config=config)
    config["opt"]["betas"].append(0.5)
    config["milestones"][0][1] = 30
    sink = RecordingSink()
    with Run([sink], info=info) as run:
        run.log(1, {"loss": 1.0})
    assert sink.opened[0].config == {"opt": {"betas": [0.9, 0.99]}, "milestones": [[10, 20]]}
