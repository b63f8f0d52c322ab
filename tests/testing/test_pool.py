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
    dist_pool.run(dist.get_rank)  # started (or restarted) before the clock runs
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


def test_rank_dying_while_starting_is_named() -> None:
    # An unknown backend fails init_process_group in every rank, as an unguarded script does.
    with pytest.raises(DistributedError) as caught:
        run_distributed(dist.get_rank, 2, backend="no-such-backend", timeout=60)
    for failure in caught.value.failures:
        assert "while starting, before its process group was up" in failure.reason
        assert '__name__ == "__main__"' in failure.reason


def test_rank_dying_in_a_task_is_not_blamed_on_starting() -> None:
    with pytest.raises(DistributedError) as caught:
        run_distributed(_rank_one_dies, 2, timeout=60)
    (died,) = [f for f in caught.value.failures if f.rank == 1]
    assert "exit code 3" in died.reason and "while starting" not in died.reason


def test_close_after_a_start_that_failed_halfway() -> None:
    pool = DistributedPool(2)
    context = pool._context  # processes made but never started, as when start() raised
    pool._processes = [context.Process(target=print) for _ in range(2)]
    pool._stop()
    assert pool._processes == []
