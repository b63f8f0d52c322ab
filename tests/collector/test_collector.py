"""The collector in one process: windows, cumulative mode, exit paths, checkpoints, errors."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from sidestream import ComposeMetric, MeanMetric, Metric, MetricAccumulator, SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import JsonlSink, read_jsonl
from tests.collector.helpers import (
    AlwaysFailingSink,
    RecordingSink,
    feed,
    make_metric,
    reference,
    window_data,
)

ROOT = Path(__file__).resolve().parents[2]


def _approx(expected: dict[str, float]) -> dict[str, object]:
    return {name: pytest.approx(value, rel=1e-12) for name, value in expected.items()}


def test_every_window_matches_numpy_with_prefix_and_pytree_results(tmp_path: Path) -> None:
    metric = make_metric()
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink], prefix="train")
    collector.bind()
    results = []
    for window in range(3):
        feed(metric, window_data(1, window, 0))
        collector.schedule_collection(step=window + 1)
        results.append(collector.collect_results())
    assert collector.close() is True
    assert sink.steps == [1, 2, 3]
    for window, (report, result) in enumerate(zip(sink.reports, results, strict=True)):
        expected = reference([window_data(1, window, 0)])
        assert report.values == _approx({f"train/{k}": v for k, v in expected.items()})
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-12)
        assert result["classes"] == pytest.approx(
            [expected[f"classes/class_{i}"] for i in range(4)], rel=1e-12
        )
    assert all(isinstance(v, float) for v in sink.reports[0].values.values())


def test_cumulative_mode_and_updates_after_scheduling_do_not_leak_in() -> None:
    metric = SumMetric()
    collector = AsyncMetricCollector(metric, reset_each_window=False)
    collector.bind("cpu")
    metric.update(torch.tensor([1.0, 2.0]))
    collector.schedule_collection(1)
    metric.update(torch.tensor([10.0]))  # after the snapshot: belongs to the next window
    assert collector.collect_results() == 3.0
    collector.schedule_collection(2)
    assert collector.collect_results() == 13.0
    collector.close()


def test_with_block_closes_and_delivers_on_exception(tmp_path: Path) -> None:
    metric = MeanMetric()
    path = tmp_path / "m.jsonl"
    collector = AsyncMetricCollector(metric, sinks=[JsonlSink(path)])
    with pytest.raises(ZeroDivisionError), collector:
        metric.update(torch.tensor([4.0]))
        collector.schedule_collection(5)
        _ = 1 / 0
    assert [json.loads(line)["values"] for line in path.read_text().splitlines()] == [
        {"value": 4.0}
    ]
    with pytest.raises(RuntimeError, match="bind"):
        collector.schedule_collection(6)


def test_checkpoint_resumes_metric_and_sink_without_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    first, partial, other, later, more = (
        np.arange(1.0, 5.0),
        np.array([100.0]),
        np.array([50.0]),
        np.array([7.0, 9.0]),
        np.array([-3.0]),
    )
    metric = MeanMetric()
    collector = AsyncMetricCollector(metric, sinks=[JsonlSink(path)]).bind()
    metric.update(torch.from_numpy(first))
    collector.schedule_collection(1)
    metric.update(torch.from_numpy(partial))  # not collected yet when the checkpoint is taken
    state = collector.state_dict()
    metric.update(torch.from_numpy(other))
    collector.schedule_collection(2)  # logged after the checkpoint, then the job "dies"
    collector.close()

    metric2 = MeanMetric()
    resumed = AsyncMetricCollector(metric2, sinks=[JsonlSink(path)])
    resumed.load_state_dict(state)
    resumed.bind()
    with pytest.raises(RuntimeError, match="before bind"):
        resumed.load_state_dict(state)
    metric2.update(torch.from_numpy(later))
    resumed.schedule_collection(2)  # replayed from the checkpoint: already in the file
    # The interrupted window's data is counted exactly once.
    assert resumed.collect_results() == pytest.approx(np.concatenate([partial, later]).mean())
    metric2.update(torch.from_numpy(more))
    resumed.schedule_collection(3)
    resumed.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert [line["values"]["value"] for line in lines] == pytest.approx(
        [first.mean(), np.concatenate([partial, other]).mean(), more.mean()]
    )


def test_bad_use_raises_clear_errors() -> None:
    with pytest.raises(TypeError, match="metric: expected a sidestream Metric"):
        AsyncMetricCollector(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"sinks\[0\]"):
        AsyncMetricCollector(MeanMetric(), sinks=["jsonl"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="sink_retry_initial_s, sink_retry_max_s"):
        AsyncMetricCollector(MeanMetric(), sink_retry_initial_s=2.0, sink_retry_max_s=1.0)
    with pytest.raises(TypeError, match="histograms: expected non-empty leaf paths"):
        AsyncMetricCollector(MeanMetric(), histograms=[""])
    collector = AsyncMetricCollector(MeanMetric())
    with pytest.raises(RuntimeError, match="bind"):
        collector.schedule_collection(1)
    collector.bind("cpu")
    with pytest.raises(RuntimeError, match="no window scheduled"):
        collector.collect_results()
    collector.schedule_collection(3)
    with pytest.raises(ValueError, match="step: expected > the previous window's 3, got 3"):
        collector.schedule_collection(3)
    with pytest.raises(TypeError, match="step: expected an int"):
        collector.schedule_collection(4.0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="already bound"):
        collector.bind("cpu")
    assert collector.close() and collector.close()


def test_histogram_leaves_go_to_report_histograms(tmp_path: Path) -> None:
    metric = make_metric()
    sink = RecordingSink(failures=2)
    path = tmp_path / "m.jsonl"
    collector = AsyncMetricCollector(
        metric,
        sinks=[sink, JsonlSink(path)],
        prefix="train",
        histograms=["classes"],
        sink_retry_initial_s=0.001,
        sink_retry_max_s=0.002,
    ).bind("cpu")
    for window in range(2):
        feed(metric, window_data(3, window, 0))
        collector.schedule_collection(step=window + 1)
    result = collector.collect_results()
    assert collector.close(timeout=30) is True
    assert sink.steps == [1, 2] and sink.attempts == 4  # two failed writes retried quickly
    for window, report in enumerate(sink.reports):
        expected = reference([window_data(3, window, 0)])
        fractions = [expected.pop(f"classes/class_{i}") for i in range(4)]
        assert report.values == _approx({f"train/{k}": v for k, v in expected.items()})
        assert list(report.histograms) == ["train/classes"]
        histogram = report.histograms["train/classes"]
        assert histogram.device.type == "cpu" and histogram.shape == (4,)
        np.testing.assert_allclose(histogram.numpy(), fractions, rtol=1e-12)
    assert result["classes"] == pytest.approx(fractions, rel=1e-12)  # results keep every leaf
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["histograms"]["train/classes"] == pytest.approx(fractions, rel=1e-12)

    # A part a composition lacks fails when the collector is made: every window failed, on
    # the dispatcher's thread, its scalars with it (a typo in a config file).
    with pytest.raises(ValueError, match=r"histograms: 'nosuch' is not a leaf .* \['loss', "):
        AsyncMetricCollector(make_metric(), histograms=["nosuch"])
    nested = ComposeMetric({"val": make_metric()})
    with pytest.raises(ValueError, match=r"'val/classez' is not a leaf .*: 'val' has the parts"):
        AsyncMetricCollector(nested, histograms=["val/classez"])
    with pytest.raises(ValueError, match=r"'val' names a ComposeMetric .*, not a leaf"):
        AsyncMetricCollector(nested, histograms=["val"])
    # Past a metric of another kind, its own result names the leaves: the first window checks.
    misnamed = AsyncMetricCollector(make_metric(), histograms=["classes/nosuch"]).bind("cpu")
    misnamed.schedule_collection(1)
    with pytest.raises(
        RuntimeError, match=r"window\(s\) failed since|latest window failed"
    ) as failed:
        misnamed.collect_results()
    assert "['classes/nosuch'] are not leaves" in str(failed.value.__cause__)
    misnamed.close()
    # A scalar leaf is no histogram: every sink would skip it, so it was logged nowhere.
    scalar = AsyncMetricCollector(make_metric(), histograms=["loss"]).bind("cpu")
    scalar.schedule_collection(1)
    with pytest.raises(RuntimeError, match=r"window\(s\) failed since") as failed:
        scalar.collect_results()
    assert "['loss'] are scalars, not bin counts" in str(failed.value.__cause__)
    scalar.close()


def test_interpreter_exit_flushes_what_was_scheduled(tmp_path: Path) -> None:
    path = tmp_path / "exit.jsonl"
    script = textwrap.dedent(
        f"""
        import torch
        from sidestream import SumMetric
        from sidestream.collector import AsyncMetricCollector
        from sidestream.sinks import JsonlSink
        from tests.collector.helpers import RecordingSink

        metric = SumMetric()
        collector = AsyncMetricCollector(
            metric, sinks=[RecordingSink(delay_s=0.2), JsonlSink({str(path)!r})]
        )
        collector.bind("cpu")
        for step in range(1, 4):
            metric.update(torch.tensor([float(step)]))
            collector.schedule_collection(step)
        # no close(): the atexit hook must deliver everything
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=120)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["step"], line["values"]["value"]) for line in lines] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
    ]


