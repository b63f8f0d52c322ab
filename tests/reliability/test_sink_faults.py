"""Sink faults with counts per sink (smaller than the `reliability` session's runs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.reliability import scenarios
from tests.reliability.scenarios import Row

SMALL: dict[str, Callable[[Path], Iterator[Row]]] = {
    "raises": partial(scenarios.sink_raises, windows=60, outage_s=0.5),
    "hangs": partial(scenarios.sink_hangs, windows=40, hang_s=1.0),
    "slow": partial(scenarios.slow_sink, windows=100, delay_s=0.005),
    "down_at_start": partial(scenarios.down_at_start, windows=40, outage_s=0.5),
    "hang_at_close": partial(scenarios.hang_at_close, windows=30),
    "unusable_spool_dir": partial(scenarios.unusable_spool_dir, windows=40),
    "spool_full": partial(scenarios.spool_full, windows=120),
    "damaged_spool": partial(scenarios.damaged_spool, windows=50),
}

# Reports of these sinks must all arrive, exactly once; the others lose what the row counts.
EVERY_REPORT = {"flaky", "jsonl (healthy)", "hung", "slow", "down"}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_fault_is_contained_and_counted(name: str, tmp_path: Path) -> None:
    rows = list(SMALL[name](tmp_path))
    assert rows
    for row in rows:
        assert row.ok, (row.outcome, row.notes)
        assert row.delivered + row.lost == row.expected
        if row.sink in EVERY_REPORT:
            assert (row.delivered, row.lost, row.duplicated) == (row.expected, 0, 0), row
        if row.blocked_ms is not None:
            # Generous (2 shared cores): the training thread never waits for a sink.
            assert row.blocked_ms < 900, row  # a hanging write takes 1 s


def test_disk_full_every_step_delivered_kept_or_counted(tmp_path: Path) -> None:
    (row,) = scenarios.disk_full(tmp_path, windows=120)
    assert row.ok, (row.outcome, row.notes)


@pytest.mark.distributed
def test_a_rank_skipping_a_window_fails_every_rank_clearly_and_fast() -> None:
    from tests.reliability.rank_faults import rank_skips_a_call

    rows = rank_skips_a_call()
    assert len(rows) == 2
    for row in rows:
        assert "RankMismatchError" in row.outcome and "wrong" not in row.outcome, row
        assert row.recover_s is not None and row.recover_s < 20, row
