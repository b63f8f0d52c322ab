"""Fault scenarios with figures: each runs a collector through one fault and counts per sink.

Every scenario returns ``Row``s: the fault, what happened, delivered / lost / duplicated per
sink, time to recover, the training thread's time in ``schedule_collection`` and memory. The
tests assert on them; ``python -m tests.reliability.report`` runs them all and writes
docs/reliability.md, so the page shows what the code does today.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sidestream import AsyncMetricCollector, MeanMetric
from sidestream.sinks import JsonlSink, Report, RunInfo, Sink, read_spool, replay_spool
from tests.reliability.faults import listening_addresses, tally

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Row:
    """One line of the table in docs/reliability.md."""

    fault: str
    sink: str
    outcome: str
    delivered: int
    lost: int
    duplicated: int
    expected: int
    recover_s: float | None = None
    blocked_ms: float | None = None  # the training thread's longest schedule_collection
    memory_mib: float | None = None
    ok: bool = True
    notes: list[str] = field(default_factory=list)


def rss_mib() -> float:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class FaultSink(Sink):
    """Records steps; ``fault(step, attempt)`` may raise or sleep; ``opening`` may raise."""

    def __init__(
        self, name: str, fault: Callable[[int], None] | None = None, clock: _Clock | None = None
    ) -> None:
        self.name = name
        self.fault = fault
        self.clock = clock
        self.open_fault: Callable[[], None] | None = None
        self.steps: list[int] = []
        self.values: list[float] = []
        self._failed = False
        self.recover_s: float | None = None

    def _attempt(self, action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:
            self._failed = True
            raise
        if self._failed and self.recover_s is None and self.clock is not None:
            # From the end of the outage to the first call that went through.
            self.recover_s = max(0.0, time.monotonic() - self.clock.end)

    def open(self, run: RunInfo) -> None:
        if self.open_fault is not None:
            self._attempt(self.open_fault)

    def write(self, report: Report) -> None:
        if self.fault is not None:
            fault = self.fault
            self._attempt(lambda: fault(report.step))
        self.steps.append(report.step)
        self.values.append(report.values["loss"])


class _Clock:
    """A fault window in wall time: ``active()`` between start and end."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start: float | None = None

    def begin(self) -> None:
        self.start = time.monotonic()

    def active(self) -> bool:
        return self.start is not None and time.monotonic() - self.start < self.seconds

    @property
    def end(self) -> float:
        assert self.start is not None
        return self.start + self.seconds


def _drive(
    sinks: list[Sink],
    windows: int,
    *,
    on_step: Callable[[int], None] | None = None,
    step_s: float = 0.0,
    close_timeout: float = 60.0,
    **options: Any,
) -> tuple[AsyncMetricCollector[Any], bool, list[float]]:
    """Log ``windows`` windows of a mean whose value at step s is s; return close's result."""
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric, sinks=sinks, prefix="loss", **options)
    collector.bind("cpu")
    blocked: list[float] = []
    for step in range(1, windows + 1):
        if on_step is not None:
            on_step(step)
        metric.update(torch.tensor([float(step)]))
        start = time.perf_counter()
        collector.schedule_collection(step)
        blocked.append(time.perf_counter() - start)
        if step_s:
            time.sleep(step_s)
    complete = collector.close(close_timeout)
    return collector, complete, blocked


def _row(
    fault: str, sink_name: str, steps: list[int], values: list[float], windows: int, **kw: Any
) -> Row:
    counts = tally(range(1, windows + 1), steps)
    row = Row(
        fault,
        sink_name,
        kw.pop("outcome", ""),
        counts["delivered"],
        counts["lost"],
        counts["duplicated"],
        windows,
        **kw,
    )
    wrong = [s for s, v in zip(steps, values, strict=True) if v != float(s)]
    if wrong or counts["unexpected"]:
        row.ok = False
        row.notes.append(f"wrong values at steps {wrong[:5]}")
    return row


def _jsonl_steps(path: Path) -> tuple[list[int], list[float]]:
    steps, values = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            steps.append(data["step"])
            values.append(data["values"]["loss"])
    return steps, values


