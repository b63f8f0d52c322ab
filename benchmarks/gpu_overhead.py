"""CUDA only: host time per update (eager, compiled, CUDA graph) and per logged step.

The training thread's cost on a GPU is the host time it spends launching work, so every figure
here is host time, with no ``torch.cuda.synchronize`` inside a timed block (the device is
synchronized between blocks): eager and compiled updates of the update-overhead benchmark's
metrics (``update_overhead._cases`` on CUDA), and the same sidestream update captured once in a
CUDA graph and replayed. Each sidestream variant is then run under
``torch.cuda.set_sync_debug_mode("error")``; *sync-free* says whether it passed. The last table
is ``time.thread_time`` around ``schedule_collection`` of the sync benchmark's 11 metrics (and of
44: four of them) on one rank joined by NCCL.

Without CUDA the section says so and measures nothing.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks import schedule_cost, update_overhead

SIZES = (64, 1_000_000)
ROUNDS = 7
BLOCK = 20
WINDOWS = 200
WARMUP = 20
HEADING = "## Host time on CUDA: eager, compiled and CUDA-graph updates, and per logged step\n"
NOT_MEASURED = HEADING + "\nNot measured yet: no CUDA device on the machines that ran it.\n"


def _host_us(step: Callable[[], object]) -> float:
    """Best host µs per call over ``ROUNDS`` blocks, the device synchronized between blocks."""
    for _ in range(3):
        step()
    best = float("inf")
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(BLOCK):
            step()
        best = min(best, (time.perf_counter() - start) / BLOCK * 1e6)
    torch.cuda.synchronize()
    return best


def _host_us_interleaved(variants: dict[str, Callable[[], object]]) -> dict[str, float]:
    """``_host_us`` of each variant, their blocks interleaved (load drift hits each alike)."""
    for step in variants.values():
        for _ in range(3):
            step()
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(ROUNDS):
        for key, step in variants.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(BLOCK):
                step()
            best[key] = min(best[key], (time.perf_counter() - start) / BLOCK * 1e6)
    torch.cuda.synchronize()
    return best


def _commit() -> str:
    """The commit measured (``unknown`` where the copy has no git history)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _sync_free(step: Callable[[], object]) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return True


