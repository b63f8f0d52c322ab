"""CUDA only: where the training thread's host time goes, for the next change to act on.

Not a benchmark table: a profile. For each update of the update-overhead benchmark (64
elements) it lists the CUDA runtime calls one eager update makes (kernel launches, copies,
events) for sidestream and the raw arithmetic, from ``torch.profiler``; then ``cProfile``'s
heaviest functions in ``schedule_collection`` of the sync benchmark's 11 and 44 metrics on one
NCCL rank, and the runtime calls of one such call. ``.ci/device-check`` runs it. Without CUDA
it says so and does nothing.
"""

from __future__ import annotations

import collections
import cProfile
import io
import itertools
import os
import pstats
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks import schedule_cost, update_overhead

WINDOWS = 200
WARMUP = 20


def runtime_calls(step: Callable[[], object]) -> tuple[int, dict[str, int], dict[str, int]]:
    """One call of ``step`` after a warm-up call: its GPU events, its CUDA runtime calls by
    name, and those calls by the outermost aten op that made them (which op launches what).

    ``step`` is called twice, so it must accept being called again (a collector's window
    needs a new step each time).
    """
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
        step()
        torch.cuda.synchronize()
    calls: collections.Counter[str] = collections.Counter()
    by_op: collections.Counter[str] = collections.Counter()
    gpu = 0
    for event in profiled.events():
        if event.device_type.name == "CUDA":
            gpu += 1
        elif event.name.startswith(("cuda", "nccl")) and event.name != "cudaDeviceSynchronize":
            calls[event.name] += 1
            by_op[_outermost_op(event)] += 1
    return gpu, dict(calls), dict(by_op)


def _outermost_op(event: object) -> str:
    """The name of the outermost ``aten::`` op above a profiler event (else its own name)."""
    name = getattr(event, "name", "?")
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith(("aten::", "c10d::", "nccl:")):
            name = parent.name
        parent = getattr(parent, "cpu_parent", None)
    return name


def _updates() -> None:
    for name, case in update_overhead._cases(64, "cuda").items():
        if not case.compiled:
            continue  # a growing store
        for label, step in (("raw", case.raw), ("sidestream", lambda c=case: c.ours(*c.args))):
            gpu, calls, by_op = runtime_calls(step)
            print(f"{name} | {label}: {gpu} GPU events; runtime calls {calls}", flush=True)
            print(f"    by op: {by_op}", flush=True)


def _schedule(copies: int) -> None:
    from sidestream.collector import AsyncMetricCollector

    metric = schedule_cost.collection(copies)
    parts = schedule_cost._parts(metric, copies)
    collector = AsyncMetricCollector(metric).bind("cuda")
    profiler = cProfile.Profile()
    step = 0
    for step in range(1, WARMUP + WINDOWS + 1):
        schedule_cost._update(parts, step, "cuda")
        if step > 1:
            collector.collect_results()
        if step > WARMUP:
            profiler.enable()
        collector.schedule_collection(step)
        if step > WARMUP:
            profiler.disable()
    later = itertools.count(step + 1)  # runtime_calls schedules twice, each a new window

    gpu, calls, by_op = runtime_calls(lambda: collector.schedule_collection(next(later)))
    print(f"schedule_collection, {11 * copies} metrics: {gpu} GPU events; runtime calls {calls}")
    print(f"    by op: {by_op}", flush=True)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)
    print(f"cProfile over {WINDOWS} windows, {11 * copies} metrics:\n{out.getvalue()}", flush=True)
    assert collector.close(timeout=120)


def run() -> None:
    if not torch.cuda.is_available():
        print("cuda_host_profile: no CUDA device; nothing profiled")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    _updates()
    with tempfile.TemporaryDirectory() as folder:
        store = f"file://{os.path.join(folder, 'store')}"
        dist.init_process_group("nccl", init_method=store, rank=0, world_size=1)
        try:
            for copies in (1, 4):
                _schedule(copies)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    run()
