"""Sink options checked when the sink is made, errors sorted into permanent and transient,
and what a close that failed reports (defects a fault probe found on landed code)."""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidestream import Run
from sidestream.sinks import (
    JsonlSink,
    ProcessSink,
    Report,
    RunInfo,
    Sink,
    SinkRunner,
    SinkStatus,
    is_permanent,
    read_jsonl,
    sinks_from_config,
)
from sidestream.sinks.console import ConsoleSink

_A_REPORT = '{"step": 1, "time": 0.0, "values": {"a": 1.0}}\n'
"""One report as a spool line: a leftover spool that holds something (an empty one is removed)."""


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda d: JsonlSink(d), ValueError, "path: expected a file, got the directory"),
        (
            lambda d: JsonlSink(_file(d) / "sub" / "m.jsonl"),
            ValueError,
            "path: '.*afile' is a file, not a directory",
        ),
        (lambda d: _tensorboard()(_file(d)), ValueError, "log_dir: '.*afile' is a file"),
        (lambda d: ConsoleSink(stream="stdout"), TypeError, "stream: expected a text stream"),
        (lambda d: ConsoleSink(every="2"), TypeError, "every: expected an int >= 1"),
        (
            lambda d: _tensorboard()(logdir=str(d)),
            TypeError,
            "TensorBoardSink has no option 'logdir'; did you mean 'log_dir'?",
        ),
        (
            lambda d: _tensorboard()(str(d), histogram_edges={"h": [1.0, 0.5]}),
            ValueError,
            r"histogram_edges\['h'\]: expected at least 2 finite increasing edges",
        ),
        (
            lambda d: _wandb()(project="p", mode="offline", bogus_opt=1),
            TypeError,
            "WandbSink has no option 'bogus_opt'",
        ),
        (lambda d: _mlflow()(http_timeout="10"), TypeError, "http_timeout: expected an int"),
        # Options forwarded to the tracker's client: their type too, not only their name.
        (
            lambda d: _tensorboard()(str(d), flush_secs="30"),
            TypeError,
            r"TensorBoardSink: flush_secs: expected int or float \(or None\), got '30' \(str\)",
        ),
        (lambda d: _tensorboard()(str(d), max_queue=True), TypeError, "max_queue: expected int"),
        # These named no option (os.fspath's message; "expected a file, got the directory").
        (lambda d: _tensorboard()(5), TypeError, r"log_dir: expected a directory path"),
        (lambda d: JsonlSink(""), ValueError, r"path: expected a file path, got ''"),
        (lambda d: _tensorboard()(str(d), purge_step=3), TypeError, "purge_step is not supported"),
        (lambda d: _mlflow()(tracking_uri=5), TypeError, "MlflowSink: tracking_uri: expected str"),
        (lambda d: _mlflow()(experiment=5), TypeError, "MlflowSink: experiment: expected str"),
        # Accepted, MLflow refused it at open on rank 0 ("Invalid experiment name: ''").
        (lambda d: _mlflow()(experiment=""), ValueError, "experiment: expected a non-empty"),
        # Accepted, these failed at open on rank 0 (MLflow's "'name' exceeds the maximum length
        # of 500 characters"; FileExistsError making the database's folder).
        (lambda d: _mlflow()(experiment="x" * 501), ValueError, "experiment: expected at most 500"),
        # A tag RunInfo refuses (MLflow refused the empty key only at open, on rank 0).
        (lambda d: _mlflow()(tags={"": "x"}), ValueError, "tags: a tag name must not be empty"),
        (lambda d: _mlflow()(tags={1: "x"}), TypeError, r"tags: expected a mapping of tag names"),
        (
            lambda d: _mlflow()(tracking_uri=f"sqlite:///{_a_file(d)}/m.db"),
            ValueError,
            r"tracking_uri: '.*afile' is a file, not a directory",
        ),
        (lambda d: _wandb()(project=5, mode="offline"), TypeError, "WandbSink: project: expected"),
        # Accepted, wandb.init refused it at open on rank 0 ("Could not parse passed run moment").
        (
            lambda d: _wandb()(mode="offline", fork_from="nonsense"),
            ValueError,
            r"fork_from: wandb does not take 'nonsense' \(.*run moment",
        ),
        (lambda d: _wandb()(dir=3, mode="offline"), TypeError, "WandbSink: dir: expected str"),
        # Accepted, these failed at open on rank 0 (an AttributeError naming no option; wandb's
        # "Invalid project name").
        (
            lambda d: _wandb()(settings=5, mode="offline"),
            TypeError,
            "settings: expected a mapping of wandb settings or a wandb.Settings, got 5",
        ),
        (
            lambda d: _wandb()(project="a/b#c", mode="offline"),
            ValueError,
            r"project: W&B project names cannot hold '#/'",
        ),
        # A config's errors name the sink, whatever their kind (ValueErrors did not).
        (
            lambda d: sinks_from_config({"jsonl": {"path": str(d / "m.jsonl"), 1: 2}}),
            TypeError,
            r"^sinks_from_config: sink 'jsonl': option names must be text, got 1",
        ),
        (
            lambda d: sinks_from_config({"jsonl": {"path": str(d / "m.jsonl"), "flush_every": 0}}),
            ValueError,
            r"^sinks_from_config: sink 'jsonl': flush_every: expected an int >= 1, got 0",
        ),
        (
            lambda d: sinks_from_config(
                {"jsonl": {"path": str(d / "m.jsonl"), "child_process": {"call_timeout_s": -1}}}
            ),
            ValueError,
            r"^sinks_from_config: sink 'jsonl': child_process: call_timeout_s: expected seconds",
        ),
        (
            lambda d: Run([JsonlSink(d / "a.jsonl"), JsonlSink(d / "." / "a.jsonl")]),
            ValueError,
            r"sinks\[1\]: JsonlSink writes .* as sinks\[0\] does",
        ),
    ],
)
def test_a_bad_option_fails_when_the_sink_is_made(
    tmp_path: Path, make: Callable[[Path], Any], error: type[Exception], message: str
) -> None:
    # Not on rank 0's sink thread once training runs, where other ranks never see it.
    with pytest.raises(error, match=message):
        make(tmp_path)


