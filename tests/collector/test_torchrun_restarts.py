"""Workers restarted in place by ``torchrun --max-restarts``: one tracker run per job.

torchrun starts every worker of the job again, with ``TORCHELASTIC_RESTART_COUNT`` counting
the restarts. A restarted worker resumes the trackers' runs only from a checkpoint: one that
loaded none opens new ones beside the earlier attempt's, which the run says.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sidestream import Run, SumMetric
from sidestream.sinks import JsonlSink, read_jsonl

RESTARTED = "torchrun restarted this job's workers (TORCHELASTIC_RESTART_COUNT=1)"


def test_a_restarted_worker_that_loaded_no_checkpoint_is_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with (
        caplog.at_level("WARNING", logger="sidestream"),
        Run([JsonlSink(tmp_path / "a.jsonl")]) as run,
    ):
        run.log(1, {"lr": 0.1})
    assert RESTARTED in caplog.text
    assert "sinks (jsonl) start anew" in caplog.text
    assert "Checkpoint the run once before the first step" in caplog.text


@pytest.mark.parametrize("count", [None, "0"])
def test_a_first_attempt_is_not_warned(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    count: str | None,
) -> None:
    if count is None:
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", count)
    with (
        caplog.at_level("WARNING", logger="sidestream"),
        Run([JsonlSink(tmp_path / "a.jsonl")]) as run,
    ):
        run.log(1, {"lr": 0.1})
    assert "TORCHELASTIC_RESTART_COUNT" not in caplog.text


def test_a_checkpoint_before_the_first_step_makes_a_restart_resume_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The recipe of docs/runs.md: the first attempt checkpoints right after bind, logs
    # steps 1..3 and fails before its next checkpoint; the restart loads that checkpoint and
    # does steps 1..5 again. Every step is in the file once, and nothing is warned.
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    run = Run([JsonlSink(path)])
    train = run.collector(SumMetric(), prefix="train").bind("cpu")
    checkpoint = run.state_dict()
    for step in range(1, 4):
        train.metric.update(torch.tensor([float(step)]))
        train.schedule_collection(step)
    run.close()

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with caplog.at_level("WARNING", logger="sidestream"):
        resumed = Run([JsonlSink(path)])
        resumed.load_state_dict(checkpoint)
        train = resumed.collector(SumMetric(), prefix="train").bind("cpu")
        for step in range(1, 6):
            train.metric.update(torch.tensor([float(step)]))
            train.schedule_collection(step)
        assert resumed.close()
    assert "TORCHELASTIC_RESTART_COUNT" not in caplog.text
    records = [r for r in read_jsonl(path) if r["stream"] == "train"]
    assert [(r["step"], r["values"]["train"]) for r in records] == [
        (step, float(step)) for step in range(1, 6)
    ]
