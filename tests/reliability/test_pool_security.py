"""TorchrunPool's store: loopback only, and a task not signed with the pool's key never runs."""

from __future__ import annotations

import os
import pickle
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from sidestream.testing import DistributedError, TorchrunPool
from sidestream.testing._signed import sign, verify
from sidestream.testing._store_messages import get_message, put_message
from tests.reliability.faults import listening_addresses

pytestmark = pytest.mark.distributed


class _Plant:
    """Unpickling this creates a file: what a crafted task would do instead of os.system."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def _other_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent for UDP connect
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
def test_pool_store_is_loopback_only_and_rejects_unsigned_tasks(tmp_path: Path) -> None:
    with TorchrunPool(2, backend="gloo") as pool:
        assert len(pool.run(os.getpid)) == 2  # starts the ranks
        assert pool._store is not None
        port = pool._store.port
        assert listening_addresses(port) == {"0100007F"}, "127.0.0.1 only"
        other = _other_address()
        if other is not None:
            with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
                pass
        # A local attacker (same machine) writes the next task without the key.
        marker = tmp_path / "pwned"
        attacker = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        task_id = pool._next_task
        # In the pool's own chunked form (an attacker can read the code).
        put_message(attacker, f"sidestream-pool/task/{task_id}", pickle.dumps(_Plant(str(marker))))
        replies = []
        for rank in range(2):
            key = f"sidestream-pool/result/{task_id}/{rank}"
            attacker.wait([key], timedelta(seconds=60))
            replies.append(get_message(attacker, key))
        time.sleep(0.2)
        assert not marker.exists(), "the unsigned task was not unpickled"
        for rank, reply in enumerate(replies):
            ok, message = pickle.loads(verify(pool._key, reply))  # signed by the rank
            assert ok is False and f"rank {rank} rejected task {task_id}" in message
        pool._next_task += 1  # the ranks moved past the forged task
        # A forged result is not unpickled by the pool either: it fails the task instead.
        task_id = pool._next_task
        for rank in range(2):
            key = f"sidestream-pool/result/{task_id}/{rank}"
            put_message(attacker, key, pickle.dumps(_Plant(str(marker))))
        with pytest.raises(DistributedError, match="rejected a result"):
            pool.run(time.sleep, 2.0)
        assert not marker.exists()


def test_sign_and_verify() -> None:
    key = os.urandom(32)
    assert verify(key, sign(key, b"task")) == b"task"
    with pytest.raises(ValueError, match="not signed"):
        verify(os.urandom(32), sign(key, b"task"))
    with pytest.raises(ValueError, match="not signed"):
        verify(key, b"x" * 40)