def _raise_while(clock: _Clock) -> Callable[[int], None]:
    def fault(step: int) -> None:
        if clock.active():
            raise ConnectionError("tracker unreachable")

    return fault


# --------------------------------------------------------------------------------- scenarios


def sink_raises(tmp: Path, windows: int = 200, outage_s: float = 1.5) -> Iterator[Row]:
    clock = _Clock(outage_s)
    flaky = FaultSink("flaky", _raise_while(clock), clock)
    jsonl = JsonlSink(tmp / "raise.jsonl")
    before = rss_mib()
    _collector, complete, blocked = _drive(
        [flaky, jsonl],
        windows,
        on_step=lambda s: clock.begin() if s == 10 else None,
        step_s=0.01,
        sink_retry_initial_s=0.05,
        sink_retry_max_s=0.2,
    )
    recover = flaky.recover_s
    fault = f"sink write raises for {outage_s} s"
    outcome = f"retried with backoff; close returned {complete}"
    yield _row(
        fault,
        "flaky",
        flaky.steps,
        flaky.values,
        windows,
        outcome=outcome,
        recover_s=recover,
        blocked_ms=max(blocked) * 1e3,
        memory_mib=rss_mib() - before,
        ok=complete,
    )
    steps, values = _jsonl_steps(tmp / "raise.jsonl")
    yield _row(fault, "jsonl (healthy)", steps, values, windows, outcome="unaffected")


def sink_hangs(tmp: Path, windows: int = 100, hang_s: float = 3.0) -> Iterator[Row]:
    def fault(step: int) -> None:
        if step == 5:
            time.sleep(hang_s)

    hung = FaultSink("hung", fault)
    jsonl = JsonlSink(tmp / "hang.jsonl", flush_every=1)
    jsonl_done: list[float] = []
    start = time.monotonic()

    def watch(step: int) -> None:
        if step == windows:
            jsonl_done.append(time.monotonic() - start)

    _collector, complete, blocked = _drive([hung, jsonl], windows, on_step=watch, step_s=0.005)
    fault_name = f"one write hangs {hang_s:.0f} s"
    yield _row(
        fault_name,
        "hung",
        hung.steps,
        hung.values,
        windows,
        outcome=f"caught up after the hang; close returned {complete}",
        blocked_ms=max(blocked) * 1e3,
        ok=complete,
    )
    steps, values = _jsonl_steps(tmp / "hang.jsonl")
    yield _row(
        fault_name,
        "jsonl (healthy)",
        steps,
        values,
        windows,
        outcome="unaffected (own queue and thread)",
    )


def slow_sink(tmp: Path, windows: int = 400, delay_s: float = 0.01) -> Iterator[Row]:
    slow = FaultSink("slow", lambda step: time.sleep(delay_s))
    before = rss_mib()
    runner_peaks: list[int] = []

    def watch(step: int) -> None:
        if collector_ref and collector_ref[0].sink_runners:
            runner_peaks.append(collector_ref[0].sink_runners[0].spooled_bytes)

    collector_ref: list[AsyncMetricCollector[Any]] = []
    metric = MeanMetric()
    collector = AsyncMetricCollector(
        metric, sinks=[slow], prefix="loss", sink_capacity=16, spool_dir=str(tmp / "spool")
    )
    collector_ref.append(collector)
    collector.bind("cpu")
    blocked = []
    for step in range(1, windows + 1):
        watch(step)
        metric.update(torch.tensor([float(step)]))
        start = time.perf_counter()
        collector.schedule_collection(step)
        blocked.append(time.perf_counter() - start)
    complete = collector.close(120)
    yield _row(
        f"sink takes {delay_s * 1e3:.0f} ms per write (windows every ~0.1 ms)",
        "slow",
        slow.steps,
        slow.values,
        windows,
        outcome=f"queue of 16 then spool (peak {max(runner_peaks) / 1024:.1f} KiB); "
        f"close returned {complete}",
        blocked_ms=max(blocked) * 1e3,
        memory_mib=rss_mib() - before,
        ok=complete,
    )


