"""Small helpers around torch.distributed shared by the sync and checkpoint paths."""

from __future__ import annotations

import atexit
import collections
import os
import weakref
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

# torch.distributed.nn takes the default group as its functions' default argument when first
# imported, and torch imports it with its optimizers (through torch._dynamo), DDP and DCP.
# First imported after init_process_group, it keeps the group alive past
# destroy_process_group(), and gloo then aborts the process at exit now and then ("terminate
# called without an active exception", exit code -6; the quickstart under torchrun in about
# one run of ten). Imported with sidestream, it comes before a script's init_process_group,
# while the default is still None.
import torch.distributed.nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "PUBLIC_GATHER",
    "Group",
    "all_gather_async",
    "all_reduce_async",
    "check_cuda_available",
    "check_device",
    "check_process_group",
    "default_group",
    "group_rank",
    "group_ranks",
    "group_size",
    "resolve_device",
    "resolve_group",
    "retain_work",
]

Group: TypeAlias = dist.ProcessGroup | DeviceMesh | None


def check_device(where: str, device: object, *, allow_none: bool = False) -> None:
    """Raise naming ``where``'s ``device`` unless ``torch.device`` can take it.

    ``torch.device(torch.float32)`` (a dtype passed by mistake) fails naming no argument, and
    so does ``torch.device("gpu")`` or ``torch.device(-1)``.

    Raises:
        TypeError: If ``device`` is of no kind a device is given as.
        ValueError: If it is a str that names no device, or a negative index.
    """
    allowed = torch.device | str | int | None if allow_none else torch.device | str | int
    if isinstance(device, bool) or not isinstance(device, allowed):
        kinds = (
            "a torch.device, a str, a CUDA index or None"
            if allow_none
            else "a torch.device, a str or a CUDA index"
        )
        raise TypeError(
            f"{where}: device: expected {kinds} (such as 'cuda:0' or 0), got {device!r}; "
            "a metric keeps its states' dtypes, it moves between devices only"
        )
    if isinstance(device, int) and device < 0:
        raise ValueError(f"{where}: device: a CUDA index is >= 0, got {device}")
    if isinstance(device, str):
        try:
            torch.device(device)
        except RuntimeError as error:
            raise ValueError(
                f"{where}: device: {device!r} names no device torch knows ({error}); give one "
                "such as 'cpu', 'cuda', 'cuda:0' or a CUDA index 0, 1, ..."
            ) from None


def resolve_device(device: torch.device) -> torch.device:
    """The device that tensors made on ``device`` report, which states and inputs are compared by.

    CUDA without an index is the current CUDA device. CPU with an index (``"cpu:0"``, which
    Accelerate's ``accelerator.device`` is on a multi-process CPU job) is plain ``cpu``: torch
    drops the index, so every CPU tensor is on ``torch.device("cpu")``, and a metric kept on
    ``cpu:0`` refused each of them as "a tensor on another device".
    """
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu" and device.index is not None:
        return torch.device("cpu")
    return device


def check_cuda_available(where: str, device: torch.device) -> None:
    """Raise ``RuntimeError`` naming ``where`` for a CUDA ``device`` where CUDA is not available.

    torch's own error names neither the call nor the way out.
    """
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"{where}: device {str(device)!r} needs CUDA, but torch.cuda.is_available() is "
            f"False (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
            f"{where}('cpu') or run on a machine with a GPU and a CUDA build of torch"
        )


