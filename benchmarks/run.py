"""Run every benchmark and write docs/benchmarks.md.

Each benchmark measures sidestream and its peers in the same run and reports ratios, so the
numbers compare like with like on whatever machine runs them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import (
    classification_update,
    collector_overhead,
    ranking_memory,
    sync_cost,
    torchmetrics_bridge,
    tracker_overhead,
)

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    sections = [
        sync_cost.run(),
        torchmetrics_bridge.run(),
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
    args.out.write_text(header + "\n" + "\n".join(sections))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
