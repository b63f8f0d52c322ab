"""A collector after a failed call: its slots come back, failures reach collect_results, and
misuse that broke it later is refused at bind (defects a probe found on landed code)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from sidestream import ComposeMetric, MeanMetric, Metric, MetricAccumulator, SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.collector._slot import Slot
from sidestream.sinks import JsonlSink
from sidestream.sync import RankMismatchError
from tests.collector.helpers import RecordingSink


def test_a_failed_schedule_gives_its_slot_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # It kept the slot: after max_slots failures the pool ran dry and a call waited forever.
    metric = SumMetric()
    collector = AsyncMetricCollector(metric, max_slots=2).bind("cpu")
    real = Slot.start_from_live
    failures = {"left": 5}

    def flaky(self: Slot, step: int, window: Any) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("staging failed")
        return real(self, step, window)

    monkeypatch.setattr(Slot, "start_from_live", flaky)
    for step in range(1, 6):
        with pytest.raises(RuntimeError, match="staging failed"):
            collector.schedule_collection(step)
    for step in range(6, 16):
        metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
    assert collector.collect_results(timeout=30) == 15.0
    assert collector.close(timeout=30)


def test_to_the_same_device_after_bind_changes_nothing() -> None:
    metric = SumMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    metric.update(torch.tensor([2.0]))
    metric.to("cpu")  # rebuilt the arena: every later window failed as "changed its states"
    collector.schedule_collection(1)
    assert collector.collect_results(timeout=30) == 2.0
    assert collector.close(timeout=30)


def test_one_metric_belongs_to_one_open_collector() -> None:
    metric = SumMetric()
    second = AsyncMetricCollector(metric, prefix="total", reset_each_window=False)
    first = AsyncMetricCollector(metric, prefix="window").bind("cpu")
    with pytest.raises(ValueError, match=r"^bind: .*another collector \(prefix 'window'\)"):
        second.bind("cpu")
    # Made while the other is open: refused at once (the group kept: test_distributed).
    with pytest.raises(ValueError, match=r"^metric: .*another collector \(prefix 'window'\)"):
        AsyncMetricCollector(metric)
    assert first.close(timeout=30)
    again = AsyncMetricCollector(metric).bind("cpu")  # closed: the metric is free again
    assert again.close(timeout=30)


class _Holder(Metric[torch.Tensor]):
    def __init__(self) -> None:
        self.total = SumMetric()

    def update(self, values: torch.Tensor) -> None:
        self.total.update(values)

    def compute(self) -> torch.Tensor:
        return self.total.compute()


def test_a_metric_inside_a_bound_metric_belongs_to_its_collector() -> None:
    # The child's bind went through and took its states out of the parent's arena; the
    # parent's collector then failed every window as "changed its states after bind".
    from sidestream import ComposeMetric

    parent = _Holder()
    first = AsyncMetricCollector(parent, prefix="parent").bind("cpu")
    with pytest.raises(ValueError, match=r"the _Holder this metric is part of is bound"):
        AsyncMetricCollector(parent.total).bind("cpu")
    parent.update(torch.tensor([3.0]))
    first.schedule_collection(1)
    assert first.collect_results(timeout=30) == 3.0
    assert first.close(timeout=30)
    other = _Holder()
    child = AsyncMetricCollector(other.total, prefix="child").bind("cpu")
    with pytest.raises(ValueError, match=r"a SumMetric inside this metric is bound"):
        AsyncMetricCollector(other).bind("cpu")
    assert child.close(timeout=30)
    pair = ComposeMetric({"a": SumMetric(), "b": SumMetric()})
    siblings = [AsyncMetricCollector(pair[name], prefix=name).bind("cpu") for name in "ab"]
    for step, collector in enumerate(siblings, start=1):  # siblings may
        collector.schedule_collection(step)
    pair.reset()  # the whole composition again: it takes its children's states back
    with pytest.raises(RankMismatchError, match="is part of a ComposeMetric, which was synced"):
        siblings[0].schedule_collection(3)
    for collector in siblings:
        collector.close(timeout=30)


_COMPUTED = [0]  # shared by the collector's copies of the metric


class _FailsOnce(Metric[torch.Tensor]):
    def __init__(self) -> None:
        self._total = MetricAccumulator(0.0)

    def update(self, value: float) -> None:
        self._total.accumulate(torch.tensor(value, dtype=torch.float64))

    def compute(self) -> torch.Tensor:
        _COMPUTED[0] += 1
        if _COMPUTED[0] == 1:
            raise ValueError("first window's compute failed")
        return self._total.value


def test_collect_results_raises_for_a_failure_followed_by_good_windows() -> None:
    _COMPUTED[0] = 0
    metric = _FailsOnce()
    collector = AsyncMetricCollector(metric).bind("cpu")
    for step in (1, 2, 3):
        metric.update(float(step))
        collector.schedule_collection(step)
    with pytest.raises(RuntimeError, match=r"1 window\(s\) failed .* \(steps 1\)") as caught:
        collector.collect_results(timeout=30)
    assert isinstance(caught.value.__cause__, ValueError)
    assert collector.collect_results(timeout=30) == 3.0  # reported once
    assert not collector.close(timeout=30)


class _Colliding(Metric[dict[str, Any]]):
    def __init__(self) -> None:
        self._total = MetricAccumulator(0.0)

    def update(self, value: float) -> None:
        self._total.accumulate(torch.tensor(value, dtype=torch.float64))

    def compute(self) -> dict[str, Any]:
        return {"a/b": self._total.value, "a": {"b": self._total.value * 10}}


def test_two_values_with_one_name_fail_the_window_instead_of_overwriting() -> None:
    metric = _Colliding()
    collector = AsyncMetricCollector(metric).bind("cpu")
    metric.update(1.0)
    collector.schedule_collection(1)
    with pytest.raises(RuntimeError, match="failed") as caught:
        collector.collect_results(timeout=30)
    assert "['a/b'] are given to more than one value" in str(caught.value.__cause__)
    assert not collector.close(timeout=30)


class _MeanAndNans(MeanMetric):
    """A result with a key of its own where the collector reports the metric's NaN count."""

    def __init__(self, key: str) -> None:
        super().__init__(nan_strategy="ignore")
        self._key = key

    def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"mean": super().compute(), self._key: torch.tensor(99.0)}