def test_close_reports_a_sink_that_cannot_deliver_in_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metric = SumMetric()
    good, broken = JsonlSink(tmp_path / "good.jsonl"), AlwaysFailingSink()
    collector = AsyncMetricCollector(
        metric, sinks=[good, broken], spool_dir=str(tmp_path / "spool")
    )
    collector.bind("cpu")
    for step in (1, 2):
        metric.update(torch.tensor([float(step)]))
        collector.schedule_collection(step)
    assert collector.collect_results() == 2.0
    with caplog.at_level(logging.WARNING):
        assert collector.close(timeout=0.5) is False
    messages = [record.getMessage() for record in caplog.records]
    assert sum("'broken'" in m and "retrying" in m for m in messages) == 1
    (kept,) = [m for m in messages if "not delivered" in m]
    assert "2 report(s)" in kept and str(tmp_path / "spool") in kept
    assert len((tmp_path / "good.jsonl").read_text().splitlines()) == 2


def test_nan_counts_are_reported_with_their_window() -> None:
    # "ignore" leaves NaN out and counts it; the count is part of the window's report, as
    # metrics.md says ("read nan_count with the result"), and only when it is not zero.
    from sidestream import ComposeMetric
    from tests.collector.helpers import RecordingSink

    metric = ComposeMetric(
        {"loss": MeanMetric(nan_strategy="ignore"), "plain": MeanMetric(nan_strategy="disable")}
    )
    sink = RecordingSink()
    with AsyncMetricCollector(metric, sinks=[sink], prefix="train").bind("cpu") as collector:
        metric["loss"].update(torch.tensor([1.0, float("nan"), 3.0, float("nan")]))
        metric["plain"].update(torch.tensor([1.0]))
        collector.schedule_collection(1)
        metric["loss"].update(torch.tensor([5.0]))
        metric["plain"].update(torch.tensor([2.0]))
        collector.schedule_collection(2)
    first, second = (report.values for report in sink.reports)
    assert first == {"train/loss": 2.0, "train/plain": 1.0, "train/loss/nan_count": 2.0}
    assert second == {"train/loss": 5.0, "train/plain": 2.0}


