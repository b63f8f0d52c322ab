"""What ``print`` shows of metrics, runs, collectors and sinks: the object, not its address."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from sidestream import ComposeMetric, MeanMetric, Run
from sidestream.collector import AsyncMetricCollector
from sidestream.metrics.classification import BinaryAUROCMetric
from sidestream.sinks import ConsoleSink, JsonlSink, ProcessSink


def test_metrics_show_their_class_and_children() -> None:
    metric = ComposeMetric({"loss": MeanMetric(), "auc": BinaryAUROCMetric()})
    assert repr(MeanMetric()) == "MeanMetric()"
    assert repr(metric) == "ComposeMetric({'loss': MeanMetric(), 'auc': BinaryAUROCMetric()})"


def test_a_wrapped_torchmetrics_metric_shows_it() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    bridge = pytest.importorskip("sidestream_torchmetrics")
    accuracy = torchmetrics.classification.BinaryAccuracy()
    assert repr(bridge.wrap(accuracy)) == "TorchmetricsMetric(BinaryAccuracy())"


def test_a_run_and_its_collector_show_sinks_streams_and_state(tmp_path: Path) -> None:
    run = Run([JsonlSink(tmp_path / "m.jsonl"), ConsoleSink(stream=io.StringIO())])
    collector = run.collector(MeanMetric(), prefix="train")
    assert repr(run) == "Run(sinks=['jsonl', 'console'], streams=['train'], closed=False)"
    assert repr(collector) == (
        "AsyncMetricCollector(prefix='train', metric=MeanMetric(), "
        "sinks=['jsonl', 'console'], unbound)"
    )
    collector.bind("cpu")
    assert repr(collector).endswith(", bound)")
    assert run.close(timeout=10)
    assert repr(collector).endswith(", closed)")
    assert repr(run).endswith("closed=True)")


def test_sinks_show_what_they_write(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    assert repr(JsonlSink(path)) == f"JsonlSink(path={str(path)!r})"
    assert repr(ConsoleSink(every=5)) == "ConsoleSink(every=5)"
    assert repr(ProcessSink(JsonlSink(path))) == f"ProcessSink(JsonlSink(path={str(path)!r}))"


def test_an_object_whose_constructor_raised_part_way_still_prints() -> None:
    # A debugger or a traceback formatter may print one.
    for cls in (Run, AsyncMetricCollector, JsonlSink, ConsoleSink, ProcessSink):
        assert repr(cls.__new__(cls)).startswith(cls.__name__ + "(")


def test_a_compose_metric_whose_constructor_raised_part_way_still_prints() -> None:
    # Its children are set last: a child already in another tree raised before, and repr
    # then raised AttributeError ('_children') where the other reprs guard for it.
    shared = MeanMetric()
    ComposeMetric({"loss": shared})
    half = ComposeMetric.__new__(ComposeMetric)
    with pytest.raises(ValueError, match="already part of the metric tree"):
        half.__init__({"acc": MeanMetric(), "loss": shared})  # type: ignore[misc]
    assert repr(half) == "ComposeMetric({})"


def test_a_compose_metric_subclass_shows_its_own_class() -> None:
    class Losses(ComposeMetric):
        pass

    assert repr(Losses({"loss": MeanMetric()})) == "Losses({'loss': MeanMetric()})"
