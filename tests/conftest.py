"""Process groups for the distributed tests.

By default every world size is a ``DistributedPool`` of spawned gloo processes (CPU CI). The
``gpu`` nox session sets ``SIDESTREAM_TEST_LAUNCHER=torchrun`` and ``SIDESTREAM_TEST_BACKEND=nccl``
so the same tests run on ranks torchrun starts, one per GPU, joined by NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from sidestream.testing import DistributedPool, RankPool, TorchrunPool

LAUNCHERS = ("spawn", "torchrun")
# The gather collective sync issues: torch 2.11 (the GPU machines') has no all_gather_single.
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
BACKENDS = ("gloo", "nccl")
LAUNCHER = os.environ.get("SIDESTREAM_TEST_LAUNCHER", "spawn")
BACKEND = os.environ.get("SIDESTREAM_TEST_BACKEND", "gloo")


def _visible_gpus() -> int:
    return torch.cuda.device_count() if BACKEND == "nccl" else 0


def _world_sizes() -> list[int]:
    sizes = [2, 4]
    if _visible_gpus() > 1 and _visible_gpus() not in sizes:
        sizes.append(_visible_gpus())  # and once over every visible GPU
    return sizes


class Pools:
    """One pool per world size, started on first use and kept for the whole session."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        """The pool of ``world_size`` ranks; skips the test when there are too few GPUs."""
        if BACKEND == "nccl" and world_size > _visible_gpus():
            pytest.skip(f"needs {world_size} GPUs for NCCL, {_visible_gpus()} visible")
        if world_size not in self._pools:
            if LAUNCHER == "torchrun":
                self._pools[world_size] = TorchrunPool(world_size, backend=BACKEND)
            else:
                self._pools[world_size] = DistributedPool(world_size, backend=BACKEND)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def pytest_configure(config: pytest.Config) -> None:
    if LAUNCHER not in LAUNCHERS:
        raise pytest.UsageError(f"SIDESTREAM_TEST_LAUNCHER: expected one of {LAUNCHERS}")
    if BACKEND not in BACKENDS:
        raise pytest.UsageError(f"SIDESTREAM_TEST_BACKEND: expected one of {BACKENDS}")
    if BACKEND == "nccl" and LAUNCHER != "torchrun":
        raise pytest.UsageError(
            "SIDESTREAM_TEST_BACKEND=nccl needs SIDESTREAM_TEST_LAUNCHER=torchrun"
        )


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    """Process groups shared by the whole session, started on first use, one per world size."""
    registry = Pools()
    yield registry
    registry.close()


@pytest.fixture(params=_world_sizes(), ids=lambda n: f"world{n}")
def dist_pool(request: pytest.FixtureRequest, pools: Pools) -> RankPool:
    """A process group of 2 and of 4 ranks (tests using it run once per size)."""
    world_size: int = request.param
    return pools.get(world_size)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if {"dist_pool", "pools"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.distributed)


@pytest.fixture(autouse=True)
def _private_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Each test's default temporary folder is its own: spool files a test's sinks keep (the
    default spool_dir is tempfile.gettempdir()) never land in the machine's shared /tmp."""
    import tempfile

    previous = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tempdir"))
    yield
    tempfile.tempdir = previous
