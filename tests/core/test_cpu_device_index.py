"""A metric moved to, or bound on, CPU with an index (``"cpu:0"``).

Accelerate's ``accelerator.device`` is ``torch.device("cpu", 0)`` on a multi-process CPU job,
and torch keeps every CPU tensor on ``torch.device("cpu")`` whatever index was asked for: a
metric that kept ``cpu:0`` as its device refused every update as "a tensor on another device".
"""

from __future__ import annotations

import pytest
import torch

from sidestream import ComposeMetric, MaxMetric, MeanMetric
from sidestream.collector import AsyncMetricCollector

CPU_WITH_INDEX = ["cpu:0", torch.device("cpu", 0)]


@pytest.mark.parametrize("device", CPU_WITH_INDEX, ids=str)
def test_to_cpu_with_an_index_takes_cpu_tensors(device: str | torch.device) -> None:
    metric = ComposeMetric({"mean": MeanMetric(), "max": MaxMetric()})
    metric.to(device)
    assert metric.device == torch.device("cpu")
    values = torch.tensor([1.0, 2.0, 6.0], device=device)  # a CPU tensor: device("cpu")
    metric["mean"].update(values)
    metric["max"].update(values)
    result = metric.compute()
    assert result["mean"].item() == 3.0
    assert result["max"].item() == 6.0


@pytest.mark.parametrize("device", CPU_WITH_INDEX, ids=str)
def test_bind_on_cpu_with_an_index_reports_windows(device: str | torch.device) -> None:
    collector = AsyncMetricCollector(MeanMetric()).bind(device)
    try:
        assert collector.metric.device == torch.device("cpu")
        collector.metric.update(torch.tensor([1.0, 2.0]))
        collector.schedule_collection(1)
        assert collector.collect_results() == 1.5
        # to() the device it was bound on keeps the arena (a new one would fail the next window)
        collector.metric.to(device)
        collector.metric.update(torch.tensor([5.0]))
        collector.schedule_collection(2)
        assert collector.collect_results() == 5.0
    finally:
        assert collector.close()
