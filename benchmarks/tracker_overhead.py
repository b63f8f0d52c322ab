"""Training-thread cost of logging one step: a tracker's own client vs a sidestream sink.

"Direct" is what training code usually does: ``loss.item()`` and then the tracker call
(``run.log``, ``mlflow.log_metrics``, ``SummaryWriter.add_scalar``) on the training thread. "Via
sink" updates a sidestream metric and calls ``AsyncMetricCollector.schedule_collection``: the real
pipeline (dispatcher thread, then the sink's own ``SinkRunner`` thread), which also moves the
``.item()`` off the training thread. "Via child" is the same with the sink wrapped in a
``ProcessSink``, so the tracker client runs in a child process. Each step also does a small
fixed amount of compute, so the table shows the loop's step time too: a background thread
competes with it for the GIL, a child process does not.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks._threads import one_thread
from sidestream import AsyncMetricCollector, Metric, MetricAccumulator
from sidestream.sinks import ProcessSink, Sink

STEPS = {"tensorboard": 400, "mlflow": 100, "wandb": 400}
VALUES = 8  # metrics per logged step (loss plus per-class values)


class _Values(Metric[torch.Tensor]):
    """The window's mean of each of ``VALUES`` per-step values (a vector state)."""

    def __init__(self) -> None:
        self._total = MetricAccumulator(torch.zeros(VALUES, dtype=torch.float64))
        self._count = MetricAccumulator(0.0, dtype=torch.float64)

    def update(self, values: torch.Tensor) -> None:
        self._total.accumulate(values)
        self._count.accumulate(torch.ones((), dtype=torch.float64))

    def compute(self) -> torch.Tensor:
        return self._total.value / self._count.value


class _ThroughCollector:
    """The real pipeline: ``AsyncMetricCollector`` with the sink behind a ``SinkRunner``."""

    def __init__(self, sink: Sink) -> None:
        self._collector = AsyncMetricCollector(_Values(), sinks=[sink]).bind("cpu")
        # Warm up: the sink is open (a child process started) before the timed loop begins.
        self.log(0, torch.zeros(VALUES))  # steps are >= 0; the timed loop starts at 1
        self._collector.collect_results(timeout=300)  # handed to the sink's runner
        for runner in self._collector.sink_runners:
            assert runner.wait_delivered(timeout=300), "the warm-up report must arrive"

    def log(self, step: int, values: torch.Tensor) -> None:
        self._collector.metric.update(values)
        self._collector.schedule_collection(step)

    def close(self) -> float:
        started = time.perf_counter()
        assert self._collector.close(timeout=300), "every report must reach the sink"
        return time.perf_counter() - started


def _piped(steps: int, make_sink: Callable[[], Sink]) -> dict[str, Any]:
    """Through the collector, with the sink on a thread and then in a child process."""
    out: dict[str, Any] = {}
    for kind, sink in (("sink", make_sink()), ("child", ProcessSink(make_sink()))):
        piped = _ThroughCollector(sink)
        out[kind] = _loop(steps, piped.log)
        out[f"{kind} drain"] = piped.close()
    return out


def _loop(steps: int, log: Callable[[int, torch.Tensor], None]) -> tuple[float, float]:
    """(seconds per step spent in ``log``, seconds per whole step) on the training thread."""
    weights = torch.randn(128, 128)
    batch = torch.randn(64, 128)
    in_log = 0.0
    started = time.perf_counter()
    for step in range(1, steps + 1):
        values = (batch @ weights).relu().mean(dim=0)[:VALUES]  # "training" + metric values
        before = time.perf_counter()
        log(step, values)
        in_log += time.perf_counter() - before
    total = time.perf_counter() - started
    return in_log / steps, total / steps


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _tensorboard(root: Path) -> dict[str, Any]:
    from torch.utils.tensorboard import SummaryWriter

    from sidestream_tensorboard import TensorBoardSink

    writer = SummaryWriter(log_dir=str(root / "direct"))

    def direct(step: int, values: torch.Tensor) -> None:
        for i in range(VALUES):
            writer.add_scalar(f"metric_{i}", values[i].item(), step)

    direct(0, torch.zeros(VALUES))  # warmed up as the sink side is (see _ThroughCollector)
    direct_cost = _loop(STEPS["tensorboard"], direct)
    drain = _timed(writer.close)
    piped = _piped(STEPS["tensorboard"], lambda: TensorBoardSink(log_dir=root / "sink"))
    return {"direct": direct_cost, "direct drain": drain, **piped}