_TOO_LONG = "損" * 90
"""A folder or file name of 270 bytes as UTF-8: over the 255 most file systems take."""


@pytest.mark.parametrize(
    ("option", "make"),
    [
        ("path", lambda d: JsonlSink(d / f"{_TOO_LONG}.jsonl")),
        ("path", lambda d: JsonlSink(d / "new" / _TOO_LONG / "m.jsonl")),
        ("log_dir", lambda d: _tensorboard()(log_dir=str(d / _TOO_LONG))),
        ("log_dir", lambda d: _tensorboard()(log_dir=str(d / "new" / _TOO_LONG))),
        ("dir", lambda d: _wandb()(mode="offline", dir=str(d / "new" / _TOO_LONG))),
        ("tracking_uri", lambda d: _mlflow()(tracking_uri=f"sqlite:///{d}/new/{_TOO_LONG}.db")),
        ("spool_dir", lambda d: Run([], spool_dir=d / _TOO_LONG)),
        ("spool_dir", lambda d: Run([], spool_dir=d / "new" / _TOO_LONG)),
        ("path", lambda d: JsonlSink(d / "/".join(["x" * 200] * 21) / "m.jsonl")),
    ],
    ids=[
        "jsonl-file",
        "jsonl-below-a-new-folder",
        "tensorboard",
        "tensorboard-below-a-new-folder",
        "wandb-below-a-new-folder",
        "mlflow-sqlite-file",
        "spool_dir",
        "spool_dir-below-a-new-folder",
        "jsonl-path-over-path-max",
    ],
)
def test_a_path_too_long_for_the_file_system_fails_naming_its_option(
    tmp_path: Path, option: str, make: Callable[[Path], Any]
) -> None:
    # A bare OSError ("File name too long") naming no option; below a folder not made yet the
    # checks passed, and every open on rank 0 failed and was retried until close.
    with pytest.raises(ValueError, match=rf"{option}: .* (bytes|takes)"):
        make(tmp_path)
    assert not (tmp_path / "new").exists()


