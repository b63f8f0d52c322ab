"""torchmetrics metrics through the sidestream bridge vs plain torchmetrics: one sync.

The 11-metric collection of ``sync_cost`` as the real torchmetrics classes, once wrapped with
``sidestream_torchmetrics.wrap`` (one coalesced sync of every state) and once synced by
torchmetrics itself (``Metric.sync``, one gather per state), on 4 gloo ranks, on the same data,
in the same run. The values after the sync are compared so both are known to agree.

Run alone: ``python -m benchmarks.torchmetrics_bridge``.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from benchmarks.sync_cost import (
    REPEATS,
    WORLD_SIZE,
    _batch,
    _inputs,
    _time_sync,
    torchmetrics_collection,
)
from sidestream.testing import DistributedPool

__all__ = ["run"]


def _measure() -> dict[str, Any]:
    from sidestream_torchmetrics import wrap

    batch = _batch(dist.get_rank())
    bridged = wrap(torchmetrics_collection(compute_groups=False))
    for name, metric in bridged.items():
        metric.update(*_inputs(name, batch))
    plain = torchmetrics_collection(compute_groups=False)
    members = dict(plain.items(keep_base=True, copy_state=False))
    for name, metric in members.items():
        metric.update(*_inputs(name, batch))

    def plain_sync() -> None:
        for metric in members.values():
            metric.sync(should_sync=True, distributed_available=lambda: True)
        for metric in members.values():
            metric.unsync()

    results: dict[str, tuple[float, int]] = {
        "torchmetrics through sidestream_torchmetrics.wrap": _time_sync(bridged.sync),
        "plain torchmetrics (Metric.sync per metric)": _time_sync(plain_sync),
    }
    bridged.sync()
    ours = {name.split("/")[-1]: float(value) for name, value in bridged.compute().items()}
    theirs = {name: float(value) for name, value in plain.compute().items()}
    difference = max(abs(ours[name] - theirs[name]) for name in theirs)
    assert all(  # a NaN on one side only fails too: max() would skip it
        math.isclose(ours[name], theirs[name], rel_tol=0, abs_tol=1e-4) for name in theirs
    ), (ours, theirs)
    states = sum(1 for _ in bridged.named_accumulators())
    return {"results": results, "difference": difference, "states": states}


def run() -> str:
    """Measure on ``WORLD_SIZE`` gloo ranks and return a markdown section."""
    with DistributedPool(WORLD_SIZE) as pool:
        measured = pool.run(_measure, timeout=900)[0]
    results: dict[str, tuple[float, int]] = measured["results"]
    base = results["torchmetrics through sidestream_torchmetrics.wrap"][0]
    lines = [
        f"## torchmetrics through the bridge, 11 metrics on {WORLD_SIZE} gloo ranks\n",
        "The collection of the sync benchmark above as real torchmetrics classes "
        f"({measured['states']} state tensors), wrapped with `sidestream_torchmetrics.wrap` "
        "against torchmetrics' own `Metric.sync` of each metric. Median of "
        f"{REPEATS} syncs on rank 0, barrier before each. Values after the sync agree to "
        f"within {measured['difference']:.1e}.\n",
        "| implementation | collectives per sync | ms per sync | time / bridge |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, (seconds, count) in results.items():
        lines.append(f"| {name} | {count} | {seconds * 1e3:.2f} | {seconds / base:.1f}x |")
    section = "\n".join(lines) + "\n"
    print(section)
    return section


def main() -> None:
    """Entry point for ``python -m benchmarks.torchmetrics_bridge``."""
    run()


if __name__ == "__main__":
    main()
