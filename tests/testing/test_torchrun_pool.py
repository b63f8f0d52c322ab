"""TorchrunPool: ranks started by torchrun (gloo here, NCCL in the gpu session) behave like a pool.

Also runs real distributed test files through the torchrun launcher, as ``nox -s gpu`` does
with NCCL, to show the same tests run unchanged on ranks torchrun starts.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in the stubs

from sidestream.testing import DistributedError, TorchrunPool, rank_device
from tests.testing.test_pool import (
    _default_group_references_left_by_ddp,
    _destroys_the_group,
    _gone_soon,
    _rank_one_dies,
    _rank_one_raises,
    _rank_sum,
    _start_a_child_then_hang,
    check_large_echo,
    kill_pool_while_busy,
)

ROOT = Path(__file__).resolve().parents[2]


def _launched_by_torchrun() -> tuple[str, str, str]:
    return os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], str(rank_device())


def _device_tensor() -> torch.Tensor:
    return torch.arange(3) * (dist.get_rank() + 1)


@pytest.fixture(scope="module")
def torchrun_pool() -> Iterator[TorchrunPool]:
    with TorchrunPool(2, backend="gloo") as pool:
        yield pool


def test_ranks_are_started_by_torchrun_and_results_come_back(torchrun_pool: TorchrunPool) -> None:
    assert torchrun_pool.run(_launched_by_torchrun) == [("0", "2", "cpu"), ("1", "2", "cpu")]
    assert torchrun_pool.run(_rank_sum) == [3.0, 3.0]
    assert torchrun_pool.run(dist.get_rank) == [0, 1]
    results = torchrun_pool.run(_device_tensor)
    assert [r.tolist() for r in results] == [[0, 1, 2], [0, 2, 4]]


def test_results_and_tasks_past_the_stores_value_limit_come_back_whole(
    torchrun_pool: TorchrunPool,
) -> None:
    # The store's server refuses a value over 8 MiB: such a result or task broke the store,
    # torchrun, and the call, with "Connection reset by peer" as the only word on it.
    from sidestream.testing._torchrun import _PREFIX

    check_large_echo(torchrun_pool)
    store = torchrun_pool._store
    assert store is not None
    # Taken out once read: the store does not keep every result (nor any earlier task).
    for task in (torchrun_pool._next_task - 3, torchrun_pool._next_task - 2):
        kept = [f"{_PREFIX}/task/{task}"]
        kept += [f"{_PREFIX}/result/{task}/{rank}" for rank in range(2)]
        assert not any(store.check([key]) for key in kept)


def test_a_chunk_count_written_by_another_process_is_refused_without_waiting() -> None:
    from sidestream.testing._store_messages import CHUNK_BYTES, get_message, put_message

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    message = os.urandom(2 * CHUNK_BYTES + 1)
    put_message(store, "whole", message)
    assert get_message(store, "whole") == message
    store.set("planted", "99")  # names chunks nobody wrote: a wait would last the timeout
    start = time.monotonic()
    with pytest.raises(ValueError, match="names 99 chunks and some are missing"):
        get_message(store, "planted")
    store.set("planted", "pickle")
    with pytest.raises(ValueError, match="not a chunk count"):
        get_message(store, "planted")
    assert time.monotonic() - start < 5


def test_ddp_in_a_rank_leaves_the_default_group_destroyable(torchrun_pool: TorchrunPool) -> None:
    assert torchrun_pool.run(_default_group_references_left_by_ddp) == [0, 0]


def test_a_task_that_destroys_the_group_is_followed_by_a_fresh_pool(
    torchrun_pool: TorchrunPool,
) -> None:
    assert torchrun_pool.run(_destroys_the_group) == [0, 1]
    assert torchrun_pool.run(_rank_sum) == [3.0, 3.0]


def _says_hello() -> int:
    print(f"hello from rank {dist.get_rank()}", flush=True)
    return dist.get_rank()


def test_what_ranks_print_is_shown_by_the_call(
    torchrun_pool: TorchrunPool, capsys: pytest.CaptureFixture[str]
) -> None:
    # It went to torchrun's private log, shown only when torchrun died.
    torchrun_pool.run(dist.get_rank)  # started before: its start-up output is not this call's
    capsys.readouterr()
    assert torchrun_pool.run(_says_hello) == [0, 1]
    out = capsys.readouterr().out
    assert "hello from rank 0" in out and "hello from rank 1" in out, out


def test_failing_rank_reported_then_pool_restarts(torchrun_pool: TorchrunPool) -> None:
    torchrun_pool.run(dist.get_rank)  # started (or restarted) before the clock runs
    start = time.monotonic()
    with pytest.raises(DistributedError) as caught:
        torchrun_pool.run(_rank_one_raises, timeout=60)
    assert time.monotonic() - start < 45
    assert [f.rank for f in caught.value.failures if "ValueError" in f.reason] == [1]
    assert "bad shard on rank one" in str(caught.value)
    assert torchrun_pool.run(dist.get_rank) == [0, 1]


def test_dead_rank_reported_with_torchrun_output(torchrun_pool: TorchrunPool) -> None:
    with pytest.raises(DistributedError, match="torchrun exited") as caught:
        torchrun_pool.run(_rank_one_dies, timeout=60)
    assert "exitcode  : 3" in str(caught.value)  # torchrun's own failure report
    assert torchrun_pool.run(dist.get_rank) == [0, 1]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_rank_past_its_timeout_is_killed_with_what_it_started(
    torchrun_pool: TorchrunPool, tmp_path: Path
) -> None:
    # torchrun gives each rank a session of its own: killing torchrun's left them running.
    torchrun_pool.run(dist.get_rank)  # started before the clock runs
    with pytest.raises(DistributedError, match="still running; killed"):
        torchrun_pool.run(_start_a_child_then_hang, str(tmp_path), timeout=10)
    pids = [int(pid) for file in tmp_path.iterdir() for pid in file.read_text().split()]
    assert len(pids) == 4 and _gone_soon(pids), pids
    assert torchrun_pool.run(dist.get_rank) == [0, 1]


def test_a_rank_pid_written_by_another_process_is_never_killed(
    torchrun_pool: TorchrunPool,
) -> None:
    # The pool kills the process groups its store names: only signed ids count.
    from sidestream.testing._torchrun import _PREFIX

    # Run first: the pool starts on its first run, and before it there are no pids (the
    # operands in one line were read left first, so the test failed whenever xdist gave it a
    # fresh pool).
    pids = torchrun_pool.run(os.getpid)
    assert sorted(torchrun_pool._rank_pids()) == sorted(pids)
    store = torchrun_pool._store
    assert store is not None
    key = f"{_PREFIX}/pid/1"
    genuine = store.get(key)
    try:
        store.set(key, str(os.getpid()))  # planted: this test process
        torchrun_pool._pids.clear()  # read from the store again, not from what it kept
        assert os.getpid() not in torchrun_pool._rank_pids()
        torchrun_pool._pids.clear()
        store.set(key, "not a pid")
        assert len(torchrun_pool._rank_pids()) == 1
    finally:
        store.set(key, genuine)  # type: ignore[arg-type]  # bytes, as the rank wrote it


def test_torchrun_leaves_no_log_folder_behind() -> None:
    # torchrun made a /tmp/torchelastic_* folder per pool start, and nothing removed it.
    import glob
    import tempfile

    pattern = os.path.join(tempfile.gettempdir(), "torchelastic_*")
    before = set(glob.glob(pattern))
    with TorchrunPool(2, backend="gloo") as pool:
        assert pool.run(os.getpid)
        folder = pool._log_dir
        assert folder is not None and os.path.isdir(folder.name)
    assert set(glob.glob(pattern)) <= before
    assert not os.path.exists(folder.name)


def test_rejects_what_it_cannot_run() -> None:
    def in_main() -> int:
        return 0

    in_main.__module__ = "__main__"
    with pytest.raises(ValueError, match="function: the torchrun ranks import it"):
        TorchrunPool(2, backend="gloo").run(in_main)
    with pytest.raises(ValueError, match="function: the torchrun ranks import it"):
        TorchrunPool(2, backend="gloo").run(functools.partial(functools.partial(in_main)))
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="world_size: NCCL needs one GPU per rank"):
            TorchrunPool(64, backend="nccl")
    with pytest.raises(ValueError, match="world_size"):
        TorchrunPool(0, backend="gloo")
    # Refused at the first run only, by every rank, after about 9 s.
    with pytest.raises(ValueError, match="backend: 'bogus' is not a torch"):
        TorchrunPool(2, backend="bogus")


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_distributed_tests_run_unchanged_through_torchrun() -> None:
    tests = [
        "tests/core/test_checkpoint_resharding.py",
        "tests/metrics/test_regression.py::test_distributed_matches_sklearn_on_all_shards",
    ]
    done = _pytest(*tests, "-m", "distributed", SIDESTREAM_TEST_LAUNCHER="torchrun")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # Every selected test ran (none skipped for want of ranks): at least the five of when
    # this was written, as tests are added to the files.
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed is not None and int(passed.group(1)) >= 5, done.stdout[-2000:]
    assert "skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]


def test_launcher_settings_are_checked() -> None:
    done = _pytest("tests/testing/test_pool.py", SIDESTREAM_TEST_BACKEND="nccl")
    assert done.returncode != 0
    assert "SIDESTREAM_TEST_BACKEND=nccl needs SIDESTREAM_TEST_LAUNCHER=torchrun" in (
        done.stdout + done.stderr
    )


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ranks_and_torchrun_end_when_the_pools_process_is_killed(tmp_path: Path) -> None:
    # A rank busy in a task never read the store again: ranks and torchrun outlived the pool.
    printed = kill_pool_while_busy(
        tmp_path, 'TorchrunPool(2, backend="gloo")', "pool._launcher.pid"
    )
    pids = [int(pid) for pid in printed]
    assert len(pids) == 3 and _gone_soon(pids), pids
