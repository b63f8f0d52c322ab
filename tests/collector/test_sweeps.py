"""Many runs in one process: a hyperparameter sweep's trials, a notebook cell run again.

Found by using the library as a sweep does (``for trial in ...: with Run(...) as run:``):

- sinks built once, outside the trial loop, and given to each trial's ``Run``: the second run
  continued the first one's tracker run and skipped every step up to the last one it had
  delivered, so a trial that started again at step 1 lost all its steps, with only a
  misleading warning ("its steps may repeat earlier ones"; MLflow: "a checkpoint of another
  job?"), while docs/runs.md says a sink given to two runs raises ``ValueError``;
- trials run in threads (Optuna's ``n_jobs``): a trial's ``with Run(...)`` block left by an
  exception told every run closing meanwhile that its job failed, so a trial that finished
  ended its MLflow run FAILED (its W&B run with exit code 1).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sidestream import Run
from sidestream._exit import ending_with, failed_exit_code
from sidestream.sinks import JsonlSink, read_jsonl
from tests.collector.helpers import RecordingSink


class EndingSink(RecordingSink):
    """Keeps how the job was ending (``failed_exit_code``) when its close ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ending: list[int | None] = []

    def close(self, timeout: float | None = None) -> bool:
        self.ending.append(failed_exit_code())
        return super().close(timeout)


def test_a_sink_of_a_closed_run_is_refused_by_the_next_trial(tmp_path):
    sinks = [JsonlSink(tmp_path / "sweep.jsonl")]  # built once, outside the loop: the mistake
    with Run(sinks) as run:
        run.log(1, {"lr": 0.1})
    with pytest.raises(ValueError, match="belonged to a run that is closed") as raised:
        Run(sinks)
    assert "build them inside the loop" in str(raised.value)
    # Sinks made per trial are fine, and each trial gets its own steps, all of them.
    for trial in range(3):
        with Run([JsonlSink(tmp_path / f"trial-{trial}.jsonl")]) as run:
            for step in (1, 2):
                run.log(step, {"trial": trial})
    for trial in range(3):
        records = list(read_jsonl(tmp_path / f"trial-{trial}.jsonl"))
        assert [(r["step"], r["values"]) for r in records] == [
            (1, {"trial": float(trial)}),
            (2, {"trial": float(trial)}),
        ]


def test_a_sink_of_a_run_that_is_gone_unclosed_and_never_started_may_be_given_again():
    sink = RecordingSink()
    Run([sink])  # never started, never closed, not referenced: gone, and its sink free
    with Run([sink]) as run:
        run.log(1, {"lr": 0.1})
    assert sink.steps == [1]


def test_a_trial_failing_in_another_thread_leaves_this_runs_ending_alone():
    failing_closes, finished = threading.Event(), threading.Event()

    def failing_trial() -> None:  # a `with Run(...)` block left by an exception, closing
        with ending_with(RuntimeError):
            failing_closes.set()
            finished.wait(10)

    other = threading.Thread(target=failing_trial)
    other.start()
    try:
        assert failing_closes.wait(10)
        sink = EndingSink()
        with Run([sink]) as run:  # this trial finished
            run.log(1, {"lr": 0.1})
    finally:
        finished.set()
        other.join()
    assert sink.ending == [None]


def test_a_trial_left_by_an_exception_tells_its_own_sinks():
    sink = EndingSink()
    with pytest.raises(ValueError), Run([sink]) as run:
        run.log(1, {"lr": 0.1})
        raise ValueError("diverged")
    assert sink.ending == [1]
    after = EndingSink()  # the next trial is fine
    with Run([after]) as run:
        run.log(1, {"lr": 0.1})
    assert after.ending == [None]


def _reuse_after_a_run_only_rank_0_logged_to() -> str:
    import torch.distributed as dist

    sinks = [RecordingSink()]
    with Run(sinks) as run:
        if dist.get_rank() == 0:  # plain values from rank 0 only: the run starts there alone
            run.log(1, {"lr": 0.1})
    try:
        Run(sinks)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_every_rank_refuses_a_closed_runs_sinks_even_where_the_run_never_started(
    pools: Any,
) -> None:
    """A rule on starting refused on rank 0 alone (only it started the run), and the other
    ranks went on to wait in their next collective for it."""
    outcomes = pools.get(2).run(_reuse_after_a_run_only_rank_0_logged_to, timeout=60)
    assert all("belonged to a run that is closed" in outcome for outcome in outcomes), outcomes