def _captured(step: Callable[[], object]) -> Callable[[], object] | str:
    """``step`` captured in a CUDA graph (its replay), or why it could not be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as error:
        return f"not captured: {str(error).splitlines()[0][:80]}"
    return graph.replay


def _replayed(graph: Callable[[], object]) -> Callable[[], None]:
    """One replay of ``graph``, finished (the peer's update and the check read its result)."""

    def replay() -> None:
        graph()
        torch.cuda.synchronize()

    return replay


def _update_rows(size: int, compiled: bool, wrong: list[str]) -> list[str]:
    """One row per metric; ``compiled`` adds inductor builds (seconds each, so small inputs
    only: the launch overhead compiling removes is what small inputs show). A graph replay
    that computed another value than one peer update is added to ``wrong``."""
    rows = []
    for name, case in update_overhead._cases(size, "cuda").items():
        if not case.compiled:
            continue  # the exact store grows: no fixed graph
        torch._dynamo.reset()
        ours = lambda c=case: c.ours(*c.args)  # noqa: E731
        variants: dict[str, Callable[[], object]] = {
            "raw": case.raw,
            "ours": ours,
            "torchmetrics": case.peer,
        }
        not_compiled = ""
        if compiled:
            raw_compiled = torch.compile(case.compiled["raw"], fullgraph=True)
            our_compiled = torch.compile(case.ours, fullgraph=True)
            try:  # build now: a machine without a C compiler still gets the other columns
                raw_compiled(*case.args)
                our_compiled(*case.args)
            except Exception as error:  # any build failure: report it in the row
                not_compiled = f"not compiled: {str(error).splitlines()[0][:60]}"
            else:
                variants["raw compiled"] = lambda f=raw_compiled, c=case: f(*c.args)
                variants["ours compiled"] = lambda f=our_compiled, c=case: f(*c.args)
        graph = _captured(ours)
        us = _host_us_interleaved(variants)
        # The same metric on both sides, as on the CPU: after the timing, and after one
        # update each from a fresh state (a lost update shows there).
        update_overhead._check_agreement(name, size, case)
        update_overhead._check_one_update(f"{name} (one update)", size, case, ours)
        free = [_sync_free(variants["ours"])]
        cells = f"| {not_compiled or '—'} | — | — |"
        if compiled and not not_compiled:
            free.append(_sync_free(variants["ours compiled"]))
            cells = (
                f"| {us['raw compiled']:.1f} | {us['ours compiled']:.1f} | "
                f"{us['ours compiled'] / us['raw compiled']:.2f}x |"
            )
        if callable(graph):
            us["graph"] = _host_us(graph)
            free.append(_sync_free(graph))
            # A replay is timed only as the update it stands for: one replay into the reset
            # state (the arena's buffers never move) must give what one peer update gives.
            # A wrong one is named in its row and fails the run at the end, after every row
            # (a device session is short: one wrong replay must not cost the other rows).
            try:
                update_overhead._check_one_update(
                    f"{name} (one graph replay)", size, case, _replayed(graph)
                )
            except AssertionError as error:
                wrong.append(str(error))
                replay = f"{us['graph']:.1f} (WRONG value)"
            else:
                replay = f"{us['graph']:.1f}"
        else:
            replay = graph
        rows.append(
            f"| {name} | {size:,} | {us['raw']:.1f} | {us['ours']:.1f} | "
            f"{us['ours'] / us['raw']:.2f}x | {us['torchmetrics']:.1f} {cells} {replay} | "
            f"{'yes' if all(free) else 'NO'} |"
        )
        print(rows[-1], flush=True)
    return rows


def _schedule_cost(copies: int) -> dict[str, float]:
    """``schedule_collection`` of ``copies`` x the sync benchmark's 11 metrics on one NCCL rank."""
    from sidestream.collector import AsyncMetricCollector

    metric = schedule_cost.collection(copies)
    parts = schedule_cost._parts(metric, copies)
    collector = AsyncMetricCollector(metric).bind("cuda")
    cpu, wall = [], []
    for step in range(1, WARMUP + WINDOWS + 1):
        schedule_cost._update(parts, step, "cuda")
        if step > 1:
            collector.collect_results()  # its compute would otherwise compete for the GIL
        begin_wall, begin_cpu = time.perf_counter(), time.thread_time()
        collector.schedule_collection(step)
        if step > WARMUP:
            cpu.append(time.thread_time() - begin_cpu)
            wall.append(time.perf_counter() - begin_wall)
    collector.collect_results()  # the dispatcher idle: the mode below is the process's
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        schedule_cost._update(parts, WARMUP + WINDOWS + 1, "cuda")
        collector.schedule_collection(WARMUP + WINDOWS + 1)
        free = 1.0
    except RuntimeError:
        free = 0.0
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert collector.close(timeout=120)
    return {
        "cpu_median_us": statistics.median(cpu) * 1e6,
        "wall_median_us": statistics.median(wall) * 1e6,
        "sync_free": free,
    }


def run() -> str:
    """The markdown section (printed too); without CUDA, ``NOT_MEASURED``."""
    if not torch.cuda.is_available():
        print(NOT_MEASURED)
        return NOT_MEASURED
    lines = [
        HEADING,
        f"`benchmarks/gpu_overhead.py`: {torch.cuda.get_device_name()}, torch "
        f"{torch.__version__}, commit {_commit()}. Host µs per call, best of {ROUNDS} "
        f"interleaved blocks of {BLOCK} (the device is synchronized between blocks, never "
        "inside one; each row checks that sidestream and torchmetrics computed the same "
        "value), so a figure is what the "
        "training thread spends launching the work; for large inputs it can include waiting "
        "for a full launch queue. *Raw* is the hand-written state arithmetic of "
        "`benchmarks/update_overhead.py`; *compiled* is `torch.compile(fullgraph=True)` "
        "(inductor; small inputs only, each build takes seconds); *graph replay* is sidestream's "
        "update captured once in a CUDA graph. "
        "*Sync-free*: the eager, compiled and graph updates ran under "
        '`set_sync_debug_mode("error")`.\n',
        "| metric | size | raw µs | sidestream µs | / raw | torchmetrics µs | raw compiled µs | "
        "sidestream compiled µs | / raw compiled | graph replay µs | sync-free |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    # The cheap figure first: a run cut short by its time limit still has it.
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(
            "nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1
        )
        try:
            costs = {11 * copies: _schedule_cost(copies) for copies in (1, 4)}
        finally:
            dist.destroy_process_group()
    print(f"schedule_collection: {costs}", flush=True)
    # Large inputs first (no compiling): a run cut short by its time limit has those rows.
    wrong: list[str] = []
    rows = {
        size: _update_rows(size, compiled=size == min(SIZES), wrong=wrong)
        for size in sorted(SIZES)[::-1]
    }
    for size in SIZES:
        lines += rows[size]
    lines += [
        "",
        "Training-thread CPU per logged step: `time.thread_time` around `schedule_collection` "
        "of the sync benchmark's 11 metrics, and of four of it in one `ComposeMetric` (44), on "
        f"one NCCL rank, median of {WINDOWS} windows; *sync-free*: one more window under "
        '`set_sync_debug_mode("error")`.\n',
        "| metrics | CPU µs (median) | wall µs (median) | CPU / 11 metrics' | sync-free |",
        "| ---: | ---: | ---: | ---: | --- |",
    ]
    for count, cost in costs.items():
        lines.append(
            f"| {count} | {cost['cpu_median_us']:.1f} | {cost['wall_median_us']:.1f} | "
            f"{cost['cpu_median_us'] / costs[11]['cpu_median_us']:.2f}x | "
            f"{'yes' if cost['sync_free'] else 'NO'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if wrong:
        raise AssertionError("graph replays computed other values:\n" + "\n".join(wrong))
    return text


if __name__ == "__main__":
    run()
