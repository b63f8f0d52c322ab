"""Run every benchmark and write docs/benchmarks.md, with a plot per section.

Each benchmark measures sidestream and its peers in the same run and reports ratios, so the
numbers compare like with like on whatever machine runs them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import (
    classification_update,
    collector_overhead,
    plots,
    ranking_memory,
    sync_cost,
    tracker_overhead,
)

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    sections = [
        sync_cost.run(),
        collector_overhead.run(),
        classification_update.run(),
        ranking_memory.run(),
        tracker_overhead.run(),
    ]
    header = (
        "# Benchmarks\n\n"
        "Written by `nox -s bench` (`python -m benchmarks.run`). Peers run in the same process "
        "group, "
        "on the same data, in the same run; ratios are peer / sidestream.\n"
    )
    # Each section's plot (figures/bench-*.svg next to the page) goes at the end of its section.
    args.out.write_text(plots.add_plots(header + "\n" + "\n".join(sections), args.out.parent))
    print(f"wrote {args.out} and its plots")


if __name__ == "__main__":
    main()
