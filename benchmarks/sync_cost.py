"""Cost of one sync of an 11-metric collection on 4 gloo ranks.

sidestream vs torchmetrics (the real classes in a ``MetricCollection``) vs a loop of one
``all_reduce`` per state tensor, in the same process group, on the same data, in the same run.
Collectives are counted with ``sidestream.testing.count_collectives``, which wraps the functions of
both ``torch.distributed`` and ``torch.distributed.distributed_c10d`` (where torchmetrics' and
the loop's collectives go), nested calls included, and the process-group methods through which
sidestream starts its own.

Both sides run their real classes on the same inputs; the values after the sync are compared
so the two collections are known to compute the same thing.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from benchmarks._bare import bare_all_gather
from benchmarks._goals import goal_line, machine_note
from sidestream import ComposeMetric, MaxMetric, MeanMetric, Metric, MinMetric, SumMetric
from sidestream import sync as sync_module
from sidestream.metrics.classification import confusion_count_metric
from sidestream.metrics.regression import MeanAbsoluteErrorMetric, MeanSquaredErrorMetric
from sidestream.testing import DistributedPool, count_collectives

WORLD_SIZE = 4
REPEATS = 20
PAIRED_REPEATS = 100  # sidestream and the bare all_gather, alternated
SCALING = (4, 256)
NUM_CLASSES = 10
SAMPLES = 4096


def sidestream_collection() -> ComposeMetric:
    """The 11 metrics with sidestream's own classes."""
    multiclass = confusion_count_metric().multiclass(NUM_CLASSES)
    binary = confusion_count_metric().binary(0.5)
    return ComposeMetric(
        {
            "mean": MeanMetric(),
            "sum": SumMetric(),
            "max": MaxMetric(),
            "acc_macro": multiclass.with_accuracy().macro().build(),
            "f1_macro": multiclass.with_f1().macro().build(),
            "precision_weighted": multiclass.with_precision().weighted().build(),
            "recall_micro": multiclass.with_recall().micro().build(),
            "binary_acc": binary.with_accuracy().build(),
            "binary_f1": binary.with_f1().build(),
            "mse": MeanSquaredErrorMetric(),
            "mae": MeanAbsoluteErrorMetric(),
        }
    )


def torchmetrics_collection(compute_groups: bool) -> Any:
    """The same 11 metrics with the real torchmetrics classes.

    With ``compute_groups`` the metrics that share state (multiclass accuracy/F1/precision, and
    binary accuracy/F1) are put in compute groups explicitly, as torchmetrics would find them.
    """
    import torchmetrics
    from torchmetrics import classification as tc
    from torchmetrics import regression as tr

    return torchmetrics.MetricCollection(
        {
            "mean": torchmetrics.MeanMetric(),
            "sum": torchmetrics.SumMetric(),
            "max": torchmetrics.MaxMetric(),
            "acc_macro": tc.MulticlassAccuracy(NUM_CLASSES, average="macro"),
            "f1_macro": tc.MulticlassF1Score(NUM_CLASSES, average="macro"),
            "precision_weighted": tc.MulticlassPrecision(NUM_CLASSES, average="weighted"),
            "recall_micro": tc.MulticlassRecall(NUM_CLASSES, average="micro"),
            "binary_acc": tc.BinaryAccuracy(),
            "binary_f1": tc.BinaryF1Score(),
            "mse": tr.MeanSquaredError(),
            "mae": tr.MeanAbsoluteError(),
        },
        compute_groups=(
            [["acc_macro", "f1_macro", "precision_weighted"], ["binary_acc", "binary_f1"]]
            if compute_groups
            else False
        ),
    )


