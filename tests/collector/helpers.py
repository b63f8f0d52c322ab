"""Sinks with known behaviour, a per-class metric, and windowed data with numpy references."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sidestream import ComposeMetric, MaxMetric, MeanMetric, Metric, WeightedMeanMetric
from sidestream.sinks import Report, RunInfo, Sink
from sidestream.state import MetricAccumulator

NUM_CLASSES = 4


class RecordingSink(Sink):
    """Keeps what it was given; optionally sleeps per write or fails the first writes."""

    name = "recording"

    def __init__(self, delay_s: float = 0.0, failures: int = 0, name: str = "recording") -> None:
        self.name = name
        self.delay_s = delay_s
        self.failures_left = failures
        self.opened: list[RunInfo] = []
        self.steps: list[int] = []
        self.reports: list[Report] = []
        self.attempts = 0
        self.closed = False

    def open(self, run: RunInfo) -> None:
        self.opened.append(run)

    def write(self, report: Report) -> None:
        self.attempts += 1
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("tracker unreachable")
        time.sleep(self.delay_s)
        self.steps.append(report.step)
        self.reports.append(report)

    def close(self, timeout: float | None = None) -> bool:
        self.closed = True
        return True


class AlwaysFailingSink(RecordingSink):
    def __init__(self) -> None:
        super().__init__(name="broken")

    def write(self, report: Report) -> None:
        self.attempts += 1
        raise ConnectionError("tracker unreachable")


class ClassFractions(Metric[Tensor]):
    """Fraction of labels per class: a vector result (one name per class)."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        self._counts = MetricAccumulator(torch.zeros(num_classes, dtype=torch.float64))

    def update(self, labels: Tensor) -> None:
        self._counts.scatter_add(labels.long(), torch.ones_like(labels, dtype=torch.float64))

    def compute(self) -> Tensor:
        counts = self._counts.value
        return counts / counts.sum()


def make_metric() -> ComposeMetric:
    return ComposeMetric(
        {
            "loss": WeightedMeanMetric(),
            "acc": MeanMetric(),
            "max_loss": MaxMetric(),
            "classes": ClassFractions(),
        }
    )


def window_data(seed: int, window: int, rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, window, rank])
    size = int(rng.integers(5, 60))
    return {
        "values": rng.normal(loc=window, scale=2.0, size=size),
        "weights": rng.integers(1, 20, size=size).astype(np.float64),
        "hits": (rng.random(size) < 0.6).astype(np.float64),
        "labels": rng.integers(0, NUM_CLASSES, size=size),
    }


def feed(
    metric: ComposeMetric, data: dict[str, np.ndarray], device: torch.device | str = "cpu"
) -> None:
    """Two batches per window, so a window is more than one update."""
    half = len(data["values"]) // 2
    for part in (slice(0, half), slice(half, None)):
        values = torch.tensor(data["values"][part], device=device)
        weights = torch.tensor(data["weights"][part], device=device)
        metric["loss"].update(values=values, weights=weights)
        metric["acc"].update(torch.tensor(data["hits"][part], device=device))
        metric["max_loss"].update(values)
        metric["classes"].update(torch.tensor(data["labels"][part], device=device))


def reference(parts: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """The expected flat values from numpy on the concatenated data of all ranks."""
    data = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
    fractions = np.bincount(data["labels"], minlength=NUM_CLASSES) / len(data["labels"])
    flat = {
        "loss": float(np.average(data["values"], weights=data["weights"])),
        "acc": float(np.mean(data["hits"])),
        "max_loss": float(np.max(data["values"])),
    }
    flat.update({f"classes/class_{i}": float(f) for i, f in enumerate(fractions)})
    return flat


class CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class BatchingSink(RecordingSink):
    """Takes up to ``max_batch`` reports per call; records each call's steps, fails some."""

    max_batch = 5

    def __init__(self, failures: int = 0) -> None:
        super().__init__(failures=failures, name="batching")
        self.calls: list[list[int]] = []

    def write(self, report: Report) -> None:
        self.write_batch([report])

    def write_batch(self, reports: Sequence[Report]) -> None:
        self.calls.append([report.step for report in reports])
        if self.failures_left:
            self.failures_left -= 1
            raise ConnectionError("tracker unreachable")
        self.steps.extend(report.step for report in reports)


class NeverCompletedCopy:
    """Stands in for a CUDA copy's event that never completes (a GPU far behind)."""

    def query(self) -> bool:
        return False
