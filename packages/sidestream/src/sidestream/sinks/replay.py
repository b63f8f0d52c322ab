"""Replay a kept spool file into a sink from the command line.

``python -m sidestream.sinks.replay SPOOL --sink jsonl --option path=out.jsonl`` builds the sink
with ``sinks_from_config`` and delivers every report of the file (see ``replay_spool``); with
``--print`` it prints the reports instead, one per line, for a person to read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from sidestream.sinks._spool_format import read_spool, replay_spool
from sidestream.sinks.config import sinks_from_config

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m sidestream.sinks.replay", description="Deliver a kept spool file."
    )
    parser.add_argument("spool", help="the spool file a warning named")
    parser.add_argument("--sink", help="entry-point name of the sink (jsonl, mlflow, ...)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sink option; VALUE is read as JSON when it parses, else as a string",
    )
    parser.add_argument(
        "--resume-state", help="a JSON file with the sink's state_dict from the checkpoint"
    )
    parser.add_argument("--print", action="store_true", help="print the reports, write nothing")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.spool):
        parser.error(f"{args.spool}: no such file")
    if args.print:
        for report in read_spool(args.spool):
            print(report)
        return 0
    if not args.sink:
        parser.error("--sink is required unless --print is given")
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--option: expected KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    try:
        (sink,) = sinks_from_config({args.sink: options})
    except (LookupError, TypeError, ValueError, ImportError) as error:
        # The message names the sink, the option and the fix: no traceback to read past.
        parser.error(f"--sink {args.sink}: {error}")
    state = None
    if args.resume_state:
        try:
            with open(args.resume_state) as file:
                state = json.load(file)
        except (OSError, ValueError) as error:
            parser.error(f"--resume-state: {error}")
    count = replay_spool(args.spool, sink, resume_state=state)
    print(f"replayed {count} report(s) from {args.spool} into {args.sink}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
