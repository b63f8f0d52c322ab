"""The multi-process harness reports results, tracebacks and dead ranks in bounded time."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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
from tests._scripts import run_python


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


LARGE_BYTES = 20 * 2**20  # past the 8 MiB one TCPStore value may hold (TorchrunPool's ranks)


def large_echo(data: bytes) -> tuple[str, bytes]:
    """The digest of a large argument, and a large result of this rank's own."""
    return hashlib.sha256(data).hexdigest(), random.Random(dist.get_rank()).randbytes(LARGE_BYTES)


def check_large_echo(pool: RankPool) -> None:
    """Large arguments and results travel whole, and ordinary calls work after them."""
    for data in (b"", random.Random(-1).randbytes(LARGE_BYTES)):  # large results, then both
        expected = [
            (hashlib.sha256(data).hexdigest(), random.Random(rank).randbytes(LARGE_BYTES))
            for rank in range(pool.world_size)
        ]
        assert pool.run(large_echo, data, timeout=120) == expected
    assert pool.run(dist.get_rank) == list(range(pool.world_size))


def test_large_arguments_and_results_come_back_whole(dist_pool: RankPool) -> None:
    check_large_echo(dist_pool)


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


def _destroys_the_group() -> int:
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def _rank_one_leaves_the_group(work_s: float) -> str:
    if dist.get_rank() == 1:
        dist.destroy_process_group()
        return "left"
    time.sleep(work_s)  # the other rank keeps working alone a while
    return "worked"


def test_a_rank_that_destroyed_its_group_lets_the_others_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The rank that destroyed its group exited at once, and the pool, seeing a dead rank, gave
    # the others the grace of a failure only: "no result after another rank failed".
    from sidestream.testing import _pool

    monkeypatch.setattr(_pool, "_GRACE_S", 1.0)
    with DistributedPool(2) as pool:
        assert pool.run(_rank_one_leaves_the_group, 3.0, timeout=60) == ["worked", "left"]
        assert pool.run(_rank_sum) == [3.0, 3.0]  # then a fresh pool


def _rank_environment() -> tuple[str | None, ...]:
    return tuple(os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def test_a_task_that_destroys_the_group_is_followed_by_a_fresh_pool(
    dist_pool: RankPool,
) -> None:
    # It returned fine, and the next, unrelated call failed on every rank ("Default process
    # group has not been initialized"), blamed on the next test.
    assert dist_pool.run(_destroys_the_group) == list(range(dist_pool.world_size))
    assert dist_pool.run(_rank_sum) == [float(sum(range(1, dist_pool.world_size + 1)))] * (
        dist_pool.world_size
    )


def test_ranks_see_their_own_rank_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # They inherited the pool's process's: a test run inside a torchrun job saw RANK=0
    # everywhere, and sidestream's world-size check refused a 1-rank pool's sync.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert run_distributed(_rank_environment, 2, timeout=60) == [("0", "0", "2"), ("1", "1", "2")]


def _rank_one_is_killed() -> int:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_a_rank_killed_by_a_signal_is_named_and_reported_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Reported as "exit code -9" only, after the whole 5 s grace though rank 0 had answered.
    # Timed on a started pool: a start (seconds under load) hid the grace. The grace is made
    # long, so that waiting for it stands out from a loaded machine's slow report (8.3 s seen
    # under a load of 15 against the 5 s grace).
    from sidestream.testing import _pool

    monkeypatch.setattr(_pool, "_GRACE_S", 40.0)
    with DistributedPool(2) as pool:
        pool.run(dist.get_rank, timeout=60)
        start = time.monotonic()
        with pytest.raises(DistributedError, match=r"exit code -9 \(killed by SIGKILL\)"):
            pool.run(_rank_one_is_killed, timeout=60)
        assert time.monotonic() - start < 25.0


def test_dead_rank_reported() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedError, match="exit code 3"):
        run_distributed(_rank_one_dies, 2, timeout=60)
    assert time.monotonic() - start < 45


def test_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        DistributedPool(0)


def _script(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.py"  # spawn imports the main module again: a file, not -c
    path.write_text(textwrap.dedent(text))
    return run_python(str(path), timeout=180)


def test_rank_dying_while_starting_is_named(tmp_path: Path) -> None:
    # Without the guard every spawned rank runs the pool again while it imports the script.
    done = _script(
        tmp_path,
        """
        import torch.distributed as dist
        from sidestream.testing import DistributedError, run_distributed
        try:
            run_distributed(dist.get_rank, 2, timeout=60)
        except DistributedError as error:
            print(error)
        """,
    )
    assert done.stdout.count("while starting, before its process group was up") == 2, done
    assert '__name__ == "__main__"' in done.stdout


def test_a_backend_the_ranks_cannot_use_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match=r"backend: .*TorchrunPool\(world_size, backend='nccl'\)"):
        DistributedPool(2, backend="nccl")
    with pytest.raises(ValueError, match="backend: 'no-such-backend' is not"):
        run_distributed(dist.get_rank, 2, backend="no-such-backend")


