"""CUDA: every confusion metric's update runs without a host sync and matches the CPU path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sidestream.metric import Metric
from tests.metrics.confusion_cases import (
    CASES,
    MATRIX_CASES,
    Case,
    make_shards,
    matrix_metrics,
    to_torch,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _metrics() -> list[tuple[Case, Metric[Any]]]:
    pairs: list[tuple[Case, Metric[Any]]] = [(case, case.builder().build()) for case in CASES]
    for case in MATRIX_CASES:
        pairs += [(case, metric) for metric in matrix_metrics(case).values()]
    return pairs


def _bad_batch(case: Case) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A batch with one out-of-range value, or ``None`` when the inputs cannot be invalid."""
    preds, target = to_torch(case, make_shards(case, 99, 1)[0][0])
    if target.dtype != torch.bool:
        target = target.clone()
        target.view(-1)[0] = 2 if case.target_dtype == "one_hot" else 99
        return preds, target
    if preds.is_floating_point() and not case.logits:
        preds = preds.clone()
        preds.view(-1)[0] = 1.5
        return preds, target
    return None


def test_updates_do_not_sync_with_host() -> None:
    pairs = _metrics()
    batches = {case: [b for s in make_shards(case, 5, 1) for b in s] for case, _ in pairs}
    gpu_inputs = {
        case: [tuple(t.cuda() for t in to_torch(case, b)) for b in batches[case]]
        for case in batches
    }
    bad_inputs = {}
    for case in batches:
        bad = _bad_batch(case)
        if bad is not None:
            bad_inputs[case] = (bad[0].cuda(), bad[1].cuda())
    gpu_metrics = [(case, type(m), m) for case, m in pairs]
    cpu_metrics = _metrics()
    for _, _, metric in gpu_metrics:
        metric.to("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for case, _, metric in gpu_metrics:
            for preds, target in gpu_inputs[case]:
                metric.update(preds, target)
            if case in bad_inputs:
                metric.update(*bad_inputs[case])  # dropped on the device and counted
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for (case, _, gpu_metric), (_, cpu_metric) in zip(gpu_metrics, cpu_metrics, strict=True):
        for batch in batches[case]:
            cpu_metric.update(*to_torch(case, batch))
        expected = cpu_metric.compute()
        actual = gpu_metric.compute()
        if isinstance(expected, dict):
            for name, value in expected.items():
                assert torch.allclose(actual[name].cpu(), value, equal_nan=True), (case, name)
        else:
            assert torch.allclose(actual.cpu(), expected, equal_nan=True), case
        if case in bad_inputs:
            assert gpu_metric.rejected_updates.item() == 1, case