def test_a_file_system_that_states_no_name_limit_takes_any_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FUSE file systems whose statfs leaves the name length at 0 (borg and bindfs mounts,
    # fusepy and llfuse ones before they set it) make pathconf answer 0 for PC_NAME_MAX, and -1
    # means no stated limit. Before: "takes names of at most 0", every path on them refused.
    real = os.pathconf
    for unstated in (0, -1):

        def pathconf(path: Any, name: str, unstated: int = unstated) -> int:
            return unstated if name == "PC_NAME_MAX" else real(path, name)

        monkeypatch.setattr(os, "pathconf", pathconf)
        JsonlSink(tmp_path / "runs" / "a.jsonl")
        Run(spool_dir=tmp_path / "spool")


def test_no_pathconf_leaves_the_lengths_to_the_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Windows has no pathconf, and its limits count UTF-16 units (NTFS: 255 a name). Before:
    # Linux's 255 bytes as UTF-8 were assumed, and a folder of 100 CJK characters, which NTFS
    # takes, was refused.
    from sidestream.sinks.support import check_name_lengths

    monkeypatch.delattr(os, "pathconf")
    check_name_lengths("path", tmp_path / ("実験" * 50) / "a.jsonl")  # no ValueError


def _file(directory: Path) -> Path:
    """A regular file where a sink option wants a directory."""
    path = directory / "afile"
    path.write_text("")
    return path


def _tensorboard() -> Any:
    from sidestream_tensorboard import TensorBoardSink

    return TensorBoardSink


def _wandb() -> Any:
    from sidestream_wandb import WandbSink

    return WandbSink


def _a_file(folder: Path) -> Path:
    """A file in ``folder``: a path under it cannot be made."""
    path = folder / "afile"
    path.write_text("")
    return path


def _mlflow() -> Any:
    from sidestream_mlflow import MlflowSink

    return MlflowSink


@pytest.mark.parametrize(
    "error",
    [
        AttributeError("'str' object has no attribute 'write'"),
        KeyError("values"),
        NameError("name 'wandb' is not defined"),
        IsADirectoryError(21, "Is a directory"),
        FileExistsError(17, "File exists"),  # mkdir(exist_ok=True) where a file is
    ],
)
def test_errors_of_the_sinks_own_code_are_permanent(error: Exception) -> None:
    assert is_permanent(error)


@pytest.mark.parametrize(
    "error",
    [ConnectionError("refused"), TimeoutError(), OSError(28, "No space left on device")],
)
def test_errors_a_retry_can_fix_are_transient(error: Exception) -> None:
    assert not is_permanent(error)


class _BuggyWrite(Sink):
    name = "buggy"

    def __init__(self) -> None:
        self.calls = 0

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        self.calls += 1
        raise AttributeError("'NoneType' object has no attribute 'log'")


def test_a_sink_bug_fails_the_sink_instead_of_retrying_forever(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = _BuggyWrite()
    runner = SinkRunner(sink, retry_initial_s=0.01, retry_max_s=0.01)
    runner.start()
    runner.submit(Report(step=1, values={"x": 1.0}, time=time.time()))
    with caplog.at_level(logging.ERROR, logger="sidestream"):
        assert not runner.close(10.0)
    assert runner.status.state == "failed" and sink.calls == 1
    assert "failed permanently" in caplog.text


class _CloseFails(Sink):
    name = "close_fails"

    def __init__(self, result: bool | None) -> None:
        self._result = result
        self.lines: list[str] = []

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        self.lines.append(str(report.step))

    def close(self, timeout: float | None = None) -> bool:
        if self._result is None:
            raise OSError("upload of the last file failed")
        return self._result


@pytest.mark.parametrize("result", [None, False])
def test_a_close_that_failed_makes_close_false(result: bool | None) -> None:
    # Everything was written, but the final flush or upload did not happen.
    sink = _CloseFails(result)
    runner = SinkRunner(sink)
    runner.start()
    runner.submit(Report(step=1, values={"x": 1.0}, time=time.time()))
    assert not runner.close(10.0)
    assert sink.lines == ["1"]
    # The status names what went wrong (it stayed "healthy" with no error): a close that
    # raised fails the sink, one that returned False keeps its state with the reason.
    if result is None:
        assert runner.status == SinkStatus(
            "failed", "close failed: OSError: upload of the last file failed"
        )
    else:
        assert runner.status == SinkStatus(
            "healthy",
            "close returned False: it did not finish (a value not in the backend, or the "
            "backend's run not ended: see the sink's own warning)",
        )


def test_a_working_sink_still_closes_true() -> None:
    stream = io.StringIO()
    runner = SinkRunner(ConsoleSink(stream=stream))
    runner.start()
    runner.submit(Report(step=1, values={"x": 1.0}, time=time.time()))
    assert runner.close(10.0)
    assert "x" in stream.getvalue()


def test_mlflow_finds_its_run_by_the_run_key_of_a_checkpoint(tmp_path: Path) -> None:
    # A checkpoint taken while the server was down holds no run id; the job that resumes from
    # it must find the run the first job created later, not make a second one.
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = _mlflow()(tracking_uri=uri, experiment="keyed")
    checkpoint = first.state_dict()
    assert checkpoint["run_id"] is None
    first.open(RunInfo(name="job"))
    first.write(Report(step=1, values={"loss": 1.0}, time=time.time()))
    assert first.close(30.0)
    resumed = _mlflow()(tracking_uri=uri, experiment="keyed")
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo(name="job"))
    resumed.write(Report(step=1, values={"loss": 9.0}, time=time.time()))  # already there
    resumed.write(Report(step=2, values={"loss": 2.0}, time=time.time()))
    assert resumed.close(30.0)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("keyed")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [first.run_id] == [resumed.run_id]
    history = client.get_metric_history(first.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0)]


