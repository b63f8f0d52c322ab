"""Replay a kept spool file into a sink from the command line.

``python -m sidestream.sinks.replay SPOOL --sink jsonl --option path=out.jsonl`` builds the sink
with ``sinks_from_config`` and delivers every report of the file (see ``replay_spool``); with
``--print`` it prints the reports instead, one per line, for a person to read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections.abc import Sequence

from sidestream._cli import run_command
from sidestream.sinks._spool import SPOOL_SUFFIX
from sidestream.sinks._spool_format import (
    STATE_SUFFIX,
    DamagedLineError,
    KeptState,
    ReplayResult,
    SpoolFormatError,
    read_kept_state,
    read_spool,
    replay_spool,
)
from sidestream.sinks.base import Sink
from sidestream.sinks.config import available_sinks, sinks_from_config
from sidestream.sinks.tracker import TrackerSink

__all__ = ["main"]


def _seconds(text: str) -> float:
    """``--timeout``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # refused below, with the same message
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected seconds (a finite number > 0), got {text!r}")
    return value


_CLOSE_GRACE_S = 10.0
"""How long past ``--timeout`` the close may run before the command gives up on it.

The built-in sinks keep their close to its timeout; the grace is for one that does not.
"""


class _Progress:
    """Prints how far a replay is, to stderr, at most every ``every`` seconds.

    A spool holds up to its cap of reports (hundreds of thousands), and a tracker takes each
    over the network: without it a long replay looks hung. A watch thread (``watch``) also
    prints while the sink takes no report, and ends the command when one call of the sink
    (its open, a write) takes longer than ``timeout``, or its close ``timeout`` and a grace.
    """

    def __init__(self, path: str, sink: str, timeout: float, every: float = 5.0) -> None:
        self._total = _count_lines(path)
        self._sink, self._timeout = sink, timeout
        self._every = every
        self._next = time.monotonic() + every
        self._done = 0
        self._last = time.monotonic()  # when the sink last took a report (or the replay began)
        self._closing = False
        self._finished = threading.Event()

    def closing(self, result: ReplayResult) -> None:
        """Once the spool is read: the sink's close that follows may wait ``timeout``."""
        self._closing, self._last = True, time.monotonic()
        _say(
            f"read {self._done:,} reports ({result.written:,} written, {result.skipped:,} the "
            f"sink had); waiting up to {self._timeout:g} s for the {self._sink} sink to "
            "confirm delivery"
        )

    def __call__(self, result: ReplayResult) -> None:
        self._done += 1
        now = time.monotonic()
        self._last = now
        if now < self._next:
            return
        self._next = now + self._every
        _say(
            f"replayed {self._done:,} of about {self._total:,} reports "
            f"({result.written:,} written, {result.skipped:,} the sink had)"
        )

    def watch(self) -> None:
        """Start the thread that reports (and ends) a sink call that does not return."""
        threading.Thread(target=self._watch, name="sidestream-replay-watch", daemon=True).start()

    def finished(self) -> None:
        """The replay returned (or raised): the watch thread stops."""
        self._finished.set()

    def _waiting_for(self) -> str:
        if self._closing:
            return "its close"
        if self._done == 0:
            return "its open or the first report's write"
        return f"the write of report {self._done + 1:,} (of the file's {self._total:,})"

    def _watch(self) -> None:
        while not self._finished.wait(min(1.0, self._every)):
            now = time.monotonic()
            idle = now - self._last
            limit = self._timeout + (_CLOSE_GRACE_S if self._closing else 0.0)
            if idle > limit:
                _say(
                    f"the {self._sink} sink did not return from {self._waiting_for()} in "
                    f"{idle:.0f} s (--timeout {self._timeout:g} s"
                    f"{f' and {_CLOSE_GRACE_S:g} s more' if self._closing else ''}): stopped. "
                    "The spool is kept; run this command again once the backend answers, or "
                    "with a longer --timeout if it is slow rather than down (the same call "
                    "would stop there again). With the state "
                    "kept beside the file, or --resume-state, reports the backend has are "
                    "skipped"
                )
                sys.stdout.flush()
                # The sink's call holds the main thread and may never return: a hard exit,
                # like a crash the replay is made to survive (the file is only renamed at
                # the end of a replay that delivered everything).
                os._exit(1)
            if idle >= self._every and now >= self._next and not self._closing:
                self._next = now + self._every
                _say(
                    f"waiting for the {self._sink} sink: {self._waiting_for()} has not "
                    f"returned for {idle:.0f} s (it stops at --timeout {self._timeout:g} s)"
                )


