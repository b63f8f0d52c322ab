"""Host-side calls that ``torch.compile`` runs as they are, never traced."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

import torch

__all__ = ["host_call"]

_F = TypeVar("_F", bound=Callable[..., object])


def host_call(function: _F) -> _F:
    """``function``, run eagerly also when a compiled function calls it.

    A collector's scheduling, a run's ``log`` and a sync are host work (locks, queues, threads,
    collectives issued through the process group). Called from a training step compiled whole,
    Dynamo traced into them and broke the step's graph at every lock and queue (24 graph breaks
    and resumed frames for one ``schedule_collection`` and one ``log``, about 200 µs a step on
    one CPU thread); skipped, the graph breaks once at each call. Eagerly the wrapper costs
    about 0.4 µs a call.
    """
    return cast(_F, torch.compiler.disable(function))  # type: ignore[no-untyped-call]
