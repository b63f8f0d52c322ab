"""A job restarted inside its process: new runs and collectors after a failed attempt."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sidestream import Run

pytest.importorskip("tensorboard")
from sidestream_tensorboard import TensorBoardSink


def _wait_settled(run: Run, key: str) -> None:
    """Until ``key``'s sink has opened (or failed): its thread opens it after the first log."""
    deadline = time.monotonic() + 10
    while run.sink_status[key].state == "healthy" and time.monotonic() < deadline:
        if run.state_dict(timeout=1)["sinks"][key].get("last_steps"):
            return
        time.sleep(0.02)


def _failed_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Run, dict[str, Any]]:
    """The failed attempt's run (left open) with step 1 logged, and its checkpoint."""
    monkeypatch.chdir(tmp_path)  # a default TensorBoard directory lands here
    old = Run([TensorBoardSink(tmp_path / "tb")])
    old.log(1, {"lr": 1.0})
    return old, old.state_dict(timeout=10)


def test_new_run_resuming_an_unclosed_runs_tracker_run_fails_its_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A retry loop that made its new run before closing the failed attempt's: the checkpoint
    # names the directory (a run id, for MLflow or W&B) the old run's sink still writes.
    old, checkpoint = _failed_attempt(tmp_path, monkeypatch)
    new = Run([TensorBoardSink()])  # a default directory: the checkpoint's replaces it
    try:
        new.load_state_dict(checkpoint)
        new.log(2, {"lr": 2.0})
        _wait_settled(new, "tensorboard")
        status = new.sink_status["tensorboard"]
        assert status.state == "failed", status
        assert "not closed yet" in (status.last_error or ""), status
    finally:
        new.close(timeout=10)
        assert old.close(timeout=10)


def test_new_run_after_the_old_one_closed_continues_its_tracker_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The documented way: close the failed attempt's run, then make new sinks and a new run.
    old, checkpoint = _failed_attempt(tmp_path, monkeypatch)
    assert old.close(timeout=10)
    new = Run([TensorBoardSink()])
    new.load_state_dict(checkpoint)
    new.log(2, {"lr": 2.0})
    assert new.close(timeout=10)
    assert new.sink_status["tensorboard"].state == "healthy"
    # One TensorBoard run, each step once, read back with TensorBoard's own reader.
    from tensorboard.backend.event_processing import event_accumulator

    assert [path.name for path in (tmp_path / "runs").glob("*")] == []  # no default dir used
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"*": 0})
    scalars = events.Reload().Scalars("lr")
    assert sorted((e.step, e.value) for e in scalars) == [(1, 1.0), (2, 2.0)]


def _restart_in_process(store_path: str) -> str:
    """On each rank: bind, destroy the group, make a new one; the old collector's answer."""
    import torch
    import torch.distributed as dist

    from sidestream import MeanMetric

    rank, world = dist.get_rank(), dist.get_world_size()
    old_run = Run()
    old = old_run.collector(MeanMetric(), prefix="train").bind("cpu")
    old.metric.update(torch.ones(2))
    dist.destroy_process_group()  # the failed attempt's group, as an in-process restart does
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    dist.barrier()  # every rank connected before one destroys the group again
    try:
        old.schedule_collection(1)
    except RuntimeError as error:
        return str(error)
    finally:
        old_run.close(timeout=10)
        dist.barrier()  # neither rank destroys the group while the other still uses it
        dist.destroy_process_group()  # the pool starts a fresh one for its next call
    return "accepted"


def test_collector_bound_under_a_destroyed_process_group_is_refused(
    tmp_path: Path, pool2: Any
) -> None:
    # Without the check its window reduced over the new group, paired with the new attempt's.
    results = pool2.run(_restart_in_process, str(tmp_path / "store"), timeout=60)
    assert all("process group this collector was bound under was destroyed" in r for r in results)