def down_at_start(tmp: Path, windows: int = 100, outage_s: float = 1.5) -> Iterator[Row]:
    clock = _Clock(outage_s)
    clock.begin()
    sink = FaultSink("down", clock=clock)

    def open_fault() -> None:
        if clock.active():
            raise ConnectionError("connection refused")

    sink.open_fault = open_fault
    _collector, complete, blocked = _drive(
        [sink], windows, step_s=0.005, sink_retry_initial_s=0.05, sink_retry_max_s=0.2
    )
    yield _row(
        f"backend down for the first {outage_s} s (open raises)",
        "down",
        sink.steps,
        sink.values,
        windows,
        outcome=f"opened on a retry; close returned {complete}",
        recover_s=sink.recover_s,
        blocked_ms=max(blocked) * 1e3,
        ok=complete,
    )


def hang_at_close(tmp: Path, windows: int = 50) -> Iterator[Row]:
    release = threading.Event()

    def fault(step: int) -> None:
        if step > 20:
            release.wait(30)

    sink = FaultSink("stuck", fault)
    spool = tmp / "close-spool"
    _collector, complete, blocked = _drive([sink], windows, close_timeout=1.0, spool_dir=str(spool))
    release.set()
    kept = list(spool.glob("*.spool.jsonl"))
    replayed = JsonlSink(tmp / "replayed.jsonl")
    count = sum(replay_spool(path, replayed).written for path in kept)
    steps, _values = _jsonl_steps(tmp / "replayed.jsonl")
    time.sleep(0.2)  # the abandoned thread finishes the write it was stuck in
    both = sorted(sink.steps + steps)
    row = _row(
        "sink stuck at close (close timeout 1 s), spool replayed",
        "stuck + replay",
        both,
        [float(s) for s in both],
        windows,
        outcome=f"close returned {complete} within its timeout; {count} reports kept "
        "in a spool file and replayed into a JSONL file",
        blocked_ms=max(blocked) * 1e3,
        ok=not complete and count > 0,
    )
    if row.duplicated:
        row.notes.append(
            "the write the thread was stuck in finished after close gave up: that report is "
            "both delivered and kept (at least once on this path)"
        )
    yield row


def unusable_spool_dir(tmp: Path, windows: int = 100) -> Iterator[Row]:
    blocker = tmp / "not-a-dir"
    gate = threading.Event()
    stuck = FaultSink("stuck", lambda step: gate.wait(60))
    jsonl = JsonlSink(tmp / "spooldir.jsonl", flush_every=1)
    metric = MeanMetric()
    collector = AsyncMetricCollector(
        metric, sinks=[stuck, jsonl], prefix="loss", spool_dir=str(blocker), sink_capacity=8
    )
    collector.bind("cpu")
    # A file in its place once the job runs (one there already is refused when it is built).
    blocker.write_text("")
    runners = {r.key: r for r in collector.sink_runners}
    for step in range(1, windows + 1):
        metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
        if step % 4 == 0:
            collector.collect_results(30)
            runners["jsonl"].wait_delivered(30)
    collector.collect_results(30)
    gate.set()
    complete = collector.close(30)
    dropped = runners["stuck"].dropped
    yield _row(
        "spool directory unusable (a file)",
        "stuck",
        stuck.steps,
        stuck.values,
        windows,
        outcome=f"{dropped} reports past the queue dropped and counted (dropped={dropped})"
        f"; close returned {complete}",
        ok=(not complete) and dropped == windows - len(stuck.steps),
    )
    steps, values = _jsonl_steps(tmp / "spooldir.jsonl")
    yield _row(
        "spool directory unusable (a file)",
        "jsonl (healthy)",
        steps,
        values,
        windows,
        outcome="unaffected",
    )


