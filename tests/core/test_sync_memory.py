"""The all_reduce path's staging and unstaging, in blocks: exact, and no whole-state temporaries.

An int64 count rides the float64 SUM buffer as two 32-bit halves; splitting it and joining it
back made temporaries of the whole state (a 10,000-class confusion matrix is 800 MB). The
references are direct reductions of every rank's data.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import Metric, ReduceOp
from sidestream import sync as sync_module
from sidestream.testing import RankPool

pytestmark = pytest.mark.distributed

KINDS = {
    "isum": (torch.int64, ReduceOp.SUM),
    "isum32": (torch.int32, ReduceOp.SUM),
    "imax": (torch.int64, ReduceOp.MAX),
    "imin": (torch.int64, ReduceOp.MIN),
    "fsum": (torch.float64, ReduceOp.SUM),
    "fmax": (torch.float32, ReduceOp.MAX),
    "fmin": (torch.float64, ReduceOp.MIN),
}


class States(Metric[dict[str, Tensor]]):
    def __init__(self, size: int) -> None:
        for name, (dtype, op) in KINDS.items():
            self.add_state(name, torch.zeros(size, dtype=dtype), op)

    def update(self, values: dict[str, Tensor]) -> None:
        for name, state in self.named_accumulators():
            state.load_local(values[name])

    def compute(self) -> dict[str, Tensor]:
        return {name: state.value for name, state in self.named_accumulators()}


def _values(rank: int, size: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(rank)
    big = torch.randint(-(2**61), 2**61, (size,), generator=generator)
    floats = torch.randn(size, generator=generator, dtype=torch.float64) * 1e3
    floats[rank::5] = math.nan
    floats[3] = -math.inf
    return {
        "isum": big,
        "isum32": torch.randint(-(2**30), 2**30, (size,), generator=generator, dtype=torch.int32),
        "imax": big.flip(0),
        "imin": big.roll(3),
        "fsum": floats.nan_to_num(0.0, 0.0, 0.0),
        "fmax": floats.float(),
        "fmin": floats.roll(1),
    }


def _sync_in_blocks(size: int) -> dict[str, list[float]]:
    sync_module.GATHER_LIMIT_BYTES, block = 0, getattr(sync_module, "_BLOCK", None)
    sync_module._BLOCK = 2  # type: ignore[attr-defined]  # blocks of 2: every cut, a remainder
    try:
        metric = States(size)
        metric.update(_values(dist.get_rank(), size))
        metric.sync()
        return {k: v.tolist() for k, v in metric.compute().items()}
    finally:
        sync_module.GATHER_LIMIT_BYTES = 1 << 20
        if block is not None:
            sync_module._BLOCK = block  # type: ignore[attr-defined]


def test_every_kind_of_state_syncs_exactly_in_blocks(pools: object) -> None:
    pool: RankPool = pools.get(2)  # type: ignore[attr-defined]
    size = 7
    results = pool.run(_sync_in_blocks, size)
    per_rank = [_values(rank, size) for rank in range(2)]
    for name, (_, op) in KINDS.items():
        rows = torch.stack([values[name] for values in per_rank])
        if op is ReduceOp.SUM:
            expected = rows.sum(0)
        elif rows.is_floating_point():  # NaN propagates, as amax does
            expected = rows.amax(0) if op is ReduceOp.MAX else rows.amin(0)
        else:
            expected = rows.max(0).values if op is ReduceOp.MAX else rows.min(0).values
        for result in results:
            assert torch.equal(torch.tensor(result[name], dtype=rows.dtype), expected) or (
                rows.is_floating_point()
                and torch.allclose(
                    torch.tensor(result[name], dtype=rows.dtype), expected, equal_nan=True
                )
            ), name


def _peak_extra_of_a_second_sync(size: int) -> float:
    sync_module.GATHER_LIMIT_BYTES = 0
    block = getattr(sync_module, "_BLOCK", None)
    sync_module._BLOCK = 2**16  # type: ignore[attr-defined]
    try:
        state = torch.arange(size, dtype=torch.int64) * (dist.get_rank() + 1)
        metric = Counts(size)
        metric.update(state)
        metric.sync()  # lays out the sync buffers: kept, not measured

        def status(field: str) -> int:
            with open("/proc/self/status") as file:
                line = next(line for line in file if line.startswith(field + ":"))
            return int(line.split()[1]) * 1024

        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        metric.sync()
        extra = status("VmHWM") - before
        assert torch.equal(metric.compute(), torch.arange(size, dtype=torch.int64) * 3)
        return extra / (size * 8)
    finally:
        sync_module.GATHER_LIMIT_BYTES = 1 << 20
        if block is not None:
            sync_module._BLOCK = block  # type: ignore[attr-defined]


class Counts(Metric[Tensor]):
    def __init__(self, size: int) -> None:
        self.add_state("counts", torch.zeros(size, dtype=torch.int64), ReduceOp.SUM)

    def update(self, values: Tensor) -> None:
        for _, state in self.named_accumulators():
            state.load_local(values)

    def compute(self) -> Tensor:
        return next(state for _, state in self.named_accumulators()).value


@pytest.mark.skipif(
    not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux's peak RSS"
)
def test_syncing_a_large_int64_state_makes_no_whole_state_temporaries(pools: object) -> None:
    # 32 MiB of int64 counts: its halves, shifts and sums were 3x that at once, every sync.
    pool: RankPool = pools.get(2)  # type: ignore[attr-defined]
    for ratio in pool.run(_peak_extra_of_a_second_sync, 2**22):
        assert ratio < 0.5, f"a sync peaked at {ratio:.2f}x the state's bytes"