def _say(text: str) -> None:
    """A progress or stall line: on stderr, at once (stdout keeps the command's result)."""
    print(text, file=sys.stderr, flush=True)


def _count_lines(path: str) -> int:
    """The number of lines of the file at ``path`` (one per report), read in chunks."""
    lines = 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            lines += chunk.count(b"\n")
    return lines


def _elsewhere(kept: KeptState | None, name: str, sink: Sink, given: set[str]) -> str | None:
    """Where a replay's reports went, when not where the job's sink delivered; else ``None``.

    Another kind of sink, or the same kind moved by an option given (a JSONL copy at another
    path). A sink of one's own with no entry point cannot be replayed into here: the sink
    given stands in for it.
    """
    if kept is None:
        return None
    if kept.sink != name:
        if kept.sink not in available_sinks():
            return None
        return (
            f"into {name}, not into the {kept.sink} sink that spooled them; replay it with "
            f"--sink {kept.sink} (or without --sink) to deliver them there"
        )
    replayed = sink.replay_options()
    if all(replayed.get(key) == value for key, value in kept.options.items() if key in given):
        return None
    named = ", ".join(f"{key}={value}" for key, value in sorted(kept.options.items()))
    return (
        f"into a {name} sink with other options than the one that spooled them ({named}); "
        "replay it without --option to deliver them there"
    )


