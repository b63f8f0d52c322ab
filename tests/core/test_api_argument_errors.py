"""Public constructors refuse a wrong-typed or out-of-range argument by name, when called.

Each case failed before either far from its cause (an ``AttributeError`` or a format error in
the first ``update``/``compute``, a sink failed for good on its thread) or with Python's own
message that names no argument ("'int' object is not iterable"), or was taken silently against
its docstring (``FBeta``'s "finite and > 0").
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

from sidestream import MeanMetric, Run
from sidestream.collector import AsyncMetricCollector
from sidestream.metrics.classification import (
    Accuracy,
    ConfusionCountMetric,
    Curve,
    FBeta,
    Problem,
    ProblemKind,
    RankingMetric,
    confusion_count_metric,
)
from sidestream.sinks import ConsoleSink, SinkRunner
from sidestream.testing import DistributedPool, TorchrunPool


@pytest.mark.parametrize(
    ("beta", "error"),
    [
        (-1.0, ValueError),  # was the F1 value, named "f-1"
        (0.0, ValueError),
        (math.nan, ValueError),  # every value NaN
        (math.inf, ValueError),
        ("2", TypeError),  # failed in ``name`` with "Unknown format code 'g'"
        (True, TypeError),  # silently beta = 1
    ],
)
def test_fbeta_refuses_a_beta_that_is_no_finite_positive_number(beta: Any, error: type) -> None:
    with pytest.raises(error, match="beta: expected a finite number > 0"):
        FBeta(beta)


def test_fbeta_keeps_taking_what_the_builder_takes() -> None:
    assert FBeta(2).name == "f2"
    assert FBeta(0.5).name == "f0.5"
    built = confusion_count_metric().binary().with_statistic(FBeta(2.0)).build()
    built.update(torch.tensor([0.9, 0.1, 0.8]), torch.tensor([1, 0, 0]))
    assert math.isclose(float(built.compute()), (1 + 4) * 1 / ((1 + 4) * 1 + 4 * 0 + 1))


@pytest.mark.parametrize("name", [3, None])
def test_a_statistic_whose_name_is_no_str_is_refused_naming_statistics(name: Any) -> None:
    with pytest.raises(TypeError, match="statistics: a statistic's name must be a str"):
        ConfusionCountMetric(Problem(ProblemKind.BINARY), [Accuracy(name)])


def test_a_statistic_with_an_empty_name_is_refused() -> None:
    # Its key vanished from the flat names: "val/f1" held the empty-named value.
    with pytest.raises(ValueError, match="statistics: a statistic's name must not be empty"):
        ConfusionCountMetric(Problem(ProblemKind.BINARY), [Accuracy(""), Accuracy()])


def test_problem_refuses_a_kind_given_as_a_string() -> None:
    # Was kept, and the metric built on it failed with "'str' object has no attribute".
    with pytest.raises(TypeError, match="kind: expected a ProblemKind"):
        Problem("multiclass", 3)  # type: ignore[arg-type]


def test_ranking_metric_refuses_a_curve_given_as_a_string() -> None:
    with pytest.raises(TypeError, match="curve: expected a Curve"):
        RankingMetric("auroc", Problem(ProblemKind.BINARY))  # type: ignore[arg-type]
    assert RankingMetric(Curve.AUROC, Problem(ProblemKind.BINARY)) is not None


@pytest.mark.parametrize("pool", [DistributedPool, TorchrunPool])
def test_pools_refuse_a_backend_that_is_no_str(pool: Any) -> None:
    # backend.lower() raised AttributeError; nothing is started before the check.
    with pytest.raises(TypeError, match="backend: expected a str"):
        pool(1, backend=3)


def test_run_and_collector_name_sinks_that_are_no_list() -> None:
    with pytest.raises(TypeError, match="sinks: expected a list of sinks, got 3"):
        Run(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sinks: expected a list of sinks, got 3"):
        AsyncMetricCollector(MeanMetric(), 3)  # type: ignore[arg-type]
    # Any iterable still does, a generator included.
    run = Run(sink for sink in [ConsoleSink(stream=io.StringIO())])
    assert run.close(timeout=10)


def test_collector_names_histograms_that_are_no_list() -> None:
    with pytest.raises(TypeError, match="histograms: expected leaf paths"):
        AsyncMetricCollector(MeanMetric(), histograms=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"capacity": "1"}, TypeError, "capacity: expected an int >= 1"),
        ({"capacity": 2.5}, TypeError, "capacity: expected an int >= 1"),
        ({"capacity": 0}, ValueError, "capacity: expected"),
        ({"spool_max_bytes": "1"}, TypeError, "spool_max_bytes: expected an int >= 1"),
        ({"spool_max_bytes": 0}, ValueError, "spool_max_bytes: expected an int >= 1"),
        # A str was taken and failed the sink for good at its first idle flush.
        ({"flush_interval_s": "1"}, TypeError, "flush_interval_s: expected a number"),
        ({"flush_interval_s": math.nan}, ValueError, "flush_interval_s: expected a number"),
        # inf (or 1e300) passed, and the idle sink's timed wait failed it for good
        # ("timestamp out of range for platform time_t").
        ({"flush_interval_s": math.inf}, ValueError, r"flush_interval_s: expected seconds in"),
        ({"flush_interval_s": 1e300}, ValueError, r"flush_interval_s: expected seconds in"),
        ({"flush_interval_s": -1.0}, ValueError, r"flush_interval_s: expected seconds in"),
        ({"resume_state": 3}, TypeError, "resume_state: expected a dict or None"),
        ({"run": {"name": "x"}}, TypeError, "run: expected a sidestream.sinks.RunInfo or None"),
        ({"key": 3}, TypeError, "key: expected a str or None"),
        ({"spool_dir": 3}, TypeError, "spool_dir: expected a directory path or None"),
    ],
)
def test_sink_runner_names_a_bad_option(options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        SinkRunner(ConsoleSink(stream=io.StringIO()), **options)