@pytest.mark.parametrize("key", ["nan_count", "nans"])
def test_a_value_named_like_a_count_fails_the_window_instead_of_being_overwritten(key: str) -> None:
    # The count (1 NaN) replaced the result's own value (99) under "train/loss/nan_count".
    data = [1.0, float("nan"), 3.0]
    sink = RecordingSink()
    metric = ComposeMetric({"loss": _MeanAndNans(key), "rejected_updates": SumMetric()})
    collector = AsyncMetricCollector(metric, sinks=[sink], prefix="train").bind("cpu")
    metric["loss"].update(torch.tensor(data))
    metric["rejected_updates"].update(torch.tensor([7.0]))
    collector.schedule_collection(1)
    if key == "nan_count":
        with pytest.raises(RuntimeError, match="failed") as caught:
            collector.collect_results(timeout=30)
        assert "['train/loss/nan_count'] are also the names" in str(caught.value.__cause__)
        # Every window, not the first alone (docs/collector.md said "its first window").
        metric["loss"].update(torch.tensor([2.0]))
        collector.schedule_collection(2)
        with pytest.raises(RuntimeError, match=r"steps 2\)") as again:
            collector.collect_results(timeout=30)
        assert "['train/loss/nan_count'] are also the names" in str(again.value.__cause__)
        assert not collector.close(timeout=30)
        assert sink.reports == []
        return
    collector.collect_results(timeout=30)
    assert collector.close(timeout=30)
    kept = [value for value in data if not math.isnan(value)]
    assert [report.values for report in sink.reports] == [
        {
            "train/loss/mean": sum(kept) / len(kept),
            "train/loss/nans": 99.0,
            "train/loss/nan_count": float(sum(math.isnan(value) for value in data)),
            "train/rejected_updates": 7.0,  # a metric of that name is just a value
        }
    ]


class _Phase(SumMetric):
    def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        total = super().compute()
        return {"ok": total, "z": torch.complex(total, total)}


