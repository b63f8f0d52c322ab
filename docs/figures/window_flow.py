"""Draw docs/figures/window_flow.svg: the data flow of one logging window.

Run ``python docs/figures/window_flow.py`` after changing the collector's phases; the SVG is
committed so the site builds without matplotlib. Four lanes, time running down: what the
training thread queues, what the side CUDA stream runs, what the dispatcher thread does and
what each sink thread does.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).with_suffix(".svg")
UNIT = 0.85  # inches per plot unit, both ways

LANES = [
    ("training thread", "current CUDA stream, every rank"),
    ("side CUDA stream", "queued by the training thread"),
    ("dispatcher thread", "every rank; only waits"),
    ("sink threads", "rank 0, one per sink"),
]
COLORS = ["#dbe9f6", "#fde6c8", "#dff0d8", "#eadcf2"]
EDGES = ["#3b6ea5", "#c77c1e", "#4a8a3c", "#7d4f9e"]
LANE_W, GAP, TOP = 2.9, 0.4, 0.0

# Each lane's boxes from the top down: (name, text). A lane starts at its y (time runs down);
# box heights follow their line count.
LANE_BOXES: list[tuple[float, list[tuple[str, str]]]] = [
    (
        TOP,
        [
            (
                "update",
                "update() x N\nadds to the live state on\nthe device; no collective,\nno host sync",
            ),
            ("take", "schedule_collection(step)\ntakes a free slot"),
            (
                "stage",
                "stage: live state -> slot\n(one batched copy);\n"
                "reset the live state;\nrecord event staged",
            ),
            ("issue", "issue the coalesced\ncollective; queue the\nwindow; return"),
            ("next", "update() x N\nthe next window,\nwithout waiting"),
        ],
    ),
    (
        TOP - 2.75,
        [
            ("wait_staged", "wait_event(staged)"),
            ("reduce", "all_gather / all_reduce\ninto the slot's buffer"),
            ("compute", "compute() on the slot"),
            ("copy", "results -> pinned host\nbuffers (non_blocking);\nrecord event done"),
        ],
    ),
    (
        TOP - 6.0,
        [
            (
                "wait_done",
                "wait for done\n(GIL released; on CPU:\nthe collective's handle,\nthen compute())",
            ),
            ("numbers", "one tolist() per leaf"),
            ("release", "give the slot back"),
            ("report", "Report(step, values);\nrank 0: onto each\nsink's bounded queue"),
        ],
    ),
    (
        TOP - 9.55,
        [
            (
                "queue",
                "take a batch;\nwrite_batch, flush;\nretry with backoff,\nspool what can't wait",
            ),
            ("backend", "W&B, MLflow,\nTensorBoard, JSONL,\nconsole"),
        ],
    ),
]
LINE, PAD, STACK_GAP = 0.24, 0.22, 0.3


def _layout() -> dict[str, tuple[int, float, float, str]]:
    """Each box's (lane, top y, height, text)."""
    boxes = {}
    for lane, (top, entries) in enumerate(LANE_BOXES):
        for name, text in entries:
            height = PAD + LINE * (text.count("\n") + 1)
            boxes[name] = (lane, top, height, text)
            top -= height + STACK_GAP
    return boxes


BOXES = _layout()
BOTTOM = min(top - height for _, top, height, _ in BOXES.values()) - 0.9
# (from, to, label): crossing a lane is an event or a queue, never a wait on the training thread.
ARROWS = [
    ("update", "take", ""),
    ("take", "stage", ""),
    ("stage", "issue", ""),
    ("issue", "next", ""),
    ("stage", "wait_staged", "staged"),
    ("wait_staged", "reduce", ""),
    ("reduce", "compute", ""),
    ("compute", "copy", ""),
    ("copy", "wait_done", "done"),
    ("wait_done", "numbers", ""),
    ("numbers", "release", ""),
    ("release", "report", ""),
    ("report", "queue", "Report"),
    ("queue", "backend", ""),
]


def _lane_x(lane: int) -> float:
    return lane * (LANE_W + GAP)


def _anchor(name: str, side: str) -> tuple[float, float]:
    lane, top, height, _ = BOXES[name]
    x = _lane_x(lane)
    if side == "bottom":
        return x + LANE_W / 2, top - height
    if side == "top":
        return x + LANE_W / 2, top
    if side == "right":
        return x + LANE_W - 0.15, top - height / 2
    return x + 0.15, top - height / 2


def main() -> None:
    """Draw the lanes, their boxes and the hand-offs, and write the SVG."""
    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "sidestream", "font.size": 10})
    width = 4 * LANE_W + 3 * GAP
    height = TOP + 0.9 - BOTTOM
    fig, ax = plt.subplots(figsize=(width * UNIT, height * UNIT))
    ax.set_xlim(-0.05, width + 0.05)
    ax.set_ylim(BOTTOM, TOP + 0.9)
    ax.axis("off")
    for lane, ((title, subtitle), fill, edge) in enumerate(zip(LANES, COLORS, EDGES, strict=True)):
        x = _lane_x(lane)
        ax.add_patch(
            FancyBboxPatch(
                (x, BOTTOM + 0.75),
                LANE_W,
                TOP + 0.2 - BOTTOM - 0.75,
                boxstyle="round,pad=0,rounding_size=0.12",
                facecolor=fill,
                edgecolor="none",
                alpha=0.45,
            )
        )
        ax.text(
            x + LANE_W / 2,
            TOP + 0.45,
            title,
            ha="center",
            va="bottom",
            weight="bold",
            fontsize=11,
            color=edge,
        )
        ax.text(
            x + LANE_W / 2,
            TOP + 0.25,
            subtitle,
            ha="center",
            va="bottom",
            fontsize=8.5,
            color="#444444",
        )
    for lane, top, height, text in BOXES.values():
        x = _lane_x(lane) + 0.07
        ax.add_patch(
            FancyBboxPatch(
                (x, top - height),
                LANE_W - 0.14,
                height,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                facecolor="white",
                edgecolor=EDGES[lane],
                linewidth=1.2,
            )
        )
        ax.text(
            x + (LANE_W - 0.14) / 2,
            top - height / 2,
            text,
            ha="center",
            va="center",
            fontsize=9.5,
            linespacing=1.2,
        )
    for start, end, label in ARROWS:
        same_lane = BOXES[start][0] == BOXES[end][0]
        if same_lane:
            tail, head = _anchor(start, "bottom"), _anchor(end, "top")
        else:
            tail, head = _anchor(start, "right"), _anchor(end, "left")
        ax.add_patch(
            FancyArrowPatch(
                tail,
                head,
                arrowstyle="-|>",
                mutation_scale=12,
                linewidth=1.1,
                color="#333333" if same_lane else "#b22222",
                linestyle="-" if same_lane else "--",
                connectionstyle="arc3,rad=0" if same_lane else "arc3,rad=-0.12",
            )
        )
        if label:
            ax.text(
                (tail[0] + head[0]) / 2,
                max(tail[1], head[1]) + 0.05,
                label,
                ha="center",
                va="bottom",
                fontsize=8.5,
                color="#b22222",
                style="italic",
            )
    ax.text(
        0.0,
        BOTTOM + 0.35,
        "Solid: order within one thread or stream.  Dashed red: a CUDA event or a queue\n"
        "hands the window on; the training thread never waits on either.",
        ha="left",
        va="center",
        fontsize=8.5,
        color="#333333",
    )
    fig.savefig(OUT, bbox_inches="tight", metadata={"Date": None})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
