"""Kill rank 0 of a real 2-rank job (SIGKILL, SIGTERM; right after a checkpoint and at random
steps), restart both ranks from the last checkpoint, and check that JSONL, TensorBoard and MLflow
hold every step exactly once, in the same runs. Also: how fast rank 1 fails once rank 0 is gone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests._ports import quiet_port
from tests.integrations._workload import expected
from tests.reliability.scenarios import Row

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Launch:
    ranks: list[subprocess.Popen[bytes]]
    logs: list[Path]


def launch(out: Path, steps: int, timeout_s: float = 20.0, attempt: int = 0) -> Launch:
    port = quiet_port()
    ranks, logs = [], []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "MLFLOW_DISABLE_TELEMETRY": "true",
            # The root for the job's imports, before the suite's own path (device-check's).
            "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        }
        log = out / f"rank{rank}.attempt{attempt}.log"
        with log.open("wb") as handle:
            ranks.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.reliability._job",
                        str(out),
                        "--steps",
                        str(steps),
                        "--timeout-s",
                        str(timeout_s),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                )
            )
        logs.append(log)
    return Launch(ranks, logs)


def _progress(out: Path) -> list[str]:
    path = out / "progress.txt"
    return path.read_text().splitlines() if path.exists() else []


def _wait_for(out: Path, predicate: Any, launch_: Launch, limit_s: float = 240.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate(_progress(out)):
        if any(p.poll() is not None for p in launch_.ranks):
            raise RuntimeError(f"a rank ended early:\n{_tails(launch_)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the job made no progress:\n{_tails(launch_)}")
        time.sleep(0.01)


def _tails(launch_: Launch) -> str:
    return "\n".join(
        f"--- {log.name} (exit {p.poll()}):\n{log.read_text(errors='replace')[-1500:]}"
        for p, log in zip(launch_.ranks, launch_.logs, strict=True)
    )


def _kill_rank0(launch_: Launch, sig: int) -> float:
    """Send ``sig`` to rank 0; return how long rank 1 took to exit on its own (or -1)."""
    launch_.ranks[0].send_signal(sig)
    launch_.ranks[0].wait(30)
    start = time.monotonic()
    try:
        launch_.ranks[1].wait(60)
        return time.monotonic() - start
    except subprocess.TimeoutExpired:
        launch_.ranks[1].kill()
        launch_.ranks[1].wait(30)
        return -1.0


FULL_PLAN = [
    ("SIGKILL just after a checkpoint", signal.SIGKILL, "checkpoint"),
    ("SIGKILL at a random step", signal.SIGKILL, "random"),
    ("SIGTERM at a random step", signal.SIGTERM, "random"),
]


def run(
    out: Path, steps: int = 60, seed: int = 0, plan: list[tuple[str, int, str]] = FULL_PLAN
) -> tuple[list[Row], dict[str, Any]]:
    """The faults of ``plan`` in one job, then a clean finish; rows and raw figures."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"rank1_exit_s": [], "rank1_messages": [], "kills": []}
    attempt = 0
    for name, sig, where in plan:
        job = launch(out, steps, attempt=attempt)
        done = len(_progress(out))
        if where == "checkpoint":
            _wait_for(out, lambda p, d=done: any(x.startswith("checkpoint") for x in p[d:]), job)
        else:
            target = rng.randint(3, 12)
            _wait_for(
                out, lambda p, d=done, t=target: sum(x.startswith("step") for x in p[d:]) >= t, job
            )
        last = _progress(out)[-1]
        exit_s = _kill_rank0(job, sig)
        figures["kills"].append(f"{name} ({last})")
        figures["rank1_exit_s"].append(exit_s)
        figures["rank1_messages"].append(_error_line(job.logs[1].read_text(errors="replace")))
        attempt += 1
    job = launch(out, steps, attempt=attempt)
    for process in job.ranks:
        process.wait(300)
    codes = [p.returncode for p in job.ranks]
    figures["final_exit_codes"] = codes
    if codes != [0, 0]:
        figures["final_logs"] = _tails(job)
    rows = check(out, steps, figures)
    return rows, figures


def _error_line(log: str) -> str:
    lines = [line for line in log.splitlines() if "Error" in line or "error" in line]
    return lines[-1][:200] if lines else "(no error line)"


def _row(
    tracker: str, steps: list[int], n: int, figures: dict[str, Any], ok: bool, note: str, runs: int
) -> Row:
    counts = Counter(steps)
    want = set(range(n))
    row = Row(
        fault=f"rank 0 killed {len(figures['kills'])}x ("
        + "; ".join(figures["kills"])
        + "), both ranks restarted from the last checkpoint",
        sink=tracker,
        outcome=f"{runs} run(s); {note}",
        delivered=len(want & set(counts)),
        lost=len(want - set(counts)),
        duplicated=sum(c - 1 for s, c in counts.items() if c > 1),
        expected=n,
        ok=ok and runs == 1 and set(counts) == want and all(c == 1 for c in counts.values()),
    )
    return row


def check(out: Path, n: int, figures: dict[str, Any]) -> list[Row]:
    rows = []
    # JSONL: one line per step, values as computed directly from all ranks' data.
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    steps = [line["step"] for line in lines]
    wrong = [
        line["step"]
        for line in lines
        if not np.isclose(line["values"]["loss"], expected(line["step"])[0]["loss"], rtol=1e-12)
    ]
    rows.append(
        _row(
            "jsonl",
            steps,
            n,
            figures,
            not wrong,
            f"wrong values at {wrong[:5]}" if wrong else "values match a direct computation",
            1,
        )
    )
    # TensorBoard, read with its own reader.
    from tensorboard.backend.event_processing import event_accumulator

    tb_dirs = sorted({p.parent for p in (out / "tb").rglob("events.out.tfevents.*")})
    tb_steps: list[int] = []
    tb_wrong: list[int] = []
    for directory in tb_dirs:
        guidance = dict.fromkeys(event_accumulator.DEFAULT_SIZE_GUIDANCE, 0)
        accumulator = event_accumulator.EventAccumulator(str(directory), size_guidance=guidance)
        accumulator.Reload()
        if "loss" in accumulator.Tags().get("scalars", []):
            for event in accumulator.Scalars("loss"):
                tb_steps.append(event.step)
                if not np.isclose(event.value, expected(event.step)[0]["loss"], rtol=1e-6):
                    tb_wrong.append(event.step)
    rows.append(
        _row(
            "tensorboard",
            tb_steps,
            n,
            figures,
            not tb_wrong,
            f"{len(tb_dirs)} event directory(ies) read with EventAccumulator",
            len(tb_dirs) or 0,
        )
    )
    # MLflow, read with its own client.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("faults")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    ml_steps: list[int] = []
    ml_wrong: list[int] = []
    for run_ in runs:
        for m in client.get_metric_history(run_.info.run_id, "loss"):
            ml_steps.append(m.step)
            if not np.isclose(m.value, expected(m.step)[0]["loss"], rtol=1e-12):
                ml_wrong.append(m.step)
    rows.append(
        _row(
            "mlflow (sqlite)",
            ml_steps,
            n,
            figures,
            not ml_wrong,
            "read with MlflowClient",
            len(runs),
        )
    )
    return rows


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        found_rows, found = run(Path(tmp))
        for r in found_rows:
            print(r)
        print(json.dumps(found, indent=1))
