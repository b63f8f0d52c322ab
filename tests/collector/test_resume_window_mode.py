"""A job resumed with the other ``reset_each_window`` is refused, naming the stream and modes.

A per-window collector's checkpoint holds the updates since its last window, a cumulative
one's every update since the run started. Loaded into the other mode, the numbers were wrong
with no word: a per-window resume of a cumulative checkpoint reported the whole run as its
first window, and a cumulative resume of a per-window checkpoint left out every earlier window.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sidestream import AsyncMetricCollector, Run, SumMetric
from sidestream.metric import DTYPES_KEY
from sidestream.sinks import JsonlSink, read_jsonl


def _first_job(path: Path, cumulative: bool) -> dict[str, Any]:
    """Steps 1..5 (a window every second step); the checkpoint after step 5."""
    run = Run([JsonlSink(path)])
    train = run.collector(SumMetric(), prefix="train", reset_each_window=not cumulative)
    train.bind("cpu")
    for step in range(1, 6):
        train.metric.update(torch.tensor([float(step)]))
        if step % 2 == 0:
            train.schedule_collection(step)
    checkpoint = run.state_dict()
    run.close()
    return checkpoint


@pytest.mark.parametrize("saved_cumulative", [True, False])
def test_the_other_window_mode_is_refused_before_anything_loads(
    tmp_path: Path, saved_cumulative: bool
) -> None:
    checkpoint = _first_job(tmp_path / "run.jsonl", saved_cumulative)
    resumed = Run([JsonlSink(tmp_path / "run.jsonl")])
    resumed.load_state_dict(checkpoint)
    with pytest.raises(ValueError) as raised:
        resumed.collector(SumMetric(), prefix="train", reset_each_window=saved_cumulative)
    message = str(raised.value)
    assert "collector 'train'" in message
    assert f"saved with reset_each_window={not saved_cumulative}" in message
    assert f"this collector has reset_each_window={saved_cumulative}" in message
    assert "new prefix" in message
    # The same mode still resumes, and the saved state is still there for it.
    train = resumed.collector(SumMetric(), prefix="train", reset_each_window=not saved_cumulative)
    train.bind("cpu")
    resumed.close()


def test_a_cumulative_stream_resumes_its_whole_sum(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    checkpoint = _first_job(path, cumulative=True)
    resumed = Run([JsonlSink(path)])
    resumed.load_state_dict(checkpoint)
    train = resumed.collector(SumMetric(), prefix="train", reset_each_window=False).bind("cpu")
    for step in range(6, 11):
        train.metric.update(torch.tensor([float(step)]))
        if step % 2 == 0:
            train.schedule_collection(step)
    resumed.close()
    rows = [(r["step"], r["values"]["train"]) for r in read_jsonl(path) if r["stream"] == "train"]
    # Direct sums of 1..step.
    assert rows == [(step, float(sum(range(1, step + 1)))) for step in (2, 4, 6, 8, 10)]


def test_through_dcp_and_a_collector_of_its_own(tmp_path: Path) -> None:
    run = Run()
    train = run.collector(SumMetric(), prefix="train", reset_each_window=False).bind("cpu")
    train.metric.update(torch.tensor([3.0]))
    train.schedule_collection(1)
    dcp.save({"run": run}, checkpoint_id=tmp_path / "ckpt")
    run.close()
    resumed = Run()
    resumed.collector(SumMetric(), prefix="train")  # per-window: made, not bound
    with pytest.raises(ValueError, match=r"saved with reset_each_window=False"):
        dcp.load({"run": resumed}, checkpoint_id=tmp_path / "ckpt")
    resumed.close()

    own = AsyncMetricCollector(SumMetric(), reset_each_window=True).bind("cpu")
    own.metric.update(torch.tensor([2.0]))
    saved = own.state_dict()
    own.close()
    with pytest.raises(ValueError, match=r"this collector has reset_each_window=False"):
        AsyncMetricCollector(SumMetric(), reset_each_window=False).load_state_dict(saved)


def test_a_checkpoint_from_before_the_record_loads_as_it_did(tmp_path: Path) -> None:
    checkpoint = _first_job(tmp_path / "run.jsonl", cumulative=True)
    state = checkpoint["collectors"]["train"]
    record = json.loads(state[DTYPES_KEY])
    assert set(record) == {"total", "sidestream/reset_each_window"}
    state[DTYPES_KEY] = json.dumps({"total": record["total"]})  # an older checkpoint's record
    resumed = Run()
    resumed.load_state_dict(checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = resumed.collector(SumMetric(), prefix="train").bind("cpu")
    assert float(train.metric.compute()) == 15.0  # as loaded before: the saved 1 + ... + 5
    resumed.close()
    # A metric given a collector's state directly takes it: the entry names no state.
    metric = SumMetric()
    metric.load_state_dict(_first_job(tmp_path / "b.jsonl", cumulative=True)["collectors"]["train"])
    assert float(metric.compute()) == 15.0
