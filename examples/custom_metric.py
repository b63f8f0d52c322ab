"""Write your own metric: a Brier score that syncs across ranks like the built-in ones.

A metric declares its state as ``MetricAccumulator`` attributes and implements ``update`` and
``compute``; ``sync``, ``reset``, ``to``, ``state_dict`` and ``load_state_dict`` come with the
base class, and the sync of any number of such metrics is coalesced into a fixed handful of
collectives.

Run ``python examples/custom_metric.py`` (one process) or ``--world-size 2`` (two gloo ranks,
each with its own data); it prints the score over all ranks' data as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from sidestream import Metric, MetricAccumulator


class BrierScoreMetric(Metric[Tensor]):
    """Mean squared difference between predicted probabilities and 0/1 targets.

    State: the sum of squared errors (float64) and the number of samples (int64, exact), both
    summed across ranks by ``sync``.
    """

    def __init__(self) -> None:
        self._squared_error = MetricAccumulator(torch.zeros((), dtype=torch.float64))
        self._count = MetricAccumulator(torch.zeros((), dtype=torch.int64))

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Add a batch of probabilities and their 0/1 targets (same shape)."""
        if probs.shape != target.shape:
            # Shapes are metadata: checking them costs no device sync.
            raise ValueError(
                f"target: expected the shape of probs {tuple(probs.shape)}, "
                f"got {tuple(target.shape)}"
            )
        error = probs.double() - target.double()
        self._squared_error.accumulate((error * error).sum())
        count = torch.full((), target.numel(), dtype=torch.int64, device=probs.device)
        self._count.accumulate(count)

    def compute(self) -> Tensor:
        """The Brier score; NaN before any sample."""
        return self._squared_error.value / self._count.value


def make_data(rank: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Each rank's probabilities and targets drawn from them (reproducible per rank)."""
    rng = np.random.default_rng([7, rank])
    probs = rng.random(samples)
    target = (rng.random(samples) < probs).astype(np.int64)
    return probs, target


def score(rank: int, samples: int) -> float:
    """Feed this rank's data in batches, sync over all ranks, return the global score."""
    metric = BrierScoreMetric()
    probs, target = make_data(rank, samples)
    for start in range(0, samples, 100):
        metric.update(
            torch.from_numpy(probs[start : start + 100]),
            torch.from_numpy(target[start : start + 100]),
        )
    metric.sync()  # a no-op in one process
    return float(metric.compute())


def _rank(rank: int, world_size: int, init_file: str, samples: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        value = score(rank, samples)
        if rank == 0:
            print(json.dumps({"world_size": world_size, "brier": value}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--samples", type=int, default=1000, help="samples per rank")
    args = parser.parse_args()
    if args.world_size == 1:
        print(json.dumps({"world_size": 1, "brier": score(0, args.samples)}))
        return
    with tempfile.TemporaryDirectory() as directory:
        init_file = os.path.join(directory, "init")
        mp.spawn(_rank, args=(args.world_size, init_file, args.samples), nprocs=args.world_size)


if __name__ == "__main__":
    main()
