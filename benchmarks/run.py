"""Run every benchmark and write docs/benchmarks.md, with plots of its tables (plots.PLOTS).

Each benchmark measures sidestream and its peers in the same run and reports ratios, so the
numbers compare like with like on whatever machine runs them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import (
    classification_update,
    collector_overhead,
    gpu_overhead,
    kernel_count,
    plots,
    ranking_memory,
    schedule_cost,
    sync_cost,
    torchmetrics_bridge,
    tracker_overhead,
    update_overhead,
)

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


BENCHMARKS = {
    "sync_cost": sync_cost.run,
    "torchmetrics_bridge": torchmetrics_bridge.run,
    "collector_overhead": collector_overhead.run,
    "schedule_cost": schedule_cost.run,
    "update_overhead": update_overhead.run,
    "kernel_count": kernel_count.run,
    "classification_update": classification_update.run,
    "ranking_memory": ranking_memory.run,
    "tracker_overhead": tracker_overhead.run,
    "gpu_overhead": gpu_overhead.run,
}
HEADER = (
    "# Benchmarks\n\n"
    "Written by `nox -s bench` (`python -m benchmarks.run`). Peers run in the same process "
    "group, on the same data, in the same run; ratios are peer / sidestream (the */ raw* "
    "columns: sidestream / raw). A machine without CUDA keeps the CUDA section a machine with "
    "one wrote, which names its commit.\n"
)


def _sections(text: str) -> list[str]:
    """The ``## `` sections of a benchmarks page, each with its heading."""
    parts = text.split("\n## ")
    return ["## " + part for part in parts[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated benchmarks to rerun (of: " + ", ".join(BENCHMARKS) + "); their "
        "sections replace the ones with the same heading in --out, the others are kept",
    )
    args = parser.parse_args()
    chosen = [name for name in args.only.split(",") if name] or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"--only: unknown benchmarks {unknown}")
    if args.only and not args.out.exists():
        parser.error(f"--only rewrites sections of an existing page; {args.out} does not exist")
    fresh = [BENCHMARKS[name]() for name in chosen]
    if args.out.exists() and gpu_overhead.NOT_MEASURED in fresh:
        # A machine without CUDA keeps the figures a CUDA machine wrote.
        heading = gpu_overhead.HEADING.strip()
        measured = [s for s in _sections(args.out.read_text()) if s.startswith(heading)]
        fresh = [
            measured[0] if section == gpu_overhead.NOT_MEASURED and measured else section
            for section in fresh
        ]
    if args.only and args.out.exists():
        kept = _sections(args.out.read_text())
        for section in fresh:
            for new in _sections("\n" + section):
                heading = new.splitlines()[0].split("(")[0].strip()
                match = [i for i, old in enumerate(kept) if old.startswith(heading)]
                if match:
                    kept[match[0]] = new.rstrip() + "\n"
                else:
                    kept.append(new.rstrip() + "\n")
        body = "\n".join(kept)
    else:
        body = "\n".join(fresh)
    # Each section's plot (figures/bench-*.svg next to the page) goes at the end of its section.
    args.out.write_text(plots.add_plots(HEADER + "\n" + body, args.out.parent))
    print(f"wrote {args.out} and its plots")


if __name__ == "__main__":
    main()
