"""Real processes: rank 0 killed and restarted from its checkpoint; a 1,000-window soak.

The kill test is heavy (``reliability`` marker: SIDESTREAM_RELIABILITY=1); its full version
(three kills) and the 100,000-window soak run in ``nox -s reliability`` / ``nox -s soak``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.reliability import process_faults, soak

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.mark.reliability
def test_sigkill_after_a_checkpoint_then_restart_delivers_every_step_once(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    plan = [("SIGKILL just after a checkpoint", signal.SIGKILL, "checkpoint")]
    rows, figures = process_faults.run(tmp_path / "job", steps=25, plan=plan)
    assert figures["final_exit_codes"] == [0, 0], figures
    for row in rows:
        assert (row.delivered, row.lost, row.duplicated) == (25, 0, 0), (row, figures)
        assert row.ok, (row, figures)
    # Rank 1 does not hang when rank 0 dies: it fails on its own, within the 20 s timeout.
    assert 0 <= figures["rank1_exit_s"][0] < 30, figures
    assert "rank" in figures["rank1_messages"][0] or "Error" in figures["rank1_messages"][0]


def test_small_soak_loses_nothing_and_stays_within_caps() -> None:
    pytest.importorskip("tensorboard")
    figures = soak.run(1000)
    rank0, rank1 = figures["ranks"]
    outputs = figures["outputs"]
    assert outputs == {
        "jsonl_lines": 1000,
        "jsonl_unique": 1000,
        "names_per_report": soak.NAMES,
        "tensorboard_steps": 1000,
        "tensorboard_unique": 1000,
    }
    assert rank0["closed"] and rank1["closed"]
    assert rank0["dropped"] == {"jsonl": 0, "tensorboard": 0}
    assert rank0["most_slots"] <= 8 and rank1["most_slots"] <= 8
    # Generous bound for a CPU torch process with TensorBoard loaded (about 300 MiB here).
    assert rank0["peak_rss_mib"] < 1024, figures
