"""One rank of a ``TorchrunPool``: join the process group, then run tasks until told to stop.

Started by torchrun (``python -m torch.distributed.run ... -m sidestream.testing._torchrun_worker``)
with ``SIDESTREAM_POOL_STORE`` naming the parent's store, where tasks and results travel.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # before the group, as in _pool._worker
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in the stubs

from sidestream.testing._pool import end_group_when, run_task
from sidestream.testing._signed import KEY_ENV, sign, verify
from sidestream.testing._store_messages import STOP, get_message, put_message


def _join_group(backend: str, timeout: timedelta) -> None:
    if backend == "nccl":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)  # one process per GPU
        dist.init_process_group(
            backend, timeout=timeout, device_id=torch.device("cuda", local_rank)
        )
    else:
        torch.set_num_threads(1)  # CPU ranks share this machine's cores
        dist.init_process_group(backend, timeout=timeout)


def _end_with_pool(pool: int) -> None:
    """Kill this rank's process group (itself and what it started) once ``pool`` is gone.

    Its parent is torchrun, not the pool: the pool's own pid is watched. A rank busy in a task
    never reads the store again, so a pool killed meanwhile left the rank and torchrun
    running; torchrun ends once its ranks do.
    """
    end_group_when(lambda: not _exists(pool))
    os.killpg(0, signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # PermissionError: the pid was reused
        return False
    return True


def main() -> None:
    threading.Thread(
        target=_end_with_pool,
        args=(int(os.environ["SIDESTREAM_POOL_PARENT"]),),
        daemon=True,
        name="pool-watch",
    ).start()
    host, port = os.environ["SIDESTREAM_POOL_STORE"].rsplit(":", 1)
    prefix = os.environ["SIDESTREAM_POOL_PREFIX"]
    backend = os.environ["SIDESTREAM_POOL_BACKEND"]
    timeout = timedelta(seconds=float(os.environ["SIDESTREAM_POOL_TIMEOUT_S"]))
    key = bytes.fromhex(os.environ.pop(KEY_ENV))  # popped: the tasks' own subprocesses don't get it
    # Tasks may be minutes apart; a lost parent closes the store, which ends the wait at once.
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(days=1))
    rank = int(os.environ["RANK"])
    # torchrun starts each rank in a session of its own, out of reach of a kill of torchrun's:
    # the pool kills this process group by its id when the rank will not stop.
    # Signed as results are: the pool kills what this key names, so nobody else may write it.
    store.set(f"{prefix}/pid/{rank}", sign(key, str(os.getpid()).encode()))  # type: ignore[arg-type]
    _join_group(backend, timeout)
    store.set(f"{prefix}/ready/{rank}", "1")
    try:
        task_id = 0
        while True:
            try:
                task = verify(key, get_message(store, f"{prefix}/task/{task_id}"))
            except ValueError as error:
                # Written by someone without the key: never unpickle it.
                result = pickle.dumps((False, f"rank {rank} rejected task {task_id}: {error}"))
            else:
                if task == STOP:
                    break
                result = run_task(task)
                if not dist.is_initialized():
                    # The task destroyed the group: the pool restarts. Said before the result,
                    # which ends the call.
                    store.set(f"{prefix}/lost/{rank}", "1")
            # In chunks: the store's server refuses (and breaks on) a value over 8 MiB.
            put_message(store, f"{prefix}/result/{task_id}/{rank}", sign(key, result))
            task_id += 1
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
