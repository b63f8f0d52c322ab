"""The spool's memory stays small beside its file: a long outage fills the disk, not the RAM."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from sidestream.sinks import Report
from sidestream.sinks._spool import Spool


def test_each_spooled_line_costs_a_few_bytes_of_memory(tmp_path: Path) -> None:
    """The spool file is on disk, but its index of lines (size, stream and step of each) is
    in memory. A deque of sizes and one of (stream, step) tuples took about 118 bytes a line:
    at the default 256 MiB cap, 2.7 million ``run.log`` reports of one value made 300 MiB of
    RSS per sink of a tracker that was down, more than the file itself. Now at most 40."""
    spool = Spool(str(tmp_path), label="t")
    lines = 20_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for step in range(1_000_000, 1_000_000 + lines):
            spool.append(Report(step=step, values={"lr": 0.5}, time=0.0, stream="train"))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(spool) == lines
    assert held / lines < 40, f"{held / lines:.0f} bytes of memory per spooled line"
    # The index still reads back in order and names lost steps.
    assert spool.pop_oldest().step == 1_000_000
    spool.discard(lost=True)
    assert spool.lost.describe() == f"train: {lines - 1} between steps 1000001 and 1019999"


def test_the_index_keeps_order_across_blocks_streams_and_odd_steps(tmp_path: Path) -> None:
    """Entries cross the index's blocks in order; a step no int64 holds (a Report made by
    hand) is kept as given."""
    spool = Spool(str(tmp_path), label="t", max_bytes=1 << 30)
    marks = [("train" if step % 3 else "", step) for step in range(10_000)]
    marks.append(("val", 2**70))
    for stream, step in marks:
        spool.append(Report(step=step, values={"x": 1.0}, time=0.0, stream=stream))
    got = []
    for _ in range(5_000):
        report = spool.pop_oldest()
        got.append((report.stream, report.step))
    while len(spool) > 1:
        report = spool.pop_oldest()
        got.append((report.stream, report.step))
    assert got == marks[:-1]
    spool.discard(lost=True)  # the last one, noted from the index
    assert spool.lost.describe() == f"val: step {2**70}"
