"""The multi-process harness reports results, tracebacks and dead ranks in bounded time."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from sidestream.testing import (
    DistributedError,
    DistributedPool,
    RankPool,
    on_rank_device,
    run_distributed,
)


@on_rank_device
def _rank_sum() -> float:
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


def _rank_one_raises() -> int:
    if dist.get_rank() == 1:
        raise ValueError("bad shard on rank one")
    dist.barrier()  # the others wait for rank 1 forever without the harness
    return 0


def _rank_one_dies() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()
    return 0


def test_results_come_back_by_rank(dist_pool: RankPool) -> None:
    n = dist_pool.world_size
    assert dist_pool.run(_rank_sum) == [n * (n + 1) / 2] * n
    assert dist_pool.run(dist.get_rank) == list(range(n))


def test_failing_rank_reported_without_hang(dist_pool: RankPool) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError) as caught:
        dist_pool.run(_rank_one_raises, timeout=60)
    assert time.monotonic() - start < 30
    message = str(caught.value)
    assert "rank 1" in message and "bad shard on rank one" in message
    assert [f.rank for f in caught.value.failures if "ValueError" in f.reason] == [1]
    # The pool restarts by itself for the next call.
    assert dist_pool.run(dist.get_rank) == list(range(dist_pool.world_size))


def test_dead_rank_reported() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError, match="exit code 3"):
        run_distributed(_rank_one_dies, 2, timeout=60)
    assert time.monotonic() - start < 45


def test_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        DistributedPool(0)
