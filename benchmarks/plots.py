"""Plots of the benchmark tables, drawn from the markdown that ``benchmarks.run`` writes.

``python -m benchmarks.run`` calls ``add_plots`` on its sections; ``python -m benchmarks.plots``
redraws the plots of an existing ``docs/benchmarks.md`` (no benchmark runs) and puts each image
link at the end of its section. The tables are the interface: a plot names the section (by the
start of its heading) and the table columns it draws, and a missing section column raises.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PLOTS", "Panel", "Plot", "Table", "add_plots", "parse_tables"]

DOCS = Path(__file__).resolve().parents[1] / "docs"
FIGURES = "figures"  # under docs/, next to benchmarks.md
_IMAGE_LINE = re.compile(r"^!\[[^\]]*\]\(figures/bench-[\w-]+\.svg\)\n?", re.M)


@dataclass(frozen=True)
class Table:
    """One markdown table: its section heading, column names and cell texts."""

    section: str
    columns: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> list[str]:
        """The cells of the column called ``name``.

        Raises:
            KeyError: If the table has no such column (the message lists the ones it has).
        """
        if name not in self.columns:
            raise KeyError(f"{self.section!r}: no column {name!r}; columns: {self.columns}")
        index = self.columns.index(name)
        return [row[index] for row in self.rows]


@dataclass(frozen=True)
class Panel:
    """Horizontal bars: one group per table row, one bar per series column.

    Attributes:
        table: Index of the table within the section.
        labels: Columns whose cells, joined with " / ", name a row (none: "same loop").
        series: (column, legend) per bar of a row; a legend of None draws one unnamed series,
            colored by whether the row is sidestream's.
        axis: The value axis label.
        split: A column: one panel per distinct value of it, holding that value's rows.
    """

    table: int
    labels: tuple[str, ...]
    series: tuple[tuple[str, str | None], ...]
    axis: str
    split: str | None = None


@dataclass(frozen=True)
class Plot:
    """One figure of one or more panels drawn from a section's tables.

    Attributes:
        slug: File name part: ``figures/bench-<slug>.svg``.
        section: The start of the section heading the tables are in.
        panels: The panels, left to right.
        title: The figure's title.
    """

    slug: str
    section: str
    panels: tuple[Panel, ...]
    title: str


PLOTS = [
    Plot(
        "sync",
        "Sync of an",
        (
            Panel(0, ("implementation",), (("ms per sync", None),), "ms per sync"),
            Panel(0, ("implementation",), (("collectives per sync", None),), "collectives"),
        ),
        "Syncing an 11-metric collection on 4 gloo ranks (lower is better)",
    ),
    Plot(
        "training-thread",
        "Training-thread time",
        (
            Panel(0, ("pattern",), (("blocked ms / step (mean)", None),), "ms blocked per step"),
            Panel(0, ("pattern",), (("step ms", None),), "ms per whole step"),
            Panel(
                1,
                (),
                (
                    ("`schedule_collection` ms (same loop)", "sidestream schedule_collection"),
                    ("blocked ms / call (mean)", "sidestream run.log"),
                ),
                "ms blocked per call, run.log next to schedule_collection",
            ),
        ),
        "Training-thread time per logged step, 2 gloo ranks (lower is better)",
    ),
    Plot(
        "classification-update",
        "Classification update",
        (Panel(0, ("implementation",), (("µs per update", None),), "µs per update", "metric"),),
        "Classification update on one CPU thread (lower is better)",
    ),
    Plot(
        "auroc",
        "BinaryAUROC",
        (
            Panel(0, ("state after 10M samples",), (("bytes", None),), "state bytes, 10M samples"),
            Panel(
                2,
                ("update throughput, batches of 1,024",),
                (("samples/s", None),),
                "samples/s, batches of 1,024",
            ),
        ),
        "Binary AUROC: state size (lower is better) and small-batch throughput (higher is better)",
    ),
    Plot(
        "tracker-overhead",
        "Tracker overhead",
        (
            Panel(
                0,
                ("backend",),
                (
                    ("direct log µs/step", ".item() + the tracker's call"),
                    ("via sink log µs/step", "sidestream, sink thread"),
                    ("via child log µs/step", "sidestream, sink child process"),
                ),
                "µs per step spent logging on the training thread",
            ),
        ),
        "Tracker overhead on the training thread (lower is better)",
    ),
    Plot(
        "schedule-cost",
        "Training-thread CPU per logged step",
        (
            Panel(
                0,
                ("metrics",),
                (
                    ("bare all_gather CPU µs", "the bare all_gather alone"),
                    ("CPU µs (median)", "sidestream schedule_collection"),
                ),
                "training-thread CPU µs per window (median), by number of metrics",
            ),
        ),
        "schedule_collection against the bare collective it starts (lower is better)",
    ),
    Plot(
        "update-overhead",
        "Update overhead",
        (
            Panel(
                0,
                ("metric",),
                (
                    ("raw µs", "raw ops, no checks"),
                    ("sidestream µs", "sidestream"),
                    ("torchmetrics µs", "torchmetrics"),
                ),
                "µs per update (eager)",
                "size",
            ),
        ),
        "Update cost against raw ops and torchmetrics, one CPU thread (lower is better)",
    ),
]


def parse_tables(markdown: str) -> dict[str, list[Table]]:
    """Every table of ``markdown``, grouped by the ``## `` heading they follow."""
    found: dict[str, list[Table]] = {}
    section = ""
    lines = markdown.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("|") and index + 1 < len(lines) and set(lines[index + 1]) <= set("|-: "):
            columns = _cells(line)
            rows = []
            index += 2
            while index < len(lines) and lines[index].startswith("|"):
                rows.append(_cells(lines[index]))
                index += 1
            found.setdefault(section, []).append(Table(section, columns, rows))
            continue
        index += 1
    return found


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _number(cell: str) -> float:
    # "1,370", "26.8x", "0.09 / 0.33" (first number), "`x`" are all tables' spellings.
    match = re.search(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", cell.replace("`", ""))
    if match is None:
        raise ValueError(f"not a number: {cell!r}")
    return float(match.group().replace(",", ""))


def _label(cell: str) -> str:
    return cell.replace("`", "").replace("**", "")


@dataclass(frozen=True)
class _Drawn:
    """One panel as drawn: a ``Panel``, or one value of its ``split`` column."""

    panel: Panel
    title: str
    labels: list[str]
    values: list[list[float]]  # per series, per row


def _panels(plot: Plot, tables: list[Table]) -> list[_Drawn]:
    drawn = []
    for panel in plot.panels:
        table = tables[panel.table]
        labels = [
            " / ".join(_label(cell) for cell in cells)
            for cells in zip(*(table.column(name) for name in panel.labels), strict=True)
        ] or ["same loop"] * len(table.rows)
        values = [[_number(cell) for cell in table.column(name)] for name, _ in panel.series]
        groups = table.column(panel.split) if panel.split is not None else [""] * len(labels)
        for group in dict.fromkeys(groups):
            keep = [row for row, value in enumerate(groups) if value == group]
            drawn.append(
                _Drawn(
                    panel,
                    _label(group),
                    [labels[row] for row in keep],
                    [[column[row] for row in keep] for column in values],
                )
            )
    return drawn


def _format(value: float) -> str:
    if abs(value) >= 1e6:
        return f"{value / 1e6:,.3g}M"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def draw(plot: Plot, tables: list[Table], out: Path) -> None:
    """Draw ``plot`` from its section's ``tables`` into the SVG file ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "sidestream", "font.size": 9})
    panels = _panels(plot, tables)
    # Panels stacked, each as tall as its bars: the page's content column is narrow.
    bars = [len(drawn.labels) * len(drawn.panel.series) for drawn in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(7.5, 0.6 + sum(0.6 + 0.26 * count for count in bars)),
        squeeze=False,
        gridspec_kw={"height_ratios": [1.5 + count for count in bars]},
    )
    for ax, drawn in zip(axes[:, 0], panels, strict=True):
        series = drawn.panel.series
        height = 0.8 / len(series)
        rows = list(range(len(drawn.labels)))[::-1]  # the table's first row on top
        for index, ((_, legend), column) in enumerate(zip(series, drawn.values, strict=True)):
            offsets = [row + (len(series) - 1 - 2 * index) * height / 2 for row in rows]
            if legend is None:  # one series: sidestream's rows stand out
                colors = ["#3b6ea5" if "sidestream" in x else "#9aa5b1" for x in drawn.labels]
            else:  # sidestream's series in blues, peers' in grey and orange
                ours = "sidestream" in legend
                same_kind = [
                    other
                    for _, other in series[:index]
                    if other and ("sidestream" in other) == ours
                ]
                palette = ("#3b6ea5", "#1f3f66") if ours else ("#9aa5b1", "#d9822b")
                colors = [palette[len(same_kind) % 2]] * len(rows)
            ax.barh(offsets, column, height=height * 0.9, color=colors, label=legend)
            for offset, value in zip(offsets, column, strict=True):
                ax.text(value, offset, " " + _format(value), va="center", fontsize=8)
        ax.set_yticks(rows, drawn.labels)
        flat = [value for column in drawn.values for value in column]
        if min(flat) > 0 and max(flat) / min(flat) > 30:
            ax.set_xscale("log")
        ax.set_xlabel(drawn.panel.axis)
        if drawn.title:
            title = drawn.panel.split + " " + drawn.title if drawn.panel.split else drawn.title
            ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
        ax.margins(x=0.3)
        if any(legend for _, legend in series):
            ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    fig.suptitle(plot.title, fontsize=10, weight="bold")
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)


def add_plots(markdown: str, docs: Path = DOCS) -> str:
    """Draw every plot of ``PLOTS`` from ``markdown`` and link each at the end of its section.

    Args:
        markdown: The benchmarks page (``benchmarks.run``'s output).
        docs: The docs directory; images go to ``<docs>/figures/bench-<slug>.svg``.

    Returns:
        ``markdown`` with one image link per plot (earlier image links replaced).

    Raises:
        KeyError: If a plot's section or one of its columns is missing from ``markdown``.
    """
    markdown = _IMAGE_LINE.sub("", markdown)
    tables = parse_tables(markdown)
    (docs / FIGURES).mkdir(parents=True, exist_ok=True)
    for plot in PLOTS:
        matches = [section for section in tables if section.startswith(plot.section)]
        if len(matches) != 1:
            raise KeyError(f"plot {plot.slug!r}: expected one section starting {plot.section!r}")
        draw(plot, tables[matches[0]], docs / FIGURES / f"bench-{plot.slug}.svg")
        markdown = _link_at_section_end(markdown, matches[0], plot)
    return markdown


def _link_at_section_end(markdown: str, section: str, plot: Plot) -> str:
    start = markdown.index(f"## {section}")
    following = markdown.find("\n## ", start + 1)
    end = len(markdown) if following == -1 else following + 1
    body = markdown[start:end].rstrip("\n")
    link = f"![{plot.title}]({FIGURES}/bench-{plot.slug}.svg)"
    return (
        markdown[:start]
        + body
        + "\n\n"
        + link
        + "\n"
        + ("\n" if following != -1 else "")
        + markdown[end:]
    )


def main() -> None:
    """Redraw the plots of an existing benchmarks page and refresh its image links."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("page", type=Path, nargs="?", default=DOCS / "benchmarks.md")
    args = parser.parse_args()
    args.page.write_text(add_plots(args.page.read_text(), args.page.parent))
    print(f"plots for {args.page} in {args.page.parent / FIGURES}")


if __name__ == "__main__":
    main()
