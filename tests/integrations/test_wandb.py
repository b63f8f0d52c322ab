from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidestream.sinks import Report, RunInfo
from sidestream.testing import DistributedPool
from tests.integrations._workload import HISTOGRAM_EDGES, expected, train
from tests.integrations.wandb_reader import HistoryRow, read_history, run_id_of

pytest.importorskip("wandb")
from sidestream_wandb import WandbSink

STEPS = 200


def _spec(root: Path) -> tuple[str, str, dict[str, Any]]:
    kwargs = {
        "project": "sidestream-it",
        "mode": "offline",
        "dir": str(root),
        "histogram_edges": HISTOGRAM_EDGES,
    }
    return ("sidestream_wandb", "WandbSink", kwargs)


def _data_file(run_dir: str) -> Path:
    files = list(Path(run_dir).glob("*.wandb"))
    assert len(files) == 1, files
    return files[0]


def _check_rows(rows: list[HistoryRow], steps: range) -> None:
    assert [row.step for row in rows] == list(steps)
    for row in rows:
        values, histogram = expected(row.step)
        assert row.items["_step"] == row.step
        for key, want in values.items():
            np.testing.assert_allclose(
                row.items[key], want, rtol=1e-12, err_msg=f"{key}@{row.step}"
            )
        scores = row.items["scores"]
        assert scores["_type"] == "histogram"
        np.testing.assert_array_equal(scores["values"], histogram)
        np.testing.assert_allclose(scores["bins"], HISTOGRAM_EDGES["scores"])


def test_two_ranks_every_window_once_offline(tmp_path: Path, pool2: DistributedPool) -> None:
    results = pool2.run(train, _spec(tmp_path), range(STEPS), timeout=240)
    assert [r["opened_sink"] for r in results] == [True, False]
    assert results[0]["closed"] is True and results[0]["failures"] == 0
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 1 created no run
    data = _data_file(results[0]["run_dir"])
    assert run_id_of(data) == results[0]["state"]["run_id"]
    _check_rows(read_history(data), range(STEPS))
    assert results[0]["state"]["last_step"] == STEPS - 1


def test_resume_keeps_the_run_id_and_never_repeats_a_step(
    tmp_path: Path, pool2: DistributedPool
) -> None:
    first = pool2.run(train, _spec(tmp_path), range(101), timeout=240)[0]
    second = pool2.run(train, _spec(tmp_path), range(90, STEPS), first["state"], timeout=240)[0]
    run_id = first["state"]["run_id"]
    assert second["state"] == {"run_id": run_id, "last_step": STEPS - 1}
    # Offline, W&B writes the continuation to a second directory of the same run id (joined by
    # `wandb sync`); together they hold every step once.
    files = [_data_file(first["run_dir"]), _data_file(second["run_dir"])]
    assert files[0] != files[1]
    assert [run_id_of(f) for f in files] == [run_id, run_id]
    rows = read_history(files[0]) + read_history(files[1])
    _check_rows(rows, range(STEPS))


def test_skips_bad_histograms_and_keeps_credentials_out(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import torch

    key = "fake0api0key0" + "7" * 27  # 40 characters, like a real key
    monkeypatch.setenv("WANDB_API_KEY", key)
    sink = WandbSink(project="sidestream-it", mode="offline", dir=str(tmp_path))
    sink.open(RunInfo(name="creds", config={"deep": {"x": object()}}, tags={"k": "v"}))
    sink.write(
        Report(
            step=5,
            values={"loss": 0.5},
            time=time.time(),
            histograms={"ok": torch.tensor([1.0, 2.0]), "bad": torch.ones(2, 2)},
        )
    )
    sink.write(Report(step=5, values={"loss": 9.0}, time=time.time()))  # already delivered
    sink.write(Report(step=4, values={"loss": 9.0}, time=time.time()))  # backwards
    state = sink.state_dict()
    run_dir = sink.run_dir
    assert sink.close(timeout=60)
    assert run_dir is not None
    rows = read_history(_data_file(run_dir))
    assert [(row.step, row.items["loss"]) for row in rows] == [(5, 0.5)]
    assert rows[0].items["ok"]["values"] == [1.0, 2.0] and "bad" not in rows[0].items
    assert "bad" in caplog.text
    assert state == {"run_id": state["run_id"], "last_step": 5}
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    assert all(key.encode() not in content for content in written)
    assert key not in repr(state) + repr(sink) + caplog.text
