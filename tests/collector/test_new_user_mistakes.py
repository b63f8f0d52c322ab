"""Mistakes a new user made with ``Run`` and plain metrics, each failing loudly or working."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from sidestream import AsyncMetricCollector, ComposeMetric, MeanMetric, Run
from sidestream.sinks import JsonlSink, read_jsonl
from sidestream.sync import CallFingerprint, RankMismatchError

ROOT = Path(__file__).resolve().parents[2]


def test_sync_and_state_dict_under_a_launcher_without_a_process_group_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun set WORLD_SIZE/RANK, the script forgot init_process_group: a sync that quietly
    # returns this rank's numbers as global ones would be a wrong number, not an error.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    metrics = ComposeMetric({"loss": MeanMetric()})
    metrics["loss"].update(torch.tensor([1.0, 3.0]))
    with pytest.raises(RuntimeError, match=r"^sync: .*WORLD_SIZE=2.*init_process_group"):
        metrics.sync()
    with pytest.raises(RuntimeError, match=r"^state_dict: .*init_process_group"):
        metrics.state_dict()
    with pytest.raises(RuntimeError, match=r"^sync: .*init_process_group"):
        metrics["loss"].sync()
    # The lower layer too: a collector-like caller would reduce nothing.
    with pytest.raises(RuntimeError, match=r"^prepare_sync: .*init_process_group"):
        metrics.prepare_sync(None)
    with pytest.raises(RuntimeError, match=r"^start_sync: .*init_process_group"):
        metrics.start_sync(None, CallFingerprint("sync", 1))
    monkeypatch.setenv("WORLD_SIZE", "1")  # a one-process job: sync is a no-op
    metrics.sync()
    assert metrics.compute()["loss"].item() == 2.0
    assert metrics.state_dict()["loss.total"].item() == 4.0


def test_run_state_dict_under_a_launcher_without_a_process_group_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A run with plain values only reduces nothing, so no metric's check caught it: every rank
    # returned its own sink states as rank 0's, for a checkpoint that resumes every tracker.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run = Run([JsonlSink(tmp_path / "m.jsonl")])
    with pytest.raises(RuntimeError, match=r"^state_dict: .*RANK=1.*init_process_group"):
        run.state_dict()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert set(run.state_dict()) == {"collectors", "sinks", "undelivered"}
    assert run.close(timeout=10)


def test_one_sink_given_twice_to_one_run_says_so(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match=r"is given twice; pass each sink object once"):
        Run([sink, sink])
    with Run([sink]) as run:  # the refused run claimed nothing
        run.log(1, {"lr": 0.1})


def test_log_takes_numpy_scalars(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    values = {"lr": np.float32(0.1), "tokens": np.int64(4096), "norm": np.float64(2.5)}
    with Run([JsonlSink(path)]) as run:
        run.log(1, values)
        with pytest.raises(TypeError, match=r"values\['flag'\]: expected a number"):
            run.log(2, {"flag": np.bool_(True)})
    (record,) = read_jsonl(path)
    assert record["values"] == {name: float(value) for name, value in values.items()}


class _FailingMean(MeanMetric):
    def compute(self) -> torch.Tensor:
        raise ValueError("compute failed")


def test_run_close_reports_a_failed_window_of_a_collector_closed_before_it(
    tmp_path: Path,
) -> None:
    # `with collector:` (as the collector docs show) closes a run's collector first; the run's
    # close must still say that not everything was delivered, and so must a second close.
    run = Run([JsonlSink(tmp_path / "m.jsonl")])
    with run.collector(_FailingMean(), prefix="val").bind("cpu") as val:
        val.metric.update(torch.tensor([1.0]))
        val.schedule_collection(1)
    assert val.close() is False
    run.log(1, {"lr": 0.1})
    assert run.close() is False
    assert run.close() is False


class _MismatchedMean(MeanMetric):
    def compute(self) -> torch.Tensor:
        # What a window's fingerprint check raises when ranks paired different calls.
        raise RankMismatchError("sync: ranks of the group paired different calls")


def test_run_state_dict_raises_a_rank_mismatch_its_windows_found(tmp_path: Path) -> None:
    # collector.state_dict() raises it before issuing its collective; run.state_dict() of a
    # run's collector must too, instead of checkpointing as if nothing happened.
    run = Run([JsonlSink(tmp_path / "m.jsonl")])
    train = run.collector(_MismatchedMean(), prefix="train").bind("cpu")
    train.metric.update(torch.tensor([1.0]))
    train.schedule_collection(1)
    with pytest.raises(RankMismatchError):
        train.collect_results(timeout=30)
    with pytest.raises(RankMismatchError, match="paired different calls"):
        train.state_dict()
    with pytest.raises(RankMismatchError, match="paired different calls"):
        run.state_dict()
    assert run.close() is False


def test_a_run_of_collectors_only_is_closed_at_interpreter_exit(tmp_path: Path) -> None:
    # "Closing also happens at interpreter exit", also when no run.log started the sinks: before,
    # only log registered the exit hook, so a bound collector's windows died with the process.
    path = tmp_path / "exit.jsonl"
    script = textwrap.dedent(
        f"""
        import time

        import torch
        from sidestream import Run, SumMetric
        from sidestream.sinks import JsonlSink


        class SlowJsonl(JsonlSink):
            def send(self, reports):
                time.sleep(0.2)  # a tracker slower than the interpreter's exit
                super().send(reports)


        run = Run([SlowJsonl({str(path)!r})])
        train = run.collector(SumMetric(), prefix="train").bind("cpu")
        for step in range(1, 4):
            train.metric.update(torch.tensor([float(step)]))
            train.schedule_collection(step)
        # no close()
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=120)
    assert [(r["step"], r["values"]["train"]) for r in read_jsonl(path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
    ]


def test_a_run_that_never_started_is_not_kept_alive(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "m.jsonl")
    Run([sink])  # never started, never closed, and gone at once: its sink is free
    Run([sink]).close()


def test_a_collector_per_validation_pass_is_refused_with_the_pattern_that_works(
    tmp_path: Path,
) -> None:
    with Run([JsonlSink(tmp_path / "m.jsonl")]) as run:
        with run.collector(MeanMetric(), prefix="val").bind("cpu") as val:
            val.metric.update(torch.tensor([1.0]))
            val.schedule_collection(100)
        with pytest.raises(ValueError, match=r"stream 'val'.*make each stream's collector once"):
            run.collector(MeanMetric(), prefix="val")


def test_run_load_state_dict_of_a_collector_checkpoint_names_the_expected_keys(
    tmp_path: Path,
) -> None:
    collector = MeanMetric()
    with Run([JsonlSink(tmp_path / "a.jsonl")]) as run:
        train = run.collector(collector, prefix="train").bind("cpu")
        saved = train.state_dict()  # the collector's own: {"metric": ..., "sinks": {}}
    resumed = Run([JsonlSink(tmp_path / "b.jsonl")])
    with pytest.raises(
        KeyError,
        match=r"\['collectors', 'sinks', 'undelivered'\] \(a checkpoint of an earlier version "
        r"may lack 'undelivered'\), got \['metric', 'sinks', 'undelivered'\]",
    ):
        resumed.load_state_dict(saved)
    assert resumed.close()


def test_bad_timeouts_and_devices_are_named_before_anything_happens(tmp_path: Path) -> None:
    """A timeout of "30" or -1, or bind(3.5), is a typo: named at the call, not deep inside
    a wait (a str timeout failed as "unsupported operand", a negative one waited 0 s)."""
    from sidestream import AsyncMetricCollector

    collector = AsyncMetricCollector(MeanMetric())
    with pytest.raises(TypeError, match=r"^bind: device: expected a torch.device, a str, a CUDA"):
        collector.bind(3.5)  # type: ignore[arg-type]
    if not torch.cuda.is_available():  # a CUDA index is a device (bind(local_rank))
        with pytest.raises(RuntimeError, match=r"CUDA|accelerator"):
            collector.bind(0)
    collector.bind()
    collector.metric.update(torch.tensor([2.0]))
    collector.schedule_collection(step=1)
    for call in (collector.collect_results, collector.state_dict, collector.close):
        name = call.__name__
        with pytest.raises(TypeError, match=rf"^{name}: timeout: expected a number of seconds"):
            call("30")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=rf"^{name}: timeout: expected .* >= 0 or None"):
            call(-1)
    assert collector.collect_results(10) == 2.0  # nothing changed: the window is still there
    assert collector.collect_results(float("inf")) == 2.0  # no limit, as None
    assert collector.close(float("inf"))
    run = Run([JsonlSink(tmp_path / "log.jsonl")])
    for call in (run.state_dict, run.close):
        with pytest.raises(ValueError, match=rf"^{call.__name__}: timeout: .*got NaN"):
            call(float("nan"))
    run.log(1, {"lr": 0.1})
    assert run.close(10)
    assert [r["values"] for r in read_jsonl(tmp_path / "log.jsonl")] == [{"lr": 0.1}]


