"""CUDA-only checks: updates never sync with the host. Skipped without a GPU."""

from __future__ import annotations

import os
import shutil

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
from sidestream.metrics.language import PerplexityMetric

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


def _five_metrics() -> ComposeMetric:
    return ComposeMetric(
        {
            "sum": SumMetric(),
            "mean": MeanMetric(),
            "weighted": WeightedMeanMetric(),
            "max": MaxMetric(),
            "min": MinMetric(),
        }
    ).to("cuda")


def _step(metrics: ComposeMetric, values: torch.Tensor, weights: torch.Tensor) -> None:
    for name in ("sum", "mean", "max", "min"):
        metrics[name].update(values)
    metrics["weighted"].update(values=values, weights=weights)


def test_updates_of_a_step_capture_in_a_cuda_graph() -> None:
    """The state arena's views are fixed, so one step's updates replay from a CUDA graph."""
    captured, eager = _five_metrics(), _five_metrics()
    values = torch.randn(1024, device="cuda")
    weights = torch.randint(0, 10, (1024,), device="cuda").float()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as CUDA graphs require
        _step(captured, values, weights)
        _step(eager, values, weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(captured, values, weights)
    generator = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            values.copy_(torch.randn(1024, device="cuda", generator=generator))
            graph.replay()
            _step(eager, values, weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name in ("sum", "mean", "weighted", "max", "min"):
        assert torch.allclose(captured[name].compute(), eager[name].compute()), name
    captured.reset()  # the arena's reset is a copy into the same buffers the graph writes
    graph.replay()
    assert torch.allclose(captured["max"].compute(), values.double().max())


# Inductor on CUDA builds Triton kernels, whose launcher needs a C compiler.
_NEEDS_A_C_COMPILER = pytest.mark.skipif(
    not any(shutil.which(cc) for cc in (os.environ.get("CC", "cc"), "gcc", "clang")),
    reason="inductor on CUDA needs a C compiler (none found)",
)


@_NEEDS_A_C_COMPILER
def test_compiled_updates_do_not_sync_with_host() -> None:
    metrics, eager = _five_metrics(), _five_metrics()
    values = torch.randn(1024, device="cuda")
    weights = torch.randint(0, 10, (1024,), device="cuda").float()
    step = torch.compile(_step, fullgraph=True)
    step(metrics, values, weights)  # compile outside sync-debug mode
    _step(eager, values, weights)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            step(metrics, values, weights)
            _step(eager, values, weights)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name in ("sum", "mean", "weighted", "max", "min"):
        assert torch.allclose(metrics[name].compute(), eager[name].compute()), name


@_NEEDS_A_C_COMPILER
def test_compiled_sums_drop_a_bad_batch_on_the_device() -> None:
    """Compiled, WeightedMean's and Perplexity's two sums stay two scalars (no stacked tensor):
    a bad batch is still dropped and counted on the device, with no host sync, and the good
    ones give eager's values."""
    weighted, eager_weighted = WeightedMeanMetric().to("cuda"), WeightedMeanMetric().to("cuda")
    perplexity, eager_perplexity = PerplexityMetric().to("cuda"), PerplexityMetric().to("cuda")
    generator = torch.Generator(device="cuda").manual_seed(3)
    values = torch.randn(256, device="cuda", generator=generator)
    weights = torch.rand(256, device="cuda", generator=generator)
    logits = torch.randn(4, 8, 50, device="cuda", generator=generator)
    target = torch.randint(0, 50, (4, 8), device="cuda", generator=generator)
    bad_weights = weights.clone()
    bad_weights[7] = -1.0
    bad_logits = logits.clone()
    bad_logits[1, 2, target[1, 2]] = float("nan")
    update_weighted = torch.compile(weighted.update, fullgraph=True)
    update_perplexity = torch.compile(perplexity.update, fullgraph=True)
    update_weighted(values, weights)  # compile outside sync-debug mode
    update_perplexity(logits, target)
    update_weighted(values, bad_weights)
    update_perplexity(bad_logits, target)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        update_weighted(values, weights)
        update_weighted(values, bad_weights)
        update_perplexity(logits, target)
        update_perplexity(bad_logits, target)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for _ in range(2):
        eager_weighted.update(values, weights)
        eager_perplexity.update(logits, target)
    assert int(weighted.rejected_updates) == 2 and int(perplexity.rejected_updates) == 2
    assert torch.allclose(weighted.compute(), eager_weighted.compute())
    assert torch.allclose(perplexity.compute(), eager_perplexity.compute())
    expected = (values.double() * weights.double()).sum() / weights.double().sum()
    assert torch.allclose(weighted.compute(), expected)