def spool_full(tmp: Path, windows: int = 300) -> Iterator[Row]:
    gate = threading.Event()
    stuck = FaultSink("stuck", lambda step: gate.wait(60))
    metric = MeanMetric()
    collector = AsyncMetricCollector(
        metric,
        sinks=[stuck],
        prefix="loss",
        spool_dir=str(tmp / "full"),
        sink_capacity=8,
        spool_max_bytes=4096,
    )
    collector.bind("cpu")
    for step in range(1, windows + 1):
        metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
    collector.collect_results(30)
    runner = collector.sink_runners[0]
    spooled = runner.spooled_bytes
    gate.set()
    complete = collector.close(30)
    oldest_kept = sorted(stuck.steps)[9] if len(stuck.steps) > 9 else None
    yield _row(
        "spool full (spool_max_bytes=4096, sink stuck)",
        "stuck",
        stuck.steps,
        stuck.values,
        windows,
        outcome=f"oldest dropped, counted (dropped={runner.dropped}); spool held "
        f"{spooled} B; newest kept from step {oldest_kept}; close returned {complete}",
        ok=runner.dropped == windows - len(stuck.steps) and spooled <= 4096,
    )


def damaged_spool(tmp: Path, windows: int = 60) -> Iterator[Row]:
    gate = threading.Event()
    stuck = FaultSink("stuck", lambda step: gate.wait(60))
    metric = MeanMetric()
    collector = AsyncMetricCollector(
        metric, sinks=[stuck], prefix="loss", spool_dir=str(tmp / "damaged"), sink_capacity=4
    )
    collector.bind("cpu")
    for step in range(1, windows + 1):
        metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
    collector.collect_results(30)
    # Every window reached the runner; its spool thread writes the backlog on its own time.
    runner = collector.sink_runners[0]
    last = f'"step":{windows},'.encode()
    deadline = time.monotonic() + 60
    while True:
        files = list((tmp / "damaged").glob("*.spool.jsonl"))
        idle = not runner._waiting_in() and runner._admitting is None
        if files and last in files[0].read_bytes() and idle:
            break
        assert time.monotonic() < deadline, "the spool thread never wrote the backlog"
        time.sleep(0.01)
    (path,) = files
    data = bytearray(path.read_bytes())
    for target in (b'"step":20,', b'"step":40,'):
        index = data.index(target)
        data[index : index + 5] = b"#####"
    path.write_bytes(bytes(data))
    gate.set()
    complete = collector.close(30)
    dropped = collector.sink_runners[0].dropped
    yield _row(
        "spool file damaged (2 lines overwritten)",
        "stuck",
        stuck.steps,
        stuck.values,
        windows,
        outcome=f"damaged lines dropped and counted (dropped={dropped}); the "
        f"rest delivered; close returned {complete}",
        ok=dropped == 2,
    )


_DISK_FULL = r"""
import json, resource, signal, sys, time
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
import torch
from sidestream import AsyncMetricCollector, MeanMetric
from sidestream.sinks import JsonlSink
out, spool, windows = sys.argv[1], sys.argv[2], int(sys.argv[3])
metric = MeanMetric()
collector = AsyncMetricCollector(metric, sinks=[JsonlSink(out, flush_every=1)], prefix="loss",
                                 spool_dir=spool, sink_capacity=8, sink_retry_max_s=0.2)
collector.bind("cpu")
resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
for step in range(1, windows + 1):
    metric.update(torch.tensor([float(step)]))
    collector.schedule_collection(step)
    time.sleep(0.002)
complete = collector.close(3)
runner = collector.sink_runners[0]
print(json.dumps({"complete": complete, "dropped": runner.dropped, "delivered": runner.delivered,
                  "state": runner.sink_state()}))
"""


def disk_full(tmp: Path, windows: int = 200) -> Iterator[Row]:
    out = tmp / "full.jsonl"
    result = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, str(out), str(tmp / "full-spool"), str(windows)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    if result.returncode != 0:
        yield Row(
            "disk full (RLIMIT_FSIZE 3000 B)",
            "jsonl",
            f"crashed: {result.stderr[-300:]}",
            0,
            windows,
            0,
            windows,
            ok=False,
        )
        return
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    steps, values = _jsonl_steps(out)
    kept = [r.step for p in (tmp / "full-spool").glob("*.spool.jsonl") for r in read_spool(p)]
    last = summary["state"].get("last_step")
    row = _row(
        "disk full (RLIMIT_FSIZE 3000 B) under the JSONL file and the spool",
        "jsonl",
        steps,
        values,
        windows,
        outcome=f"writes fail and are retried; close returned {summary['complete']}; "
        f"dropped (counted) {summary['dropped']}; kept in spool {len(kept)}; "
        f"state last_step={last}",
    )
    # Honest accounting: every step is either in the file, kept, or counted as dropped.
    accounted = row.delivered + len(kept) + summary["dropped"]
    row.ok = (
        not summary["complete"]
        and accounted >= windows
        and (last is None or last <= max(steps, default=0))
    )
    if accounted < windows:
        row.notes.append(f"{windows - accounted} steps neither delivered, kept nor counted")
    if last is not None and last > max(steps, default=0):
        row.notes.append(f"state says last_step={last} but the file ends at {max(steps)}")
    yield row