@pytest.mark.parametrize("with_sink", [False, True])
def test_a_complex_result_fails_the_window_with_or_without_sinks(
    with_sink: bool, tmp_path: Path
) -> None:
    # It failed only where sinks take the values (rank 0): other ranks returned it.
    metric = _Phase()
    sinks = [JsonlSink(tmp_path / "m.jsonl")] if with_sink else []
    collector = AsyncMetricCollector(metric, sinks=sinks).bind("cpu")
    metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    with pytest.raises(RuntimeError, match="failed") as caught:
        collector.collect_results(timeout=30)
    assert "a complex tensor at 'z'" in str(caught.value.__cause__)
    assert not collector.close(timeout=30)


def test_a_device_torch_cannot_parse_is_named_by_bind_and_to() -> None:
    for device, kind in (("nonsense", ValueError), ("cpu:x", ValueError), (-1, ValueError)):
        with pytest.raises(kind, match=r"^bind: device: "):
            AsyncMetricCollector(SumMetric()).bind(device)
        with pytest.raises(kind, match=r"^to: device: "):
            SumMetric().to(device)


def test_a_run_stream_refused_for_a_metric_of_another_collector_keeps_no_prefix(
    tmp_path: Path,
) -> None:
    from sidestream import Run

    with Run([JsonlSink(tmp_path / "m.jsonl")]) as run:
        metric = SumMetric()
        run.collector(metric, prefix="train").bind("cpu")
        with pytest.raises(ValueError, match=r"^metric: .*another collector \(prefix 'train'\)"):
            run.collector(metric, prefix="val")
        assert run.streams == ["train"]
        run.collector(SumMetric(), prefix="val").bind("cpu")  # the fix: a metric of its own
        assert sorted(run.state_dict()["collectors"]) == ["train", "val"]


class _SlowSum(SumMetric):
    def compute(self) -> torch.Tensor:
        import time

        time.sleep(0.5)
        return super().compute()


def test_collect_results_that_times_out_says_what_may_hold_the_window() -> None:
    collector = AsyncMetricCollector(_SlowSum()).bind("cpu")
    collector.metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    with pytest.raises(RuntimeError, match=r"1 window\(s\) still running after 0.01 s: .* rank"):
        collector.collect_results(timeout=0.01)
    assert collector.collect_results(timeout=30) == 1.0
    assert collector.close(timeout=30)


def test_a_close_that_times_out_says_what_may_hold_the_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    collector = AsyncMetricCollector(_SlowSum()).bind("cpu")
    collector.metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    assert collector.close(timeout=0.05) is False
    assert "1 window(s) not finished within 0.05 s" in caplog.text
    # One process: no rank to blame, the compute is what is slow.
    assert "waits for its compute(): is it slower than the timeout?" in caplog.text
    assert "did a rank skip" not in caplog.text


