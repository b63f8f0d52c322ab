"""Confusion-count metrics on 2 and 4 gloo ranks against scikit-learn on all shards.

Shards are uneven, batches include an empty one, and the last rank has no data at all.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch.distributed as dist

from sidestream.testing import RankPool, on_rank_device
from tests.metrics.confusion_cases import (
    AGGREGATIONS,
    MATRIX_CASES,
    Case,
    assert_matches,
    assert_matrix_matches,
    binary_cases,
    make_shards,
    matrix_reference,
    multiclass_cases,
    reference,
    run_case,
    run_matrix_case,
    to_torch,
)

_MULTICLASS = [case for case in multiclass_cases() if case.aggregation == "macro"] + [
    Case("multiclass", 5, aggregation=aggregation, ignore=True)
    for aggregation in ("micro", "weighted", "per_class")
]
_MULTILABEL = [
    Case("multilabel", 4, aggregation=aggregation, ignore=ignore, extra_dims=dims)
    for aggregation, (ignore, dims) in itertools.product(AGGREGATIONS, [(False, ()), (True, (2,))])
]
CASES = binary_cases() + _MULTICLASS + _MULTILABEL
SEEDS = (11, 12)


@on_rank_device
def _on_rank(seed: int) -> dict[str, list[Any]]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counts = [run_case(case, make_shards(case, seed, world_size)[rank], True) for case in CASES]
    matrices = [
        run_matrix_case(case, make_shards(case, seed, world_size)[rank], True)
        for case in MATRIX_CASES
    ]
    # A checkpoint holds the global counts: restored on every rank and synced, it counts once.
    case = CASES[len(binary_cases())]
    metric = case.builder().build()
    for batch in make_shards(case, seed, world_size)[rank]:
        metric.update(*to_torch(case, batch))
    restored = case.builder().build()
    restored.load_state_dict(metric.state_dict())
    restored.sync()
    result = restored.compute()
    assert isinstance(result, dict)
    checkpoint = {name: value.tolist() for name, value in result.items()}
    return {"counts": counts, "matrices": matrices, "checkpoint": [checkpoint]}


def test_synced_values_match_sklearn_on_all_shards(dist_pool: RankPool) -> None:
    world_size = dist_pool.world_size
    for seed in SEEDS:
        per_rank = dist_pool.run(_on_rank, seed)
        for index, case in enumerate(CASES):
            everything = [b for shard in make_shards(case, seed, world_size) for b in shard]
            expected = reference(case, everything)
            for rank, result in enumerate(per_rank):
                assert_matches(result["counts"][index], expected, (case, seed, rank))
        for index, case in enumerate(MATRIX_CASES):
            everything = [b for shard in make_shards(case, seed, world_size) for b in shard]
            expected_matrix = matrix_reference(case, everything)
            for rank, result in enumerate(per_rank):
                assert_matrix_matches(result["matrices"][index], expected_matrix, (case, rank))
        case = CASES[len(binary_cases())]
        everything = [b for shard in make_shards(case, seed, world_size) for b in shard]
        for result in per_rank:
            assert_matches(result["checkpoint"][0], reference(case, everything), "checkpoint")
