"""What the W&B sink counts as delivered is in the run's ``.wandb`` file, read back.

Checked against the independent reader in ``wandb_reader`` on real offline runs: a file read
as it grows, a damaged record, a run directory deleted mid-run, and a script that ends without
closing its ``Run`` (wandb's own at-exit teardown must not come first).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sidestream.sinks import Report, RunInfo
from tests.integrations.wandb_reader import read_history, read_records

pytest.importorskip("wandb")
from sidestream_wandb import WandbSink, _transaction_log
from sidestream_wandb._transaction_log import TransactionLog


def _finished_run(root: Path, steps: int) -> Path:
    """A closed offline run with rows of two streams, some large enough to span blocks."""
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(root))
    sink.open(RunInfo(name="log"))
    for step in range(1, steps + 1):
        # Every fifth row holds a 512-bin histogram: a record longer than what is left of a
        # block, split into parts.
        histograms = {"h": torch.arange(512, dtype=torch.float64)} if step % 5 == 0 else {}
        values = {"x": float(step)}
        sink.write(Report(step, values, time.time(), histograms, stream="train"))
        sink.write(Report(step=step, values={"lr": 0.1}, time=time.time()))
    run_dir = sink.run_dir
    assert run_dir is not None and sink.close(timeout=60)
    (data,) = Path(run_dir).glob("*.wandb")
    return data


def _reference(path: Path) -> dict[str, int]:
    steps: dict[str, int] = {}
    for row in read_history(path):
        for key in ("step", "train/step"):
            if key in row.items:
                steps[key] = max(steps.get(key, row.items[key]), row.items[key])
    return steps


@pytest.mark.parametrize("piece", ["default", "one block"])
def test_the_file_read_as_it_grows_gives_the_last_step_of_the_rows_written_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: str
) -> None:
    if piece == "one block":  # read in pieces of one block: records split across pieces
        monkeypatch.setattr(_transaction_log, "READ_BYTES", 1)
    data = _finished_run(tmp_path / "run", steps=60)
    whole = data.read_bytes()
    assert len(whole) > 2 * 32768  # records in several blocks, some split across them
    growing = tmp_path / "growing.wandb"
    growing.write_bytes(b"")
    log = TransactionLog(str(growing))
    seen: dict[str, int] = {}
    for cut in [*range(0, len(whole), 997), len(whole)]:
        growing.write_bytes(whole[:cut])  # what wandb had written by then
        steps = log.last_steps()
        prefix = tmp_path / "prefix.wandb"
        prefix.write_bytes(whole[:cut])
        # Read at once, the prefix gives the same: the incremental read keeps its place.
        assert steps == TransactionLog(str(prefix)).last_steps(), cut
        seen = steps
    assert seen == _reference(data) == {"step": 60, "train/step": 60}
    assert not log.damaged


def _payload_byte_after(data: bytes, position: int) -> int:
    """The first byte of the first non-empty chunk payload starting after ``position``."""
    offset = 7  # the file header
    while offset + 7 <= len(data):
        left_in_block = 32768 - offset % 32768
        if left_in_block < 7:
            offset += left_in_block
            continue
        length = int.from_bytes(data[offset + 4 : offset + 6], "little")
        if offset > position and length:
            return offset + 7
        offset += 7 + length
    raise AssertionError("no chunk after the middle")


def test_a_damaged_record_ends_what_counts(tmp_path: Path) -> None:
    data = _finished_run(tmp_path / "run", steps=20)
    whole = bytearray(data.read_bytes())
    middle = _payload_byte_after(whole, len(whole) // 2)
    whole[middle] ^= 0xFF
    damaged = tmp_path / "damaged.wandb"
    damaged.write_bytes(bytes(whole))
    log = TransactionLog(str(damaged))
    steps = log.last_steps()
    assert log.damaged
    # Only rows wholly before the damage: those of a file cut there.
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(bytes(whole[:middle]))
    assert steps == TransactionLog(str(cut)).last_steps()
    assert steps["train/step"] < 20


def test_rows_written_after_the_run_directory_was_deleted_do_not_count(tmp_path: Path) -> None:
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="deleted"))
    for step in range(1, 4):
        sink.write(Report(step=step, values={"x": float(step)}, time=time.time()))
    assert sink.flush(timeout=30)
    assert sink.state_dict()["last_steps"] == [["", 3]]
    run_dir = sink.run_dir
    assert run_dir is not None
    shutil.rmtree(run_dir)
    for step in range(4, 7):
        sink.write(Report(step=step, values={"x": float(step)}, time=time.time()))
    assert not sink.flush(timeout=5)
    assert sink.state_dict()["last_steps"] == [["", 3]]
    assert [report.step for report in sink.pending_reports()] == [4, 5, 6]
    # finish returns, but wandb wrote into a file that is gone: the rows stay undelivered.
    assert not sink.close(timeout=60)
    assert sink.state_dict()["last_steps"] == [["", 3]]
    assert [report.step for report in sink.pending_reports()] == [4, 5, 6]


_NO_CLOSE = """
import sys, time, torch
from sidestream import MeanMetric, Run
from sidestream.sinks import RunInfo, sinks_from_config
options = {"project": "p", "mode": "offline", "dir": sys.argv[1]}
run = Run(sinks_from_config({"wandb": {**options, "child_process": sys.argv[3] == "child"}}),
          info=RunInfo(name="no-close"))
train = run.collector(MeanMetric(), prefix="train").bind("cpu")
for step in range(1, 11):
    train.metric.update(torch.tensor([float(step)]))
    train.schedule_collection(step)
deadline = time.monotonic() + 120
while not all(runner.opened for runner in run.sink_runners) and time.monotonic() < deadline:
    time.sleep(0.1)  # opened: wandb registered its teardown after the Run's close
