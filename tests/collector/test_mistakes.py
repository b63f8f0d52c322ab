"""Mistakes fail early and clearly; permanent sink failures stop retrying; JSONL durability."""

from __future__ import annotations

import copy
import json
import logging
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sidestream import ComposeMetric, MeanMetric, Run, SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import (
    JsonlSink,
    PermanentSinkError,
    ProcessSink,
    Report,
    RunInfo,
    SinkStatus,
    TrackerSink,
    is_permanent,
    read_jsonl,
    sinks_from_config,
)
from tests._scripts import run_python
from tests.collector.helpers import RecordingSink

_python = run_python


def _printed(stdout: str) -> list[str]:
    """The lines a job printed: torch 2.8's gloo prints "[Gloo] Rank 0 is connected ..." too."""
    return [line for line in stdout.splitlines() if not line.startswith("[Gloo]")]


class HttpError(Exception):
    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}")
        self.status_code = status_code


class FailingSink(RecordingSink):
    """Raises ``error`` from ``open`` (or from the first ``fail_writes`` writes)."""

    def __init__(self, error: Exception, *, at_open: bool = True, fail_writes: int = 0) -> None:
        super().__init__(name="failing")
        self.error, self.at_open, self.fail_writes = error, at_open, fail_writes

    def open(self, run: RunInfo) -> None:
        if self.at_open:
            raise self.error
        super().open(run)

    def write(self, report: Report) -> None:
        if self.fail_writes:
            self.fail_writes -= 1
            self.attempts += 1
            raise self.error
        super().write(report)


def test_option_typo_names_the_option_the_valid_ones_and_the_nearest(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"no option 'paht'; did you mean 'path'\?.*flush_every"):
        sinks_from_config({"jsonl": {"paht": "x"}})
    pytest.importorskip("sidestream_tensorboard")
    with pytest.raises(
        TypeError,
        match=r"sink 'tensorboard' has no option 'logdir'; did you mean 'log_dir'\? "
        r"\(valid options: .*flush_secs.*\)",
    ):
        sinks_from_config({"tensorboard": {"logdir": str(tmp_path)}})


