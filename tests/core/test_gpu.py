"""CUDA-only checks: updates never sync with the host. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from sidestream import (
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    MinMetric,
    SumMetric,
    WeightedMeanMetric,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_updates_do_not_sync_with_host() -> None:
    metrics = ComposeMetric(
        {
            "sum": SumMetric(),
            "mean": MeanMetric(),
            "weighted": WeightedMeanMetric(),
            "max": MaxMetric(),
            "min": MinMetric(),
        }
    ).to("cuda")
    values = torch.randn(1024, device="cuda")
    weights = torch.randint(0, 10, (1024,), device="cuda")
    bad_weights = -torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            for name in ("sum", "mean", "max", "min"):
                metrics[name].update(values)
            metrics["weighted"].update(values=values, weights=weights)
            metrics["weighted"].update(values=values, weights=bad_weights)  # dropped, counted
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.allclose(metrics["sum"].compute(), values.double().sum() * 10)
    expected = (values.double() * weights.double()).sum() / weights.double().sum()
    assert torch.allclose(metrics["weighted"].compute(), expected)
    assert metrics["weighted"].rejected_updates.item() == 10  # type: ignore[attr-defined]
    assert torch.allclose(metrics["mean"].compute(), values.double().mean())


def test_python_number_inputs_do_not_sync() -> None:
    metric = WeightedMeanMetric().to("cuda")
    values = torch.randn(64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        metric.update(values=values)  # default weights=1.0, a Python number
        metric.update(values=values, weights=3)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.allclose(metric.compute(), values.double().mean())
