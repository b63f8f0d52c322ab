"""CUDA: ``Run.log`` of device tensors never syncs the host. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from sidestream import Run
from tests.collector.helpers import RecordingSink

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_log_of_cuda_tensors_has_no_host_sync_and_delivers_each_value() -> None:
    sink = RecordingSink()
    run = Run([sink])
    inputs = [torch.rand((), device="cuda", dtype=torch.float32) for _ in range(50)]
    expected = [2.0 * value.item() for value in inputs]  # read before sync debug mode is on
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, value in enumerate(inputs, start=1):
            doubled = value * 2  # made on the current stream just before the call
            # A fill, not torch.tensor(step, device="cuda"): that copies from pageable memory,
            # a host sync that sync debug mode reports.
            count = torch.full((), step, dtype=torch.int64, device="cuda")
            run.log(step, {"x": doubled, "int": count, "lr": 0.5})
            del doubled  # its memory may be reused at once: the copy must still read it right
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert run.close(timeout=60)
    assert [report.step for report in sink.reports] == list(range(1, 51))
    assert [report.values["x"] for report in sink.reports] == pytest.approx(expected, rel=1e-6)
    assert [report.values["int"] for report in sink.reports] == [float(s) for s in range(1, 51)]
    assert all(report.values["lr"] == 0.5 and report.stream == "" for report in sink.reports)