@pytest.mark.parametrize(("name", "client"), [("mlflow", "mlflow"), ("wandb", "wandb")])
def test_missing_tracker_client_raises_at_build_with_both_install_commands(
    name: str, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip(f"sidestream_{name}")
    monkeypatch.setitem(sys.modules, client, None)  # "import mlflow" now raises ImportError
    with pytest.raises(
        LookupError,
        match=rf'sink {name!r}: .*pip install "sidestream\[{name}\]" \(from a checkout of the '
        rf"repository: pip install ./packages/sidestream ./integrations/sidestream-{name}\)",
    ):
        sinks_from_config([name])


def test_several_processes_without_a_process_group_fail_at_bind_and_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    collector = AsyncMetricCollector(MeanMetric())
    with pytest.raises(RuntimeError, match=r"bind: .*WORLD_SIZE=2, RANK=1.*init_process_group"):
        collector.bind("cpu")
    run = Run()
    with pytest.raises(RuntimeError, match=r"log: .*torch\.distributed\.init_process_group"):
        run.log(1, {"lr": 0.1})
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    run.log(1, {"lr": 0.1})  # a one-process job is fine
    assert run.close()


def test_a_process_group_of_another_size_than_the_launchers_fails_at_bind() -> None:
    # Each torchrun rank made a world_size=1 group: both acted as rank 0, each wrote its own
    # unreduced numbers to the trackers, and closed True.
    script = textwrap.dedent(
        """
        import torch.distributed as dist
        from sidestream import MeanMetric, Run
        from sidestream.collector import AsyncMetricCollector

        dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
        for call in (lambda: AsyncMetricCollector(MeanMetric()).bind("cpu"),
                     lambda: Run().log(1, {"lr": 0.1}), lambda: MeanMetric().sync()):
            try:
                call()
            except RuntimeError as error:
                print(error)
            else:
                print("no error")
        dist.destroy_process_group()  # torch aborts at exit now and then without it
        """
    )
    done = _python("-c", script, WORLD_SIZE="2", RANK="1")
    assert done.returncode == 0, done.stderr
    lines = _printed(done.stdout)
    assert len(lines) == 3, lines
    for line, where in zip(lines, ("bind", "log", "sync"), strict=True):
        assert line.startswith(f"{where}: the environment says this job has 2 processes"), line
        assert "holds this process alone" in line, line


def test_a_group_per_node_smaller_than_the_launchers_world_fails_at_bind(tmp_path: Path) -> None:
    # Two nodes of two processes each, where every node made its own group from LOCAL_RANK
    # and LOCAL_WORLD_SIZE: each node's local rank 0 was rank 0 of a group of 2, so both wrote
    # their node's half of the numbers (count 80 where the job had 160) to the same shared
    # JSONL file and TensorBoard directory, every step twice, and closed True. One node of it
    # here: WORLD_SIZE=4, RANK=2 and 3, a group of 2.
    script = textwrap.dedent(
        """
        import os
        import sys
        import torch.distributed as dist
        import torch.multiprocessing as mp
        from sidestream import MeanMetric, Run
        from sidestream.collector import AsyncMetricCollector

        def work(local_rank, init_method):
            os.environ["RANK"] = str(2 + local_rank)
            dist.init_process_group("gloo", init_method=init_method, world_size=2, rank=local_rank)
            lines = []
            for where, call in (
                ("bind", lambda: AsyncMetricCollector(MeanMetric()).bind("cpu")),
                ("log", lambda: Run().log(1, {"lr": 0.1})),
                ("sync", lambda: MeanMetric().sync()),
            ):
                try:
                    call()
                except RuntimeError as error:
                    lines.append(f"{local_rank} {error}")
                else:
                    lines.append(f"{local_rank} {where}: no error")
            sys.stdout.write("\\n".join(lines) + "\\n")  # one write: the ranks share the pipe
            sys.stdout.flush()
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(work, args=(f"file://{__file__}.store",), nprocs=2)
        """
    )
    path = tmp_path / "per_node.py"  # spawn imports the main module again: a file, not -c
    path.write_text(script)
    done = _python(str(path), WORLD_SIZE="4", RANK="2")
    assert done.returncode == 0, done.stderr
    lines = sorted(_printed(done.stdout))
    assert len(lines) == 6, lines
    for line in lines:
        local_rank = int(line[0])
        assert "no error" not in line, line
        assert re.match(
            rf"{local_rank} (bind|log|sync): the environment says this job has 4 processes "
            rf"\(WORLD_SIZE, RANK={2 + local_rank}\), but the default process group holds 2 "
            rf"processes \(this one as rank {local_rank}\)",
            line,
        ), line
        assert "init_process_group" in line, line


def test_a_larger_group_than_the_launchers_world_is_fine(tmp_path: Path) -> None:
    # Launchers that set WORLD_SIZE/RANK per node and spawn a process per GPU (PyTorch's
    # ImageNet example): a group larger than WORLD_SIZE says is the job, not a mistake.
    script = textwrap.dedent(
        """
        import sys
        import torch, torch.distributed as dist, torch.multiprocessing as mp
        from sidestream import MeanMetric
        from sidestream.collector import AsyncMetricCollector

        def work(rank, init_method):
            dist.init_process_group("gloo", init_method=init_method, world_size=2, rank=rank)
            metric = MeanMetric()
            collector = AsyncMetricCollector(metric).bind("cpu")
            metric.update(torch.tensor([float(rank)]))
            collector.schedule_collection(1)
            value = float(collector.collect_results(timeout=60))
            sys.stdout.write(f"{rank} {value}\\n")  # one write: the two ranks share the pipe
            sys.stdout.flush()
            collector.close(timeout=30)
            # Without it gloo's threads abort the exit now and then (pytorch/pytorch#190489).
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(work, args=(f"file://{__file__}.store",), nprocs=2)
        """
    )
    path = tmp_path / "per_gpu.py"  # spawn imports the main module again: a file, not -c
    path.write_text(script)
    done = _python(str(path), WORLD_SIZE="1", RANK="0")
    assert done.returncode == 0, done.stderr
    assert sorted(_printed(done.stdout)) == ["0 0.5", "1 0.5"], done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    collector = AsyncMetricCollector(MeanMetric())
    with pytest.raises(RuntimeError, match=r"bind: device 'cuda' needs CUDA.*bind\('cpu'\)"):
        collector.bind("cuda")
    # The README's metric.to("cuda") raised torch's "Torch not compiled with CUDA enabled".
    metric = MeanMetric()
    metric.update(torch.tensor([2.0]))
    with pytest.raises(RuntimeError, match=r"to: device 'cuda:1' needs CUDA.*to\('cpu'\)"):
        metric.to("cuda:1")
    assert metric.device.type == "cpu" and metric.compute().item() == 2.0


def test_which_failures_are_permanent() -> None:
    assert is_permanent(ImportError("no module"))
    assert is_permanent(TypeError("unexpected keyword"))
    assert is_permanent(PermanentSinkError("bad project"))
    # The same numbers overflow on every retry (a config int TensorBoard's hparams cannot hold).
    assert is_permanent(OverflowError("int too large to convert to float"))
    assert is_permanent(IndexError("list index out of range"))
    assert is_permanent(HttpError(403)) and is_permanent(HttpError(404))
    assert not is_permanent(HttpError(408)) and not is_permanent(HttpError(429))
    assert not is_permanent(HttpError(503)) and not is_permanent(ConnectionError("down"))


@pytest.mark.parametrize(
    ("error", "at_open"),
    [(ImportError("No module named 'tracker'"), True), (HttpError(403), False)],
)
def test_permanent_failure_is_reported_once_and_healthy_sinks_get_everything(
    error: Exception, at_open: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = FailingSink(error, at_open=at_open, fail_writes=0 if at_open else 1)
    path = tmp_path / "m.jsonl"
    run = Run(
        [JsonlSink(path), broken],
        sink_retry_initial_s=0.01,
        sink_retry_max_s=0.02,
        spool_dir=str(tmp_path),  # the failed sink's kept spool stays out of the shared /tmp
    )
    train = run.collector(SumMetric(), prefix="train").bind("cpu")
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        for step in range(1, 21):
            train.metric.update(torch.tensor([float(step)]))
            train.schedule_collection(step)
            run.log(step, {"lr": 0.1})
        assert train.wait_windows(30)
        assert run.close(timeout=30) is False
    status = run.sink_status
    assert status["jsonl"] == SinkStatus("healthy", None)
    assert status["failing"].state == "failed"
    assert type(error).__name__ in str(status["failing"].last_error)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "failed permanently" in errors[0].getMessage()
    assert "close() returns False" in errors[0].getMessage()
    assert broken.attempts <= 1, "a permanent failure is not retried"
    records = list(read_jsonl(path))
    for stream in ("train", ""):
        assert [r["step"] for r in records if r["stream"] == stream] == list(range(1, 21))


def test_transient_http_failure_is_retried_and_recovers(tmp_path: Path) -> None:
    flaky = FailingSink(HttpError(429), at_open=False, fail_writes=3)
    run = Run([flaky], sink_retry_initial_s=0.01, sink_retry_max_s=0.02, spool_dir=str(tmp_path))
    run.log(1, {"lr": 0.5})
    assert run.close(timeout=30) is True
    assert flaky.steps == [1] and flaky.attempts == 4
    assert run.sink_status["failing"] == SinkStatus("healthy", "HttpError: HTTP 429")


def test_jsonl_counts_a_step_only_once_it_is_in_the_file(tmp_path: Path) -> None:
    """A full disk (RLIMIT_FSIZE): close is False and the state holds only what is in the file."""
    path = tmp_path / "m.jsonl"
    script = textwrap.dedent(
        f"""
        import json, resource, signal, torch
        from sidestream import SumMetric
        from sidestream.collector import AsyncMetricCollector
        from sidestream.sinks import JsonlSink

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))
        metric = SumMetric()
        collector = AsyncMetricCollector(
            metric, sinks=[JsonlSink({str(path)!r})], sink_retry_initial_s=0.01,
            sink_retry_max_s=0.05, spool_dir={str(tmp_path)!r},
        ).bind("cpu")
        for step in range(1, 401):
            metric.update(torch.tensor([float(step)]))
            collector.schedule_collection(step)
        state = collector.state_dict(timeout=3)["sinks"]["jsonl"]
        closed = collector.close(timeout=3)
        print(json.dumps({{"closed": closed, "state": state}}))
        """
    )
    done = _python("-c", script)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    steps = [record["step"] for record in read_jsonl(path)]
    assert 0 < len(steps) < 400
    assert steps == list(range(1, len(steps) + 1)), "each step once, in order"
    assert result["closed"] is False, "undelivered steps make close() False"
    # The state never claims a step the file lacks (lines of a failed batch may be there).
    assert dict(result["state"]["last_steps"])[""] <= steps[-1]
    # Resumed with room on the disk: every step exactly once.
    resumed = JsonlSink(path)
    resumed.load_state_dict(result["state"])
    resumed.open(RunInfo())
    for step in range(1, 401):
        resumed.write(Report(step=step, values={"": float(step)}, time=0.0))
    resumed.close()
    assert [record["step"] for record in read_jsonl(path)] == list(range(1, 401))


def test_jsonl_resume_finds_the_last_line_of_any_length(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    big = {"h": list(range(40000))}  # a line of about 250 KB: longer than any fixed tail
    sink = JsonlSink(path)
    sink.open(RunInfo())
    for step in (1, 2, 3):
        sink.write(
            Report(
                step=step,
                values={"x": 1.0},
                time=0.0,
                histograms={k: torch.tensor(v) for k, v in big.items()},
            )
        )
    sink.close()
    assert path.stat().st_size > 3 * 200_000
    resumed = JsonlSink(path)
    # An old checkpoint: no offset, one stream.
    resumed.load_state_dict({"path": str(path), "last_step": 1})
    resumed.open(RunInfo())
    for step in (2, 3, 4):
        resumed.write(Report(step=step, values={"x": 2.0}, time=0.0))
    resumed.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4]


def test_jsonl_on_a_character_device_does_not_read_it(tmp_path: Path) -> None:
    sink = JsonlSink("/dev/null")
    sink.load_state_dict({"path": "/dev/null", "last_steps": {"": 3}, "offset": 10})
    sink.open(RunInfo())  # no tail read of an endless device
    sink.write(Report(step=4, values={"x": 1.0}, time=0.0))
    assert sink.close()
    assert sink.state_dict()["last_steps"] == [["", 4]]
    json.dumps(sink.state_dict())


def test_close_is_false_when_the_final_flush_of_a_buffering_sink_fails(tmp_path: Path) -> None:
    class Buffering(TrackerSinkForTests):
        durable_on_send = False

        def persist(self, timeout: float | None) -> bool:
            return False  # the backend never confirms

    sink = Buffering()
    run = Run([sink], spool_dir=str(tmp_path))  # its kept spool stays out of the shared /tmp
    run.log(1, {"lr": 0.1})
    assert run.close(timeout=30) is False
    assert sink.sent == [1] and sink.state_dict()["last_steps"] == []
    assert len(list(tmp_path.glob("*.spool.jsonl"))) == 1  # the unconfirmed report, kept


class TrackerSinkForTests(TrackerSink):
    name = "buffering"

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[int] = []

    def open(self, run: RunInfo) -> None:
        del run

    def send(self, reports: Sequence[Report]) -> None:
        self.sent += [report.step for report in reports]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tags": ["x", "y"]}, r"tags: expected a mapping of tag names .*\['x', 'y'\]"),
        ({"tags": {1: "a"}}, r"tags: expected a mapping of tag names"),
        ({"config": "lr=3"}, r"config: expected a mapping of hyper-parameters .*'lr=3'"),
        ({"name": 5}, r"name: expected a str or None, got 5"),
    ],
)
def test_run_info_of_wrong_types_fails_when_made(fields: dict[str, object], message: str) -> None:
    # Accepted as made, they failed on rank 0's sink thread at open, after training started
    # (TensorBoard: 'list' object has no attribute 'items').
    with pytest.raises(TypeError, match=message):
        RunInfo(**fields)  # type: ignore[arg-type]
    assert RunInfo(name="a", config={"lr": {"x": 1}}, tags={"team": ""}).tags == {"team": ""}


