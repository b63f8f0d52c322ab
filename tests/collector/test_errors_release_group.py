"""A mismatch error never keeps the process group alive through its traceback.

A script lets the error propagate (or keeps it) and calls ``destroy_process_group()``; a
library frame in the traceback that holds the group keeps it alive past that call, and gloo
then aborts the process at exit (exit code -6, "terminate called without an active
exception"), which torchrun reports as the job's root cause instead of the mismatch.
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sidestream import MeanMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.sync import RankMismatchError
from sidestream.testing import RankPool


def _path_to_group(start: object) -> list[str] | None:
    """The chain of objects by which ``start`` reaches the default group, if any.

    Module namespaces are not followed: torch.distributed's own registry holds the group
    until ``destroy_process_group()``, which is not what is looked for.
    """
    target = dist.group.WORLD
    skipped = {id(module.__dict__) for module in list(sys.modules.values()) if module}
    seen = {id(start)}
    queue: list[tuple[object, list[str]]] = [(start, [type(start).__name__])]
    for obj, path in queue:
        for ref in gc.get_referents(obj):
            if ref is target:
                return [*path, "ProcessGroup"]
            if id(ref) in seen or id(ref) in skipped or isinstance(ref, (type, types.ModuleType)):
                continue
            seen.add(id(ref))
            name = type(ref).__name__
            if isinstance(ref, types.FrameType):
                name = f"frame of {ref.f_code.co_name}"
            queue.append((ref, [*path, name]))
    return None


def _caught(mistake: Callable[[], None]) -> RankMismatchError:
    try:
        mistake()
    except RankMismatchError as error:
        return error
    raise AssertionError("no RankMismatchError")


def _sync_of_other_dtypes() -> None:
    metric = MeanMetric(dtype=torch.float32 if dist.get_rank() else torch.float64)
    metric.update(torch.tensor([1.0]))
    metric.sync()


def _bind_of_other_dtypes() -> None:
    metric = MeanMetric(dtype=torch.float32 if dist.get_rank() else torch.float64)
    collector = AsyncMetricCollector(metric)
    try:
        collector.bind("cpu")
    finally:
        collector.close(timeout=30)


def _windows_at_other_steps() -> None:
    collector = AsyncMetricCollector(MeanMetric()).bind("cpu")
    try:
        collector.metric.update(torch.tensor([1.0]))
        collector.schedule_collection(1 + dist.get_rank())  # a rank skipped step 1
        collector.collect_results(timeout=60)
    finally:
        collector.close(timeout=30)


def _sinks_on_one_rank() -> None:
    from sidestream.sinks import ConsoleSink

    sinks = [ConsoleSink()] if dist.get_rank() else []
    collector = AsyncMetricCollector(MeanMetric(), sinks=sinks)
    try:
        collector.bind("cpu")
    finally:
        collector.close(timeout=30)


_MISTAKES: dict[str, Callable[[], None]] = {
    "sync of other dtypes": _sync_of_other_dtypes,
    "bind of other dtypes": _bind_of_other_dtypes,
    "windows at other steps": _windows_at_other_steps,
    "sinks on one rank": _sinks_on_one_rank,
}


def _holders_after(name: str) -> Any:
    error = _caught(_MISTAKES[name])
    gc.collect()
    return _path_to_group(error)


@pytest.mark.parametrize("name", list(_MISTAKES))
def test_a_mismatch_error_does_not_hold_the_group(pools: Any, name: str) -> None:
    """Before: the structure check's error held the group through ``prepare_sync``'s frame
    (its ``default`` local): 3 of 10 torchrun jobs whose script let it propagate, then
    destroyed the group, aborted at exit."""
    pool: RankPool = pools.get(2)
    for rank, path in enumerate(pool.run(_holders_after, name, timeout=120)):
        assert path is None, (rank, " -> ".join(path))


def _checkpoint_behind_a_stopped_peer(through_run: bool, wait: float) -> str:
    """Rank 1 stops after step 1 (hung); rank 0 schedules step 2, then checkpoints.

    With ``wait`` past the group's timeout the window has failed when the checkpoint's
    collective starts (the backend then fails that one at once), else it is still waiting.
    """
    import datetime
    import time

    from sidestream import Run

    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    run = Run([]) if through_run else None
    metric = MeanMetric()
    if run is None:
        collector = AsyncMetricCollector(metric, group=group)
    else:
        collector = run.collector(metric, prefix="train", group=group)
    collector.bind("cpu")
    metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    collector.collect_results(timeout=30)
    outcome = "stopped"
    if dist.get_rank() == 0:
        metric.update(torch.tensor([2.0]))
        collector.schedule_collection(2)
        try:
            (run or collector).state_dict(timeout=wait)
            outcome = "no error"
        except RuntimeError as error:
            outcome = str(error)
    else:
        time.sleep(6)  # past the group's timeout and the checkpoint's wait
    (run or collector).close(timeout=5)
    dist.destroy_process_group(group)
    return outcome


@pytest.mark.parametrize("through_run", [False, True], ids=["collector", "run"])
@pytest.mark.parametrize("wait", [0.5, 4.0], ids=["window waiting", "window failed"])
def test_a_checkpoint_behind_a_stopped_peer_names_the_windows(
    through_run: bool, wait: float
) -> None:
    """The checkpoint's collective failed at the group's timeout with gloo's message alone
    ("Application timeout caused pair closure"), naming neither the call nor the windows."""
    from sidestream.testing import DistributedPool

    with DistributedPool(2) as pool:  # its own: a group that timed out is not reused
        outcome = pool.run(_checkpoint_behind_a_stopped_peer, through_run, wait, timeout=120)[0]
    where = "run.state_dict" if through_run else "state_dict"
    prefix = "train" if through_run else ""
    called = f"{where}: the checkpoint's collective (collector prefix {prefix!r}) with the other"
    assert outcome.startswith(called), outcome
    if wait < 2:
        assert f"1 window(s) of the collector with prefix {prefix!r} were still running" in (
            outcome
        )
    else:
        assert f"the window(s) at step 2 of the collector with prefix {prefix!r} had failed" in (
            outcome
        )
    assert "did one skip a schedule_collection?" in outcome


def _checkpoint_after_a_skipped_window() -> str:
    """Rank 1 skips step 2 and checkpoints a second late: rank 0's wait for its windows
    (0.2 s) ends before its window 2 paired with rank 1's checkpoint."""
    import datetime
    import time

    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    collector = AsyncMetricCollector(MeanMetric(), group=group).bind("cpu")
    collector.metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    if dist.get_rank() == 0:
        collector.schedule_collection(2)
    else:
        time.sleep(1.0)
    try:
        collector.state_dict(timeout=0.2)
        outcome = "no error"
    except RuntimeError as error:
        outcome = f"{type(error).__name__}: {error}"
    collector.close(timeout=5)
    dist.destroy_process_group(group)
    return outcome