def _mlflow(root: Path, *, synchronous: bool = True) -> dict[str, Any]:
    import mlflow

    from sidestream_mlflow import MlflowSink

    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("bench")
    mlflow.start_run()

    def direct(step: int, values: torch.Tensor) -> None:
        # One request for the step's values, as the sink's log_batch: like for like.
        # synchronous=False: MLflow's own background logging, drained by end_run.
        mlflow.log_metrics(
            {f"metric_{i}": values[i].item() for i in range(VALUES)},
            step=step,
            synchronous=synchronous,
        )

    direct(0, torch.zeros(VALUES))  # warmed up as the sink side is (see _ThroughCollector)
    direct_cost = _loop(STEPS["mlflow"], direct)
    drain = _timed(mlflow.end_run)
    piped = _piped(STEPS["mlflow"], lambda: MlflowSink(tracking_uri=uri, experiment="bench"))
    return {"direct": direct_cost, "direct drain": drain, **piped}


def _wandb(root: Path) -> dict[str, Any]:
    import wandb

    from sidestream_wandb import WandbSink

    run = wandb.init(project="bench", mode="offline", dir=str(root), reinit="create_new")

    def direct(step: int, values: torch.Tensor) -> None:
        run.log({f"metric_{i}": values[i].item() for i in range(VALUES)}, step=step)

    direct(0, torch.zeros(VALUES))  # warmed up as the sink side is (see _ThroughCollector)
    direct_cost = _loop(STEPS["wandb"], direct)
    drain = _timed(run.finish)
    piped = _piped(
        STEPS["wandb"], lambda: WandbSink(project="bench", mode="offline", dir=str(root))
    )
    return {"direct": direct_cost, "direct drain": drain, **piped}


def _timed(action: Callable[[], object]) -> float:
    """Seconds ``action`` takes (a tracker's close: the work it still had queued)."""
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


@one_thread
def run() -> str:
    os.environ.setdefault("WANDB_SILENT", "true")
    backends = {
        "TensorBoard (`SummaryWriter.add_scalar`)": _tensorboard,
        "MLflow, SQLite store (`mlflow.log_metrics`)": _mlflow,
        "MLflow, SQLite store (`log_metrics(..., synchronous=False)`)": partial(
            _mlflow, synchronous=False
        ),
        "W&B offline (`run.log`)": _wandb,
    }
    rows = []
    for label, measure in backends.items():
        with tempfile.TemporaryDirectory() as tmp, _quiet():
            result = measure(Path(tmp))
        (direct_log, direct_step), (sink_log, sink_step) = result["direct"], result["sink"]
        child_log, child_step = result["child"]
        rows.append(
            f"| {label} | {direct_log * 1e6:,.0f} | {sink_log * 1e6:,.1f} | "
            f"{child_log * 1e6:,.1f} | {direct_log / sink_log:,.1f}x | "
            f"{direct_log / child_log:,.1f}x | "
            f"{direct_step * 1e6:,.0f} | {sink_step * 1e6:,.0f} | {child_step * 1e6:,.0f} | "
            f"{direct_step / sink_step:.1f}x | {direct_step / child_step:.1f}x | "
            f"{result['direct drain']:.2f} / {result['sink drain']:.2f} / "
            f"{result['child drain']:.2f} |"
        )
    return (
        "## Tracker overhead on the training thread\n\n"
        f"`benchmarks/tracker_overhead.py`: {VALUES} values per logged step, every step logged; a "
        "small matmul stands in for the training step. *Direct*: `.item()` then the tracker's "
        "own call on the training thread. *Via sink*: `metric.update` + "
        "`AsyncMetricCollector.schedule_collection` (the real pipeline: dispatcher thread, then "
        "the sink's own thread). *Via child*: the same with the sink wrapped in `ProcessSink` "
        "(`child_process: true`), so the tracker client runs in a child process. "
        "Ratios are direct / via sink (thread) and direct / via child, of the time in the "
        "logging call and of the whole step. Each loop makes one untimed call first (direct "
        "and via sink alike: step 0). MLflow's own background logging "
        "(`synchronous=False`, which queues each call for a thread of MLflow's) has a row of "
        "its own; its sidestream columns are measured again in that row. *Drain*: seconds "
        "still needed after the loop ended: the tracker's own close for direct logging "
        "(`SummaryWriter.close`, `mlflow.end_run`, which waits for MLflow's queue, "
        "`run.finish`), the background thread (or child) for sidestream (off the training "
        "thread); where it is large, most delivery happened after the loop, so the step-time "
        "columns understate the background thread's share of the GIL. Each backend is "
        "measured once, in the order direct, via sink, via child: compare rows measured in "
        "the same run only. On CPU tensors "
        "`.item()` is free; on a GPU each one is a host sync that stalls the training "
        "thread, which this CPU measurement cannot show. Absolute numbers depend heavily on "
        "the machine's load.\n\n"
        "| backend | direct log µs/step | via sink log µs/step | via child log µs/step | "
        "log: direct / sink | log: direct / child | direct step µs | via sink step µs | "
        "via child step µs | step: direct / sink | step: direct / child | "
        "drain s (direct / sink / child) |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
        + "\n".join(rows)
        + "\n"
    )


if __name__ == "__main__":
    print(run())