_SURROGATE = "bad\udc80name"  # a file name read with surrogateescape: no UTF-8 writer takes it


@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"name": _SURROGATE}, "name"),
        ({"tags": {_SURROGATE: ""}}, "tags: a tag name"),
        ({"tags": {"team": _SURROGATE}}, r"tags\['team'\]"),
        ({"config": {"opt": {_SURROGATE: 1}}}, "config: a key"),
        ({"config": {"data": Path(_SURROGATE)}}, r"config\['data'\]"),
    ],
)
def test_run_info_refuses_text_utf8_cannot_encode(fields: dict[str, object], what: str) -> None:
    # Accepted, it failed every tracker's open on rank 0 (TensorBoard: UnicodeEncodeError).
    with pytest.raises(ValueError, match=rf"{what}: expected text that UTF-8 can encode"):
        RunInfo(**fields)  # type: ignore[arg-type]


def test_value_names_utf8_cannot_encode_are_refused_before_anything_counts() -> None:
    # A value named so failed the TensorBoard sink for good, and again in every job resumed
    # from a checkpoint that held the report.
    run = Run([RecordingSink()])
    with pytest.raises(ValueError, match=r"values: a name: expected text that UTF-8 can encode"):
        run.log(1, {"lr": 0.1, _SURROGATE: 1.0})
    run.log(1, {"lr": 0.1})  # the step did not count
    with pytest.raises(ValueError, match="prefix: expected text that UTF-8 can encode"):
        AsyncMetricCollector(MeanMetric(), prefix=_SURROGATE)
    with pytest.raises(ValueError, match="metrics: a name: expected text that UTF-8 can encode"):
        ComposeMetric({_SURROGATE: MeanMetric()})
    assert run.close()


