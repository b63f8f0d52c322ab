"""Host-side calls that ``torch.compile`` runs as they are, never traced."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["host_call"]

_F = TypeVar("_F", bound=Callable[..., object])


def host_call(function: _F, reason: str | None = None) -> _F:
    """``function``, run eagerly also when a compiled function calls it.

    A collector's scheduling, a run's ``log`` and a sync are host work (locks, queues, threads,
    collectives issued through the process group). Called from a training step compiled whole,
    Dynamo traced into them and broke the step's graph at every lock and queue (24 graph breaks
    and resumed frames for one ``schedule_collection`` and one ``log``, about 200 µs a step on
    one CPU thread); skipped, the graph breaks once at each call.

    Not ``torch.compiler.disable`` at definition: that imports ``torch._dynamo`` (with sympy,
    about 800 modules and 2 s) into every process that imports sidestream, compiled or not.
    Until something imported it nothing can be compiling, so the call goes straight through;
    after that the wrapper defers to ``torch.compiler.disable(function)``, made on the first
    call. Dynamo does not inline the wrapper into a caller (``_torchdynamo_disable``), and its
    code is marked skipped there, so at most the first compiled call traces it once.

    Args:
        function: The host-side function (or method, defined in a class body).
        reason: What ``torch.compile(fullgraph=True)`` says when a graph reaches the call
            (``torch.compiler.disable``'s ``reason``).
    """
    disabled: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None:  # no torch.compile in this process yet: nothing traces this
                return function(*args, **kwargs)
            # One code object for every wrapper; private to Dynamo, so looked up with care.
            skip_code = getattr(getattr(dynamo, "eval_frame", None), "skip_code", None)
            if skip_code is not None:
                skip_code(call.__code__)
            disabled.append(
                torch.compiler.disable(function, reason=reason)  # type: ignore[no-untyped-call]
            )
        return disabled[0](*args, **kwargs)

    functools.update_wrapper(call, function)  # its name, docstring and signature
    call._torchdynamo_disable = True  # type: ignore[attr-defined]  # a caller breaks here
    if reason is not None:  # what a fullgraph compile's error says (read by Dynamo)
        call._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
    return cast(_F, call)
