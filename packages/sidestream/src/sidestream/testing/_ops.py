"""Which torch ops a piece of code dispatches: on CUDA, roughly its kernel launches."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpRecorder"]


class OpRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the name of every aten op dispatched inside it, in order (``ops``).

    On CUDA each op that computes is a kernel launch, the host cost of a small update; on the
    meta device the same ops are dispatched without running, so counting them there needs no
    GPU. Views and scalar wrappers are recorded too: filter them out where they launch nothing.

    Example:
        >>> import torch
        >>> with OpRecorder() as recorder:
        ...     _ = torch.ones(3, device="meta").sum()
        >>> recorder.ops
        ['ones', 'sum']
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