def test_a_compute_result_key_utf8_cannot_encode_fails_its_window() -> None:
    class Named(MeanMetric):
        def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
            return {_SURROGATE: super().compute()}

    metric = Named()
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind("cpu")
    metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    with pytest.raises(
        RuntimeError, match="compute\\(\\) result: a name: expected text that UTF-8"
    ):
        collector.collect_results()
    assert not collector.close(timeout=30)
    assert sink.reports == []


def test_run_info_refuses_an_empty_tag_name() -> None:
    # W&B refuses the empty tag and MLflow the empty key, on rank 0 at open.
    with pytest.raises(ValueError, match=r"tags: a tag name must not be empty, got \{'': 'x'\}"):
        RunInfo(tags={"": "x"})


def test_a_refused_collector_checkpoint_leaves_the_sinks_unresumed(tmp_path: Path) -> None:
    # The sinks' states were loaded before the metric refused the checkpoint: a job that
    # caught the error and started fresh skipped every step up to the checkpoint's.
    source = AsyncMetricCollector(MeanMetric(), sinks=[JsonlSink(tmp_path / "a.jsonl")])
    source.bind("cpu")
    source.metric.update(torch.tensor([1.0]))
    source.schedule_collection(3)
    source.collect_results(timeout=30)
    saved = source.state_dict()
    source.close()
    sink = JsonlSink(tmp_path / "b.jsonl")
    other = AsyncMetricCollector(SumMetric(), sinks=[sink])
    with pytest.raises(KeyError):
        other.load_state_dict(saved)
    with pytest.raises(KeyError, match=r"collector.state_dict\(\)'s keys .*run.load_state_dict"):
        other.load_state_dict({"collectors": {}, "sinks": {}})
    other.bind("cpu")  # started fresh
    other.metric.update(torch.tensor([2.0]))
    other.schedule_collection(2)
    assert other.close(timeout=30)
    assert [line["step"] for line in read_jsonl(tmp_path / "b.jsonl")] == [2]


