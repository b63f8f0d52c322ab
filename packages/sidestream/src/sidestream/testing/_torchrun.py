"""A ``RankPool`` whose ranks torchrun starts: one process per GPU with NCCL, or CPU with gloo."""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import IO, Any

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in the stubs

from sidestream.testing._pool import RankPool, Result, kill_own_group
from sidestream.testing._signed import KEY_ENV, sign, verify

# STOP from _store_messages, not _torchrun_worker: run as `-m`, a module this package's
# __init__ imported already warned in every rank (runpy's RuntimeWarning, "found in
# sys.modules ... unpredictable behaviour").
from sidestream.testing._store_messages import (
    STOP,
    delete_message,
    get_message,
    has_message,
    put_message,
)

__all__ = ["TorchrunPool"]

_PREFIX = "sidestream-pool"
_LOG_TAIL_CHARS = 4000


class TorchrunPool(RankPool):
    """``world_size`` ranks launched by torchrun, running one function at a time.

    This is how multi-GPU machines run the distributed tests: torchrun starts one process per
    GPU, each binds ``cuda:LOCAL_RANK`` and joins an NCCL process group, exactly as a training
    job does. Tasks and results travel through a TCP store this process hosts, so the test
    process itself stays out of the group; in chunks, so they may be of any size (the store
    takes at most 8 MiB in one value). Failures, timeouts and restarts behave as in
    ``DistributedPool``; when a rank dies, torchrun stops the others and its output is quoted.

    The store listens on 127.0.0.1 only, and every task and result in it is signed (HMAC-SHA256)
    with a random key made per pool and handed to the ranks through their environment: a rank
    unpickles only tasks this process wrote, and this process only results its ranks wrote.

    Args:
        world_size: Number of ranks (at most the number of visible GPUs with NCCL).
        backend: ``"nccl"`` for GPU ranks, ``"gloo"`` for CPU ranks.
        collective_timeout_s: Timeout of each collective inside the ranks.

    Raises:
        ValueError: If ``backend`` is ``"nccl"`` and fewer than ``world_size`` GPUs are visible.

    Example:
        >>> with TorchrunPool(2, backend="gloo") as pool:
        ...     ranks = pool.run(torch.distributed.get_rank)
        >>> ranks
        [0, 1]
    """

    def __init__(
        self, world_size: int, backend: str = "nccl", collective_timeout_s: float = 30.0
    ) -> None:
        if not isinstance(backend, str):
            # backend.lower() below raised AttributeError, naming no argument.
            raise TypeError(f"backend: expected a str such as 'nccl' or 'gloo', got {backend!r}")
        backend = backend.lower()  # as torch reads it: "NCCL" skipped the GPU checks below
        super().__init__(world_size, backend, collective_timeout_s)
        if backend != "nccl" and not torch.distributed.is_backend_available(backend):
            # Refused here, as DistributedPool does, not by every rank at the first call.
            raise ValueError(
                f"backend: {backend!r} is not a torch.distributed backend this torch has "
                "('nccl' for GPU ranks, 'gloo' for CPU ranks)"
            )
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"world_size: NCCL needs one GPU per rank, got {world_size} ranks and "
                f"{torch.cuda.device_count()} visible GPUs"
            )
        self._store: TCPStore | None = None
        self._listener: socket.socket | None = None
        self._key = b""
        self._launcher: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        # torchrun's own log folder, removed at stop (left to itself, it made a
        # /tmp/torchelastic_* folder per start and never removed it).
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        self._pids: dict[int, int] = {}  # rank -> pid, as read once: a broken store has none
        self._echoed = 0  # how much of torchrun's output (the ranks' too) was echoed already

    def run(
        self, function: Callable[..., Result], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Result]:
        """Run ``function(*args, **kwargs)`` on every rank; see ``RankPool.run``.

        Raises:
            ValueError: If ``function`` lives in ``__main__``, which the ranks cannot import.
            DistributedError: If any rank raised, timed out or died.
        """
        inner = function
        while isinstance(inner, functools.partial):  # the function it calls is what is pickled
            inner = inner.func
        if getattr(inner, "__module__", None) == "__main__":
            raise ValueError(
                "function: the torchrun ranks import it by module; define it in an importable "
                "module, not in __main__"
            )
        try:
            return super().run(function, *args, timeout=timeout, **kwargs)
        finally:
            self._echo_output()  # after a failure: _stop echoed it before closing the log

    def _echo_output(self) -> None:
        """Write what the ranks (and torchrun) printed since the last call to this stdout.

        The ranks write into torchrun's log file, not this process's stdout as
        ``DistributedPool``'s ranks do: without this a rank's print or log line was never seen
        (only quoted when torchrun died), and pytest showed nothing of it under a failed test.
        """
        if self._log is None:
            return
        # pread, not seek and read: torchrun writes through the same open file, whose offset
        # a seek would move under its next write.
        descriptor = self._log.fileno()
        size = os.fstat(descriptor).st_size
        new = os.pread(descriptor, max(0, size - self._echoed), self._echoed)
        self._echoed += len(new)
        if new:
            sys.stdout.write(new.decode(errors="replace"))
            sys.stdout.flush()

    def _start(self) -> None:
        self._key = secrets.token_bytes(32)
        # TCPStore's own server listens on every interface; hand it a socket bound to
        # loopback instead, so no other machine can reach the store.
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._store = TCPStore(
            "127.0.0.1",
            self._listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=30),
            master_listen_fd=self._listener.fileno(),
        )
        self._log = tempfile.TemporaryFile(prefix="sidestream-torchrun-")  # noqa: SIM115 (closed in _stop)
        self._echoed = 0
        self._log_dir = tempfile.TemporaryDirectory(prefix="sidestream-torchrun-logs-")
        env = {
            **os.environ,
            "SIDESTREAM_POOL_STORE": f"127.0.0.1:{self._store.port}",
            "SIDESTREAM_POOL_PREFIX": _PREFIX,
            "SIDESTREAM_POOL_BACKEND": self.backend,
            "SIDESTREAM_POOL_TIMEOUT_S": str(self._collective_timeout_s),
            # The ranks end themselves once this process is gone (killed, no close).
            "SIDESTREAM_POOL_PARENT": str(os.getpid()),
            KEY_ENV: self._key.hex(),
            # What torchrun would set, without its banner about it in the ranks' output.
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            # The ranks unpickle functions by module, as spawned processes would.
            "PYTHONPATH": os.pathsep.join(path for path in sys.path if path),
        }
        if self.backend != "nccl":
            env["CUDA_VISIBLE_DEVICES"] = ""
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.world_size}",
            "--max-restarts=0",
            "--monitor-interval=0.2",
            f"--log-dir={self._log_dir.name}",
            "-m",
            "sidestream.testing._torchrun_worker",
        ]
        # Its own session, so stopping it by force stops torchrun's agent (the ranks have
        # sessions of their own: _stop kills them by the ids they wrote to the store).
        self._launcher = subprocess.Popen(
            command, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _submit(self, task_id: int, task: bytes) -> None:
        assert self._store is not None
        self._rank_pids()  # kept, so a stop after the store broke still finds the ranks
        if task_id > 0:  # every rank answered the task before: none reads it again
            delete_message(self._store, f"{_PREFIX}/task/{task_id - 1}")
        # In chunks: the store's server refuses (and breaks on) a value over 8 MiB.
        put_message(self._store, f"{_PREFIX}/task/{task_id}", sign(self._key, task))

    def _poll(self, task_id: int, waiting: set[int], wait_s: float) -> list[tuple[int, bytes]]:
        assert self._store is not None
        deadline = time.monotonic() + wait_s
        while True:
            finished = []
            for rank in sorted(waiting):
                key = f"{_PREFIX}/result/{task_id}/{rank}"
                if has_message(self._store, key):
                    finished.append((rank, self._verified(self._store, key)))
            if finished or time.monotonic() >= deadline:
                return finished
            time.sleep(0.01)

    def _verified(self, store: TCPStore, key: str) -> bytes:
        """The result under ``key``, taken out of the store (results can be large)."""
        try:
            return verify(self._key, get_message(store, key))
        except ValueError as error:
            # Not from a rank: never unpickle it; report a failure made here instead.
            return pickle.dumps((False, f"rejected a result: {error}"))
        finally:
            delete_message(store, key)

    def _any_dead(self) -> bool:
        return self._launcher is None or self._launcher.poll() is not None

    def _rank_alive(self, rank: int) -> bool:
        return not self._any_dead()  # torchrun stops every rank when one ends

    def _rank_started(self, rank: int) -> bool:
        return self._store is not None and self._store.check([f"{_PREFIX}/ready/{rank}"])

    def _group_lost(self) -> bool:
        if self._store is None:
            return False
        keys = [f"{_PREFIX}/lost/{rank}" for rank in range(self.world_size)]
        return any(self._store.check([key]) for key in keys)

    def _rank_pids(self) -> list[int]:
        """The ranks' process ids, as each wrote it when it started (not all may have)."""
        if self._store is None:
            return []
        for rank in range(self.world_size):
            if rank in self._pids:
                continue
            key = f"{_PREFIX}/pid/{rank}"
            try:
                if not self._store.check([key]):
                    continue
                # Signed by the rank: a pid planted by another process is never killed.
                self._pids[rank] = int(verify(self._key, self._store.get(key)))
            except ValueError:
                continue
            except Exception:  # the store broke (its server gone): what is known
                break
        return list(self._pids.values())

    def _death_reason(self, rank: int) -> str:
        code = None if self._launcher is None else self._launcher.returncode
        return f"torchrun exited with code {code}; its output ends with:\n{self._log_tail()}"

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-_LOG_TAIL_CHARS:]

    def _stop(self) -> None:
        if self._launcher is not None:
            if self._store is not None and self._launcher.poll() is None:
                with contextlib.suppress(Exception):
                    stop_key = f"{_PREFIX}/task/{self._next_task}"
                    put_message(self._store, stop_key, sign(self._key, STOP))
            try:
                self._launcher.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                # torchrun gave each rank a session of its own: killing torchrun's group would
                # leave a rank that is stuck in a task running, so each rank's group goes first.
                for pid in self._rank_pids():
                    kill_own_group(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._launcher.pid, signal.SIGKILL)
                self._launcher.wait(timeout=10.0)
        if self._log is not None:
            with contextlib.suppress(Exception):
                self._echo_output()
            self._log.close()
        if self._listener is not None:
            self._listener.close()
        if self._log_dir is not None:
            self._log_dir.cleanup()
        self._launcher, self._log, self._store, self._listener = None, None, None, None
        self._log_dir = None
        self._pids = {}
