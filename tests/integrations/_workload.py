"""The training run the integration tests log: per-rank data, the loop, the references.

Every rank draws its batches from a generator seeded by (rank, step), so the parent process can
recompute each window directly with numpy on the concatenated data of all ranks.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import ComposeMetric, MeanMetric, Metric, MetricAccumulator
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import Report, RunInfo, TrackerSink, sinks_from_config

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


class _SinkWarnings(logging.Handler):
    """Keeps the sink pipeline's warnings (failure streaks, recoveries) of this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _signal(directory: str | None, name: str, wait: bool) -> None:
    """Tell the test process that rank 0 reached a point; optionally wait for its answer."""
    if directory is None:
        return
    (Path(directory) / name).touch()
    answer = Path(directory) / f"{name}.done"
    deadline = time.monotonic() + 120.0
    while wait and not answer.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test process never answered {name!r}")
        time.sleep(0.01)


def train(
    config: dict[str, Any],
    steps: range,
    state: dict[str, Any] | None = None,
    *,
    checkpoint_at: int | None = None,
    step_seconds: float = 0.0,
    signals: str | None = None,
    signal_steps: tuple[int, ...] = (),
    sink_capacity: int = 1024,
) -> dict[str, Any]:
    """One rank's training loop, logged through ``AsyncMetricCollector`` every step.

    Every rank builds the same sinks with ``sinks_from_config(config)`` and the same collector;
    only rank 0 opens them. Each step updates the metric with the rank's batch and calls
    ``schedule_collection(step)``; the time spent inside that call is recorded.

    Args:
        config: The ``sinks_from_config`` config.
        steps: The steps to run.
        state: A ``collector.state_dict()`` to resume from; it holds the first step's batch
            (the checkpoint was taken after that step's update), so that step is not updated
            again, only collected.
        checkpoint_at: After this step's update, take ``collector.state_dict()``, close and
            stop (the job dies before logging that step); the checkpoint is returned.
        step_seconds: Sleep per step (stands for the training work).
        signals: A directory for ``_signal`` files to the test process.
        signal_steps: After collecting these steps, rank 0 signals ``step_<n>`` and waits for
            the answer (the test process acts on the backend meanwhile).
        sink_capacity: Reports kept in memory per sink before spooling to disk.

    Returns:
        On every rank: the sinks' own ``state_dict`` and how many sink threads ran; the time per
        ``schedule_collection``; whether ``close`` finished in time; the checkpoint; on rank 0
        also what its sink runner saw (most reports spooled at once, reports delivered, the
        pipeline's warnings).
    """
    rank = dist.get_rank()
    warnings = _SinkWarnings()
    logging.getLogger("sidestream.sinks").addHandler(warnings)
    metric = make_metric()
    sinks = sinks_from_config(config)
    spool_dir = tempfile.mkdtemp(prefix="sidestream-it-spool-")
    collector = AsyncMetricCollector(
        metric,
        sinks=sinks,
        histograms=list(HISTOGRAM_EDGES),
        run=RUN_INFO,
        sink_capacity=sink_capacity,
        sink_retry_initial_s=0.05,
        sink_retry_max_s=0.5,
        # A directory of its own: the system temp dir may hold other jobs' spool files, which
        # the sinks would name in a warning this job's checks would count.
        spool_dir=spool_dir,
    )
    if state is not None:
        collector.load_state_dict(state)
    collector.bind("cpu")
    runners = collector.sink_runners
    schedule_seconds: list[float] = []
    most_spooled = 0
    checkpoint = None
    for step in steps:
        if state is None or step != steps.start:
            losses, labels, scores = batch(rank, step)
            metric["loss"].update(torch.from_numpy(losses))
            metric["per_class"].update(torch.from_numpy(labels))
            metric["scores"].update(torch.from_numpy(scores))
        if step == checkpoint_at:
            checkpoint = collector.state_dict()
            break
        started = time.perf_counter()
        collector.schedule_collection(step)
        schedule_seconds.append(time.perf_counter() - started)
        most_spooled = max([most_spooled, *(runner.spooled for runner in runners)])
        if rank == 0 and step in signal_steps:
            _signal(signals, f"step_{step}", wait=True)
        time.sleep(step_seconds)
    closed = collector.close(timeout=240.0)
    shutil.rmtree(spool_dir, ignore_errors=True)  # what close kept was counted above
    logging.getLogger("sidestream.sinks").removeHandler(warnings)
    return {
        "rank": rank,
        "sink_threads": len(runners),
        "sink_states": [sink.state_dict() for sink in sinks],
        "delivered": [runner.delivered for runner in runners],
        "most_spooled": most_spooled,
        "schedule_seconds": schedule_seconds,
        "closed": closed,
        "checkpoint": checkpoint,
        "sink_warnings": warnings.messages,
    }


def reports_named_like_streams(step: int) -> list[Report]:
    """One step's reports whose value names do not tell their streams: ``train`` from the
    ``train`` collector, ``train/grad_norm`` from ``Run.log``, and ``val@ema/loss`` (a name
    MLflow rewrites) at every third step."""
    reports = [Report(step=step, values={"lr": 0.1, "train/grad_norm": 1.0}, time=time.time())]
    if step % 2 == 0:
        reports.append(Report(step=step, values={"train": 2.0}, time=time.time(), stream="train"))
    if step % 3 == 0:
        values = {"val@ema/loss": 3.0}
        reports.append(Report(step=step, values=values, time=time.time(), stream="val@ema"))
    return reports


def resume_with_names_like_streams(first: TrackerSink, resumed: TrackerSink) -> dict[str, Any]:
    """``first`` delivers steps 1-7 of ``reports_named_like_streams`` (a checkpoint at 4);
    ``resumed`` loads that checkpoint and gets steps 5-10 again. The checkpoint is returned."""
    first.open(RunInfo(name="names"))
    for step in range(1, 8):
        first.write_batch(reports_named_like_streams(step))
        if step == 4:
            checkpoint = first.state_dict()
    assert first.close(timeout=30)
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo(name="names"))
    for step in range(5, 11):  # recomputed from the checkpoint
        resumed.write_batch(reports_named_like_streams(step))
    assert resumed.close(timeout=30)
    return checkpoint
