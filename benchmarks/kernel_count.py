"""Kernels per update: the ops one eager update dispatches on the device path.

On CUDA each op of an eager update is a kernel launch, and launches are what a small update
costs the training thread (about 10 µs each on the H200 of "Host time on CUDA", a sandboxed
machine). The count is the same on every machine: it is taken on the meta device, which
dispatches the ops CUDA would run without running them, and sidestream takes its device path
there (value checks counted on the device, never read on the host). Views and Python numbers
wrapped as tensors launch nothing and are not counted. An implementation whose ops need values
(``bincount`` sizes its output by the largest index) is counted on the CPU instead, marked *.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks import update_overhead
from sidestream.testing import OpRecorder

SIZE = 64
NOT_LAUNCHED = frozenset(
    {
        "alias",
        "as_strided",
        "detach",
        "empty",
        "expand",
        "lift_fresh",
        "promote_types",
        "reshape",
        "scalar_tensor",
        "select",
        "slice",
        "squeeze",
        "t",
        "unbind",
        "unsqueeze",
        "view",
        "_unsafe_view",
    }
)
"""Ops that make a view or a host-side scalar: no kernel on CUDA."""


def kernels(update: Callable[[], object]) -> list[str]:
    """The ops of one call of ``update`` that launch a kernel on CUDA (after one warm-up call)."""
    update()
    with OpRecorder() as recorder:
        update()
    return [op for op in recorder.ops if op not in NOT_LAUNCHED]


def _count(on_meta: update_overhead.Case, on_cpu: update_overhead.Case, which: str) -> str:
    def call(case: update_overhead.Case) -> Callable[[], object]:
        if which == "ours":
            return lambda: case.ours(*case.args)
        return case.raw if which == "raw" else case.peer

    try:
        return str(len(kernels(call(on_meta))))
    except (NotImplementedError, RuntimeError):  # an op that needs values has no meta kernel
        return f"{len(kernels(call(on_cpu)))}*"


def run() -> str:
    """The markdown section (also printed)."""
    on_meta, on_cpu = update_overhead._cases(SIZE, "meta"), update_overhead._cases(SIZE)
    lines = [
        "## Kernels per update on the device path\n",
        "`benchmarks/kernel_count.py`: ops one eager `update` dispatches on the device path, "
        f"{SIZE} input elements, torch {torch.__version__}; on CUDA each is a kernel launch, "
        "the host cost of a small update. Counted on the meta device, which runs none of them "
        "(* counted on the CPU: an op needs values). *Raw ops* and torchmetrics as in the "
        "update-overhead table; sidestream's count includes its value checks, which on CUDA "
        "drop and count a bad batch on the device.\n",
        "| metric | raw ops | sidestream | torchmetrics |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, case in on_meta.items():
        if name.startswith(update_overhead.EXACT_ROW):
            continue  # a growing store: its count is the appends, not arithmetic
        counts = [_count(case, on_cpu[name], which) for which in ("raw", "ours", "peer")]
        lines.append(f"| {name} | " + " | ".join(counts) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    return text


if __name__ == "__main__":
    run()
