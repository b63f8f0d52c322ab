"""A sink that changes the report it was given changes nothing another sink gets."""

from __future__ import annotations

import pytest
import torch

from sidestream import ComposeMetric, MeanMetric, Metric, ReduceOp, Run, SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.sinks import Report, RunInfo, Sink
from tests.collector.helpers import RecordingSink


class _Bins(Metric[torch.Tensor]):
    def __init__(self) -> None:
        self._counts = self.add_state("counts", torch.zeros(4), op=ReduceOp.SUM)

    def update(self, scores: torch.Tensor) -> None:
        self._counts.accumulate(torch.histc(scores, bins=4, min=0.0, max=1.0))

    def compute(self) -> torch.Tensor:
        return self._counts.value.clone()


class _Vandal(Sink):
    """Writes over the values and histograms of every report it is given."""

    name = "vandal"

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        values = report.values
        assert isinstance(values, dict)
        values.clear()
        values["value"] = -999.0
        for histogram in report.histograms.values():
            histogram.fill_(-1.0)

    def close(self, timeout: float | None = None) -> bool:
        return True


def test_a_sink_that_changes_its_report_leaves_the_others_theirs() -> None:
    recording = RecordingSink()
    run = Run([_Vandal(), recording])
    mean = MeanMetric()
    bins = _Bins()
    metrics = ComposeMetric({"mean": mean, "bins": bins})
    collector = run.collector(metrics, prefix="train", histograms=["bins"]).bind("cpu")
    generator = torch.Generator().manual_seed(0)
    expected = {}
    for step in range(1, 6):
        values = torch.rand(10, generator=generator, dtype=torch.float64)
        mean.update(values)
        bins.update(values.float())
        expected[("train", step)] = values.mean().item()
        collector.schedule_collection(step)
        run.log(step, {"lr": step / 10})
        expected[("", step)] = step / 10
    assert run.close(30)
    got = {}
    for report in recording.reports:
        if report.stream == "train":
            got[("train", report.step)] = report.values["train/mean"]
            assert report.histograms["train/bins"].sum().item() == 10, report.step
        else:
            got[("", report.step)] = report.values["lr"]
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(got[key] - value) < 1e-12, key


class _NoState(RecordingSink):
    def state_dict(self) -> dict[str, object]:
        raise ConnectionError("cannot read the run id")


def test_a_sink_whose_state_cannot_be_read_is_said_once_and_in_its_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # It warned after every delivered report (202 warnings for 200) and its status read healthy.
    sink = _NoState()
    metric = SumMetric()
    collector = AsyncMetricCollector(metric, sinks=[sink]).bind("cpu")
    with caplog.at_level("WARNING", logger="sidestream"):
        for step in range(1, 51):
            metric.update(torch.tensor([1.0]))
            collector.schedule_collection(step)
        collector.state_dict(timeout=30)  # waits until every report is delivered
        status = collector.sink_status["recording"]
        assert collector.close(timeout=30)
    assert status.last_error == "state_dict failed: ConnectionError: cannot read the run id"
    streaks = [r for r in caplog.records if "sends this sink the reports" in r.getMessage()]
    assert len(streaks) == 1
    assert sink.steps == list(range(1, 51))