@pytest.mark.parametrize(
    ("max_batch", "error"), [(0, ValueError), (-3, ValueError), (2.5, TypeError)]
)
def test_a_sink_max_batch_below_one_is_refused_when_the_run_is_built(
    max_batch: object, error: type[Exception]
) -> None:
    # It was made 1 without a word on rank 0 only, when the sink's runner started.
    from sidestream.sinks import ConsoleSink

    sink = ConsoleSink()
    sink.max_batch = max_batch  # type: ignore[assignment]
    with pytest.raises(error, match=r"^sinks\[0\]\.max_batch: expected an int >= 1"):
        Run([sink])
    with pytest.raises(error, match=r"^sinks\[0\]\.max_batch: expected an int >= 1"):
        AsyncMetricCollector(MeanMetric(), sinks=[sink])


def test_a_with_block_per_validation_pass_says_the_collector_is_closed(tmp_path: Path) -> None:
    """The second `with val:` entered a closed collector silently; schedule_collection then
    asked for a bind that bind itself refused ("already bound (or closed)")."""
    run = Run([JsonlSink(tmp_path / "m.jsonl")])
    val = run.collector(MeanMetric(), prefix="val")
    with val:  # the first pass binds, and closes at its end
        val.metric.update(torch.tensor([1.0]))
        val.schedule_collection(100)
    for call in (val.__enter__, lambda: val.schedule_collection(200), lambda: val.bind("cpu")):
        with pytest.raises(RuntimeError, match=r"the collector is closed \(by close\(\)"):
            call()
    assert run.close(timeout=30)