def main(argv: Sequence[str] | None = None, prog: str = "python -m sidestream.sinks.replay") -> int:
    """Run the command line; return the exit status (``prog``: the command typed)."""
    parser = argparse.ArgumentParser(prog=prog, description="Deliver a kept spool file.")
    parser.add_argument("spool", help="the spool file a warning named")
    parser.add_argument(
        "--sink",
        help="entry-point name of the sink (jsonl, mlflow, ...); default: the one the "
        f"SPOOL{STATE_SUFFIX} file names",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a sink option; VALUE is read as JSON when it parses, else as a string. Options "
        f"the SPOOL{STATE_SUFFIX} file names (where the job's sink delivered: MLflow's "
        "tracking_uri, W&B's project) are used unless given",
    )
    parser.add_argument(
        "--resume-state",
        help="a JSON file with the sink's state_dict from the checkpoint (default: the "
        f"SPOOL{STATE_SUFFIX} file a close wrote beside it, if there is one)",
    )
    parser.add_argument(
        "--skip-damaged",
        action="store_true",
        help="skip damaged lines (each is named) and deliver the rest",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="leave the spool file as it is (by default it is renamed SPOOL.replayed once "
        "every report was delivered, so it is not replayed twice; a replay into another "
        f"installed sink than the one the SPOOL{STATE_SUFFIX} file names always keeps it)",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=120.0,
        metavar="SECONDS",
        help="how long the sink's close may wait for its backend to confirm every report, "
        "and its open or one write may take (default 120: longer than wandb.init's own 90 s "
        "wait); if it takes longer, the file is kept and the command exits 1",
    )
    parser.add_argument("--print", action="store_true", help="print the reports, write nothing")
    args = parser.parse_args(argv)
    if args.spool.endswith(_REPLAYED) and not args.print:
        parser.error(
            f"{args.spool}: replayed already (its reports were delivered); to deliver them "
            f"again, rename it without {_REPLAYED}"
        )
    if os.path.isdir(args.spool):
        parser.error(f"{args.spool}: a directory; give one of the spool files a warning named")
    if not os.path.isfile(args.spool):
        done = (
            f" (it was replayed already: {args.spool}{_REPLAYED})"
            if os.path.isfile(args.spool + _REPLAYED)
            else ""
        )
        parser.error(f"{args.spool}: no such file{done}")
    _refuse_a_file_of_no_reports(parser, args.spool, args.skip_damaged)
    if args.print:
        damaged: list[str] | None = [] if args.skip_damaged else None
        try:
            for report in read_spool(args.spool, damaged=damaged):
                print(report)
        except DamagedLineError as error:
            print(f"{error} (--skip-damaged prints the rest)", file=sys.stderr)
            return 1
        for line in damaged or []:
            print(f"skipped a damaged line: {line}", file=sys.stderr)
        return 0
    state_damaged = False
    try:
        kept = read_kept_state(args.spool)
    except ValueError as error:
        state_damaged = True
        if not args.sink:
            parser.error(
                f"{error}; give --sink (with its --option values, and --resume-state for the "
                "sink's delivered steps) to replay without it"
            )
        # Everything it would give is on the command line: a cut state file (a disk that
        # filled as the job closed) must not stop the replay.
        print(f"ignoring {args.spool}{STATE_SUFFIX}: {error}", file=sys.stderr)
        kept = None
    if not args.sink:
        if kept is None:
            parser.error(
                f"--sink is required: {args.spool}{STATE_SUFFIX}, which names the sink, is not "
                "there (a crashed job writes none)"
            )
        args.sink = kept.sink
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--option: expected KEY=VALUE, got {item!r}")
        if key == "child_process":
            parser.error(
                "--option child_process: a replay runs the sink in this process, where it can "
                "tell which reports its backend has already; leave the option out"
            )
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    given = set(options)
    if kept is not None and kept.sink == args.sink:
        # Where the job's sink delivered (MLflow's tracking URI), unless given otherwise.
        taken = {key: value for key, value in kept.options.items() if key not in options}
        if taken:
            named = ", ".join(f"{key}={value}" for key, value in sorted(taken.items()))
            print(f"options from {kept.path}: {named}")
            options = {**taken, **options}
    sink = _sink(parser, args.sink, options)
    elsewhere = None if args.keep else _elsewhere(kept, args.sink, sink, given)
    if kept is None and not options and isinstance(sink, TrackerSink):
        # A crashed job's spool: a tracker's defaults are not where the job delivered (an
        # MLflow store in this folder, wandb's default project, ./runs), its state (a run id)
        # does not say where that is either, and the file would count as replayed.
        where = sorted(sink.replay_options())
        why = (
            f"its {STATE_SUFFIX} file could not be read"
            if state_damaged
            else f"it has no {STATE_SUFFIX} file beside it (its job ended without closing: "
            "crashed or killed)"
        )
        parser.error(
            f"{args.spool}: {why}, so where its {args.sink} sink delivered is not known; give "
            "it with --option (the job's sink options"
            + (f", such as {', '.join(where)}" if where else "")
            + "; an environment variable does not count) and, to continue the job's run, "
            "--resume-state with the sink's state from the job's last checkpoint "
            f"(run.state_dict()['sinks'][{args.sink!r}], saved as JSON)"
        )
    state = None  # replay_spool takes the kept state beside the spool, if any
    if args.resume_state:
        try:
            with open(args.resume_state) as file:
                state = json.load(file)
        except (OSError, ValueError) as error:
            parser.error(f"--resume-state: {error}")
        if not isinstance(state, dict):
            parser.error(
                f"--resume-state: expected a JSON object (the sink's state_dict from the "
                f"checkpoint), got {type(state).__name__}"
            )
        # A copy of the sink takes it first: a state it refuses is a wrong argument, found
        # before anything is delivered, not a failed replay.
        try:
            _sink(parser, args.sink, options).load_state_dict(state)
        except (TypeError, ValueError, KeyError) as error:
            parser.error(f"--resume-state: {error}")
    progress = _Progress(args.spool, args.sink, args.timeout)
    progress.watch()
    try:
        result = replay_spool(
            args.spool,
            sink,
            resume_state=state,
            timeout=args.timeout,
            skip_damaged=args.skip_damaged,
            progress=progress,
            closing=progress.closing,
        )
    except DamagedLineError as error:
        print(
            f"stopped at a damaged line: {error}; the reports before it were delivered. Run "
            "again with --skip-damaged to deliver the rest, and with --resume-state (the "
            "sink's state from the job's checkpoint, which a resuming sink uses to skip steps "
            "it has): without it the reports before the damaged line are delivered again",
            file=sys.stderr,
        )
        return 1
    except Exception as error:  # the sink could not open or write: its message says why
        print(f"replay failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        progress.finished()
    if result.resumed_from is not None:
        print(f"resumed the sink's run from {result.resumed_from}")
    for line in result.damaged:
        print(f"skipped a damaged line: {line}", file=sys.stderr)
    print(
        f"{'delivered' if result.closed else 'wrote'} {result.written} report(s) from "
        f"{args.spool} into {args.sink}; "
        f"{result.skipped} the sink already had, {len(result.damaged)} damaged line(s) skipped"
    )
    if result.lacking:
        print(
            f"the run lacks values the backend could not take: {', '.join(result.lacking)} "
            "(warned when each was left out)",
            file=sys.stderr,
        )
    if not result.closed:
        print(
            f"the {args.sink} sink's close did not confirm that its backend has every report "
            f"written (it failed, or ran past --timeout {args.timeout:g} s: its warnings say "
            f"which), so some may be missing there; {args.spool} is kept. Run this command "
            "again: with the state kept beside the file (or --resume-state), reports the "
            "backend has are skipped; without it they may be written twice",
            file=sys.stderr,
        )
    if result.held:
        print(
            f"{result.held} report(s) had values the backend holds at later steps, which a "
            "tracker never logs below its largest step, so they were not sent and may be "
            f"missing there; {args.spool} is kept (replay a kept file before resuming the job)",
            file=sys.stderr,
        )
    if result.held or not result.closed:
        return 1
    if elsewhere is not None:
        # Written out elsewhere (a JSONL copy to read), not delivered where the job sent them:
        # renamed, the file would never be replayed into its own sink.
        print(f"{args.spool} is kept: its reports went {elsewhere}", file=sys.stderr)
        return 0
    if not args.keep:
        try:
            os.replace(args.spool, args.spool + _REPLAYED)
        except OSError as error:
            print(
                f"every report was delivered, but {args.spool} could not be renamed ({error}): "
                "move or delete it, or a second replay delivers its reports again",
                file=sys.stderr,
            )
            return 1
        print(f"renamed the spool to {args.spool}{_REPLAYED}")
        try:  # the kept state goes with its spool
            os.replace(args.spool + STATE_SUFFIX, args.spool + _REPLAYED + STATE_SUFFIX)
        except FileNotFoundError:
            pass
        except OSError as error:
            print(f"{args.spool}{STATE_SUFFIX} could not be renamed ({error})", file=sys.stderr)
    return 0


def _refuse_a_file_of_no_reports(
    parser: argparse.ArgumentParser, path: str, skip_damaged: bool
) -> None:
    """Exit (2) before any sink opens if ``path`` starts with no report (not a spool file).

    A checkpoint or log given by mistake opened the tracker (an empty run) before its first
    line failed. A spool whose first line was cut is replayed with ``--skip-damaged``.
    """
    damaged: list[str] = []
    try:
        for _ in read_spool(path, damaged=damaged if skip_damaged else None):
            return  # a report: a spool file
    except SpoolFormatError as error:  # a newer sidestream's file: no sink opens for it
        parser.error(str(error))
    except DamagedLineError:  # the first line, as no report came before it
        parser.error(
            f"{path}: its first line is not a report, so it is not a spool file (or one whose "
            "first line was cut: --skip-damaged then delivers the rest)"
        )
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"{path}: not a spool file ({type(error).__name__}: {error})")
    if damaged and not path.endswith(SPOOL_SUFFIX):
        # A spool's own name: one whose every line was cut is replayed (nothing delivered)
        # and renamed, or a job would name it at every start with no way to clear it.
        parser.error(f"{path}: not a spool file (none of its {len(damaged)} line(s) is a report)")


def _sink(parser: argparse.ArgumentParser, name: str, options: dict[str, object]) -> Sink:
    try:
        (sink,) = sinks_from_config({name: options})
    except (LookupError, TypeError, ValueError, ImportError) as error:
        # The message names the sink, the option and the fix: no traceback to read past.
        parser.error(f"--sink {name}: {error}")
    return sink


_REPLAYED = ".replayed"


if __name__ == "__main__":
    run_command(main)