def _start_a_console_sink(spool_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Start and close a console sink spooling to ``spool_dir``, its warnings in ``caplog``."""
    runner = SinkRunner(ConsoleSink(stream=io.StringIO()), spool_dir=str(spool_dir))
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        runner.start()
        assert runner.close(10.0)


def _ended_process_id() -> int:
    """The id of a process that has ended (its spool files count as left behind)."""
    import subprocess
    import sys

    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(ended.stdout)


def test_the_leftover_warning_of_a_sink_with_no_entry_point_gives_a_placeholder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--sink sink`` (a custom sink's default name) was printed: a command that fails."""
    from sidestream.sinks import Sink, SinkRunner

    class Mine(Sink):
        def open(self, run: RunInfo) -> None:
            del run

        def write(self, report: Report) -> None:
            del report

    pid = _ended_process_id()
    (tmp_path / f"sidestream-sink@{pid}-abc123.spool.jsonl").write_text(_A_REPORT)
    runner = SinkRunner(Mine(), spool_dir=str(tmp_path))
    with caplog.at_level("WARNING", logger="sidestream"):
        runner.start()
    runner.close(timeout=10)
    assert "replay FILE --sink NAME --option ..." in caplog.text, caplog.text


def test_spool_files_of_an_ended_job_are_named_when_the_sink_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A crashed job's spool holds reports never delivered: the next job says where they are.
    pid = _ended_process_id()
    left = tmp_path / f"sidestream-console@{pid}-abc123.spool.jsonl"
    left.write_text(_A_REPORT)
    other_sink = tmp_path / f"sidestream-jsonl@{pid}-abc123.spool.jsonl"
    other_sink.write_text(_A_REPORT)
    replayed = tmp_path / f"sidestream-console@{pid}-def456.spool.jsonl.replayed"
    replayed.write_text("")
    _start_a_console_sink(tmp_path, caplog)
    assert str(left) in caplog.text and "python -m sidestream replay FILE --sink console" in (
        caplog.text
    )
    assert str(other_sink) not in caplog.text and str(replayed) not in caplog.text


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="needs /proc")
def test_a_spool_of_an_ended_process_whose_id_was_reused_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A restarted container often gives the new job's process the crashed one's id: the start
    # time in the name tells the two apart. Here the id is this very process's.
    with open(f"/proc/{os.getpid()}/stat", "rb") as stat:
        text = stat.read()
    started = int(text[text.rfind(b")") + 2 :].split()[19])
    reused = tmp_path / f"sidestream-console@{os.getpid()}.{started - 1}-abc.spool.jsonl"
    reused.write_text(_A_REPORT)
    own = tmp_path / f"sidestream-console@{os.getpid()}.{started}-def.spool.jsonl"
    own.write_text(_A_REPORT)
    _start_a_console_sink(tmp_path, caplog)
    assert str(reused) in caplog.text
    assert str(own) not in caplog.text  # this process's own (a live job's) spool


def test_a_spool_file_is_named_with_its_process_and_start_time(tmp_path: Path) -> None:
    from sidestream.sinks._spool import Spool

    spool = Spool(str(tmp_path), "console")
    spool.append(Report(step=1, time=0.0, values={"a": 1.0}))
    assert spool.path is not None
    name = os.path.basename(spool.path)
    assert name.startswith(f"sidestream-console@{os.getpid()}")
    if os.path.exists("/proc/self/stat"):
        assert name.split("@")[1].split("-")[0].count(".") == 1, name
    assert spool.leftovers() == []  # its own process runs
    spool.discard()