assert all(runner.opened for runner in run.sink_runners)
if sys.argv[2] == "raise":
    raise RuntimeError("training crashed")
"""


@pytest.mark.parametrize(
    ("ending", "mode"), [("return", "thread"), ("raise", "thread"), ("raise", "child")]
)
def test_a_script_that_never_closes_its_run_delivers_every_row_at_exit(
    tmp_path: Path, ending: str, mode: str
) -> None:
    # The Run's close at exit ran after wandb's teardown of its service (registered later, at
    # wandb.init), found it gone and spooled rows the file already held.
    spool_dir = tmp_path / "tmp"
    spool_dir.mkdir()
    env = {**os.environ, "TMPDIR": str(spool_dir), "WANDB_SILENT": "true"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_NO_CLOSE), str(tmp_path), ending, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr[-3000:]
    for complaint in ("finish failed", "did not finish", "spool"):
        assert complaint not in done.stderr, done.stderr[-3000:]
    (data,) = (tmp_path / "wandb").glob("offline-run-*/*.wandb")
    rows = read_history(data)
    assert [row.items["train/step"] for row in rows] == list(range(1, 11))
    np.testing.assert_allclose([row.items["train"] for row in rows], np.arange(1, 11))
    assert not list(spool_dir.glob("sidestream-*"))
    # A crash is recorded as one (wandb marks a run with exit code 0 finished), as wandb's own
    # exit hook would have: the Run's close at exit ran first and passed 0. A child process
    # sink is told the code with the close.
    (ending_record,) = [r for r in read_records(data) if r.WhichOneof("record_type") == "exit"]
    assert ending_record.exit.exit_code == (1 if ending == "raise" else 0)


def test_a_replay_given_only_the_spool_continues_the_run_where_the_job_kept_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Built from --sink wandb alone, the replay's sink wrote to ./wandb of wherever the command
    # ran, in wandb's default project.
    from sidestream import Run
    from sidestream.sinks.replay import main

    jobs = tmp_path / "job"
    spools = tmp_path / "spools"
    sink = WandbSink(project="kept-project", mode="offline", dir=str(jobs))
    run = Run([sink], info=RunInfo(name="kept"), spool_dir=str(spools))
    run.log(1, {"x": 1.0})
    assert run.state_dict(timeout=30)["sinks"]["wandb"]["last_steps"] == [["", 1]]
    shutil.rmtree(sink.run_dir)  # what wandb writes from here on is lost
    for step in range(2, 5):
        run.log(step, {"x": float(step)})
    assert not run.close(timeout=30)
    (kept,) = spools.glob("*.spool.jsonl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(kept)]) == 0
    (data,) = (jobs / "wandb").glob(f"offline-run-*-{sink.run_id}/*.wandb")
    assert [row.items["step"] for row in read_history(data)] == [2, 3, 4]
    assert not list(elsewhere.iterdir())


def test_a_replay_goes_to_the_jobs_own_wandb_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only project, entity, mode and dir were kept: a job on a self-hosted server was replayed
    # to W&B's cloud, in a project of the same name there.
    own = WandbSink(
        project="p",
        mode="offline",
        dir=str(tmp_path),
        settings={"base_url": "http://user:secret@127.0.0.1:1"},
    )
    default = WandbSink(project="p", mode="offline", dir=str(tmp_path))
    for sink in (own, default):
        sink.open(RunInfo())
        assert sink.close(30)
    assert own.replay_options()["settings"] == {"base_url": "http://***@127.0.0.1:1"}
    assert "settings" not in default.replay_options()
    # A server down for the whole job is the usual reason for a spool: known before open too,
    # from the settings or WANDB_BASE_URL, and in a ProcessSink's parent.
    from sidestream.sinks import ProcessSink

    never_opened = WandbSink(project="p", mode="offline", settings={"base_url": "http://h:2"})
    assert never_opened.replay_options()["settings"] == {"base_url": "http://h:2"}
    wrapped = ProcessSink(
        WandbSink(project="p", mode="offline", settings={"base_url": "http://h:3"})
    )
    assert wrapped.replay_options()["settings"] == {"base_url": "http://h:3"}
    monkeypatch.setenv("WANDB_BASE_URL", "http://h:4")
    assert WandbSink(project="p", mode="offline").replay_options()["settings"] == {
        "base_url": "http://h:4"
    }


def test_a_resumed_sink_skips_rows_the_earlier_file_has_past_its_progress_file(
    tmp_path: Path,
) -> None:
    # wandb's service stalled, close gave up with the progress file at step 2, and wandb then
    # wrote every row: a replay (or a resumed job) of the kept reports read only the progress
    # file and wrote steps 3 to 6 a second time.
    first = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    first.open(RunInfo(name="stalled"))
    for step in range(1, 7):
        first.write(Report(step=step, values={"x": float(step)}, time=time.time()))
    earlier = first.run_dir
    assert earlier is not None and first.close(timeout=60)
    state = first.state_dict()
    state["last_steps"] = [["", 2]]  # as the job's close left it
    (Path(earlier) / "sidestream-steps.json").write_text('{"": 2}')
    resumed = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    resumed.load_state_dict(state)
    resumed.open(RunInfo(name="stalled"))
    for step in range(3, 9):
        resumed.write(Report(step=step, values={"x": float(step)}, time=time.time()))
    later = resumed.run_dir
    assert later is not None and later != earlier and resumed.close(timeout=60)
    steps = [
        row.items["step"]
        for directory in (earlier, later)
        for data in Path(directory).glob("*.wandb")
        for row in read_history(data)
    ]
    assert sorted(steps) == list(range(1, 9))
