"""A checkpoint's collective that fails names its likely cause instead of gloo's bare message."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from sidestream.sync import RankMismatchError

__all__ = ["naming_checkpoint_failures"]


_OUT_OF_MEMORY: type[RuntimeError] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class _Windows(Protocol):
    @property
    def prefix(self) -> str: ...

    def _windows_waiting(self) -> int: ...

    def _windows_failed(self) -> list[int]: ...

    def _mismatch_found(self) -> BaseException | None: ...


@contextlib.contextmanager
def naming_checkpoint_failures(where: str, collectors: Sequence[_Windows]) -> Iterator[None]:
    """Re-raise a failed checkpoint collective naming the call and what may have caused it.

    A peer that stopped (hung, or gone) leaves this rank's windows waiting for their
    collectives; the checkpoint's collective queues behind them and fails at the process
    group's timeout with the backend's message alone ("Application timeout caused pair
    closure"), which names neither the call nor the windows. Entered around the collectives
    only (a local error is not theirs to name).

    Raises:
        RankMismatchError: If a window of ``collectors`` found that ranks paired different
            calls: that is the cause, whatever the backend said (a ``RankMismatchError``
            raised inside passes unchanged).
        RuntimeError: Naming ``where``, the collectors, and the windows still running as it
            started or failed before it, chained to the backend's error (any other error
            passes unchanged).
    """
    # Counted before the collective: once the backend gives up on it, it fails the windows'
    # collectives too, and the dispatcher may have handed them back by the time this raises.
    waiting = {c.prefix: c._windows_waiting() for c in collectors}
    waiting = {prefix: count for prefix, count in waiting.items() if count}
    try:
        yield
    except (RankMismatchError, _OUT_OF_MEMORY):  # not the collective's to name
        raise
    except RuntimeError as error:
        for collector in collectors:
            mismatch = collector._mismatch_found()
            if mismatch is not None:
                # A window paired with another call (a rank skipped one): that is the cause,
                # whatever the backend said when it gave up on this collective.
                raise RankMismatchError(str(mismatch)) from error
        # Windows that failed before it (their collectives timed out: the backend then fails
        # every later one of the group at once).
        failed = {c.prefix: c._windows_failed() for c in collectors}
        failed = {prefix: steps for prefix, steps in failed.items() if steps}
        causes = [
            f"{count} window(s) of the collector with prefix {prefix!r} were still running as "
            "it started"
            for prefix, count in waiting.items()
        ] + [
            f"the window(s) at step {', '.join(map(str, steps))} of the collector with prefix "
            f"{prefix!r} had failed before it"
            for prefix, steps in failed.items()
        ]
        cause = (
            f"; {'; '.join(causes)} (is a rank behind, stopped or gone, or did one skip a "
            "schedule_collection?)"
            if causes
            else " (did every rank of the group call it, and is every rank alive?)"
        )
        of = ", ".join(repr(collector.prefix) for collector in collectors)
        raise RuntimeError(
            f"{where}: the checkpoint's collective (collector prefix {of}) with the other ranks "
            f"failed{cause}: {type(error).__name__}: {error}"
        ) from error
