"""Load: many windows of 200 names through JSONL and TensorBoard on 2 gloo ranks.

``run(windows)`` returns rank 0's figures: windows/s, peak RSS of each rank, the training
thread's longest ``schedule_collection``, and what each sink got. The ``soak`` nox session runs
100,000 windows; the CI test runs 1,000. Also a lagging sink (a few ms per write) and a lagging
dispatcher (a slow ``compute``), whose memory must stay within the documented caps.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import Metric
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import JsonlSink, Report, RunInfo, Sink
from sidestream.state import MetricAccumulator
from sidestream.testing import DistributedPool

NAMES = 200


class Counts(Metric[Tensor]):
    """200 sums (one name each in a report); ``compute`` may sleep (a lagging dispatcher)."""

    def __init__(self, compute_s: float = 0.0) -> None:
        self._sums = MetricAccumulator(torch.zeros(NAMES, dtype=torch.float64))
        self._compute_s = compute_s

    def update(self, values: Tensor) -> None:
        self._sums.accumulate(values)

    def compute(self) -> Tensor:
        if self._compute_s:
            time.sleep(self._compute_s)
        return self._sums.value.clone()


class LaggingSink(Sink):
    """Counts steps, ``delay_s`` per write."""

    name = "lagging"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.steps: list[int] = []

    def open(self, run: RunInfo) -> None:
        del run

    def write(self, report: Report) -> None:
        time.sleep(self.delay_s)
        self.steps.append(report.step)


def _rss_mib() -> float:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * 4096 / 2**20


def rank_loop(
    out: str, windows: int, tensorboard: bool, lag_s: float, compute_s: float, max_slots: int
) -> dict[str, Any]:
    rank = dist.get_rank()
    sinks: list[Sink] = [JsonlSink(Path(out) / "soak.jsonl", flush_every=256)]
    if tensorboard:
        from sidestream_tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(Path(out) / "tb"))
    lagging = LaggingSink(lag_s) if lag_s else None
    if lagging is not None:
        sinks.append(lagging)
    metric = Counts(compute_s)
    collector = AsyncMetricCollector(
        metric,
        sinks=sinks,
        prefix="soak",
        spool_dir=str(Path(out) / f"spool{rank}"),
        # Unpaced, the windows outrun TensorBoard (about 10x): the backlog waits on disk.
        spool_max_bytes=2**30,
        max_slots=max_slots,
    )
    collector.bind("cpu")
    values = torch.arange(NAMES, dtype=torch.float64) * (rank + 1)
    rss_start = peak_rss = _rss_mib()
    longest = 0.0
    most_slots = most_spooled = 0
    start = time.perf_counter()
    for step in range(windows):
        metric.update(values)
        began = time.perf_counter()
        collector.schedule_collection(step)
        longest = max(longest, time.perf_counter() - began)
        if step % 100 == 0:
            peak_rss = max(peak_rss, _rss_mib())
            most_slots = max(most_slots, collector._slot_count)
            most_spooled = max([most_spooled, *(r.spooled_bytes for r in collector.sink_runners)])
    scheduled_s = time.perf_counter() - start
    closed = collector.close(3600)
    peak_rss = max(peak_rss, _rss_mib())
    elapsed = time.perf_counter() - start
    runners = collector.sink_runners
    return {
        "rank": rank,
        "windows_per_s_scheduled": windows / scheduled_s,
        "windows_per_s_delivered": windows / elapsed,
        # Sampled, not getrusage's ru_maxrss: Linux keeps that across the exec of a spawned
        # process, so it reported the parent's RSS at fork (a long pytest session's, 1 GiB).
        "peak_rss_mib": peak_rss,
        "rss_growth_mib": _rss_mib() - rss_start,
        "longest_schedule_ms": longest * 1e3,
        "slot_wait_s": collector.slot_wait_s,
        "most_slots": most_slots,
        "most_spooled_bytes": most_spooled,
        "closed": closed,
        "delivered": {r.key: r.delivered for r in runners},
        "dropped": {r.key: r.dropped for r in runners},
        "lagging_steps": len(lagging.steps) if lagging is not None and rank == 0 else None,
    }


def count_outputs(out: Path, tensorboard: bool) -> dict[str, Any]:
    """Steps each sink wrote, read back from its files (TensorBoard with its own reader)."""
    steps = [json.loads(line)["step"] for line in (out / "soak.jsonl").open()]
    found: dict[str, Any] = {"jsonl_lines": len(steps), "jsonl_unique": len(set(steps))}
    first = json.loads(next(iter((out / "soak.jsonl").open())))
    found["names_per_report"] = len(first["values"])
    if tensorboard:
        # TensorBoard's own event reader, streamed: EventAccumulator would hold every one of
        # the 200 tags' events in memory.
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

        tb_steps = [
            event.step
            for path in sorted((out / "tb").rglob("events.out.tfevents.*"))
            for event in EventFileLoader(str(path)).Load()
            if any(value.tag == "soak/class_7" for value in event.summary.value)
        ]
        found["tensorboard_steps"] = len(tb_steps)
        found["tensorboard_unique"] = len(set(tb_steps))
    return found


def run(
    windows: int,
    *,
    tensorboard: bool = True,
    lag_s: float = 0.0,
    compute_s: float = 0.0,
    max_slots: int = 8,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sidestream-soak-") as tmp:
        with DistributedPool(2) as pool:
            ranks = pool.run(
                rank_loop, tmp, windows, tensorboard, lag_s, compute_s, max_slots, timeout=7200
            )
        return {"ranks": ranks, "outputs": count_outputs(Path(tmp), tensorboard)}


def run_all(windows: int) -> dict[str, Any]:
    """The soak and its two lagging variants (those at a tenth of the windows, at least 500)."""
    lagging = max(500, windows // 10)
    started = time.perf_counter()
    figures = {
        "windows": windows,
        "soak": run(windows),
        "lagging_sink": run(lagging, tensorboard=False, lag_s=0.002),
        "lagging_dispatcher": run(lagging, tensorboard=False, compute_s=0.004, max_slots=4),
    }
    figures["seconds"] = time.perf_counter() - started
    figures["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return figures


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=Path("build/soak.json"))
    args = parser.parse_args()
    result = run_all(args.windows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
