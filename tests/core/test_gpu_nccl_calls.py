"""CUDA: the c10d calls a window's collectives go through, issued on NCCL. Skipped without a GPU.

On one GPU every test group has one rank, and one rank syncs by a local copy, so the other
``gpu`` tests never issue ``all_gather_async`` / ``all_reduce_async`` on NCCL. This issues them
on a one-rank NCCL group (a valid communicator), on a side stream as the collector does, under
sync debug mode, in a fresh interpreter (the default process group stays out of the test
process).
"""

from __future__ import annotations

import pytest
import torch

from tests._scripts import run_python

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_SCRIPT = """
import os, sys, tempfile
import torch
import torch.distributed as dist
from sidestream._distributed import all_gather_async, all_reduce_async

device = torch.device("cuda", 0)
with tempfile.TemporaryDirectory() as folder:
    dist.init_process_group(
        "nccl", init_method="file://" + os.path.join(folder, "store"), rank=0, world_size=1,
        device_id=device,
    )
    try:
        send = torch.arange(16, dtype=torch.uint8, device=device)
        gathered = torch.empty(16, dtype=torch.uint8, device=device)
        sums = torch.arange(8, dtype=torch.float64, device=device)
        largest = torch.full((4,), 7, dtype=torch.int64, device=device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                works = [
                    all_gather_async(gathered, send, None),
                    all_reduce_async(sums, dist.ReduceOp.SUM, None),
                    all_reduce_async(largest, dist.ReduceOp.MAX, None),
                ]
                for work in works:
                    work.wait()  # the side stream waits, not the host
                done = torch.cuda.Event(blocking=True)
                done.record(side)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        done.synchronize()
        assert gathered.tolist() == list(range(16)), gathered
        assert sums.tolist() == [float(i) for i in range(8)], sums
        assert largest.tolist() == [7] * 4, largest
        print("ok")
    finally:
        dist.destroy_process_group()
"""


def test_window_collectives_run_on_nccl_from_a_side_stream_without_a_host_sync() -> None:
    done = run_python("-c", _SCRIPT, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok"), done.stdout + done.stderr