def test_a_checkpoint_behind_a_skipped_window_raises_the_mismatch_on_every_rank() -> None:
    """Rank 0 got the backend's timeout renamed, though its dispatcher held the mismatch."""
    from sidestream.testing import DistributedPool

    with DistributedPool(2) as pool:
        outcomes = pool.run(_checkpoint_after_a_skipped_window, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith("RankMismatchError: "), (rank, outcome)
        assert "paired different calls" in outcome, (rank, outcome)


def _checkpoint_of_collectors_over_two_groups() -> str:
    """Collector 'a' over a group of its own, 'b' over the default one; rank 1 stops after
    step 1 and rank 0 schedules step 2 of 'b' only: the check over a's group fails."""
    import datetime
    import time

    from sidestream import Run

    group = dist.new_group(timeout=datetime.timedelta(seconds=2))
    run = Run([])
    over_a = run.collector(MeanMetric(), prefix="a", group=group).bind("cpu")
    over_b = run.collector(MeanMetric(), prefix="b").bind("cpu")
    for collector in (over_a, over_b):
        collector.metric.update(torch.tensor([1.0]))
        collector.schedule_collection(1)
        collector.collect_results(timeout=30)
    outcome = "stopped"
    if dist.get_rank() == 0:
        over_b.schedule_collection(2)
        try:
            run.state_dict(timeout=0.5)
            outcome = "no error"
        except RuntimeError as error:
            outcome = str(error)
    else:
        time.sleep(4)  # past a's group timeout: then b's window 2 of rank 0 gets its partner
        over_b.schedule_collection(2)
    run.close(timeout=5)
    dist.destroy_process_group(group)
    return outcome


def test_a_failed_checkpoint_collective_names_its_own_group_only() -> None:
    """The check over a's group blamed the window of 'b', over another group."""
    from sidestream.testing import DistributedPool

    with DistributedPool(2) as pool:
        outcome = pool.run(_checkpoint_of_collectors_over_two_groups, timeout=120)[0]
    assert outcome.startswith(
        "run.state_dict: the checkpoint's collective (collector prefix 'a') with the other ranks"
    ), outcome
    assert "'b'" not in outcome, outcome


def test_a_local_error_of_a_checkpoint_is_not_named_a_collective() -> None:
    """An exact metric's input changed in place while a window was still computing: the
    local error was renamed a failed collective "while 1 window(s) still waited"."""
    import threading

    from sidestream.metrics.classification import BinaryAUROCMetric

    release = threading.Event()

    class SlowAUROC(BinaryAUROCMetric):
        def compute(self) -> torch.Tensor:
            release.wait(30)
            return super().compute()

    metric = SlowAUROC(exact=True)
    collector = AsyncMetricCollector(metric, reset_each_window=False).bind("cpu")
    scores = torch.tensor([0.2, 0.8])
    metric.update(scores, torch.tensor([0, 1]))
    collector.schedule_collection(1)  # its compute waits
    scores.add_(0.1)  # the kept input changed in place
    try:
        with pytest.raises(RuntimeError, match="modified in place") as raised:
            collector.state_dict(timeout=0.2)
        assert "collective" not in str(raised.value)
    finally:
        release.set()
        collector.close(timeout=30)
