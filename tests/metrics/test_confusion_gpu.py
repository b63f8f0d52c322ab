"""CUDA: every confusion metric's update runs without a host sync and matches the CPU path."""

from __future__ import annotations

import pytest
import torch

from tests.metrics.confusion_cases import bad_batch, device_metrics, make_shards, to_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_updates_do_not_sync_with_host() -> None:
    pairs = device_metrics()
    batches = {case: [b for s in make_shards(case, 5, 1) for b in s] for case, _ in pairs}
    gpu_inputs = {
        case: [tuple(t.cuda() for t in to_torch(case, b)) for b in batches[case]]
        for case in batches
    }
    bad_inputs = {}
    for case in batches:
        bad = bad_batch(case)
        if bad is not None:
            bad_inputs[case] = (bad[0].cuda(), bad[1].cuda())
    gpu_metrics = [(case, type(m), m) for case, m in pairs]
    cpu_metrics = device_metrics()
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
