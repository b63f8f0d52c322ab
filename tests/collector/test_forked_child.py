"""A run or collector used in a child made by ``os.fork`` fails loudly instead of dropping.

Their threads (the dispatcher, the sinks' runners) stay in the process that started them: in
the child, ``run.log`` and ``schedule_collection`` returned normally and nothing was delivered,
and the child's ``close`` said every report was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests._scripts import run_python


def _job(tmp_path: Path, template: str, timeout: float = 180, **fields: str) -> tuple[Any, str]:
    """Run ``template`` (filled with ``fields``) as a script; its last stdout line as JSON."""
    script = tmp_path / "job.py"
    script.write_text(template.format(**fields))
    done = run_python(str(script), timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


_SCRIPT = """
import json, os, sys
from sidestream import MeanMetric, Run
from sidestream.sinks import JsonlSink

run = Run([JsonlSink({path!r})])
train = run.collector(MeanMetric(), prefix="train").bind("cpu")
train.metric.update(1.0)
train.schedule_collection(1)
run.log(1, {{"lr": 0.1}})
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    seen = {{}}
    for name, call in (
        ("log", lambda: run.log(2, {{"lr": 0.2}})),
        ("schedule", lambda: train.schedule_collection(2)),
    ):
        try:
            call()
            seen[name] = "returned"
        except RuntimeError as error:
            seen[name] = str(error)
    seen["close"] = run.close(timeout=5)
    os.write(write, json.dumps(seen).encode())
    sys.exit(0)  # its at-exit hooks run: they must leave the parent's run alone
os.close(write)
with os.fdopen(read) as pipe:
    seen = json.loads(pipe.read())
