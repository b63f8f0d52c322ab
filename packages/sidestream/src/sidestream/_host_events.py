"""CUDA events that a host thread waits on, and that wait.

A default event's ``synchronize`` spins a CPU core until the device reaches it; a blocking one
sleeps. Background threads wait on window results that may take as long as the slowest rank, so
their events are blocking. Events only other streams wait on (``wait_event``) need neither.
"""

from __future__ import annotations

import time

import torch

__all__ = ["host_event", "wait_on_host"]

_POLL_S = 0.0002


def host_event() -> torch.cuda.Event:
    """A new event for a host thread to wait on (``blocking=True``: the wait sleeps)."""
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]


def wait_on_host(event: torch.cuda.Event) -> None:
    """Wait on a background thread until the device passed ``event``.

    Sync debug mode watches the training thread for host syncs: while it is on, this polls
    instead of synchronizing, so a background thread's wait is never reported as one (also when
    another thread turns the mode on while this one is about to wait).
    """
    if torch.cuda.get_sync_debug_mode() == 0:
        try:
            event.synchronize()  # releases the GIL while it waits
            return
        except RuntimeError:
            if torch.cuda.get_sync_debug_mode() == 0:
                raise  # a real failure, not the debug mode turned on meanwhile
    while not event.query():  # type: ignore[no-untyped-call]
        time.sleep(_POLL_S)
