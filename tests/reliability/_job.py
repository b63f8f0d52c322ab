"""A 2-rank training job for the process-fault runs: logs every step to JSONL, TensorBoard and
MLflow (SQLite), checkpoints every few steps, resumes from the last checkpoint.

Started by ``process_faults.py`` once per rank with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set, as torchrun would. Rank 0 appends its progress to ``progress.txt`` (``step N``
after each collected step, ``checkpoint N`` once the checkpoint file for step N is in place).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import sinks_from_config
from tests.integrations._workload import HISTOGRAM_EDGES, RUN_INFO, batch, make_metric


def sink_config(out: Path) -> dict[str, dict[str, object]]:
    return {
        "jsonl": {"path": str(out / "metrics.jsonl")},
        "tensorboard": {"log_dir": str(out / "tb"), "histogram_edges": HISTOGRAM_EDGES},
        "mlflow": {"tracking_uri": f"sqlite:///{out / 'mlflow.db'}", "experiment": "faults"},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    args = parser.parse_args()
    out: Path = args.out
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    metric = make_metric()
    collector = AsyncMetricCollector(
        metric,
        sinks=sinks_from_config(sink_config(out)),
        histograms=list(HISTOGRAM_EDGES),
        run=RUN_INFO,
        sink_retry_initial_s=0.05,
        sink_retry_max_s=0.5,
    )
    checkpoint = out / "checkpoint.pt"
    start = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        collector.load_state_dict(saved["collector"])
        start = saved["step"] + 1
    collector.bind("cpu")
    progress = (out / "progress.txt").open("a", buffering=1) if rank == 0 else None
    for step in range(start, args.steps):
        losses, labels, scores = batch(rank, step)
        metric["loss"].update(torch.from_numpy(losses))
        metric["per_class"].update(torch.from_numpy(labels))
        metric["scores"].update(torch.from_numpy(scores))
        collector.schedule_collection(step)
        if progress is not None:
            progress.write(f"step {step}\n")
        if (step + 1) % args.checkpoint_every == 0:
            state = {"collector": collector.state_dict(), "step": step}
            if rank == 0:
                partial = out / "checkpoint.pt.tmp"
                with partial.open("wb") as file:
                    torch.save(state, file)
                    file.flush()
                    os.fsync(file.fileno())
                partial.replace(checkpoint)
                assert progress is not None
                progress.write(f"checkpoint {step}\n")
        time.sleep(args.step_seconds)
    closed = collector.close(60)
    if progress is not None:
        progress.write(f"closed {closed}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
