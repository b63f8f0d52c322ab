"""CUDA: the collector's training-thread path never syncs with the host. Skipped without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from sidestream import ComposeMetric, MaxMetric, MeanMetric, WeightedMeanMetric
from sidestream._distributed import Group
from sidestream.collector import AsyncMetricCollector
from tests.collector.helpers import ClassFractions, RecordingSink, reference, window_data

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WARMUP, WINDOWS = 3, 20
# (phase, stream) pairs from every copy of the probe: the collector works on deep copies.
STREAMS: list[tuple[str, Any]] = []


class StreamProbe(MeanMetric):
    """A mean that records which CUDA stream its sync and compute ran on."""

    def sync(self, group: Group = None) -> None:
        STREAMS.append(("sync", torch.cuda.current_stream()))
        super().sync(group)

    def compute(self) -> Tensor:
        STREAMS.append(("compute", torch.cuda.current_stream()))
        return super().compute()


def _metric() -> ComposeMetric:
    return ComposeMetric(
        {
            "loss": WeightedMeanMetric(),
            "acc": MeanMetric(),
            "max_loss": MaxMetric(),
            "classes": ClassFractions(),
            "probe": StreamProbe(),
        }
    )


def _batches(device: str) -> list[list[dict[str, Tensor]]]:
    """Every window's two batches, already on ``device`` (copies to CUDA are host syncs)."""
    windows = []
    for window in range(WARMUP + WINDOWS):
        data = window_data(11, window, 0)
        half = len(data["values"]) // 2
        windows.append(
            [
                {key: torch.tensor(array[part], device=device) for key, array in data.items()}
                for part in (slice(0, half), slice(half, None))
            ]
        )
    return windows


def _feed(metric: ComposeMetric, batches: list[dict[str, Tensor]]) -> None:
    for batch in batches:
        metric["loss"].update(values=batch["values"], weights=batch["weights"])
        metric["acc"].update(batch["hits"])
        metric["max_loss"].update(batch["values"])
        metric["classes"].update(batch["labels"])
        metric["probe"].update(batch["values"])


def _run(device: str, debug_sync: bool) -> tuple[list[Any], AsyncMetricCollector[Any]]:
    metric = _metric()
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind(device)
    windows = _batches(device)
    for step, batches in enumerate(windows[:WARMUP], start=1):
        _feed(metric, batches)
        collector.schedule_collection(step)
    collector.collect_results()
    if debug_sync:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for step, batches in enumerate(windows[WARMUP:], start=WARMUP + 1):
            _feed(metric, batches)
            collector.schedule_collection(step)
    finally:
        if debug_sync:
            torch.cuda.set_sync_debug_mode(0)
    assert collector.close(timeout=60)
    return sink.reports, collector


def test_collection_every_step_has_no_host_sync_and_matches_cpu() -> None:
    STREAMS.clear()
    cuda_reports, collector = _run("cuda", debug_sync=True)
    side = collector.side_stream
    assert side is not None
    assert {phase for phase, _ in STREAMS} == {"sync", "compute"}
    assert all(stream == side for _, stream in STREAMS), "sync and compute ran on the side stream"
    # One reduction per window; compute also runs once per slot when it is made (pinned sizes).
    assert sum(phase == "sync" for phase, _ in STREAMS) == WARMUP + WINDOWS

    cpu_reports, _ = _run("cpu", debug_sync=False)
    assert [r.step for r in cuda_reports] == [r.step for r in cpu_reports]
    assert [r.step for r in cuda_reports] == list(range(1, WARMUP + WINDOWS + 1))
    for window, (on_gpu, on_cpu) in enumerate(zip(cuda_reports, cpu_reports, strict=True)):
        assert on_gpu.values.keys() == on_cpu.values.keys()
        for name, value in on_cpu.values.items():
            assert on_gpu.values[name] == pytest.approx(value, rel=1e-12, abs=1e-12), name
        expected = reference([window_data(11, window, 0)])
        for name, value in expected.items():
            assert on_gpu.values[name] == pytest.approx(value, rel=1e-9), name
