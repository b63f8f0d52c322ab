"""After a sync, any update (an empty batch too) makes every built-in metric compute locally.

The reference is a second metric fed only this rank's batch, never synced.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sidestream.testing import RankPool
from tests.metrics.test_compiled_updates import CASES


def _empty(argument: Any) -> Any:
    return argument[:0] if isinstance(argument, torch.Tensor) else argument


def _local_after_an_empty_update() -> dict[str, str]:
    generator = torch.Generator().manual_seed(11 + dist.get_rank())  # other data per rank
    problems = {}
    for name, (factory, batch) in CASES.items():
        arguments = batch(generator)
        synced, local = factory(), factory()
        synced.update(*arguments)
        local.update(*arguments)
        synced.sync()
        synced.update(*(_empty(argument) for argument in arguments))
        ours, reference = synced.compute(), local.compute()
        if isinstance(reference, dict):
            same = all(
                torch.equal(ours[key].nan_to_num(-7.0), value.nan_to_num(-7.0))
                for key, value in reference.items()
            )
        else:
            same = torch.equal(ours.nan_to_num(-7.0), reference.nan_to_num(-7.0))
        if not same:
            problems[name] = f"{ours} after the empty update, local {reference}"
    return problems


def test_an_empty_update_after_a_sync_computes_locally(dist_pool: RankPool) -> None:
    # Max/Min, the ranking and calibration metrics and samplewise returned before touching
    # their freshness flag on an empty batch: those ranks kept reporting the global value
    # while a rank with data reported its own.
    for rank, problems in enumerate(dist_pool.run(_local_after_an_empty_update, timeout=120)):
        assert problems == {}, (rank, problems)
