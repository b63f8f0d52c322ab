"""Run every fault and bad input of the reliability suite and write docs/reliability.md.

``nox -s reliability`` runs this; ``nox -s soak`` first writes ``build/soak.json`` (100,000
windows), which the page then quotes. Without that file a 1,000-window soak runs here and the
page says so. Exits with status 1 when a row that should hold does not (the page is still
written, showing it).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests.reliability import fuzz, process_faults, rank_faults, scenarios, soak
from tests.reliability.scenarios import Row

ROOT = Path(__file__).resolve().parents[2]


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rows_table(rows: list[Row]) -> list[str]:
    lines = [
        "| Fault | Sink | What happened | Delivered | Lost | Duplicated | Time to recover (s) "
        "| Longest `schedule_collection` (ms) | Memory (MiB) | Holds |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        outcome = row.outcome + "".join(f" **Note:** {note}." for note in row.notes)
        lines.append(
            f"| {row.fault} | {row.sink} | {outcome.replace('|', '/')} | "
            f"{row.delivered}/{row.expected} | {row.lost} | {row.duplicated} | "
            f"{_num(row.recover_s)} | {_num(row.blocked_ms)} | {_num(row.memory_mib, 1)} | "
            f"{'yes' if row.ok else '**no**'} |"
        )
    return lines


def _soak_section(figures: dict[str, Any], source: str) -> list[str]:
    lines = [
        "## Load: windows of 200 names on 2 ranks",
        "",
        f"Source: {source}. Each window reports 200 names; rank 0 writes them to JSONL and "
        "TensorBoard (read back with TensorBoard's own reader). The windows are scheduled as fast "
        "as the loop can go, so the sinks fall behind and their backlog waits in the spool "
        "(capped at 1 GiB for this run). The lagging variants run a tenth of the windows.",
        "",
        "| Run | Windows | Scheduled /s | Delivered /s (end to end) | Peak RSS rank 0 / 1 (MiB) "
        "| Longest `schedule_collection` (ms) | Waited for a slot (s) | Most slots | "
        "Most spooled (MiB) | Lost | Duplicated |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ok = True
    for key, title in (
        ("soak", "JSONL + TensorBoard"),
        ("lagging_sink", "JSONL + a sink taking 2 ms per write"),
        ("lagging_dispatcher", "JSONL, `compute` taking 4 ms, `max_slots=4`"),
    ):
        run = figures[key]
        r0, r1 = run["ranks"]
        outputs = run["outputs"]
        windows = figures["windows"] if key == "soak" else max(500, figures["windows"] // 10)
        lost = windows - outputs["jsonl_unique"] + sum(r0["dropped"].values())
        duplicated = outputs["jsonl_lines"] - outputs["jsonl_unique"]
        if "tensorboard_steps" in outputs:
            lost += windows - outputs["tensorboard_unique"]
            duplicated += outputs["tensorboard_steps"] - outputs["tensorboard_unique"]
        ok = ok and lost == 0 and duplicated == 0 and r0["closed"]
        lines.append(
            f"| {title} | {windows} | {r0['windows_per_s_scheduled']:.0f} | "
            f"{r0['windows_per_s_delivered']:.0f} | {r0['peak_rss_mib']:.0f} / "
            f"{r1['peak_rss_mib']:.0f} | {r0['longest_schedule_ms']:.1f} | "
            f"{r0['slot_wait_s']:.2f} | {r0['most_slots']} | "
            f"{r0['most_spooled_bytes'] / 2**20:.1f} | {lost} | {duplicated} |"
        )
    lines.append("")
    return lines if ok else [*lines, "**A soak run lost or duplicated windows.**", ""]


def _fuzz_section() -> tuple[list[str], bool]:
    outcomes = [fuzz.run_case(*case) for case in fuzz.cases()]
    by_metric: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    gaps = []
    for outcome in outcomes:
        key = (outcome.metric, outcome.argument, outcome.mutation)
        if outcome.ok:
            kind = (
                "raised"
                if outcome.result.split(":")[0] in {"TypeError", "ValueError"}
                else ("accepted")
            )
        elif key in fuzz.KNOWN_GAPS:
            kind = "known gap"
            gaps.append((outcome, fuzz.KNOWN_GAPS[key]))
        else:
            kind = "FAILED"
            gaps.append((outcome, outcome.problem))
        by_metric[outcome.metric][kind] += 1
    lines = [
        "## Bad input to every metric's `update`",
        "",
        f"{len(outcomes)} calls: each metric first gets a valid batch, then one argument is "
        "broken in one of these ways: " + ", ".join(m.name for m in fuzz.MUTATIONS) + ". "
        "A call must either raise `TypeError`/`ValueError` naming an argument, with every state "
        "tensor bit for bit as before, or be a correct update (the same state as the values it "
        "means, or a value that shows in the result). On CPU; CUDA drops such batches on the "
        "device and counts them in `rejected_updates` instead.",
        "",
        "| Metric | Raised a clear error, state unchanged | Accepted, correct | Known gap "
        "| Failed |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for metric, counts in by_metric.items():
        lines.append(
            f"| `{metric}` | {counts['raised']} | {counts['accepted']} | {counts['known gap']} "
            f"| {counts['FAILED']} |"
        )
    lines.append("")
    if gaps:
        lines += ["Gaps, with the work item that closes them:", ""]
        for outcome, why in gaps:
            lines.append(
                f"- `{outcome.metric}` `{outcome.argument}` {outcome.mutation}: "
                f"{outcome.result} ({why})"
            )
        lines.append("")
    failed = any(c["FAILED"] for c in by_metric.values())
    return lines, not failed


def _pytest_section(title: str, paths: list[str], what: str) -> tuple[list[str], bool]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *paths],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    seconds = time.monotonic() - started
    outcomes = [
        line
        for line in result.stdout.splitlines()
        if line.startswith(("PASSED", "FAILED", "XFAIL", "XPASS", "ERROR", "SKIPPED"))
    ]
    lines = [f"## {title}", "", what, "", f"`pytest {' '.join(paths)}` ({seconds:.0f} s):", ""]
    lines += [f"- {line.split(' - ')[0]}" for line in outcomes]
    lines.append("")
    return lines, result.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    parser.add_argument("--soak", type=Path, default=ROOT / "build" / "soak.json")
    parser.add_argument(
        "--wait-soak", type=float, default=0.0, help="seconds to wait for the soak's file"
    )
    args = parser.parse_args()
    started = time.monotonic()
    holds = True
    sink_rows = scenarios.run_all([*scenarios.FAST, scenarios.mlflow_server_restart])
    holds &= all(r.ok for r in sink_rows if "disk full" not in r.fault)
    with tempfile.TemporaryDirectory(prefix="sidestream-rel-") as tmp:
        process_rows, process_figures = process_faults.run(Path(tmp) / "job")
    holds &= all(r.ok for r in process_rows)
    rank_rows = rank_faults.rank_skips_a_call()
    fuzz_lines, fuzz_ok = _fuzz_section()
    property_lines, property_ok = _pytest_section(
        "Properties (hypothesis)",
        ["tests/reliability/test_properties.py"],
        "Random data split over 1, 2 and 4 gloo ranks in any order and batching gives the "
        "single-process result (exactly for counts and extrema, within float64 rounding for "
        "sums); `reset` then replay gives the same result; a `state_dict` round trip after any "
        "batch continues exactly.",
    )
    security_lines, security_ok = _pytest_section(
        "Security",
        ["tests/reliability/test_security.py", "tests/reliability/test_pool_security.py"],
        "A planted password (in a `user:pass@` tracking URI) and a planted API token "
        "(`MLFLOW_TRACKING_TOKEN`) are searched for in every log record, error message, spool "
        "file, state dict and tracker file of a run whose tracker is unreachable. "
        "`TorchrunPool`'s store must listen on 127.0.0.1 only, and a task or result written "
        "into it without the pool's key must never be unpickled. Every place the library "
        "unpickles is listed and reviewed.",
    )
    holds &= fuzz_ok and property_ok and security_ok
    waited = time.monotonic() + args.wait_soak
    while not args.soak.exists() and time.monotonic() < waited:
        time.sleep(5)  # a `nox -s soak` still running beside this one
    if args.soak.exists():
        soak_figures = json.loads(args.soak.read_text())
        at = f", at commit `{soak_figures['commit']}`" if "commit" in soak_figures else ""
        soak_source = (
            f"`nox -s soak` ({soak_figures['windows']} windows, {soak_figures['seconds']:.0f} s"
            f"{at})"
        )
    else:
        soak_figures = soak.run_all(1000)
        soak_source = "a 1,000-window run (no `build/soak.json` from `nox -s soak` was found)"
    generated = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    lines = [
        "# Reliability",
        "",
        "<!-- Generated by `nox -s reliability` (tests/reliability/report.py); do not edit. -->",
        "",
        "What sidestream does under faults and bad input, measured. Every table below is the "
        "output of a run of the reliability suite (`nox -s reliability`, after `nox -s soak`); "
        "the same scenarios, smaller, run in CI under `tests/reliability/`.",
        "",
        f"Generated {generated} at commit `{commit}` on {os.cpu_count()} CPU cores "
        f"({platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}), "
        "on a machine shared with other jobs: times are upper bounds, not benchmarks.",
        "",
        "**Delivered / lost / duplicated** count the windows each sink holds at the end against "
        "the windows scheduled, read back from the backend. **Time to recover** is from the end "
        "of an outage to the first report the backend takes. **Longest `schedule_collection`** "
        "is the longest time the training thread spent scheduling a window (it never waits for "
        "a sink; it waits for a free staging slot only when `max_slots` windows are still being "
        "reduced). **Memory** is the growth of the process's resident set over the run.",
        "",
        "## Sink faults (one process)",
        "",
        "Every run logs one window per step (the value at step *s* is *s*, checked) to the faulty "
        "sink and, where named, a healthy JSONL sink beside it.",
        "",
        *_rows_table(sink_rows),
        "",
        "## Process faults (2 gloo ranks, real processes)",
        "",
        "Rank 0 of a 2-rank job logging every step to JSONL, TensorBoard and MLflow (SQLite) is "
        "killed three times: " + "; ".join(process_figures["kills"]) + ". After each kill both "
        "ranks restart from the last checkpoint (`collector.state_dict()` every 10 steps). "
        "Each tracker is read back with its own reader; values are checked against a direct "
        "computation on both ranks' data.",
        "",
        *_rows_table(process_rows),
        "",
        "When rank 0 died, rank 1 failed on its own after "
        + ", ".join(f"{s:.1f} s" for s in process_figures["rank1_exit_s"])
        + f" (collective timeout 20 s) with: `{process_figures['rank1_messages'][0]}`",
        "",
        "## A rank that skips a call",
        "",
        "Rank 1 skips one `schedule_collection`; every rank should raise `RankMismatchError` "
        f"within the collective timeout ({rank_faults.COLLECTIVE_TIMEOUT_S:.0f} s) instead of "
        "pairing the wrong collectives. Time to recover here is how long the rank ran until "
        "it stopped.",
        "",
        *_rows_table(rank_rows),
        "",
        *(
            []
            if all(r.ok for r in rank_rows)
            else [
                "This does not hold yet: the call fingerprint that turns a skipped call into "
                "`RankMismatchError` on every rank is issue 11 item 7 (separate work). Until "
                "it lands, the collectives of different windows pair up and the numbers are "
                "wrong, as the table shows.",
                "",
            ]
        ),
        *_soak_section(soak_figures, soak_source),
        *fuzz_lines,
        *property_lines,
        *security_lines,
        "## Caps and policies",
        "",
        "- **Sink queue**: `sink_capacity` reports per sink in memory (1024 by default); more "
        "go to the sink's spool file.",
        "- **Spool file**: one JSON report per line, readable by its owner only (0600, in a "
        "0700 directory when the runner makes it), at most `spool_max_bytes` of undelivered "
        "reports (256 MiB by default; on disk within twice that, since the delivered part is "
        "cut off once it outgrows the rest; its index in memory about 20 bytes a report). "
        "Full: the oldest "
        "spooled reports are dropped (the queue's, older still, are kept: what goes to the "
        "backend first). Unusable (a bad directory, a full disk) or damaged: the report "
        "that cannot be written or read is dropped. Every drop is counted "
        "(`SinkRunner.dropped`), logged once per streak and in total at close, and makes "
        "`close()` return `False`. Only that sink is affected.",
        "- **Kept spool at close**: reports a sink could not take within the close timeout are "
        "written to a spool file that is kept, and the warning names it; "
        "`sidestream.sinks.replay_spool(path, sink)` or "
        "`python -m sidestream.sinks.replay PATH --sink jsonl --option path=out.jsonl` "
        "delivers them later (and renames the file `PATH.replayed`, so it is not replayed "
        "twice, but only once the sink's close confirmed that its backend has them: otherwise "
        "the file is kept and the command exits 1; a replay into another sink than the one "
        "that spooled it, such as this JSONL copy of an MLflow spool, keeps the file for its "
        "own sink).",
        "- **Staging slots**: at most `max_slots` (8 by default) copies of the metric, one per "
        "window still being reduced; they also bound the windows waiting for the dispatcher. "
        "With none free, `schedule_collection` waits for the oldest window (logged once when a "
        "wait passes 0.5 s, timed in `collector.slot_wait_s`): skipping the window instead "
        "would pair different collectives on ranks whose dispatchers finish at different "
        "times. Slots beyond the first three are freed once the backlog drains; a window "
        "whose `compute` raises gives its slot back.",
        "",
        f"_Suite run time: {time.monotonic() - started:.0f} s._",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}; every row holds: {holds}")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
