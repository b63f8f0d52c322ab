"""The training run the integration tests log: per-rank data, metrics, reports, references.

Every rank draws its batches from a generator seeded by (rank, step), so the parent process can
recompute each window directly with numpy on the concatenated data of all ranks.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import ComposeMetric, MeanMetric, Metric, MetricAccumulator
from sidestream.sinks import Report, RunInfo, Sink
from tests.integrations._driver import RetryingDriver

NUM_CLASSES = 4
NUM_BINS = 8
WORLD_SIZE = 2
RUN_INFO = RunInfo(
    name="integration",
    config={"optimizer": {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.95]}, "epochs": 3},
    tags={"suite": "integration"},
)
HISTOGRAM_EDGES = {"scores": [i / NUM_BINS for i in range(NUM_BINS + 1)]}


class ClassCountMetric(Metric[Tensor]):
    """How often each class occurs: a (C,) sum of one-hot rows."""

    def __init__(self, num_classes: int) -> None:
        self._num_classes = num_classes
        self._counts = MetricAccumulator(torch.zeros(num_classes, dtype=torch.float64))

    def update(self, labels: Tensor) -> None:
        ones = torch.ones(labels.numel(), dtype=torch.float64, device=labels.device)
        counts = torch.zeros(self._num_classes, dtype=torch.float64, device=labels.device)
        self._counts.accumulate(counts.index_add_(0, labels.reshape(-1), ones))

    def compute(self) -> Tensor:
        return self._counts.value.clone()


class BinCountMetric(Metric[Tensor]):
    """Counts of values in ``num_bins`` equal bins over [0, 1) (a histogram)."""

    def __init__(self, num_bins: int) -> None:
        self._num_bins = num_bins
        self._counts = MetricAccumulator(torch.zeros(num_bins, dtype=torch.float64))

    def update(self, values: Tensor) -> None:
        index = (values.double() * self._num_bins).floor().long().clamp(0, self._num_bins - 1)
        ones = torch.ones(index.numel(), dtype=torch.float64, device=values.device)
        counts = torch.zeros(self._num_bins, dtype=torch.float64, device=values.device)
        self._counts.accumulate(counts.index_add_(0, index.reshape(-1), ones))

    def compute(self) -> Tensor:
        return self._counts.value.clone()


def batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(losses, labels, scores) of one rank at one step; sizes vary by rank and step."""
    rng = np.random.default_rng([2024, rank, step])
    size = 3 + (rank * 7 + step) % 6
    losses = rng.gamma(2.0, 0.5, size)
    labels = rng.integers(0, NUM_CLASSES, size)
    scores = rng.random(size)
    return losses, labels, scores


def expected(step: int, world_size: int = WORLD_SIZE) -> tuple[dict[str, float], np.ndarray]:
    """The window of ``step`` computed directly on all ranks' data: values and score counts."""
    parts = [batch(rank, step) for rank in range(world_size)]
    losses = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    scores = np.concatenate([p[2] for p in parts])
    values = {"loss": float(losses.mean())}
    counts = np.bincount(labels, minlength=NUM_CLASSES)
    values.update({f"per_class/class_{i}": float(counts[i]) for i in range(NUM_CLASSES)})
    histogram, _ = np.histogram(scores, bins=NUM_BINS, range=(0.0, 1.0))
    return values, histogram.astype(np.float64)


def make_metric() -> ComposeMetric:
    return ComposeMetric(
        {
            "loss": MeanMetric(),
            "per_class": ClassCountMetric(NUM_CLASSES),
            "scores": BinCountMetric(NUM_BINS),
        }
    )


def report_from(step: int, computed: dict[str, Tensor], histograms: bool = True) -> Report:
    """What the collector hands to sinks: flat Python floats, per-class names, CPU histograms."""
    values = {"loss": float(computed["loss"])}
    per_class = computed["per_class"].tolist()
    values.update({f"per_class/class_{i}": float(v) for i, v in enumerate(per_class)})
    hists = {"scores": computed["scores"].cpu()} if histograms else {}
    return Report(step=step, values=values, time=time.time(), histograms=hists)


def build_sink(spec: tuple[str, str, dict[str, Any]]) -> Sink:
    module, name, kwargs = spec
    sink: Sink = getattr(importlib.import_module(module), name)(**kwargs)
    return sink


def train(
    spec: tuple[str, str, dict[str, Any]],
    steps: range,
    state: dict[str, Any] | None = None,
    histograms: bool = True,
) -> dict[str, Any] | None:
    """One rank's loop: update, sync each window; rank 0 alone opens the sink and writes.

    Returns rank 0's sink state and run details; other ranks return whether they made a sink.
    """
    rank = dist.get_rank()
    metric = make_metric()
    sink = driver = None
    if rank == 0:
        sink = build_sink(spec)
        if state is not None:
            sink.load_state_dict(state)
        sink.open(RUN_INFO)
        driver = RetryingDriver(sink)
    for step in steps:
        losses, labels, scores = batch(rank, step)
        metric["loss"].update(torch.from_numpy(losses))
        metric["per_class"].update(torch.from_numpy(labels))
        metric["scores"].update(torch.from_numpy(scores))
        metric.sync()
        computed = metric.compute()
        metric.reset()
        if driver is not None:
            driver.submit(report_from(step, computed, histograms))
    if sink is None or driver is None:
        return {"rank": rank, "opened_sink": False}
    driver.stop()
    result = {
        "rank": rank,
        "opened_sink": True,
        "state": sink.state_dict(),
        "delivered": driver.delivered,
        "failures": driver.failures,
        "max_submit_s": max(driver.submit_seconds, default=0.0),
        "run_dir": getattr(sink, "run_dir", None),
        "closed": None,
    }
    result["closed"] = sink.close(timeout=60.0)
    return result
