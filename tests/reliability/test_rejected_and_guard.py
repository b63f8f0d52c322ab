"""Dropped-batch counts reach the reports; a ProcessSink without a __main__ guard is named."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import sidestream.metrics
from sidestream import AsyncMetricCollector, ComposeMetric, MeanMetric, Metric, WeightedMeanMetric
from sidestream.collector._window import _COUNTERS_OF_THE_LIBRARY
from sidestream.metrics.language import PerplexityMetric, TokenAccuracyMetric
from tests.collector.helpers import RecordingSink

ROOT = Path(__file__).resolve().parents[2]


def _drop_one_batch(metric: WeightedMeanMetric) -> None:
    """What ``update`` does on CUDA for a batch with a bad value, without a GPU."""
    metric._rejected.accumulate(torch.tensor(1, dtype=torch.int64))


def test_rejected_updates_are_reported_with_their_window() -> None:
    metric = ComposeMetric({"loss": WeightedMeanMetric(), "acc": MeanMetric()})
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink], prefix="train")
    collector.bind("cpu")
    for step in range(1, 6):
        metric["loss"].update(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]))
        metric["acc"].update(torch.tensor([1.0]))
        for _ in range(step % 3):
            _drop_one_batch(metric["loss"])  # type: ignore[arg-type]
        collector.schedule_collection(step)
    assert collector.close(20) is True
    got = [r.values.get("train/loss/rejected_updates") for r in sink.reports]
    assert got == [1.0, 2.0, None, 1.0, 2.0], "counted per window, absent when none"
    assert all(r.values["train/loss"] == 2.0 for r in sink.reports)


def _library_metric_classes() -> set[type]:
    for module in pkgutil.walk_packages(sidestream.metrics.__path__, "sidestream.metrics."):
        importlib.import_module(module.name)
    found: set[type] = set()
    pending: list[type] = [Metric]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            pending.append(sub)
            if sub.__module__.startswith("sidestream."):
                found.add(sub)
    return found


def test_every_library_counter_of_dropped_batches_is_one_the_collector_reports() -> None:
    # A metric with a rejected_updates of its own (not the shared counter's) was never
    # reported: perplexity and token accuracy dropped bad batches on CUDA unseen.
    unreported = sorted(
        cls.__name__
        for cls in _library_metric_classes()
        for attribute in ("rejected_updates", "nan_count")
        if hasattr(cls, attribute) and getattr(cls, attribute) not in _COUNTERS_OF_THE_LIBRARY
    )
    assert unreported == []


def test_language_metrics_report_their_dropped_batches() -> None:
    metric = ComposeMetric({"ppl": PerplexityMetric(), "acc": TokenAccuracyMetric()})
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink], prefix="val")
    collector.bind("cpu")
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0]]])
    target = torch.tensor([[0, 0]])
    for step in range(1, 4):
        metric["ppl"].update(logits, target)
        metric["acc"].update(logits, target)
        for name in ("ppl", "acc"):
            for _ in range(step - 1):  # what update does on CUDA for a bad batch
                metric[name]._rejected.accumulate(torch.tensor(1, dtype=torch.int64))
        collector.schedule_collection(step)
    assert collector.close(20) is True
    for name in ("ppl", "acc"):
        got = [r.values.get(f"val/{name}/rejected_updates") for r in sink.reports]
        assert got == [None, 1.0, 2.0]
    # Token accuracy of the two tokens: argmax 0 and 1 against targets 0 and 0.
    assert all(r.values["val/acc"] == 0.5 for r in sink.reports)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rejected_updates_on_cuda_reach_the_report_without_host_sync() -> None:
    # "error": a NaN value is bad input (the default "disable" would let it through).
    metric = WeightedMeanMetric(nan_strategy="error")
    sink = RecordingSink()
    collector = AsyncMetricCollector(metric, sinks=[sink], prefix="loss")
    collector.bind("cuda")
    good, bad = (
        torch.tensor([1.0, 3.0], device="cuda"),
        torch.tensor([1.0, float("nan")], device="cuda"),
    )
    ones = torch.ones(2, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            metric.update(good, ones)
            for _ in range(step - 1):
                metric.update(bad, ones)
            collector.schedule_collection(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert collector.close(30) is True
    assert [r.values.get("loss/rejected_updates") for r in sink.reports] == [None, 1.0, 2.0]
    assert [r.values["loss"] for r in sink.reports] == [2.0, 2.0, 2.0]


_UNGUARDED = """
import json, sys
from sidestream.sinks import JsonlSink, ProcessSink, RunInfo, Report

sink = ProcessSink(JsonlSink(sys.argv[1]))
try:
    sink.open(RunInfo())
except Exception as error:
    print("ERROR", type(error).__name__, error)
    raise SystemExit(3)
sink.write(Report(step=1, values={"x": 1.0}, time=0.0))
sink.close(10)
print("OK")
"""


def test_process_sink_without_main_guard_says_so(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_UNGUARDED))
    out = tmp_path / "m.jsonl"
    result = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    text = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"top-level code of {script} (line 5)" in text, text[-3000:]
    assert 'if __name__ == "__main__":' in text
    assert "bootstrapping" not in text, "no child was started to run the script again"
    assert not out.exists()


def test_process_sink_without_main_guard_is_a_permanent_error(tmp_path: Path) -> None:
    # The script does not change between retries: the pipeline must fail the sink, not retry.
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "from sidestream.sinks import JsonlSink, ProcessSink, SinkProcessError, is_permanent\n"
        "try:\n"
        "    ProcessSink(JsonlSink(sys.argv[1]))\n"
        "except SinkProcessError as error:\n"
        "    print('permanent' if is_permanent(error) else 'transient', error)\n"
    )
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "m.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.stdout.startswith("permanent "), result.stdout + result.stderr
    assert f"top-level code of {script} (line 4)" in result.stdout


def test_process_sink_with_main_guard_works(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    body = textwrap.indent(textwrap.dedent(_UNGUARDED).split("\n", 3)[3], "    ")
    script.write_text(
        "import json, sys\nfrom sidestream.sinks import JsonlSink, ProcessSink, RunInfo, Report\n"
        f'\nif __name__ == "__main__":\n{body}\n'
    )
    out = tmp_path / "m.jsonl"
    result = subprocess.run(
        [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip().endswith("OK"), result.stdout + result.stderr
    assert json.loads(out.read_text())["step"] == 1
