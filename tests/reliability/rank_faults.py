"""One rank skips a call: the others must fail with a clear error within a set timeout."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from sidestream import AsyncMetricCollector, MeanMetric
from sidestream.testing import DistributedPool
from tests.reliability.scenarios import Row

COLLECTIVE_TIMEOUT_S = 10.0


def _skip_one_window(skip_step: int, steps: int) -> dict[str, Any]:
    """Every rank logs ``steps`` windows, except that rank 1 skips ``skip_step``."""
    rank = dist.get_rank()
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric)
    collector.bind("cpu")
    started = time.monotonic()
    results: list[Any] = []
    error = ""
    try:
        for step in range(steps):
            metric.update(torch.tensor([float(step * 10 + rank)]))
            if rank == 1 and step == skip_step:
                continue
            collector.schedule_collection(step)
            results.append(collector.collect_results(timeout=2 * COLLECTIVE_TIMEOUT_S))
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}".splitlines()[0][:160]
    elapsed = time.monotonic() - started
    collector.close(5)
    return {"rank": rank, "results": results, "error": error, "seconds": elapsed}


def rank_skips_a_call(steps: int = 6, skip_step: int = 2) -> list[Row]:
    with DistributedPool(2, collective_timeout_s=COLLECTIVE_TIMEOUT_S) as pool:
        try:
            ranks = pool.run(_skip_one_window, skip_step, steps, timeout=120)
        except Exception as caught:  # a rank died or the pool timed out
            return [
                Row(
                    "rank 1 skips one schedule_collection",
                    "(both ranks)",
                    f"the pool failed: {str(caught).splitlines()[0][:160]}",
                    0,
                    0,
                    0,
                    steps,
                    ok=False,
                )
            ]
    rows = []
    for rank in ranks:
        # Window s holds the mean of s*10 and s*10+1 on both ranks: 10 s + 0.5.
        right = [10 * s + 0.5 for s in range(len(rank["results"]))]
        wrong = [r for r, w in zip(rank["results"], right, strict=False) if r != w]
        clear = "RankMismatchError" in rank["error"]
        outcome = rank["error"] or "no error"
        if wrong:
            outcome += f"; {len(wrong)} wrong window value(s), e.g. {wrong[0]}"
        rows.append(
            Row(
                "rank 1 skips one schedule_collection",
                f"rank {rank['rank']}",
                outcome,
                delivered=len(rank["results"]) - len(wrong),
                lost=0,
                duplicated=0,
                expected=steps,
                recover_s=rank["seconds"],
                ok=clear and not wrong and rank["seconds"] < 3 * COLLECTIVE_TIMEOUT_S,
            )
        )
    return rows


if __name__ == "__main__":
    for row in rank_skips_a_call():
        print(row)