class _TwoArguments(Exception):
    def __init__(self, first: str, second: str) -> None:
        super().__init__(f"{first} {second}")


def _result_that_cannot_be_rebuilt() -> Exception:
    return _TwoArguments("a", "b")  # pickles, but unpickling calls __init__ with one argument


def test_a_result_that_cannot_be_unpickled_is_a_rank_failure() -> None:
    with pytest.raises(DistributedError) as caught:
        run_distributed(_result_that_cannot_be_rebuilt, 2, timeout=60)
    assert [f.rank for f in caught.value.failures] == [0, 1]
    assert "could not be unpickled here: TypeError" in caught.value.failures[0].reason


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; only its parent has not collected it yet


def _gone_soon(pids: list[int]) -> bool:
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


def _start_a_child_then_hang(pid_dir: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pid_dir, str(dist.get_rank())).write_text(f"{os.getpid()} {child.pid}")
    time.sleep(300)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_rank_stopped_by_force_takes_the_processes_it_started_along(tmp_path: Path) -> None:
    with DistributedPool(2) as pool:
        pool.run(dist.get_rank)  # started before the timeout runs
        with pytest.raises(DistributedError, match="still running; killed"):
            pool.run(_start_a_child_then_hang, str(tmp_path), timeout=10)
    pids = [int(pid) for file in tmp_path.iterdir() for pid in file.read_text().split()]
    assert len(pids) == 4 and _gone_soon(pids), pids