def test_counts_of_metrics_inside_a_metric_of_ones_own_are_reported() -> None:
    """A library metric held by a user's metric reports its counts under its path too."""
    from sidestream import ComposeMetric, Metric
    from tests.collector.helpers import RecordingSink

    class Wrapped(Metric[torch.Tensor]):
        def __init__(self) -> None:
            self.loss = MeanMetric(nan_strategy="ignore")

        def update(self, values: torch.Tensor) -> None:
            self.loss.update(values)

        def compute(self) -> torch.Tensor:
            return self.loss.compute()

    metric = ComposeMetric({"wrap": Wrapped()})
    sink = RecordingSink()
    with AsyncMetricCollector(metric, sinks=[sink], prefix="t").bind("cpu") as collector:
        metric["wrap"].update(torch.tensor([1.0, float("nan"), 3.0]))
        collector.schedule_collection(1)
    (report,) = sink.reports
    assert report.values == {"t/wrap": 2.0, "t/wrap/loss/nan_count": 1.0}


def test_a_metric_with_a_nan_count_of_its_own_is_not_taken_for_a_counter() -> None:
    from sidestream import Metric, MetricAccumulator

    class ColumnMeans(Metric[torch.Tensor]):
        def __init__(self) -> None:
            self._sums = MetricAccumulator(torch.zeros(3, dtype=torch.float64))
            self._counts = MetricAccumulator(torch.zeros(3, dtype=torch.float64))

        @property
        def nan_count(self) -> torch.Tensor:  # per column: not the library's counter
            return self._counts.value

        def update(self, rows: torch.Tensor) -> None:
            kept = ~rows.isnan()
            self._sums.accumulate(torch.where(kept, rows, 0.0).sum(0))
            self._counts.accumulate(kept.sum(0).double())

        def compute(self) -> torch.Tensor:
            return self._sums.value / self._counts.value

    metric = ColumnMeans()
    with AsyncMetricCollector(metric).bind("cpu") as collector:
        metric.update(torch.tensor([[1.0, float("nan"), 3.0], [3.0, 2.0, float("nan")]]))
        collector.schedule_collection(1)
        assert collector.collect_results(timeout=30) == [2.0, 2.0, 3.0]


