"""An exact ranking metric's sync: every rank's rows, exactly, with no copies kept behind.

The rows are gathered into one tensor; before, a list of parts, a padded copy and their
concatenation stayed allocated after the sync (the last collectives' works keep their tensors,
see ``retain_work``): 45 bytes per local sample at 2 ranks for 18 bytes of gathered rows.
References: scikit-learn on the concatenated data of both ranks.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
from sklearn.metrics import roc_auc_score

from sidestream.metrics.classification import BinaryAUROCMetric
from sidestream.testing import RankPool

pytestmark = pytest.mark.distributed


def _data(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    preds = (torch.rand(rows, generator=generator) * 50).round() / 50  # ties across ranks
    return preds, torch.randint(0, 2, (rows,), generator=generator)


def _synced_auroc(rows: list[int]) -> float:
    metric = BinaryAUROCMetric(exact=True)
    preds, target = _data(dist.get_rank(), rows[dist.get_rank()])
    metric.update(preds, target)
    metric.sync()
    return metric.compute().item()


@pytest.mark.parametrize("rows", [[40, 40], [41, 17], [0, 23], [23, 0]])
def test_synced_exact_auroc_is_sklearns_on_both_ranks_rows(pools: object, rows: list[int]) -> None:
    pool: RankPool = pools.get(2)  # type: ignore[attr-defined]
    parts = [_data(rank, count) for rank, count in enumerate(rows)]
    preds = torch.cat([p for p, _ in parts])
    target = torch.cat([t for _, t in parts])
    expected = roc_auc_score(target.numpy(), preds.numpy())
    for value in pool.run(_synced_auroc, rows):
        assert value == pytest.approx(expected, abs=1e-12)


def _kept_after_sync(rows: int, uneven: bool) -> float:
    def resident() -> int:
        with open("/proc/self/status") as file:
            line = next(line for line in file if line.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    rank = dist.get_rank()
    count = rows - (rank if uneven else 0)
    metric = BinaryAUROCMetric(exact=True)
    generator = torch.Generator().manual_seed(rank)
    metric.update(torch.rand(count, generator=generator), torch.randint(0, 2, (count,)))
    metric.compute()  # the local rows become the store's own (float64 and int8) first
    gc.collect()
    before = resident()
    metric.sync()
    gc.collect()
    return (resident() - before) / rows


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's VmRSS")
@pytest.mark.parametrize("uneven", [False, True])
def test_an_exact_sync_keeps_only_the_gathered_rows(pools: object, uneven: bool) -> None:
    # 2**21 samples per rank: 9 bytes each (float64 score, int8 label), 18 per local sample
    # gathered over 2 ranks.
    pool: RankPool = pools.get(2)  # type: ignore[attr-defined]
    for kept in pool.run(_kept_after_sync, 2**21, uneven):
        assert kept < 24, f"the sync kept {kept:.1f} bytes per local sample (18 gathered)"
