"""Small helpers around torch.distributed shared by the sync and checkpoint paths."""

from __future__ import annotations

from typing import TypeAlias

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Group", "group_rank", "group_size", "resolve_group"]

Group: TypeAlias = "dist.ProcessGroup | DeviceMesh | None"


def resolve_group(group: Group) -> dist.ProcessGroup | None:
    """Turn the accepted group forms into a process group (``None`` means the default group).

    Args:
        group: A process group, a one-dimensional device mesh, or ``None`` for the default group.

    Returns:
        The process group to pass to collectives, or ``None`` for the default group.

    Raises:
        ValueError: If ``group`` is a device mesh with more than one dimension.
    """
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: expected a 1-D DeviceMesh (for example mesh['dp']), got {group.ndim} "
                f"dimensions {group.mesh_dim_names}"
            )
        return group.get_group()
    return group


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)
