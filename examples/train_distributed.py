"""A real multi-process training run: train and validation streams and the learning rate in one Run.

Run it as ``python examples/train_distributed.py`` (it starts its own gloo processes) or under
``torchrun --standalone --nproc-per-node N examples/train_distributed.py`` (NCCL when GPUs are
visible).
Every rank trains a shard with DDP. One ``Run`` holds three streams: ``train`` (a collector
reduced every ``--log-every`` steps), ``val`` (a collector over a held-out shard, every
``--val-every`` steps) and the learning rate (``run.log``). Rank 0 writes them to the console,
to a JSON-lines file and, when ``sidestream-tensorboard`` is installed, to TensorBoard. The
training loop never waits for any of it. At the end rank 0 draws the curves with
``python -m sidestream show --plot`` and prints the image's path.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group: see the note in main()
import torch.multiprocessing as mp
from torch import nn

from sidestream import ComposeMetric, MaxMetric, MeanMetric, Run, WeightedMeanMetric
from sidestream.sinks import RunInfo, available_sinks, sinks_from_config

FEATURES, CLASSES = 32, 10


def make_data(rank: int, samples: int, split: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s shard of one split (0: train, 1: validation) of a noisy linear task."""
    generator = torch.Generator().manual_seed(1234)
    true_weights = torch.randn(FEATURES, CLASSES, generator=generator)
    generator.manual_seed(1000 * split + rank)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    noise = 0.5 * torch.randn(samples, CLASSES, generator=generator)
    return inputs, (inputs @ true_weights + noise).argmax(1)


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps, then cosine decay to 10% of ``peak``."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def sink_config(out: Path) -> dict[str, dict[str, str] | None]:
    """JSONL and console always; TensorBoard too when its integration is installed."""
    config: dict[str, dict[str, str] | None] = {"jsonl": {"path": str(out)}, "console": None}
    if "tensorboard" in available_sinks():
        config["tensorboard"] = {"log_dir": str(out.parent / "tensorboard")}
    return config


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    device = torch.device(
        f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: learning_rate(step, args.steps, args.lr) / args.lr
    )
    inputs, labels = (t.to(device) for t in make_data(rank, args.samples))
    val_inputs, val_labels = (t.to(device) for t in make_data(rank, args.samples // 4, split=1))

    out = Path(args.out)
    if rank == 0:
        # A fresh log per demo run: the sinks append to what they find (steps would repeat).
        out.unlink(missing_ok=True)
        shutil.rmtree(out.parent / "tensorboard", ignore_errors=True)
    # Every rank builds the same run and collectors; only rank 0 opens and writes the sinks.
    run = Run(sinks_from_config(sink_config(out)), info=RunInfo(name="demo", config=vars(args)))
    train_metrics = ComposeMetric(
        {"loss": WeightedMeanMetric(), "accuracy": MeanMetric(), "max_loss": MaxMetric()}
    )
    val_metrics = ComposeMetric({"loss": MeanMetric(), "accuracy": MeanMetric()})
    train_stream = run.collector(train_metrics, prefix="train").bind(device)
    val_stream = run.collector(val_metrics, prefix="val").bind(device)
    started = time.monotonic()
    with run:
        for step in range(1, args.steps + 1):
            index = torch.randint(0, args.samples, (args.batch_size,), device=device)
            logits = ddp(inputs[index])
            per_sample = nn.functional.cross_entropy(logits, labels[index], reduction="none")
            optimizer.zero_grad(set_to_none=True)
            per_sample.mean().backward()
            optimizer.step()

            # Device-side updates: no communication, no host sync.
            train_metrics["loss"].update(values=per_sample.detach(), weights=1)
            train_metrics["accuracy"].update((logits.argmax(1) == labels[index]).float())
            train_metrics["max_loss"].update(per_sample.detach())

            if step % args.log_every == 0:
                # Stages the window, starts one coalesced reduction, returns at once.
                train_stream.schedule_collection(step)
                run.log(step, {"lr": schedule.get_last_lr()[0]})  # no collective
            if step % args.val_every == 0:
                with torch.no_grad():
                    val_logits = ddp(val_inputs)
                    val_metrics["loss"].update(
                        nn.functional.cross_entropy(val_logits, val_labels, reduction="none")
                    )
                    val_metrics["accuracy"].update((val_logits.argmax(1) == val_labels).float())
                val_stream.schedule_collection(step)
            schedule.step()
        final = train_stream.collect_results()  # blocking: the last train window on this rank
    # Leaving the block closed the run: every window of every stream reached every sink.
    if rank == 0:
        print(
            f"{world_size} ranks, {args.steps} steps, {time.monotonic() - started:.1f} s; "
            f"last train window {final}; log {out}"
        )
        plot(out, Path(args.plot) if args.plot else out.with_name("curves.png"))


def plot(log: Path, image: Path) -> None:
    """Draw every stream's curves with ``python -m sidestream show --plot`` (needs matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"no plot: pip install matplotlib, then python -m sidestream show {log} --plot X.png")
        return
    command = [sys.executable, "-m", "sidestream", "show", str(log), "--plot", str(image)]
    subprocess.run(command, check=True)
    print(f"curves: {image}")


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
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument(
        "--world-size", type=int, default=2, help="ranks to start (without torchrun)"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--out", default="runs/demo/metrics.jsonl")
    parser.add_argument(
        "--plot", help="where to draw the curves (default: curves.png beside --out)"
    )
    args = parser.parse_args()
    # torch.distributed.nn (which DDP imports) takes the default group as a default argument
    # of its functions when first imported: imported after init_process_group, that group then
    # outlives destroy_process_group(), and gloo aborts the exit now and then ("terminate
    # called without an active exception"). Imported above, before any group, it holds none;
    # the DDP model, which holds the group while it lives, is gone once train() returns.
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    init_file = Path(tempfile.gettempdir()) / f"sidestream-demo-{os.getpid()}"
    try:
        mp.spawn(_spawned, args=(args.world_size, str(init_file), args), nprocs=args.world_size)
    finally:
        init_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
