"""Ports for servers the tests start, and for ones that must stay closed."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def quiet_port() -> int:
    """A free TCP port on 127.0.0.1 that no automatic ``bind(0)`` of another process can take.

    A port from ``bind(0)`` is free only until its socket closes: a gloo group, a TCPStore or
    the other xdist worker's torchrun asking the kernel for a port may get it in the seconds an
    mlflow server takes to start, or while a test has stopped one to restart it. Ports below the
    kernel's ephemeral range are never handed out that way.
    """
    low = 32768
    if _EPHEMERAL.exists():
        low = int(_EPHEMERAL.read_text().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} in 200 tries")