def _batch(rank: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return {
        "values": torch.randn(SAMPLES, generator=generator),
        "logits": torch.randn(SAMPLES, NUM_CLASSES, generator=generator),
        "labels": torch.randint(0, NUM_CLASSES, (SAMPLES,), generator=generator),
        "probs": torch.rand(SAMPLES, generator=generator),
        "binary": torch.randint(0, 2, (SAMPLES,), generator=generator),
        "preds": torch.randn(SAMPLES, generator=generator),
        "target": torch.randn(SAMPLES, generator=generator),
    }


def _inputs(name: str, batch: dict[str, Tensor]) -> tuple[Tensor, ...]:
    if name in ("mean", "sum", "max"):
        return (batch["values"],)
    if name.startswith("binary"):
        return batch["probs"], batch["binary"]
    if name in ("mse", "mae"):
        return batch["preds"], batch["target"]
    return batch["logits"], batch["labels"]


def _time_sync(sync: Callable[[], None]) -> tuple[float, int]:
    """Median seconds per sync over ``REPEATS`` (barrier before each) and collectives per sync."""
    sync()  # warm-up; sidestream's first sync of a structure also checks it across ranks
    with count_collectives() as calls:
        sync()
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(calls)


def _time_alternated(
    first: Callable[[], None], second: Callable[[], None]
) -> tuple[tuple[float, int], tuple[float, int]]:
    """``_time_sync`` of two syncs, alternated call by call (``PAIRED_REPEATS`` each).

    Their ratio is the figure of interest: alternating puts both under the same load, where
    timing one after the other lets the machine's load drift between them.
    """
    counts = []
    for sync in (first, second):
        sync()
        with count_collectives() as calls:
            sync()
        counts.append(len(calls))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(PAIRED_REPEATS):
        for sync, out in zip((first, second), times, strict=True):
            dist.barrier()
            start = time.perf_counter()
            sync()
            out.append(time.perf_counter() - start)
    return (
        (statistics.median(times[0]), counts[0]),
        (statistics.median(times[1]), counts[1]),
    )


def _iterate(compose: ComposeMetric) -> Iterator[tuple[str, Metric[Any]]]:
    return compose.items()


def _measure() -> dict[str, Any]:
    rank = dist.get_rank()
    batch = _batch(rank)
    ours = sidestream_collection()
    for name, metric in _iterate(ours):
        metric.update(*_inputs(name, batch))
    theirs = {flag: torchmetrics_collection(flag) for flag in (False, True)}
    for collection in theirs.values():
        for name, metric in collection.items(keep_base=True, copy_state=False):
            metric.update(*_inputs(name, batch))

    def torchmetrics_sync(compute_groups: bool) -> Callable[[], None]:
        collection = theirs[compute_groups]
        if compute_groups:
            # One metric per compute group holds the shared state: sync only those. A floor:
            # MetricCollection.compute syncs every member all the same (90 collectives here).
            by_name = dict(collection.items(keep_base=True, copy_state=False))
            members = [by_name[group[0]] for group in collection.compute_groups.values()]
        else:
            members = list(collection.values(copy_state=False))

        def sync() -> None:
            for metric in members:
                metric.sync(should_sync=True, distributed_available=lambda: True)
            for metric in members:
                metric.unsync()

        return sync

    accumulators = [acc for _, acc in ours.named_accumulators()]
    ops = {"SUM": dist.ReduceOp.SUM, "MAX": dist.ReduceOp.MAX, "MIN": dist.ReduceOp.MIN}

    def loop_sync() -> None:
        for accumulator in accumulators:
            dist.all_reduce(accumulator.local.clone(), op=ops[accumulator.op.name])

    # The layout is chosen when a metric first lays out its sync: force the path on a copy.
    forced = sidestream_collection()
    for name, metric in _iterate(forced):
        metric.update(*_inputs(name, batch))
    previous = sync_module.GATHER_LIMIT_BYTES
    sync_module.GATHER_LIMIT_BYTES = 0
    try:
        forced.prepare_sync(None)
    finally:
        sync_module.GATHER_LIMIT_BYTES = previous

    # A bare all_gather of exactly the bytes one sync sends (its state and fingerprint).
    ours.prepare_sync(None)
    packed = (
        sum(s.local.numel() * s.local.element_size() for s in _arena_segments(ours))
        + sync_module.FINGERPRINT_BYTES
    )
    send = torch.zeros(packed, dtype=torch.uint8)
    gathered = torch.empty(packed * dist.get_world_size(), dtype=torch.uint8)

    def bare() -> None:
        work = bare_all_gather(gathered, send)
        assert work is not None
        work.wait()

    ours_timed, bare_timed = _time_alternated(ours.sync, bare)
    results = {
        "sidestream": ours_timed,
        "sidestream, all_reduce path forced": _time_sync(forced.sync),
        "torchmetrics, compute_groups=False": _time_sync(torchmetrics_sync(False)),
        "torchmetrics, one sync per compute group (a floor)": _time_sync(torchmetrics_sync(True)),
        "one all_reduce per state tensor": _time_sync(loop_sync),
        f"bare all_gather of the same {packed} bytes (floor)": bare_timed,
    }
    ours.sync()
    ours_values = {name: float(value) for name, value in ours.compute().items()}
    # The forced path reduces the same data into the same values (float64 sums added in
    # another order: the last bit may differ), or its row is no peer.
    forced_values = {name: float(value) for name, value in forced.compute().items()}
    assert all(
        math.isclose(forced_values[name], ours_values[name], rel_tol=1e-12, abs_tol=1e-15)
        for name in ours_values
    ), (forced_values, ours_values)
    theirs_values = {name: float(value) for name, value in theirs[False].compute().items()}
    difference = max(abs(ours_values[name] - theirs_values[name]) for name in ours_values)
    # float32 (torchmetrics) against float64 sums: anything more is not the same metric (a NaN
    # on one side only fails too: max() would skip it).
    assert all(
        math.isclose(ours_values[name], theirs_values[name], rel_tol=0, abs_tol=1e-4)
        for name in ours_values
    ), (ours_values, theirs_values)
    return {
        "results": results,
        "states": len(accumulators),
        "state_bytes": sum(a.local.numel() * a.local.element_size() for a in accumulators),
        "difference": difference,
    }


def _arena_segments(metric: Metric[Any]) -> list[Any]:
    arena = metric.__dict__["_state_arena"]
    return list(arena.segments)


def _aggregations(count: int) -> ComposeMetric:
    kinds = [SumMetric, MeanMetric, MaxMetric, MinMetric]
    return ComposeMetric({f"m{i}": kinds[i % len(kinds)]() for i in range(count)})


def _scaling() -> dict[int, float]:
    """Median seconds of ``sync()`` + ``compute()`` of compositions of 4 and 256 metrics."""
    out = {}
    for count in SCALING:
        metric = _aggregations(count)
        for _, child in metric.items():
            child.update(torch.rand(16))

        def step(m: ComposeMetric = metric) -> None:
            m.sync()
            m.compute()

        out[count] = _time_sync(step)[0]
    return out


def _measure_all() -> dict[str, Any]:
    return {**_measure(), "scaling": _scaling()}


def goals(over_bare: float, scaling: dict[int, float]) -> list[str]:
    """Issue 12's sync goals: one sync against the bare collective of its bytes (``over_bare``)
    and ``sync()`` + ``compute()`` seconds by metric count (``scaling``)."""
    small, large = SCALING
    growth = round(scaling[large] / scaling[small], 1)
    over_bare = round(over_bare, 2)
    return [
        goal_line(
            "one sync within 1.2x of one bare collective of the same bytes",
            f"{over_bare:.2f}x",
            over_bare <= 1.2,
        ),
        goal_line(
            f"sync + compute of {large} metrics within 3x of {small}",
            f"{growth:.1f}x",
            growth <= 3,
        ),
    ]


def run() -> str:
    with DistributedPool(WORLD_SIZE) as pool:
        measured = pool.run(_measure_all, timeout=900)[0]
    results: dict[str, tuple[float, int]] = measured["results"]
    ours_time, ours_count = results["sidestream"]
    lines = [
        f"## Sync of an 11-metric collection on {WORLD_SIZE} gloo ranks\n",
        "mean, sum, max; multiclass (10 classes) accuracy macro, F1 macro, precision weighted, "
        "recall micro; binary accuracy, binary F1; MSE; MAE. "
        f"{measured['states']} state tensors ({measured['state_bytes']} bytes) per rank. "
        f"Median of {REPEATS} syncs on rank 0, barrier before each; sidestream and the bare "
        f"all_gather are timed alternately, {PAIRED_REPEATS} each, so their ratio is taken "
        "under the same load. The bare all_gather is torch.distributed's public call (what "
        "hand-written code issues); sidestream starts its collective through the process "
        "group's own method, which skips that call's per-call checks. Collectives counted with "
        "`sidestream.testing.count_collectives` (both routes).\n",
        "Both sides use their real classes on the same inputs; after the sync their values "
        f"agree to within {measured['difference']:.1e}.\n",
        "torchmetrics runs the real classes in a `MetricCollection`. Its compute groups share "
        "state between members, so the *one sync per compute group* row syncs only the first "
        "metric of each group: a floor no torchmetrics call reaches, since "
        "`MetricCollection.compute` syncs every member with compute groups on or off.\n",
        "| implementation | collectives per sync | ms per sync | time / sidestream |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (seconds, count) in results.items():
        lines.append(f"| {name} | {count} | {seconds * 1e3:.2f} | {seconds / ours_time:.1f}x |")
    floor = next(seconds for name, (seconds, _) in results.items() if name.startswith("bare"))
    scaling: dict[int, float] = measured["scaling"]
    small, large = SCALING
    lines += [
        "",
        f"One sync takes {ours_time / floor:.2f}x the time of the bare all_gather of the same "
        "bytes in the same run. Machine: "
        f"{machine_note()}; 1-minute load average {os.getloadavg()[0]:.1f} after the "
        "run. Absolute times vary from run to run.\n",
        f"### Sync + compute against metric count ({WORLD_SIZE} gloo ranks)\n",
        "`ComposeMetric` of Sum, Mean, Max and Min metrics in turn; one `sync()` plus one "
        f"`compute()`, median of {REPEATS}. Both are one collective.\n",
        "| metrics | ms per sync + compute | / 4 metrics |",
        "| ---: | ---: | ---: |",
    ]
    for count in SCALING:
        lines.append(
            f"| {count} | {scaling[count] * 1e3:.2f} | {scaling[count] / scaling[small]:.1f}x |"
        )
    del large
    lines += [
        "",
        "Goals (issue 12), from the medians above as printed:",
        "",
        *goals(ours_time / floor, scaling),
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    assert ours_count > 0
    return section


if __name__ == "__main__":
    run()