def test_staging_copies_freed_by_the_pool_are_not_kept_alive() -> None:
    # The cache of a metric's dropped-batch counters held the metric itself as a value of its
    # own weak key: every slot made and freed again stayed in memory (734 MeanMetric copies
    # after 6000 windows whose backlog grew and drained, with 3 slots in the pool).
    import gc
    import weakref

    from sidestream import MeanMetric
    from sidestream.collector._window import rejected_names

    copy = MeanMetric()
    assert rejected_names(copy, "train") == ["train/rejected_updates"]
    gone = weakref.ref(copy)
    del copy
    gc.collect()
    assert gone() is None


def test_staging_copies_of_a_composition_freed_by_the_pool_are_not_kept_alive() -> None:
    # A metric inside a ComposeMetric refers to the composition through its state arena: the
    # counter cache held the inner metrics, so it still kept every staging copy alive.
    import gc
    import weakref

    from sidestream import MeanMetric
    from sidestream.collector._window import rejected_names
    from sidestream.metrics import ComposeMetric

    copy = ComposeMetric({"loss": MeanMetric(), "acc": MeanMetric()})
    assert rejected_names(copy, "train") == [
        "train/loss/rejected_updates",
        "train/acc/rejected_updates",
    ]
    gone = weakref.ref(copy)
    del copy
    gc.collect()
    assert gone() is None


_EPOCH = [0]


class _KeyPerEpoch(Metric[dict[str, Tensor]]):
    """A sum reported under a name of the current epoch: a result whose names change."""

    def __init__(self) -> None:
        self._sum = MetricAccumulator(torch.zeros((), dtype=torch.float64))

    def update(self, value: Tensor) -> None:
        self._sum.accumulate(value.double().sum())

    def compute(self) -> dict[str, Tensor]:
        return {f"epoch{_EPOCH[0]}": self._sum.value}


def test_layouts_of_results_whose_names_change_are_capped(tmp_path: Path) -> None:
    """The dispatcher keeps each result layout for reuse; a result with a name per epoch made
    one per window, kept for the whole run."""
    from sidestream.collector._dispatcher import _LAYOUTS_KEPT

    windows = _LAYOUTS_KEPT + 36
    metric = _KeyPerEpoch()
    collector = AsyncMetricCollector(metric, sinks=[JsonlSink(tmp_path / "m.jsonl")])
    collector.bind("cpu")
    try:
        for step in range(windows):
            metric.update(torch.tensor([1.0]))
            if step:
                collector.collect_results()  # the previous window computed under its epoch
            _EPOCH[0] = step
            collector.schedule_collection(step)
        collector.collect_results()
        assert len(collector._dispatcher._layouts) <= _LAYOUTS_KEPT
    finally:
        assert collector.close()
    names = [name for record in read_jsonl(tmp_path / "m.jsonl") for name in record["values"]]
    assert names == [f"epoch{step}" for step in range(windows)]