def test_a_child_process_sink_writing_the_same_file_is_refused(tmp_path: Path) -> None:
    from sidestream.sinks import sinks_from_config

    sinks = sinks_from_config(
        [
            {"type": "jsonl", "path": str(tmp_path / "a.jsonl")},
            {"type": "jsonl", "path": str(tmp_path / "a.jsonl"), "child_process": True},
        ]
    )
    with pytest.raises(ValueError, match=r"sinks\[1\]: JsonlSink writes .* child process"):
        Run(sinks)


def test_mlflow_timeout_zero_is_refused() -> None:
    # requests refuses a connect timeout of 0: every request would fail, retried forever.
    with pytest.raises(ValueError, match="http_timeout: expected an int >= 1"):
        _mlflow()(http_timeout=0)
    with pytest.raises(ValueError, match="http_max_retries: expected an int >= 0"):
        _mlflow()(http_max_retries=-1)
    with pytest.raises(TypeError, match=r"http_timeout: expected an int >= 1 or None, got 0\.5"):
        _mlflow()(http_timeout=0.5)  # MLflow takes whole seconds


def test_wandb_service_gone_fails_the_sink_for_good(tmp_path: Path) -> None:
    # run.log talks only to wandb's local service: a broken connection cannot heal.
    sink = _wandb()(project="p", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo())

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    real_log = sink._run.log
    sink._run.log = broken
    with pytest.raises(Exception, match="service process is gone") as caught:
        sink.write(Report(step=1, values={"x": 1.0}, time=time.time()))
    assert is_permanent(caught.value)
    sink._run.log = real_log
    assert sink.close(60.0)


class _HoldsReports(Sink):
    """Takes reports without making them durable, and cannot close (a dead child's sink)."""

    name = "holds"

    def __init__(self) -> None:
        self.taken: list[Report] = []

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        self.taken.append(report)

    def pending_reports(self) -> list[Report]:
        return list(self.taken)

    def close(self, timeout: float | None = None) -> bool:
        raise ConnectionError("the child process died during close")


def test_reports_a_sink_held_when_its_close_failed_are_spooled(tmp_path: Path) -> None:
    from sidestream.sinks import read_spool

    runner = SinkRunner(_HoldsReports(), spool_dir=str(tmp_path))
    runner.start()
    for step in (1, 2, 3):
        runner.submit(Report(step=step, values={"x": float(step)}, time=0.0))
    assert not runner.close(10.0)
    (kept,) = tmp_path.glob("*.spool.jsonl")
    assert [report.step for report in read_spool(kept)] == [1, 2, 3]


def test_two_live_runs_writing_one_file_or_directory_are_refused(tmp_path: Path) -> None:
    # Each run's JSONL file held every step twice, with different values; TensorBoard had two
    # event files of the same steps. One sink object in two runs was refused already.
    import gc

    first = Run([JsonlSink(tmp_path / "m.jsonl"), _tensorboard()(tmp_path / "tb")])
    with pytest.raises(ValueError, match=r"sinks\[0\]: JsonlSink writes .*m\.jsonl.* not closed"):
        Run([JsonlSink(tmp_path / "." / "m.jsonl")])
    with pytest.raises(ValueError, match=r"sinks\[1\]: TensorBoardSink writes .*tb"):
        Run([JsonlSink(tmp_path / "other.jsonl"), _tensorboard()(tmp_path / "tb")])
    assert first.close(timeout=10)
    second = Run([JsonlSink(tmp_path / "m.jsonl")])  # the first run is closed: its file is free
    del second
    gc.collect()
    assert Run([JsonlSink(tmp_path / "m.jsonl")]).close(timeout=10)  # a run that is gone, too


