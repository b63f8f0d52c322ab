"""Run functions on N local gloo processes and get each rank's result or traceback back."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["DistributedError", "DistributedPool", "RankFailure", "run_distributed"]

_STOP = "stop"


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: its traceback, or why it produced no result."""

    rank: int
    reason: str


class DistributedError(RuntimeError):
    """One or more ranks failed, timed out or died; ``failures`` says which and how."""

    def __init__(self, function: str, world_size: int, failures: list[RankFailure]) -> None:
        self.failures = failures
        lines = [f"{function} failed on {len(failures)} of {world_size} ranks:"]
        for failure in failures:
            lines.append(f"--- rank {failure.rank} ---\n{failure.reason.rstrip()}")
        super().__init__("\n".join(lines))


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    collective_timeout_s: float,
    tasks: Any,
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share this machine's cores
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # gloo ranks are CPU ranks
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    try:
        while True:
            task = tasks.get()
            if task == _STOP:
                break
            task_id, function, args, kwargs = task
            try:
                results.put((task_id, rank, True, function(*args, **kwargs)))
            except BaseException:  # report everything, the parent decides
                results.put((task_id, rank, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class DistributedPool:
    """A process group of ``world_size`` local processes that runs one function at a time.

    Starting processes and a process group costs seconds, so the pool keeps them between calls.
    When a call fails on any rank, times out, or a process dies, the pool is torn down (so a
    half-finished collective cannot poison the next call) and restarted on the next ``run``.

    Args:
        world_size: Number of ranks.
        backend: The torch.distributed backend (``"gloo"`` for CPU processes).
        collective_timeout_s: Timeout of each collective inside the ranks, so a rank waiting for
            a peer that never comes raises instead of hanging.

    Example:
        >>> with DistributedPool(2) as pool:
        ...     ranks = pool.run(torch.distributed.get_rank)
        >>> ranks
        [0, 1]
    """

    def __init__(
        self, world_size: int, backend: str = "gloo", collective_timeout_s: float = 30.0
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {world_size}")
        self.world_size = world_size
        self._backend = backend
        self._collective_timeout_s = collective_timeout_s
        self._context = mp.get_context("spawn")
        self._processes: list[BaseProcess] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store_dir: tempfile.TemporaryDirectory[str] | None = None
        self._next_task = 0

    def _start(self) -> None:
        self._store_dir = tempfile.TemporaryDirectory(prefix="sidestream-pg-")
        store_path = os.path.join(self._store_dir.name, "store")
        self._results = self._context.Queue()
        self._tasks = [self._context.Queue() for _ in range(self.world_size)]
        self._processes = [
            self._context.Process(
                target=_worker,
                args=(
                    rank,
                    self.world_size,
                    store_path,
                    self._backend,
                    self._collective_timeout_s,
                    self._tasks[rank],
                    self._results,
                ),
                daemon=True,
                name=f"sidestream-rank-{rank}",
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()

    def run(
        self, function: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Any]:
        """Run ``function(*args, **kwargs)`` on every rank and return the results by rank.

        ``function`` must be picklable (defined at module level) and so must its arguments and
        results.

        Raises:
            DistributedError: If any rank raised, did not finish within ``timeout`` seconds, or
                died. Every rank's traceback or reason is in the message.
        """
        if not self._processes:
            self._start()
        task_id = self._next_task
        self._next_task += 1
        for task_queue in self._tasks:
            task_queue.put((task_id, function, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            try:
                got_id, rank, ok, payload = self._results.get(timeout=min(0.2, limit - now))
            except queue.Empty:
                if any(not p.is_alive() for p in self._processes) and grace_deadline is None:
                    grace_deadline = time.monotonic() + 5.0
                continue
            if got_id != task_id:
                continue
            outcomes[rank] = (ok, payload)
            if not ok and grace_deadline is None:
                # Give the other ranks a moment to report their own view, then stop waiting.
                grace_deadline = time.monotonic() + 5.0
        name = getattr(function, "__qualname__", repr(function))
        gave_up = grace_deadline is not None and time.monotonic() < deadline
        failures = self._failures(outcomes, timeout, gave_up)
        if failures:
            self.close()
            raise DistributedError(name, self.world_size, failures)
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _failures(
        self, outcomes: dict[int, tuple[bool, Any]], timeout: float, gave_up: bool
    ) -> list[RankFailure]:
        failures = []
        for rank in range(self.world_size):
            if rank in outcomes:
                ok, payload = outcomes[rank]
                if not ok:
                    failures.append(RankFailure(rank, payload))
                continue
            process = self._processes[rank]
            if process.is_alive() and gave_up:
                reason = "no result after another rank failed (likely waiting on it; killed)"
            elif process.is_alive():
                reason = f"no result within {timeout:.0f} s (still running; killed)"
            else:
                reason = f"process died with exit code {process.exitcode}"
            failures.append(RankFailure(rank, reason))
        return failures

    def close(self) -> None:
        """Stop every rank (politely, then by force) and forget the process group."""
        for task_queue in self._tasks:
            with contextlib.suppress(Exception):
                task_queue.put(_STOP)
        deadline = time.monotonic() + 5.0
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        for task_queue in [*self._tasks, self._results]:
            if task_queue is not None:
                task_queue.close()
                task_queue.cancel_join_thread()
        self._processes, self._tasks, self._results = [], [], None
        if self._store_dir is not None:
            self._store_dir.cleanup()
            self._store_dir = None

    def __enter__(self) -> DistributedPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_distributed(
    function: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``function`` once on ``world_size`` fresh gloo processes; results by rank.

    Raises:
        DistributedError: If any rank raised, timed out or died (see ``DistributedPool.run``).
    """
    with DistributedPool(world_size, backend=backend) as pool:
        return pool.run(function, *args, timeout=timeout, **kwargs)