def test_a_metric_of_a_bound_collector_refuses_a_checkpoint() -> None:
    # Loaded on some ranks only after bind, the checkpoint was dropped silently (only the
    # group's first rank takes saved numbers) and the windows mixed it in on rank 0 alone.
    metric = MeanMetric()
    saved = MeanMetric()
    saved.update(torch.tensor([5.0]))
    state = saved.state_dict()
    collector = AsyncMetricCollector(metric, prefix="train").bind("cpu")
    with pytest.raises(RuntimeError, match=r"bound collector \(prefix 'train'\).*before bind"):
        metric.load_state_dict(state)
    copied = copy.deepcopy(metric)  # a copy belongs to no collector
    copied.load_state_dict(state)
    assert float(copied.compute()) == 5.0
    collector.close()
    metric.load_state_dict(state)  # closed: the metric is the user's again
    assert float(metric.compute()) == 5.0


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"spool_dir": 123}, TypeError, r"spool_dir: expected a path"),
        ({"exit_timeout": "10"}, TypeError, r"exit_timeout: expected a number of seconds"),
        ({"exit_timeout": float("nan")}, ValueError, r"exit_timeout: .*NaN"),
        ({"sink_retry_max_s": "x"}, TypeError, r"sink_retry_max_s: expected a number"),
    ],
)
def test_run_options_of_the_wrong_type_are_named(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    # spool_dir=123 was taken, then 17 of 20 reports were dropped at run time.
    with pytest.raises(error, match=message):
        Run([], **options)  # type: ignore[arg-type]


def test_run_log_refuses_what_a_tracker_cannot_take(tmp_path: Path) -> None:
    # A step of -3 or 2**63 + 5 was taken, then failed TensorBoard for the whole run.
    run = Run([JsonlSink(tmp_path / "run.jsonl")])
    with pytest.raises(ValueError, match=r"step: expected an int in \[0, 2\*\*63\), got -3"):
        run.log(-3, {"x": 1.0})
    with pytest.raises(ValueError, match=r"step: expected an int in \[0, 2\*\*63\)"):
        run.log(2**63 + 5, {"x": 1.0})
    with pytest.raises(ValueError, match=r"values\['x'\]: too large for a float"):
        run.log(1, {"x": 10**400})
    # The literal 1e400 is inf: compare as a longdouble (x86: 80 bits, wider than a double).
    if np.finfo(np.longdouble).max > np.longdouble("1e400"):
        with pytest.raises(ValueError, match=r"values\['x'\]: too large for a float"):
            run.log(1, {"x": np.longdouble("1e400")})  # float() gave inf, no OverflowError
    run.log(1, {"inf": np.longdouble("inf"), "nan": float("nan")})  # what they are: logged
    with pytest.raises(TypeError, match=r"sinks: expected a list of sinks, got one sink"):
        Run(JsonlSink(tmp_path / "other.jsonl"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"path: expected a file path"):
        JsonlSink(123)  # type: ignore[arg-type]
    run.log(2, {"x": 1.0})
    assert run.close(timeout=30)
    # The refused calls took no step: the first step logged is the inf and NaN one.
    assert [line["step"] for line in read_jsonl(tmp_path / "run.jsonl")] == [1, 2]


def test_closing_a_collector_that_never_bound_keeps_the_guard_of_the_one_that_did() -> None:
    metric = MeanMetric()
    idle = AsyncMetricCollector(metric, prefix="idle")
    bound = AsyncMetricCollector(metric, prefix="train").bind("cpu")
    idle.close()
    with pytest.raises(RuntimeError, match=r"bound collector \(prefix 'train'\)"):
        metric.load_state_dict(MeanMetric().state_dict())
    bound.close()


def test_a_child_process_sink_checks_its_state_at_load() -> None:
    sink = ProcessSink(TrackerSinkForTests())
    with pytest.raises(ValueError, match=r"run_id"):
        sink.load_state_dict({"run_id": 5, "last_steps": "x"})
    sink.load_state_dict({"run_id": None, "last_steps": [["", 3]]})


@pytest.mark.parametrize("bad_part", ["sink state", "undelivered"])
@pytest.mark.parametrize("through_run", [True, False])
def test_a_malformed_sink_state_fails_at_load_before_anything_is_restored(
    through_run: bool, bad_part: str, tmp_path: Path
) -> None:
    """It was taken as given and failed on rank 0's sink thread at open (training going on
    with the sink failed, ``close`` False); now the load raises, on every rank, naming the
    sink, and neither the metric nor the sink is resumed. A malformed ``undelivered`` part
    raised only after the metric and the sinks had taken their states."""
    saved_metric = {"total": torch.tensor(6.0).double(), "count": torch.tensor(2.0).double()}
    good = {"run_id": "r", "last_steps": [["train", 7]]}
    if bad_part == "sink state":
        sinks, undelivered, error = {"buffering": {"run_id": 5, "last_steps": "x"}}, {}, ValueError
        message = r"sink 'buffering' refuses its saved state: .*"
    else:
        sinks, undelivered, error = {"buffering": good}, {"buffering": 5}, TypeError
        message = r"state_dict\['undelivered'\]\['buffering'\]: expected text"
    sink = TrackerSinkForTests()
    if through_run:
        run = Run([sink], spool_dir=str(tmp_path))
        collector = run.collector(MeanMetric(), prefix="train")
        checkpoint = {"collectors": {"train": saved_metric}, "sinks": sinks}
        with pytest.raises(error, match=message):
            run.load_state_dict({**checkpoint, "undelivered": undelivered})
    else:
        collector = AsyncMetricCollector(MeanMetric(), sinks=[sink], spool_dir=str(tmp_path))
        with pytest.raises(error, match=message):
            collector.load_state_dict(
                {"metric": saved_metric, "sinks": sinks, "undelivered": undelivered}
            )
    assert collector.metric.state_dict()["count"].item() == 0  # the metric was not restored
    assert sink.state_dict()["last_steps"] == []  # nor the sink
    collector.bind()
    collector.metric.update(torch.tensor([3.0]))
    collector.schedule_collection(step=1)
    assert collector.close(timeout=30)
    if through_run:
        assert run.close(timeout=30)  # a run's sinks deliver until the run closes
    assert sink.sent == [1]  # a fresh start delivers its first step


def test_a_run_restores_no_collector_when_one_refuses_its_checkpoint(tmp_path: Path) -> None:
    """Collectors loaded one by one: ``a`` was restored before ``b`` refused a checkpoint of
    another threshold, so a job that caught the error and started fresh counted ``a`` twice."""
    from sidestream.metrics.classification import confusion_count_metric

    def f1(threshold: float) -> Any:
        return confusion_count_metric().binary(threshold).with_f1().build()

    saved_mean, saved_f1 = MeanMetric(), f1(0.9)
    saved_mean.update(torch.tensor([4.0]))
    saved_f1.update(torch.tensor([0.95, 0.2]), torch.tensor([1, 0]))
    checkpoint = {
        "collectors": {"a": saved_mean.state_dict(), "b": saved_f1.state_dict()},
        "sinks": {},
    }
    run = Run([JsonlSink(tmp_path / "log.jsonl")])
    first = run.collector(MeanMetric(), prefix="a")
    second = run.collector(f1(0.5), prefix="b")
    with pytest.raises(ValueError, match=r"state_dict\['configuration'\]"):
        run.load_state_dict(checkpoint)
    assert first.metric.state_dict()["count"].item() == 0  # not restored either
    assert second.metric.state_dict()["counts"].sum().item() == 0
    assert run.close(timeout=30)


def test_a_second_bound_collector_of_the_same_prefix_sends_other_fingerprints(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Windows are paired across ranks by prefix and step: two collectors of one prefix,
    scheduled in another order on one rank, logged each other's numbers with no error. A
    twin's windows now carry fingerprints of their own (the order is checked across ranks in
    test_distributed)."""
    caplog.set_level(logging.INFO, logger="sidestream.collector")
    # A prefix of its own: collectors other tests left bound do not count.
    loss = AsyncMetricCollector(MeanMetric(), prefix="twin").bind("cpu")
    other = AsyncMetricCollector(MeanMetric(), prefix="twin-other").bind("cpu")
    assert "bound collector(s) have the prefix" not in caplog.text
    accuracy = AsyncMetricCollector(MeanMetric(), prefix="twin").bind("cpu")
    assert "1 other bound collector(s) have the prefix 'twin'" in caplog.text
    assert (loss._stream, accuracy._stream) == ("twin", "twin (twin 1)")
    # Another twin bound once the first closed takes an index no open twin holds.
    assert loss.close(timeout=30)
    third = AsyncMetricCollector(MeanMetric(), prefix="twin").bind("cpu")
    assert third._stream == "twin (twin 2)"
    for collector in (other, accuracy, third):
        assert collector.close(timeout=30)
    caplog.clear()
    again = AsyncMetricCollector(MeanMetric(), prefix="twin").bind("cpu")  # the others closed
    assert "bound collector(s) have the prefix" not in caplog.text and again._stream == "twin"
    assert again.close(timeout=30)


def test_log_refuses_bool_and_meta_tensors_naming_the_value_and_keeps_the_step() -> None:
    # A bool tensor was logged as 1.0 while a Python bool is refused; a meta tensor failed
    # with torch's own error, naming no value.
    run = Run([RecordingSink()])
    with pytest.raises(
        TypeError, match=r"values\['done'\]: expected a real tensor, got torch.bool"
    ):
        run.log(1, {"done": torch.tensor(True)})
    with pytest.raises(TypeError, match=r"values\['lr'\]: expected a tensor with data, got a meta"):
        run.log(1, {"lr": torch.tensor(0.1, device="meta")})
    run.log(1, {"lr": torch.tensor(0.1)})  # the failed calls took no step
    assert run.close(timeout=30)


def test_bind_refuses_the_meta_device() -> None:
    collector = AsyncMetricCollector(MeanMetric())
    with pytest.raises(ValueError, match=r"bind: device 'meta' holds no values"):
        collector.bind("meta")
    assert collector.close(timeout=30)


def test_a_spool_dir_that_cannot_be_made_is_refused_when_built(tmp_path: Path) -> None:
    # Under a file it is never made: every report that overflowed a queue was dropped.
    blocker = tmp_path / "file"
    blocker.write_text("")
    spool_dir = str(blocker / "spools")
    with pytest.raises(ValueError, match=r"spool_dir: .*is a file, not a directory"):
        Run([RecordingSink()], spool_dir=spool_dir)
    with pytest.raises(ValueError, match=r"spool_dir: .*is a file, not a directory"):
        AsyncMetricCollector(MeanMetric(), sinks=[RecordingSink()], spool_dir=spool_dir)


def test_a_spool_dir_that_cannot_be_written_is_refused_when_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Accepted, it dropped every report past the queue (5984 of 6000 with MLflow down). As
    # root a folder's mode does not stop writes, so the file system's answer is stood in for.
    import os

    locked = tmp_path / "read-only"
    locked.mkdir()
    real_access = os.access

    def access(path: object, mode: int, **kwargs: object) -> bool:
        if Path(str(path)) == locked and mode & os.W_OK:
            return False
        return real_access(path, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "access", access)
    for spool_dir in (locked, locked / "spools"):
        with pytest.raises(ValueError, match=r"spool_dir: '.*read-only' is not writable"):
            Run([RecordingSink()], spool_dir=str(spool_dir))
    Run([RecordingSink()], spool_dir=str(tmp_path / "spools")).close()
    # A file that is there already is appended to without its folder (a log, /dev/stdout).
    (locked / "log.jsonl").write_text("")
    JsonlSink(locked / "log.jsonl")
    with pytest.raises(ValueError, match=r"path: '.*read-only' is not writable"):
        JsonlSink(locked / "new.jsonl")


def test_a_spool_dir_that_is_a_dangling_link_is_refused_when_built(tmp_path: Path) -> None:
    # exists() is False for a link to nothing, so the check took its parent and accepted it;
    # every spool attempt then failed (FileExistsError) and overflowing reports were dropped.
    link = tmp_path / "spools"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=r"spool_dir: .*is a symbolic link to nothing"):
        Run([RecordingSink()], spool_dir=str(link / "run"))


@pytest.mark.parametrize("made_by", ["run", "hand-made runner"])
def test_a_relative_spool_dir_stays_where_it_was_when_made(
    made_by: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Resolved at each spill, it followed a later os.chdir: the kept spool landed under
    # another folder than the one checked when the run (or a public SinkRunner) was made,
    # where a restarted job, started in the first folder, never found it among the leftovers.
    from sidestream.sinks import Report, SinkRunner

    class Down(RecordingSink):
        def open(self, run: RunInfo) -> None:
            raise PermanentSinkError("down")

    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(job)
    if made_by == "run":
        run = Run([Down()], spool_dir="spools")
        run.log(1, {"x": 1.0})
        monkeypatch.chdir(elsewhere)
        run.log(2, {"x": 2.0})
        assert not run.close(timeout=5)
    else:
        runner = SinkRunner(Down(), RunInfo(), capacity=1, spool_dir="spools")
        runner.start()
        runner.submit(Report(step=1, values={"x": 1.0}, time=0.0))
        monkeypatch.chdir(elsewhere)
        for step in (2, 3):
            runner.submit(Report(step=step, values={"x": float(step)}, time=0.0))
        assert not runner.close(timeout=5)
    kept = sorted(path.relative_to(tmp_path).parts[:2] for path in tmp_path.rglob("*.spool.jsonl"))
    assert kept == [("job", "spools")]


def test_a_state_put_in_a_container_after_bind_is_named_when_its_window_fails() -> None:
    # The window's copy (made at bind) held an empty list: compute failed with a bare
    # "IndexError: list index out of range" that did not say why.
    from torch import Tensor

    from sidestream import Metric, MetricAccumulator

    class FillsLater(Metric[Tensor]):
        def __init__(self) -> None:
            self._count = MetricAccumulator(0.0)
            self.sums: list[MetricAccumulator] = []

        def update(self, values: Tensor) -> None:
            if not self.sums:
                self.sums.append(MetricAccumulator(0.0))
            self.sums[0].accumulate(values.double().sum())
            self._count.accumulate(float(values.numel()))

        def compute(self) -> Tensor:
            return self.sums[0].value / self._count.value

    collector = AsyncMetricCollector(FillsLater(), prefix="fills-later").bind("cpu")
    try:
        collector.metric.update(torch.ones(3))
        collector.schedule_collection(1)
        with pytest.raises(RuntimeError, match=r"likely cause: sums: a MetricAccumulator inside"):
            collector.collect_results(timeout=30)
    finally:
        collector.close(timeout=30)


@pytest.mark.parametrize("bound_first", ["original", "copy"])
@pytest.mark.parametrize("copied", ["root", "child"])
def test_a_shallow_copy_of_a_bound_metric_is_refused_by_another_collector(
    bound_first: str, copied: str
) -> None:
    """copy.copy shares the original's states: a second collector on it was accepted, and the
    two then staged and reset the same storage (one reported the other's updates)."""
    import copy

    from sidestream import ComposeMetric, MaxMetric, MeanMetric

    original = ComposeMetric({"loss": MeanMetric(), "top": MaxMetric()})
    part = original if copied == "root" else original["loss"]
    shallow = copy.copy(part)
    first, second = (part, shallow) if bound_first == "original" else (shallow, part)
    collector = AsyncMetricCollector(first, prefix="a").bind("cpu")
    try:
        with pytest.raises(ValueError, match="shares its states with the metric of another"):
            AsyncMetricCollector(second, prefix="b")
        deep = AsyncMetricCollector(copy.deepcopy(part), prefix="c").bind("cpu")  # its own
        deep.close()
    finally:
        collector.close()
    AsyncMetricCollector(second, prefix="b").close()  # the first one closed: free again


def test_permanent_failure_advice_fits_an_error_that_is_no_missing_client(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A JSONL file another writer appends to is no option or client to fix: say so plainly.

    Found when a killed torchrun's orphaned ranks kept writing beside the resumed job: the
    error said "Fix the sink's options or install its client", which fitted neither.
    """
    path = tmp_path / "m.jsonl"
    run = Run([JsonlSink(path)], spool_dir=str(tmp_path))
    with caplog.at_level(logging.ERROR, logger="sidestream.sinks"):
        run.log(1, {"lr": 0.1})
        run.state_dict()  # waits until step 1 is in the file
        with path.open("a") as other:  # a second job on the same path
            other.write(json.dumps({"step": 1, "stream": "", "values": {"lr": 0.1}}) + "\n")
        run.log(2, {"lr": 0.1})
        assert run.close(timeout=30) is False
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "another writer" in errors[0]
    assert "install its client" not in errors[0]
    assert "fix what the error names" in errors[0].lower()