_, status = os.waitpid(pid, 0)
train.metric.update(3.0)
train.schedule_collection(2)
run.log(2, {{"lr": 0.2}})
print(json.dumps({{"child": seen, "child_exit": os.waitstatus_to_exitcode(status),
                  "closed": run.close(timeout=60)}}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_is_refused_the_parents_run_and_its_close_does_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.jsonl"
    result, stderr = _job(tmp_path, _SCRIPT, path=str(path))
    child = result["child"]
    assert child["log"].startswith("log: this Run was started in the process this one was"), child
    assert "forked from (os.fork)" in child["schedule"], child
    assert child["close"] is False  # not "every report delivered": it delivers nothing
    assert "nothing was done here" in stderr
    assert result["child_exit"] == 0
    assert result["closed"] is True
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [(line["step"], sorted(line["values"])) for line in lines]
    assert sorted(steps) == [(1, ["lr"]), (1, ["train"]), (2, ["lr"]), (2, ["train"])]
    trained = [line["values"]["train"] for line in lines if "train" in line["values"]]
    assert trained == [1.0, 3.0]  # each window once, the second with the parent's update only


_IN_FLIGHT = """
import json, os, signal, sys, time
from sidestream import MeanMetric, Run
from sidestream.sinks import JsonlSink

class Slow(MeanMetric):
    def compute(self):
        time.sleep(2.0)  # the window is still being computed when the trainer forks
        return super().compute()

run = Run([JsonlSink({path!r})])
train = run.collector(Slow(), prefix="train").bind("cpu")
train.metric.update(1.0)
train.schedule_collection(1)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    signal.alarm(20)  # a call that waits for the parent's threads ends the child here
    seen = {{}}
    for name, call in (
        ("collect_results", lambda: train.collect_results()),
        ("collector.state_dict", lambda: train.state_dict()),
        ("run.state_dict", lambda: run.state_dict()),
        ("bind", lambda: run.collector(MeanMetric(), prefix="val").bind("cpu")),
    ):
        try:
            call()
            seen[name] = "returned"
        except RuntimeError as error:
            seen[name] = str(error)
    os.write(write, json.dumps(seen).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read) as pipe:
    seen = json.loads(pipe.read())
os.waitpid(pid, 0)
print(json.dumps({{"child": seen, "parent": train.collect_results(),
                  "closed": run.close(timeout=60)}}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_is_refused_the_calls_that_wait_for_the_parents_threads(
    tmp_path: Path,
) -> None:
    # A window in flight at the fork is computed by the parent's dispatcher thread: in the
    # child collect_results and state_dict waited for it for ever (with a timeout, blaming a
    # rank that was behind), and a new collector's bind handed its windows to the parent's
    # sink threads.
    result, _ = _job(tmp_path, _IN_FLIGHT, timeout=120, path=str(tmp_path / "m.jsonl"))
    for name, outcome in result["child"].items():
        assert "forked from (os.fork)" in outcome, (name, outcome)
    assert result["parent"] == 1.0
    assert result["closed"] is True


# A run made in a multiprocessing child and left to the close at exit, as a LightningModule's
# or an Accelerate training function's run is when the job does not close it: under the fork
# and forkserver methods (Lightning's ddp_fork / ddp_notebook, Accelerate's notebook_launcher)
# the child ends with os._exit, which runs no atexit hook.
_CHILD_SCRIPT = """
import json, multiprocessing, sys, time
from sidestream import MeanMetric, Run
from sidestream.sinks import JsonlSink, Sink

class SlowSink(Sink):
    name = "slow"

    def __init__(self, path):
        self.path = path

    def open(self, run):
        pass

    def write(self, report):
        time.sleep(0.02)  # a tracker's round trip
        with open(self.path, "a") as f:
            f.write(json.dumps([report.stream, report.step]) + "\\n")

def train(folder):
    run = Run([JsonlSink(folder + "/m.jsonl"), SlowSink(folder + "/slow.jsonl")])
    collector = run.collector(MeanMetric(), prefix="train").bind("cpu")
    for step in range(1, 31):
        collector.metric.update(float(step))
        collector.schedule_collection(step)
        run.log(step, {{"lr": 0.1}})
    # no close: the run closes at the process's exit, as in the main process

if __name__ == "__main__":
    child = multiprocessing.get_context({method!r}).Process(target=train, args=({folder!r},))
    child.start()
    child.join(120)
    print(json.dumps({{"exitcode": child.exitcode}}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs the fork and forkserver methods")
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_run_left_open_in_a_multiprocessing_child_is_closed_at_its_exit(
    tmp_path: Path, method: str
) -> None:
    result, stderr = _job(tmp_path, _CHILD_SCRIPT, method=method, folder=str(tmp_path))
    assert result == {"exitcode": 0}, stderr
    expected = sorted((stream, step) for stream in ("", "train") for step in range(1, 31))
    slow = [tuple(json.loads(line)) for line in (tmp_path / "slow.jsonl").read_text().splitlines()]
    assert sorted(slow) == expected  # every report, once: nothing left in the dead sink thread
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sorted((line["stream"], line["step"]) for line in lines) == expected


# A run left open in a multiprocessing child whose target raised: multiprocessing prints the
# exception itself (the child's sys.excepthook never sees it) and runs its finalizers, the
# close at exit among them, in a ``finally`` while it is on its way out.
_CRASHED_CHILD = """
import json, multiprocessing, os, sys
from sidestream import Run
from sidestream.sinks import Sink
from sidestream.sinks.support import failed_exit_code

class CodeSink(Sink):
    name = "code"

    def __init__(self, path):
        self.path = path

    def open(self, run):
        pass

    def write(self, report):
        pass

    def close(self, timeout=None):
        with open(self.path, "a") as f:
            f.write(json.dumps(failed_exit_code()) + "\\n")
        return True

def train(path, how):
    run = Run([CodeSink(path)])
    run.log(1, {{"lr": 0.1}})
    if how == "raise":
        raise ValueError("the training crashed")
    if how == "exit":
        sys.exit(3)
    if how == "exit0":
        sys.exit(0)

if __name__ == "__main__":
    codes = {{}}
    for how in ("raise", "exit", "exit0", "return"):
        path = {folder!r} + "/" + how
        child = multiprocessing.get_context({method!r}).Process(target=train, args=(path, how))
        child.start()
        child.join(120)
        with open(path) as f:
            codes[how] = [child.exitcode, json.loads(f.read())]
    print(json.dumps(codes))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs the fork method")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_run_closed_at_a_multiprocessing_childs_exit_is_told_how_the_child_ended(
    tmp_path: Path, method: str
) -> None:
    # A crashed child's run was closed as a success (MLflow FINISHED, wandb exit code 0, the
    # spool file's exit code None): its finalizers ran before its exception was recorded.
    codes, _ = _job(tmp_path, _CRASHED_CHILD, method=method, folder=str(tmp_path))
    assert codes == {"raise": [1, 1], "exit": [3, 3], "exit0": [0, None], "return": [0, None]}
