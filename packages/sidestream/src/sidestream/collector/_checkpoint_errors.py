"""A checkpoint's collective that fails names its likely cause instead of gloo's bare message."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch.distributed as dist

from sidestream.sync import RankMismatchError

__all__ = ["naming_checkpoint_failures"]

_BACKEND_ERRORS: tuple[type[BaseException], ...] = tuple(
    error for error in (getattr(dist, "DistError", None),) if error is not None
)
"""What torch.distributed raises for a failed collective (a plain ``RuntimeError`` in gloo's
case before torch named its errors)."""


class _Windows(Protocol):
    @property
    def prefix(self) -> str: ...

    def _windows_waiting(self) -> int: ...

    def _windows_failed(self) -> list[int]: ...


@contextlib.contextmanager
def naming_checkpoint_failures(where: str, collectors: Sequence[_Windows]) -> Iterator[None]:
    """Re-raise a failed checkpoint collective with what was waiting when it failed.

    A peer that stopped (hung, or gone) leaves this rank's windows waiting for their
    collectives; the checkpoint's collective queues behind them and fails at the process
    group's timeout with the backend's message alone ("Application timeout caused pair
    closure"), which names neither the call nor the windows. A ``RankMismatchError`` and other
    errors pass unchanged.

    Raises:
        RuntimeError: Naming ``where`` and the windows still waiting, chained to the backend's
            error, when windows were waiting or the backend raised a ``DistError``.
    """
    # Counted before the collective: once the backend gives up on it, it fails the windows'
    # collectives too, and the dispatcher may have handed them back by the time this raises.
    waiting = {c.prefix: c._windows_waiting() for c in collectors}
    waiting = {prefix: count for prefix, count in waiting.items() if count}
    try:
        yield
    except RankMismatchError:
        raise
    except RuntimeError as error:
        # Windows that failed before it (their collectives timed out: the backend then fails
        # every later one of the group at once).
        failed = {c.prefix: c._windows_failed() for c in collectors}
        failed = {prefix: steps for prefix, steps in failed.items() if steps}
        if not waiting and not failed and not isinstance(error, _BACKEND_ERRORS):
            raise
        causes = [
            f"{count} window(s) of the collector with prefix {prefix!r} still waited for their "
            "collectives as it started"
            for prefix, count in waiting.items()
        ] + [
            f"the window(s) at step {', '.join(map(str, steps))} of the collector with prefix "
            f"{prefix!r} had failed"
            for prefix, steps in failed.items()
        ]
        cause = (
            f" while {'; '.join(causes)} (a rank is behind, stopped or gone, or skipped a "
            "schedule_collection)"
            if causes
            else " (did every rank of the group call it, and is every rank alive?)"
        )
        raise RuntimeError(
            f"{where}: the checkpoint's collective with the other ranks failed{cause}: "
            f"{type(error).__name__}: {error}"
        ) from error