def kill_pool_while_busy(tmp_path: Path, make: str, extra: str) -> list[str]:
    """Run a job that makes the pool ``make``, prints its ranks' pids and ``extra``, sets every
    rank busy in a task, then is killed (no close, no atexit); return what it printed."""
    done = _script(
        tmp_path,
        f"""
        import os, pathlib, signal, sys, threading, time
        from sidestream.testing import DistributedPool, TorchrunPool
        from tests.testing._busy import busy

        if __name__ == "__main__":
            pool = {make}
            print("printed:", *pool.run(os.getpid), {extra}, flush=True)
            # Busy in a task, as a rank is when a job's process group is killed.
            marks = pathlib.Path(sys.argv[0]).with_name("busy")
            marks.mkdir()
            threading.Thread(target=pool.run, args=(busy, str(marks)), daemon=True).start()
            while len(list(marks.iterdir())) < 2:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    # Its line only: the ranks share the job's stdout, where torch 2.8's gloo prints
    # "[Gloo] Rank 0 is connected to 1 peer ranks" too.
    line = next(line for line in done.stdout.splitlines() if line.startswith("printed: "))
    return line.split()[1:]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ranks_end_and_clean_up_when_the_pools_process_is_killed(tmp_path: Path) -> None:
    *pids, store_dir = kill_pool_while_busy(tmp_path, "DistributedPool(2)", "pool._store_dir.name")
    assert _gone_soon([int(pid) for pid in pids]), pids
    assert not Path(store_dir).exists()


def test_rank_dying_in_a_task_is_not_blamed_on_starting() -> None:
    with pytest.raises(DistributedError) as caught:
        run_distributed(_rank_one_dies, 2, timeout=60)
    (died,) = [f for f in caught.value.failures if f.rank == 1]
    assert "exit code 3" in died.reason and "while starting" not in died.reason


def _default_group_references_left_by_ddp() -> int:
    """References to the default group that building and dropping a DDP model leaves behind."""
    import gc

    pg = dist.group.WORLD
    gc.collect()
    before = sys.getrefcount(pg)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    del model
    gc.collect()
    return sys.getrefcount(pg) - before


def test_ddp_in_a_rank_leaves_the_default_group_destroyable() -> None:
    # torch.distributed.nn, first imported by DDP after the group exists, would hold the group
    # in its functions' defaults: destroy_process_group() then frees nothing, and gloo aborts
    # the rank's exit now and then. A fresh pool: a rank that imported it before is not fresh.
    with DistributedPool(2) as pool:
        assert pool.run(_default_group_references_left_by_ddp) == [0, 0]


def test_close_after_a_start_that_failed_halfway() -> None:
    pool = DistributedPool(2)
    context = pool._context  # processes made but never started, as when start() raised
    pool._processes = [context.Process(target=print) for _ in range(2)]
    pool._stop()
    assert pool._processes == []


def _sleep_then_rank(seconds: float) -> int:
    time.sleep(seconds)
    return dist.get_rank()


def test_a_bad_timeout_is_refused_before_the_task_is_sent() -> None:
    # It failed on "float + NoneType" after the ranks had the task, which then broke the next
    # call ("still running; killed").
    with DistributedPool(2) as pool:
        with pytest.raises(TypeError, match="timeout: expected seconds > 0, got None"):
            pool.run(_sleep_then_rank, 30.0, timeout=None)  # type: ignore[arg-type]
        assert not pool._started  # nothing was started, nothing runs
        assert pool.run(_sleep_then_rank, 0.0, timeout=60) == [0, 1]


def test_calls_from_two_threads_take_turns() -> None:
    # Each call dropped the other's results: both waited out their timeout.
    import threading

    results: dict[str, object] = {}
    with DistributedPool(2) as pool:
        pool.run(_sleep_then_rank, 0.0, timeout=60)  # started before the threads race

        def call(name: str) -> None:
            try:
                results[name] = pool.run(_sleep_then_rank, 0.3, timeout=30)
            except Exception as error:
                results[name] = error

        threads = [threading.Thread(target=call, args=(name,)) for name in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert results == {"a": [0, 1], "b": [0, 1]}


def test_an_interrupted_call_stops_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ctrl-C (or pytest-timeout) in the caller left the task running on the ranks, and the
    # next call was blamed for it: "no result within 15 s (still running; killed)".
    with DistributedPool(2) as pool:
        pool.run(_sleep_then_rank, 0.0, timeout=60)
        original = type(pool)._poll

        def interrupted(self: DistributedPool, *args: object) -> object:
            monkeypatch.setattr(type(pool), "_poll", original)
            raise KeyboardInterrupt

        monkeypatch.setattr(type(pool), "_poll", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.run(_sleep_then_rank, 30.0, timeout=60)
        assert not pool._started
        started = time.monotonic()
        assert pool.run(_sleep_then_rank, 0.0, timeout=60) == [0, 1]  # a fresh pool
        assert time.monotonic() - started < 30


def _gather_and_scatter_counted() -> list[str]:
    import warnings

    from sidestream.testing import count_collectives

    world = dist.get_world_size()
    with count_collectives() as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all_gather_into_tensor is deprecated on newer torch
        dist.all_gather_into_tensor(torch.empty(world), torch.ones(1))
        if hasattr(dist, "reduce_scatter_single"):
            dist.reduce_scatter_single(torch.empty(1), torch.ones(world))
    return calls


def test_count_collectives_counts_an_old_name_once_and_the_new_scatter(
    dist_pool: RankPool,
) -> None:
    # On torch 2.13 all_gather_into_tensor calls all_gather_single: one call counted twice;
    # reduce_scatter_single was not counted at all.
    expected = ["all_gather_into_tensor"]
    if hasattr(dist, "reduce_scatter_single"):
        expected.append("reduce_scatter_single")
    for calls in dist_pool.run(_gather_and_scatter_counted, timeout=60):
        assert calls == expected


def _counted_from_two_threads() -> tuple[bool, list[str], list[str]]:
    import threading

    from sidestream.testing import count_collectives

    original = dist.all_reduce
    first = count_collectives()
    first_calls = first.__enter__()
    opened, closed = threading.Event(), threading.Event()
    second_calls: list[str] = []

    def second() -> None:  # opened after the first block, closed after it
        with count_collectives() as calls:
            opened.set()
            closed.wait(30)
        second_calls.extend(calls)

    thread = threading.Thread(target=second)
    thread.start()
    opened.wait(30)
    dist.all_reduce(torch.ones(1))
    first.__exit__(None, None, None)
    closed.set()
    thread.join(30)
    return dist.all_reduce is original, first_calls, second_calls


def test_count_collectives_blocks_on_two_threads_restore_torch(dist_pool: RankPool) -> None:
    # Closed out of order, the first block restored the second's wrapper: all_reduce stayed
    # patched for the rest of the process.
    for restored, first, second in dist_pool.run(_counted_from_two_threads, timeout=60):
        assert restored
        assert first == second == ["all_reduce"]  # a block counts the whole process


def _rank_one_dies_mid_result() -> int:
    """Rank 1 writes the start of a result message, then dies before the rest."""
    import gc
    import struct
    from multiprocessing.connection import Connection

    if dist.get_rank() == 1:
        for thing in gc.get_objects():
            # A result pipe's write end: writable only.
            if type(thing) is Connection and not thing.closed and not thing.readable:
                os.write(thing.fileno(), struct.pack("!i", 1 << 20) + b"cut short")
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


@pytest.mark.timeout(120)
def test_a_rank_killed_in_the_middle_of_its_result_is_reported() -> None:
    # The results once shared one queue whose write end the pool's process held too, so the
    # read of a message cut short waited for its rest forever.
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"(?s)rank 1 -+\nprocess died with exit code -9"):
        run_distributed(_rank_one_dies_mid_result, 2, timeout=30)
    assert time.monotonic() - start < 60
