"""Refuse to be pickled by ``torch.distributed.checkpoint`` (a Stateful nested in its dict)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import NoReturn

__all__ = ["refuse_dcp_pickle", "refuse_pickling", "under_dcp"]

_DCP = "torch.distributed.checkpoint"


def under_dcp() -> bool:
    """Whether ``torch.distributed.checkpoint`` is on the calling thread's stack.

    DCP calls ``state_dict()`` / ``load_state_dict()`` only on the top-level values of the dict
    it is given; anything else that is not a tensor it pickles whole (``torch.save``) on save
    and unpickles on load. So a sidestream object pickled or unpickled with DCP on the stack is
    one nested in that dict (``{"metrics": {"acc": acc}}``).
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith(_DCP):
            return True
        frame = frame.f_back
    return False


def refuse_dcp_pickle(obj: object, what: str) -> None:
    """Raise ``TypeError`` if ``torch.distributed.checkpoint`` is pickling ``obj``.

    ``what`` says why that loses data, for the object's kind.
    """
    if under_dcp():
        raise TypeError(dcp_message(obj, what))


def dcp_message(obj: object, what: str) -> str:
    """The error for ``obj`` pickled by ``torch.distributed.checkpoint``; ``what``: the loss."""
    return (
        f"torch.distributed.checkpoint is pickling this {type(obj).__name__}, which is nested "
        "in the dict given to dcp.save / dcp.async_save / dcp.load (as in "
        "{'app': {'metrics': obj}}): DCP calls state_dict() and load_state_dict() only on that "
        f"dict's top-level values. {what} Put it at the top level instead: "
        "dcp.save({'model': model_state, 'metrics': obj}, ...), and the same dict shape for "
        "dcp.load."
    )


def refuse_pickling(obj: object, kind: str) -> NoReturn:
    """Raise ``TypeError`` for pickling or copying ``obj`` (a ``kind``: a Run, a collector).

    It holds threads, locks and sinks; the message says how to checkpoint it instead (and,
    under ``torch.distributed.checkpoint``, where it belongs in the dict).
    """
    if under_dcp():
        why = f"A {kind} holds threads and sinks and cannot be pickled."
        raise TypeError(dcp_message(obj, why))
    raise TypeError(
        f"a {kind} cannot be pickled or copied (it holds threads, locks and sinks); "
        "checkpoint its state_dict() instead. To have one in a process started by spawning "
        "(multiprocessing, Lightning's ddp_spawn pickling a LightningModule), make it in that "
        "process (in the function it runs, or the module's setup()), not before"
    )