def test_child_process_options_go_in_a_mapping_and_are_named_elsewhere(tmp_path: Path) -> None:
    """``call_timeout_s`` beside ``child_process: True`` was refused as a sink option with a
    suggestion of another client's option; it goes in ``child_process: {...}``."""
    path = str(tmp_path / "a.jsonl")
    with pytest.raises(TypeError, match=r"'call_timeout_s' is an option of the child process"):
        sinks_from_config({"jsonl": {"path": path, "child_process": True, "call_timeout_s": 5}})
    with pytest.raises(TypeError, match=r"child_process has no option 'call_timout_s'; did you"):
        sinks_from_config({"jsonl": {"path": path, "child_process": {"call_timout_s": 5}}})
    with pytest.raises(TypeError, match=r"child_process must be true, false \(or null\) or a"):
        sinks_from_config({"jsonl": {"path": path, "child_process": "yes"}})
    for option, value, expected in (
        ("call_timeout_s", "30", "call_timeout_s: expected a number of seconds, got '30'"),
        ("start_timeout_s", None, "start_timeout_s: expected a number of seconds, got None"),
        ("flush_every", "256", "flush_every: expected an int >= 1, got '256'"),
    ):
        with pytest.raises(TypeError, match=expected):  # from a YAML config, say
            sinks_from_config({"jsonl": {"path": path, "child_process": {option: value}}})
    (own,) = sinks_from_config({"jsonl": {"path": path, "flush_every": 10}})  # JsonlSink's own
    assert isinstance(own, JsonlSink)
    (sink,) = sinks_from_config(
        {"jsonl": {"path": path, "flush_every": 1, "child_process": {"flush_every": 4}}}
    )
    assert isinstance(sink, ProcessSink) and sink.name == "jsonl"
    run = Run([sink])
    run.log(1, {"lr": 0.5})
    assert run.close(timeout=60)
    assert [record["values"] for record in read_jsonl(path)] == [{"lr": 0.5}]


