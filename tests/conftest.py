from __future__ import annotations

from collections.abc import Iterator

import pytest

from sidestream.testing import DistributedPool

_pools: dict[int, DistributedPool] = {}


@pytest.fixture(scope="session")
def pools() -> Iterator[dict[int, DistributedPool]]:
    """Process groups shared by the whole session, started on first use, one per world size."""
    yield _pools
    for pool in _pools.values():
        pool.close()


@pytest.fixture(params=[2, 4], ids=lambda n: f"world{n}")
def dist_pool(request: pytest.FixtureRequest, pools: dict[int, DistributedPool]) -> DistributedPool:
    """A gloo process group of 2 and of 4 ranks (tests using it run once per size)."""
    world_size: int = request.param
    if world_size not in pools:
        pools[world_size] = DistributedPool(world_size)
    return pools[world_size]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "dist_pool" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.distributed)
