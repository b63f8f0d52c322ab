"""A real multi-process training run that logs metrics through sidestream.

Run it as ``python examples/train_distributed.py`` (it starts its own gloo processes) or under
``torchrun --nproc-per-node N examples/train_distributed.py`` (NCCL when GPUs are visible).
Every rank trains a shard with DDP; every ``--log-every`` steps an ``AsyncMetricCollector``
reduces the window's metrics across ranks in the background and rank 0's sinks print them and
append them to a JSON-lines file. The training loop never waits for any of it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from sidestream import ComposeMetric, MaxMetric, MeanMetric, WeightedMeanMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import ConsoleSink, JsonlSink, RunInfo


def make_data(rank: int, samples: int, features: int, classes: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1234)
    true_weights = torch.randn(features, classes, generator=generator)
    generator.manual_seed(rank)
    inputs = torch.randn(samples, features, generator=generator)
    labels = (
        inputs @ true_weights + 0.5 * torch.randn(samples, classes, generator=generator)
    ).argmax(1)
    return inputs, labels


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device(
        f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    inputs, labels = (t.to(device) for t in make_data(rank, args.samples, 32, 10))

    metrics = ComposeMetric(
        {"loss": WeightedMeanMetric(), "accuracy": MeanMetric(), "max_loss": MaxMetric()}
    )
    out = Path(args.out)
    if rank == 0:
        out.unlink(missing_ok=True)  # a fresh log per demo run (the sink only appends)
    # Every rank builds the same collector; only rank 0 opens and writes the sinks.
    collector = AsyncMetricCollector(
        metrics,
        sinks=[JsonlSink(out), ConsoleSink()],
        prefix="train",
        run=RunInfo(name="demo", config=vars(args)),
    )
    started = time.monotonic()
    with collector.bind(device):
        for step in range(args.steps):
            index = torch.randint(0, args.samples, (args.batch_size,), device=device)
            logits = ddp(inputs[index])
            per_sample = nn.functional.cross_entropy(logits, labels[index], reduction="none")
            optimizer.zero_grad(set_to_none=True)
            per_sample.mean().backward()
            optimizer.step()

            # Device-side updates: no communication, no host sync.
            metrics["loss"].update(values=per_sample.detach(), weights=1)
            metrics["accuracy"].update((logits.argmax(1) == labels[index]).float())
            metrics["max_loss"].update(per_sample.detach())

            if (step + 1) % args.log_every == 0:
                # Stages the window, starts one coalesced reduction, returns at once.
                collector.schedule_collection(step + 1)
        final = collector.collect_results()  # blocking: the last window on this rank
    # Leaving the block closed the collector: every window reached the sinks.
    if rank == 0:
        print(
            f"{world_size} ranks, {args.steps} steps, {time.monotonic() - started:.1f} s; "
            f"last window {final}; log {out}"
        )


def _spawned(rank: int, world_size: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        train(rank, world_size, args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to start (without torchrun)"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--out", default="runs/demo/metrics.jsonl")
    args = parser.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    init_file = Path(f"/tmp/sidestream-demo-{os.getpid()}")
    try:
        mp.spawn(_spawned, args=(args.world_size, str(init_file), args), nprocs=args.world_size)
    finally:
        init_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
