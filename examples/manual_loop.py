"""The manual loop: one metric updated every step, then synced, computed and reset by hand.

No collector and no sinks: the four calls of the metric lifecycle, written out. A tiny
next-token model trains on padded sequences; each step's mean loss counts with the number of
real (non-padding) tokens in its batch, so the epoch's number is the token-weighted loss over
every rank's batches.

    python examples/manual_loop.py                                   # one process
    torchrun --standalone --nproc-per-node 2 examples/manual_loop.py  # 2 ranks (gloo on CPU)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group, for DDP: see train_distributed.py's main()
from torch import nn

from sidestream import WeightedMeanMetric

VOCAB = 32
PAD = -100  # label of a padding position: cross_entropy ignores it


def make_batches(
    rank: int, steps: int, batch_size: int, length: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard: ``steps`` batches of token ids and labels, padded to ``length``."""
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch_size, length), generator=generator)
        labels = (tokens * 7 + 3) % VOCAB  # a learnable next token
        lengths = torch.randint(1, length + 1, (batch_size, 1), generator=generator)
        labels[torch.arange(length).expand(batch_size, length) >= lengths] = PAD
        batches.append((tokens, labels))
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch on each rank")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument(
        "--record", type=Path, help="a directory: each rank appends its steps' (loss, tokens)"
    )
    args = parser.parse_args()

    distributed = "RANK" in os.environ  # launched by torchrun
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, VOCAB)).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = make_batches(rank, args.steps, args.batch_size, args.length)

    metric = WeightedMeanMetric()
    metric.to(device)
    for epoch in range(args.epochs):
        for tokens, labels in batches:
            tokens, labels = tokens.to(device), labels.to(device)
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            loss = loss.detach()
            num_tokens = (labels != PAD).sum()  # a device tensor: no host sync
            metric.update(values=loss, weights=num_tokens)  # no communication, no host sync
            if args.record is not None:  # the test's own copy of what went in (syncs: tests only)
                with (args.record / f"rank{rank}.jsonl").open("a") as record:
                    print(json.dumps([epoch, loss.item(), num_tokens.item()]), file=record)
        # one all_gather across ranks, current stream; the epoch in the call's fingerprint makes a
        # rank that skipped an epoch's sync fail there instead of pairing the next one.
        metric.sync(step=epoch)
        epoch_loss = metric.compute()  # sum(loss * tokens) / sum(tokens) over every rank's steps
        metric.reset()
        if rank == 0:
            print(f"epoch {epoch}: token-weighted loss {float(epoch_loss)!r}")

    if distributed:
        # Free DDP before its process group: freed later (at exit) it destroys the group from
        # a path that holds the GIL and can deadlock with gloo's worker threads.
        del model
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
