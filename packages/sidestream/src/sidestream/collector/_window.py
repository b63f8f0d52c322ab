"""What the training thread hands the dispatcher for one logging window."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sidestream.collector._slot import Slot
from sidestream.collector._tree import FlatTree
from sidestream.sync import SyncHandle

__all__ = ["Window"]


@dataclass
class Window:
    """One scheduled collection.

    CPU: ``batch`` holds the started collectives; the dispatcher waits on it and computes on
    ``slot.metric``. CUDA: reduction and compute were queued on the side stream; ``tree``
    describes the result, ``host`` holds its pinned copies, valid once ``done`` has passed.
    """

    step: int
    time: float
    slot: Slot
    batch: SyncHandle | None = None
    done: torch.cuda.Event | None = None
    tree: FlatTree | None = None
    host: list[Any] = field(default_factory=list)
