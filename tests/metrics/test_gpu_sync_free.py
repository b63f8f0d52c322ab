"""CUDA only: every ranking, regression and language metric updates without a host sync.

Each metric gets a valid batch and a bad one under ``torch.cuda.set_sync_debug_mode("error")``;
the bad batch must be dropped on the device and counted, and the result must equal the CPU
metric fed the valid batch only. Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.metrics.device_cases import device_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_every_update_is_sync_free_and_drops_bad_batches() -> None:
    cases = device_cases()
    on_gpu = []
    for name, factory, ok, bad in cases:
        metric = factory().to("cuda")
        ok_cuda = {k: v.cuda() for k, v in ok.items()}
        bad_cuda = {k: v.cuda() for k, v in bad.items()}
        on_gpu.append((name, metric, ok_cuda, bad_cuda))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _, metric, ok_cuda, bad_cuda in on_gpu:
            metric.update(**ok_cuda)
            metric.update(**bad_cuda)
            metric.update(**ok_cuda)
        # A Python-number weight must not copy to the device either.
        on_gpu[-2][1].update(losses=on_gpu[-2][2]["losses"], weights=0.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for (name, factory, ok, _), (_, metric, _, _) in zip(cases, on_gpu, strict=True):
        reference = factory()
        reference.update(**ok)
        reference.update(**ok)
        assert metric.rejected_updates.item() == 1, name
        assert torch.allclose(
            metric.compute().cpu(), reference.compute(), rtol=1e-6, atol=1e-9, equal_nan=True
        ), name