def test_only_spool_files_that_may_be_this_runs_are_named_when_the_sink_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Every leftover of the sink's name in the directory was named, other jobs' kept files
    # too (a shared /tmp): a new user was told to replay files of runs not theirs.
    from sidestream.sinks._spool_format import write_kept_state

    pid = _ended_process_id()
    path = str(tmp_path / "m.jsonl")
    ours, theirs, crashed = (
        tmp_path / f"sidestream-jsonl@{pid}-{tag}.spool.jsonl" for tag in ("a1", "b2", "c3")
    )
    for spool in (ours, theirs, crashed):
        spool.write_text(_A_REPORT)
    write_kept_state(str(ours), "jsonl", {"path": path, "last_steps": []}, RunInfo())
    other = {"path": str(tmp_path / "other.jsonl"), "last_steps": []}
    write_kept_state(str(theirs), "jsonl", other, RunInfo())  # crashed wrote none
    runner = SinkRunner(JsonlSink(path), spool_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="sidestream"):
        runner.start()
        assert runner.close(10.0)
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert str(ours) in warned and str(crashed) in warned, warned
    assert str(theirs) not in caplog.text
    assert "1 spool file(s) in the spool directory were kept by other runs" in caplog.text


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_histogram_edges_keyed_without_the_streams_prefix_are_named(
    tracker: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "scores" for the histogram a "train" collector reports as "train/scores": the bins were
    # drawn as [i, i + 1) and close returned True without a word.
    import torch

    from sidestream import ComposeMetric, Metric, ReduceOp

    class TwoBins(Metric[torch.Tensor]):
        def __init__(self) -> None:
            super().__init__()
            self._counts = self.add_state("counts", torch.zeros(2), ReduceOp.SUM)

        def update(self, counts: torch.Tensor) -> None:
            self._counts.local.add_(counts)

        def compute(self) -> torch.Tensor:
            return self._counts.value

    edges = {"scores": [0.0, 0.5, 1.0], "train/score": [0.0, 0.5, 1.0]}
    if tracker == "tensorboard":
        sink = _tensorboard()(log_dir=str(tmp_path / "tb"), histogram_edges=edges)
    else:
        monkeypatch.setenv("WANDB_SILENT", "true")
        sink = _wandb()(project="p", mode="offline", dir=str(tmp_path), histogram_edges=edges)
    caplog.set_level(logging.WARNING, logger="sidestream.sinks")
    with Run([sink]) as run:
        collector = run.collector(
            ComposeMetric({"scores": TwoBins()}), prefix="train", histograms=["scores"]
        ).bind("cpu")
        for step in (1, 2):
            collector.metric["scores"].update(torch.ones(2))
            collector.schedule_collection(step)
    name = type(sink).__name__
    messages = [r.getMessage() for r in caplog.records if "histogram" in r.getMessage()]
    assert messages == [
        f"{name}: histogram 'train/scores' has no histogram_edges entry, so its bins are drawn "
        "as [i, i + 1); the option has 'scores': its keys are the names as reported, with the "
        "stream's prefix ('train/scores')",
        f"{name}: histogram_edges 'scores' (did you mean 'train/scores'?), 'train/score' (did you "
        "mean 'train/scores'?) matched no histogram of this run (histograms without edges: "
        "'train/scores'); keys are the names as reported, with the stream's prefix (such as "
        "'train/scores')",
    ]


@pytest.mark.parametrize("sink", ["mlflow", "wandb", "tensorboard"])
@pytest.mark.parametrize("resume_state", [False, True])
def test_a_crashed_jobs_spool_is_not_replayed_to_the_sinks_defaults(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    sink: str,
    resume_state: bool,
) -> None:
    """No state file beside it (the job crashed): ``--sink mlflow`` alone delivered into a new
    MLflow store in the current folder, a new run, and renamed the file as replayed (W&B: its
    default project; TensorBoard: ./runs). A state alone names a run, not where it is."""
    from sidestream.sinks.replay import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    spool = tmp_path / "crashed.spool.jsonl"
    spool.write_text(_A_REPORT)
    command = [str(spool), "--sink", sink]
    if resume_state:
        state = tmp_path / "state.json"
        state.write_text("{}")
        command += ["--resume-state", str(state)]
    with pytest.raises(SystemExit) as exited:
        main(command)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "has no .state.json file beside it" in error and "--option" in error, error
    assert "--resume-state" in error, error
    if sink == "mlflow":
        assert "such as tracking_uri" in error, error
    left = {path.name for path in tmp_path.iterdir()} - {"state.json"}
    assert left == {"crashed.spool.jsonl"}


def test_a_crashed_spool_with_a_damaged_state_file_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sidestream.sinks.replay import main

    monkeypatch.chdir(tmp_path)
    spool = tmp_path / "kept.spool.jsonl"
    spool.write_text(_A_REPORT)
    (tmp_path / "kept.spool.jsonl.state.json").write_text("{cut")
    with pytest.raises(SystemExit):
        main([str(spool), "--sink", "mlflow"])
    error = capsys.readouterr().err
    assert "its .state.json file could not be read" in error, error
    assert "has no .state.json" not in error, error


def test_a_spool_whose_every_line_was_cut_can_be_cleared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused as "not a spool file" even with --skip-damaged: the next job named it again at
    every start, with no way to clear it."""
    from sidestream.sinks.replay import main

    spool = tmp_path / "sidestream-jsonl@1-abc.spool.jsonl"
    spool.write_text(_A_REPORT[: len(_A_REPORT) // 2] + "\n")
    out = tmp_path / "out.jsonl"
    command = [str(spool), "--sink", "jsonl", "--option", f"path={out}", "--skip-damaged"]
    assert main(command) == 0
    assert not spool.exists() and Path(f"{spool}.replayed").exists()
    assert "1 damaged line(s) skipped" in capsys.readouterr().out


@pytest.mark.parametrize("skip_damaged", [False, True])
def test_a_file_that_is_no_spool_is_refused_before_the_sink_opens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], skip_damaged: bool
) -> None:
    """A checkpoint given by mistake opened the tracker (an empty run, an empty file) before
    its first line failed."""
    import torch

    from sidestream.sinks.replay import main

    checkpoint = tmp_path / "ck.pt"
    torch.save({"step": torch.tensor(3)}, checkpoint)
    out = tmp_path / "out.jsonl"
    command = [str(checkpoint), "--sink", "jsonl", "--option", f"path={out}"]
    with pytest.raises(SystemExit) as exited:
        main(command + (["--skip-damaged"] if skip_damaged else []))
    assert exited.value.code == 2
    assert "not a spool file" in capsys.readouterr().err
    assert not out.exists()


def test_the_replay_command_speaks_as_typed_and_names_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sidestream.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["replay", str(tmp_path)])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: python -m sidestream replay "), error
    assert "a directory" in error and "no such file" not in error, error


def test_a_url_log_dir_is_not_length_checked_as_a_local_path() -> None:
    # Before: s3://bucket/<300-byte key part> was refused as a local folder name.
    pytest.importorskip("sidestream_tensorboard")
    from sidestream_tensorboard import TensorBoardSink

    TensorBoardSink(log_dir="s3://bucket/" + "k" * 300 + "/run")
