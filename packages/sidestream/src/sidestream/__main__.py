"""``python -m sidestream show PATH.jsonl [--plot out.png]``: look at a run without a tracker.

``python -m sidestream replay ...`` is ``python -m sidestream.sinks.replay ...``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from sidestream._cli import run_command
from sidestream._text import printable
from sidestream.sinks.jsonl import read_lines

__all__ = ["main"]

_MAX_LINES_PER_PLOT = 20
_MAX_PLOTS = 12
"""Streams drawn, one plot each (3 inches tall): a job with many prefixes would make an image
taller than the backend can write (matplotlib refuses 2**16 pixels and more)."""


_SNIFF_BYTES = 1 << 16
"""Bytes read from the start of a file to tell a binary one (a torch checkpoint) from text."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["replay"]:
        # Its own options and help: one tool, reached from both names.
        from sidestream.sinks.replay import main as replay

        return replay(arguments[1:], prog="python -m sidestream replay")
    parser = argparse.ArgumentParser(prog="python -m sidestream")
    from sidestream import __version__

    parser.add_argument("--version", action="version", version=f"sidestream {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "replay",
        help="deliver a spool file a sink kept (python -m sidestream.sinks.replay; "
        "python -m sidestream replay --help)",
        add_help=False,
    )
    show = commands.add_parser(
        "show", help="print each stream's latest values from a JsonlSink file"
    )
    show.add_argument("path", type=Path, help="the .jsonl file a JsonlSink wrote")
    show.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="also draw the values over steps into this image, one plot per stream (the first "
        f"{_MAX_PLOTS} streams by name, {_MAX_LINES_PER_PLOT} values each; needs matplotlib: "
        'pip install "sidestream[plot]")',
    )
    args = parser.parse_args(arguments)
    if not args.path.exists():
        show.error(f"{args.path}: no such file")
    if not args.path.is_file():
        show.error(f"{args.path}: not a regular file; expected the .jsonl file a JsonlSink wrote")
    try:
        with args.path.open("rb") as file:
            # The first line only: a JSONL file cut by a crash may end in NUL bytes.
            binary = b"\0" in file.readline(_SNIFF_BYTES)
    except OSError as error:
        print(f"error: {args.path}: {error.strerror or error}", file=sys.stderr)
        return 1
    if binary:
        # A checkpoint given by mistake holds JSON lines of its own (a run's undelivered
        # reports): shown, they looked like the run's values.
        print(
            f"error: {args.path}: a binary file (its first line holds NUL bytes), not the .jsonl "
            "file a "
            "JsonlSink wrote",
            file=sys.stderr,
        )
        return 1
    out = args.plot
    if out is not None:
        if out.is_dir():
            show.error(f"--plot: {out} is a directory; expected an image file such as out.png")
        if not out.suffix:
            out = out.with_suffix(".png")  # what matplotlib would write, and is said below
    history, damaged = _history(args.path, every_point=out is not None)
    if damaged:
        print(
            f"warning: {damaged} line(s) of {args.path} are no JsonlSink records (cut short, or "
            "not written by a JsonlSink); skipped",
            file=sys.stderr,
        )
    if not any(history.values()):
        print(f"{args.path}: no records with numeric values", file=sys.stderr)
        return 1
    print(_table(history))
    if out is not None:
        try:
            left_out = _plot(history, out)
        except ImportError:
            print(
                'error: --plot needs matplotlib: pip install "sidestream[plot]" (or pip install '
                "matplotlib)",
                file=sys.stderr,
            )
            return 2
        except (ValueError, OSError) as error:  # a format matplotlib lacks, an unwritable path
            print(f"error: --plot {out}: {error}", file=sys.stderr)
            return 2
        if left_out:
            print(
                f"note: --plot drew the first {_MAX_PLOTS} streams by name; left out: "
                + ", ".join(printable(stream) or "(log)" for stream in left_out),
                file=sys.stderr,
            )
        print(f"plot written to {out}")
    return 0


# stream -> name -> [(step, value)], in file order
History = dict[str, dict[str, list[tuple[int, float]]]]


def _history(path: Path, every_point: bool) -> tuple[History, int]:
    """Each stream's points, and how many lines were no record.

    One pass: a second read of a live file would count lines appended meanwhile.

    Args:
        path: The JSONL file.
        every_point: Keep every point (for a plot). Otherwise only the one the table shows
            per name (the largest step, of equal steps the one written last), so a file of
            millions of records takes no more memory than its names.
    """
    history: History = {}
    damaged = 0
    for record in read_lines(path):
        if record is None:
            damaged += 1
            continue
        stream = str(record.get("stream", ""))
        names = history.setdefault(stream, {})
        values = record.get("values")
        step = int(record["step"])
        for name, value in (values if isinstance(values, dict) else {}).items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            points = names.setdefault(name, [])
            if every_point or not points:
                points.append((step, float(value)))
            elif step >= points[0][0]:
                points[0] = (step, float(value))
    return history, damaged


def _table(history: History) -> str:
    rows = [("stream", "step", "name", "value")]
    for stream in sorted(history):
        for name in sorted(history[stream]):
            # The largest step, whatever the line order; of a step written twice (a spool
            # replayed twice), the value written last.
            points = history[stream][name]
            step = max(point[0] for point in points)
            value = next(v for s, v in reversed(points) if s == step)
            rows.append((_cell(stream) or "(log)", str(step), _cell(name), _number(value)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _cell(text: str) -> str:
    """``text`` with unprintable characters escaped.

    A newline in a name made a row of its own, a tab or carriage return broke the columns.
    """
    return printable(text)


def _number(value: float) -> str:
    return str(value) if not math.isfinite(value) else f"{value:.6g}"


def _plot(history: History, out: Path) -> list[str]:
    """Draw the first ``_MAX_PLOTS`` streams into ``out``; the streams left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = sorted(stream for stream, names in history.items() if names)
    streams, left_out = every[:_MAX_PLOTS], every[_MAX_PLOTS:]
    figure, axes = plt.subplots(
        len(streams), 1, figsize=(8, 3 * len(streams)), squeeze=False, constrained_layout=True
    )
    for axis, stream in zip(axes[:, 0], streams, strict=True):
        names = sorted(history[stream])
        for name in names[:_MAX_LINES_PER_PLOT]:
            # By step only (a stable sort keeps a repeated step's values in file order); with
            # markers, so a series of one point (a validation logged once) shows.
            points = sorted(history[stream][name], key=lambda point: point[0])
            axis.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
        title = stream or "(log)"
        if len(names) > _MAX_LINES_PER_PLOT:
            title += f" (first {_MAX_LINES_PER_PLOT} of {len(names)} values)"
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return left_out


if __name__ == "__main__":
    run_command(main)