def resolve_group(group: Group) -> dist.ProcessGroup | None:
    """Turn the accepted group forms into a process group (``None`` means the default group).

    Args:
        group: A process group, a one-dimensional device mesh, or ``None`` for the default group.

    Returns:
        The process group to pass to collectives, or ``None`` for the default group.

    Raises:
        TypeError: If ``group`` is none of these (for example d9d's ``DistributedContext``).
        ValueError: If ``group`` is a device mesh with more than one dimension, or what
            ``new_group`` returns on a rank outside the group.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    outside: object = group  # typed as a group, yet new_group returns an int outside it
    if type(outside) is int and outside == dist.GroupMember.NON_GROUP_MEMBER:
        # What new_group returns on a rank outside the group: a plain int to torch, a value
        # the user passed on purpose, so the type is not the mistake.
        raise ValueError(
            f"group: global rank {dist.get_rank() if dist.is_initialized() else '?'} is not "
            "a member of this group (new_group returned GroupMember.NON_GROUP_MEMBER here); "
            "sync, bind and checkpoint over it only on its member ranks"
        )
    if not isinstance(group, DeviceMesh):
        raise TypeError(
            "group: expected a torch.distributed ProcessGroup, a 1-D DeviceMesh or None (the "
            f"default group), got {type(group).__name__}"
        )
    if group.ndim != 1:
        raise ValueError(
            f"group: expected a 1-D DeviceMesh (for example mesh['dp']), got {group.ndim} "
            f"dimensions {group.mesh_dim_names}"
        )
    return group.get_group()


def default_group() -> dist.ProcessGroup | None:
    """The default process group as it is now; ``None`` when torch.distributed is not initialized.

    A default group destroyed and made again (say with another world size) is another object,
    so layouts kept for ``group=None`` compare it, not ``None``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (``None``: the default group); ``(0,)`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """The global ranks of the whole mesh that ``mesh`` (a slice, ``mesh["dp"]``) is part of."""
    # A private accessor (torch 2.2 to 2.13 at least); without it, the mesh is taken as
    # spanning the world, as init_device_mesh makes it.
    root = getattr(mesh, "_get_root_mesh", None)
    if root is None:
        return list(range(dist.get_world_size()))
    return [int(rank) for rank in root().mesh.flatten().tolist()]


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


_checked_group: weakref.ref[dist.ProcessGroup] | None = None
"""The default process group ``check_process_group`` last passed."""


def check_process_group(where: str) -> None:
    """Raise if the environment says this job has several processes but none is joined.

    torchrun (and most launchers) set ``WORLD_SIZE`` and ``RANK``. Without
    ``init_process_group`` every rank would act as rank 0 of a job of its own: each writes to
    the trackers, each reduces only its own data. The same happens with a default group of one
    process where the environment says several (a ``world_size=1`` group on every rank), and
    with any default group smaller than the environment's world: a group per node (made with
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` on a multi-node job) has a rank 0 on every node, and
    each of them writes its node's numbers to the same trackers. A larger group is fine: some
    launchers set ``WORLD_SIZE``/``RANK`` per node and spawn one process per GPU (PyTorch's
    ImageNet example, Kubeflow's PyTorchJob).

    Raises:
        RuntimeError: Naming ``torch.distributed.init_process_group``.
    """
    global _checked_group
    if dist.is_available() and dist.is_initialized():
        default = dist.group.WORLD
        if _checked_group is not None and _checked_group() is default:
            return  # a window's sync calls this on the training thread: checked once per group
        world, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK", "")
        size = dist.get_world_size()
        if world.isdigit() and size < int(world):
            # Smaller than the launcher's world: the job is split into several groups, each
            # with a rank 0 that writes its part to the trackers as if it were the whole job.
            if size == 1:
                held = "holds this process alone"
                consequence = (
                    "each rank reduces only its own data and writes to the trackers as rank 0"
                )
            else:
                held = (
                    f"holds {size} processes (this one as rank {dist.get_rank()}): the job "
                    "is split into groups, a group per node when it was made with "
                    "LOCAL_RANK/LOCAL_WORLD_SIZE"
                )
                consequence = (
                    "each group reduces only its own data and its rank 0 writes to the "
                    "trackers as the job's"
                )
            raise RuntimeError(
                f"{where}: the environment says this job has {world} processes (WORLD_SIZE, "
                f"RANK={rank or 'unset'}), but the default process group {held}; initialize "
                "it with the environment's world size and rank on every rank "
                "(torch.distributed.init_process_group() reads them itself), otherwise "
                f"{consequence}"
            )
        # A weak reference: one kept past destroy_process_group ran gloo's destructor at exit,
        # which aborted the process ("terminate called without an active exception").
        if default is not None:
            _checked_group = weakref.ref(default)
        return
    world, rank = os.environ.get("WORLD_SIZE", ""), os.environ.get("RANK", "")
    several = (world.isdigit() and int(world) > 1) or (rank.isdigit() and int(rank) > 0)
    if several:
        raise RuntimeError(
            f"{where}: the environment says this job has several processes (WORLD_SIZE="
            f"{world or 'unset'}, RANK={rank or 'unset'}) but no process group is initialized; "
            "call torch.distributed.init_process_group(...) on every rank first (otherwise "
            "every rank acts as a job of its own: it reduces only its own data and writes to "
            "the trackers as if it were rank 0)"
        )


# The last collectives' handles, so a gloo worker thread never drops the last reference to one.
# Dropping it there destroys the work's tensors, which takes the GIL; if the main thread then
# destroys the process group (a DDP model freed at exit) it joins that worker while holding
# the GIL, and both wait for ever. Works dropped from here go on the thread that drops them,
# long after the worker let go. The cap bounds what this keeps alive (small packed buffers).
_RECENT_WORKS: collections.deque[dist.Work] = collections.deque(maxlen=64)
# Freed while the interpreter is whole, on the main thread, not during its teardown.
atexit.register(_RECENT_WORKS.clear)


def retain_work(work: dist.Work | None) -> dist.Work | None:
    """Keep a reference to ``work`` (see ``_RECENT_WORKS``) and return it."""
    if work is not None:
        _RECENT_WORKS.append(work)
    return work


# A sync's collectives straight through the process group's own (C++) methods. The public
# functions around them re-check their arguments and look the group up on every call: a third
# of what a logged step's collective costs the training thread (about 25 of 75 µs with gloo).
# Every buffer passed here is the library's own plain dense tensor on the group's device, so
# those checks have nothing to find; a group of another type (a Python subclass) takes the
# public functions.
_GATHER = getattr(dist.ProcessGroup, "all_gather_single", None) or getattr(
    dist.ProcessGroup, "_allgather_base", None
)
_REDUCE = getattr(dist.ProcessGroup, "allreduce", None)
PUBLIC_GATHER = (
    "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
)
"""torch.distributed's public gather into one tensor: its newer name, where torch has it."""


def _async(options: Any) -> Any:
    """``options`` for an async start; one object serves every call (the backend copies it)."""
    options.asyncOp = True
    return options


_GATHER_OPTIONS = _async(torch._C._distributed_c10d.AllgatherOptions())
_REDUCE_OPTIONS: dict[object, Any] = {}  # by reduce op, made on first use


def _direct(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` (the default one for ``None``) if its methods may be called directly."""
    target = dist.group.WORLD if group is None else group
    return target if type(target) is dist.ProcessGroup else None


def all_gather_async(
    output: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup | None
) -> dist.Work | None:
    """Start gathering every rank's ``send`` into ``output`` (async; wait on the work).

    ``output`` and ``send`` are contiguous tensors of one dtype on the group's device, ``output``
    ``group size`` times as long: what ``all_gather_into_tensor`` takes.
    """
    target = _direct(group)
    if target is None or _GATHER is None:
        work: dist.Work | None = getattr(dist, PUBLIC_GATHER)(
            output, send, group=group, async_op=True
        )
        return work
    return _GATHER(target, output, send, _GATHER_OPTIONS)  # type: ignore[no-any-return]


def all_reduce_async(
    buffer: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None
) -> dist.Work | None:
    """Start reducing ``buffer`` in place across ``group`` with ``op`` (async; wait on it)."""
    target = _direct(group)
    if target is None or _REDUCE is None:
        work: dist.Work | None = dist.all_reduce(buffer, op=op, group=group, async_op=True)
        return work
    options = _REDUCE_OPTIONS.get(op)
    if options is None:
        options = _async(torch._C._distributed_c10d.AllreduceOptions())
        options.reduceOp = op
        _REDUCE_OPTIONS[op] = options  # complete before another thread can read it
    return _REDUCE(target, [buffer], options)  # type: ignore[no-any-return]