def test_a_window_finishing_after_close_gave_up_logs_no_sink_error(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    import time

    collector = AsyncMetricCollector(_SlowSum(), sinks=[JsonlSink(tmp_path / "m.jsonl")])
    collector.bind("cpu")
    collector.metric.update(torch.tensor([1.0]))
    collector.schedule_collection(1)
    assert collector.close(timeout=0.05) is False  # warns: the window is not reported
    dispatcher = collector._dispatcher
    assert dispatcher is not None
    deadline = time.monotonic() + 60
    while dispatcher.alive and time.monotonic() < deadline:  # the 0.5 s compute ends, late
        time.sleep(0.05)
    assert not dispatcher.alive
    assert "submit after close" not in caplog.text
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_bad_collector_arguments_name_themselves() -> None:
    with pytest.raises(TypeError, match="prefix: expected a str"):
        AsyncMetricCollector(SumMetric(), prefix=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reset_each_window: expected a bool"):
        AsyncMetricCollector(SumMetric(), reset_each_window="no")  # type: ignore[arg-type]
    collector = AsyncMetricCollector(SumMetric()).bind("cpu")
    for step in (-5, 2**70):  # a window's step travels as an int64, as sync(step=)'s does
        with pytest.raises(ValueError, match=r"step: expected an int in \[0, 2\*\*63\)"):
            collector.schedule_collection(step)
    collector.schedule_collection(0)
    assert collector.close(timeout=30)


class _CancelledAtStep3(SumMetric):
    def compute(self) -> torch.Tensor:
        import asyncio

        if float(self._total.value) == 6.0:  # the window of step 3 (1 + 2 + 3)
            raise asyncio.CancelledError("compute cancelled")
        return super().compute()


def test_a_base_exception_in_compute_fails_its_window_instead_of_the_dispatcher() -> None:
    """asyncio.CancelledError (a BaseException) ended the dispatcher thread: collect_results
    waited for good, and close returned True with windows 3 to 10 never logged."""
    from tests.collector.helpers import RecordingSink

    sink = RecordingSink()
    collector = AsyncMetricCollector(_CancelledAtStep3(), sinks=[sink], reset_each_window=False)
    collector.bind("cpu")
    for step in (1, 2, 3, 4):
        collector.metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
    with pytest.raises(RuntimeError, match=r"steps 3\b.*CancelledError.*compute cancelled"):
        collector.collect_results(timeout=30)
    assert not collector.close(timeout=30)  # a window failed
    assert [report.step for report in sink.reports] == [1, 2, 4]


def test_a_second_thread_scheduling_at_the_same_time_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both calls copied the live state before either reset it: the windows summed to 1508 and
    # 1545 where 1500 had been added, with no error.
    import threading

    metric = SumMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    inside, go_on = threading.Event(), threading.Event()
    real = Slot.start_from_live

    def slow(self: Slot, step: int, window: Any) -> Any:
        inside.set()
        go_on.wait(30)
        return real(self, step, window)

    monkeypatch.setattr(Slot, "start_from_live", slow)
    metric.update(torch.tensor([1.0]))
    first = threading.Thread(target=collector.schedule_collection, args=(1,))
    first.start()
    assert inside.wait(30)
    with pytest.raises(RuntimeError, match="from another thread while a call is in progress"):
        collector.schedule_collection(2)
    go_on.set()
    first.join(30)
    monkeypatch.setattr(Slot, "start_from_live", real)
    metric.update(torch.tensor([2.0]))
    collector.schedule_collection(2)  # the refused call used no step
    assert collector.collect_results(timeout=30) == 2.0
    assert collector.close(timeout=30)


def test_a_wait_for_a_slot_that_was_interrupted_leaves_its_step_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metric = SumMetric()
    collector = AsyncMetricCollector(metric).bind("cpu")
    real = AsyncMetricCollector._take_slot

    def interrupted(self: AsyncMetricCollector) -> Slot:
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncMetricCollector, "_take_slot", interrupted)
    metric.update(torch.tensor([3.0]))
    with pytest.raises(KeyboardInterrupt):
        collector.schedule_collection(1)
    monkeypatch.setattr(AsyncMetricCollector, "_take_slot", real)
    collector.schedule_collection(1)  # once refused as "expected > the previous window's 1"
    assert collector.collect_results(timeout=30) == 3.0
    assert collector.close(timeout=30)


def test_an_interrupted_close_says_how_many_windows_are_not_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Ctrl-C in close lost the windows still computing without a word (29 of 40 delivered).
    import threading

    from sidestream import Run
    from sidestream.collector._dispatcher import Dispatcher

    release = threading.Event()

    class Stalled(SumMetric):
        def compute(self) -> torch.Tensor:
            release.wait(30)
            return super().compute()

    def interrupted(self: Dispatcher, timeout: float | None) -> bool:
        raise KeyboardInterrupt

    run = Run([])
    collector = run.collector(Stalled(), prefix="train", max_slots=8).bind("cpu")
    for step in range(1, 4):
        collector.schedule_collection(step)
    monkeypatch.setattr(Dispatcher, "stop", interrupted)
    with caplog.at_level("WARNING"), pytest.raises(KeyboardInterrupt):
        run.close(30)
    release.set()
    monkeypatch.undo()
    assert collector._dispatcher is not None
    assert collector._dispatcher.stop(30)  # no thread left for later tests
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        re.search(r"close was interrupted: [1-3] window\(s\) of stream 'train' not finished", m)
        for m in messages
    ), messages
    assert sum("not finished" in m for m in messages) == 1  # said once, by the collector
