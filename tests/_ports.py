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
    low, high = 32768, 60999
    if _EPHEMERAL.exists():
        low, high = (int(part) for part in _EPHEMERAL.read_text().split()[:2])
    # Below the range where it leaves room, else above it (a range tuned to 1024-65535 leaves
    # neither: then any free port, as bind(0) gives).
    span = range(max(1024, low - 12000), low) if low > 2048 else range(high + 1, 65536)
    for _ in range(200):
        if not span:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                return int(sock.getsockname()[1])
        port = random.choice(span)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {span} in 200 tries")