FAST = [
    sink_raises,
    sink_hangs,
    slow_sink,
    down_at_start,
    hang_at_close,
    unusable_spool_dir,
    spool_full,
    damaged_spool,
    disk_full,
]


def run_all(scenarios: list[Callable[[Path], Iterator[Row]]] = FAST) -> list[Row]:
    rows = []
    for scenario in scenarios:
        with tempfile.TemporaryDirectory(prefix="sidestream-rel-") as tmp:
            rows.extend(scenario(Path(tmp)))
    return rows


# ------------------------------------------------------------------- heavier: real backends


def mlflow_server_restart(
    tmp: Path, windows: int = 150, down: tuple[int, int] = (30, 90)
) -> Iterator[Row]:
    """A real ``mlflow server`` (SQLite store) killed at one step and started again later."""
    import shutil

    from mlflow.tracking import MlflowClient

    from sidestream_mlflow import MlflowSink
    from tests.integrations.conftest import MlflowServer

    root = Path(
        tempfile.mkdtemp(
            prefix="sidestream-rel-mlflow-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
    )
    server = MlflowServer(root)
    server.start()
    listening = listening_addresses(server.port)
    password = "planted-secret-password"
    uri = server.uri.replace("://", f"://alice:{password}@")
    restarted_at: list[float] = []

    def on_step(step: int) -> None:
        if step == down[0]:
            server.kill()
        if step == down[1]:
            server.start()
            restarted_at.append(time.monotonic())

    written: list[float] = []

    class TimedMlflowSink(MlflowSink):
        def write_batch(self, reports: Any) -> None:
            super().write_batch(reports)
            written.append(time.monotonic())

        def write(self, report: Report) -> None:
            super().write(report)
            written.append(time.monotonic())

    sink = TimedMlflowSink(uri, experiment="outage", http_timeout=2)
    before = rss_mib()
    try:
        collector, complete, blocked = _drive(
            [sink],
            windows,
            on_step=on_step,
            step_s=0.02,
            sink_retry_initial_s=0.05,
            sink_retry_max_s=0.5,
            sink_capacity=8,
            spool_dir=str(tmp / "spool"),
            close_timeout=180,
        )
        runner = collector.sink_runners[0]
        client = MlflowClient(tracking_uri=server.uri)
        experiment = client.get_experiment_by_name("outage")
        runs = client.search_runs([experiment.experiment_id])
        history = [m for r in runs for m in client.get_metric_history(r.info.run_id, "loss")]
        steps = [m.step for m in history]
        values = [m.value for m in history]
        logs = (root / "server.log").read_text(errors="replace")
    finally:
        server.kill()
        shutil.rmtree(root, ignore_errors=True)
    row = _row(
        f"MLflow server killed at step {down[0]}, restarted at step {down[1]}",
        "mlflow (server)",
        steps,
        values,
        windows,
        outcome=f"{len(runs)} run; backlog spooled then sent in batches; close returned {complete}",
        blocked_ms=max(blocked) * 1e3,
        memory_mib=rss_mib() - before,
        ok=complete and len(runs) == 1,
    )
    del runner
    after = [t - restarted_at[0] for t in written if restarted_at and t > restarted_at[0]]
    row.recover_s = min(after) if after else None
    if listening != {"0100007F"}:
        row.ok = False
        row.notes.append(f"the test server listens on {listening}, not only 127.0.0.1")
    if password in logs:
        row.ok = False
        row.notes.append("the planted password reached the server log")
    yield row
