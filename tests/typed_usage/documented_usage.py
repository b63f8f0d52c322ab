"""The core package's documented usage, as a user's ``mypy --strict`` sees it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, assert_type

import torch
import torch.distributed as dist
from torch import Tensor

from sidestream import (
    AsyncMetricCollector,
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    Metric,
    MetricAccumulator,
    Run,
    SumMetric,
)
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    ConfusionCountMetric,
    SamplewiseConfusionCountMetric,
    confusion_count_metric,
)
from sidestream.sinks import ConsoleSink, JsonlSink, Report, RunInfo, TrackerSink
from sidestream.testing import DistributedPool, run_distributed


def as_float(metric: Metric[Tensor]) -> float:
    metric.sync()
    return float(metric.compute())


def metrics() -> None:
    mean = MeanMetric().to("cpu")
    mean.update(torch.tensor([1.0, 3.0]))
    assert_type(mean.compute(), Tensor)
    mean.load_state_dict(mean.state_dict())

    # docs/sync.md: children are indexed, nested compositions too.
    compose = ComposeMetric(
        {"loss": MeanMetric(), "train": ComposeMetric({"tokens": SumMetric(), "max": MaxMetric()})}
    )
    compose["loss"].update(torch.tensor([0.5, 1.5]))
    compose["train"]["tokens"].update(torch.tensor([512.0]))
    print(compose.compute()["loss"])

    auroc = BinaryAUROCMetric()
    auroc.update(torch.rand(8), torch.randint(0, 2, (8,)))
    assert_type(auroc.error_bound(), Tensor)
    as_float(auroc)


def confusion_builder() -> None:
    # docs/classification.md: one statistic gives a tensor, several a dict.
    f1 = confusion_count_metric().multiclass(3).with_f1().macro().build()
    assert_type(f1, ConfusionCountMetric[Tensor])
    f1.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    assert_type(f1.compute(), Tensor)
    print(f1.counts()["tp"], as_float(f1))

    several = confusion_count_metric().binary(0.5, logits=True).with_precision().with_recall()
    assert_type(several.build().compute(), dict[str, Tensor])
    print(several.build().compute()["precision"])

    per_image = confusion_count_metric(multidim_average="samplewise").multiclass(3).with_f1()
    assert_type(per_image.build(), SamplewiseConfusionCountMetric[Tensor])

    # build() without a statistic raises ValueError; a type checker says so first.
    confusion_count_metric().multiclass(3).macro().build()  # type: ignore[misc]


class ListTracker(TrackerSink):
    """docs/sinks.md's tracker: ``identity`` with the setter ``load_state_dict`` calls."""

    name = "list"
    identity_key = "run_id"

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, int]] = []
        self.run_id: str | None = None

    @property
    def identity(self) -> str | None:
        return self.run_id

    @identity.setter
    def identity(self, value: str | None) -> None:
        self.run_id = value

    def open(self, run: RunInfo) -> None:
        self.run_id = self.run_id or "run-1"

    def send(self, reports: Sequence[Report]) -> None:
        self.rows += [(report.stream, report.step) for report in reports]


def collectors_and_runs(directory: str) -> None:
    collector = AsyncMetricCollector(MeanMetric(), sinks=[ConsoleSink()]).bind("cpu")
    collector.metric.update(torch.tensor([1.0]))
    collector.schedule_collection(step=1)
    collector.close()

    # docs/runs.md: a stream's metric is the metric given, indexed by name.
    with Run([JsonlSink(f"{directory}/run.jsonl"), ListTracker()], info=RunInfo()) as run:
        val = run.collector(
            ComposeMetric(
                {
                    "loss": MeanMetric(),
                    "f1": confusion_count_metric().multiclass(3).with_f1().macro().build(),
                }
            ),
            prefix="val",
        ).bind("cpu")
        assert_type(val.metric, ComposeMetric)
        val.metric["loss"].update(torch.rand(16))
        val.metric["f1"].update(torch.randn(16, 3), torch.randint(0, 3, (16,)))
        val.schedule_collection(100)
        run.log(100, {"lr": 3e-4, "tokens": 512, "loss_scale": torch.tensor(1024.0)})
        run.log(101, {"lr": "3e-4"})  # type: ignore[dict-item]
        state: dict[str, Any] = run.state_dict()
        print(state)


def world_rank() -> int:
    return dist.get_rank()


def pools() -> None:
    # docs/testing.md: results come back by rank, typed as the function returns them.
    assert_type(run_distributed(world_rank, 2), list[int])
    with DistributedPool(2) as pool:
        assert_type(pool, DistributedPool)
        assert_type(pool.run(world_rank), list[int])


def build_f1(num_classes: int) -> ConfusionCountMetric:
    # A factory annotated with the documented class: ConfusionCountMetric[Tensor] is one.
    return confusion_count_metric().multiclass(num_classes).with_f1().macro().build()


def build_counts(
    num_classes: int, per_sample: bool
) -> ConfusionCountMetric | SamplewiseConfusionCountMetric:
    if per_sample:
        samplewise = confusion_count_metric(multidim_average="samplewise")
        return samplewise.multiclass(num_classes).with_f1().build()
    return confusion_count_metric().multiclass(num_classes).with_f1().with_recall().build()


def any_value(metric: Metric[Tensor | dict[str, Tensor]]) -> None:
    print(metric.compute())


class Trainer:
    """Collectors kept in attributes typed with the metric interface, as a trainer does."""

    def __init__(self, run: Run) -> None:
        # docs/runs.md's chain: run.collector(...).bind(device).
        self.train: AsyncMetricCollector[Metric[Tensor]] = run.collector(
            MeanMetric(), prefix="train"
        ).bind("cpu")
        self.val: AsyncMetricCollector[Metric[dict[str, Any]]] = run.collector(
            ComposeMetric({"loss": MeanMetric()}), prefix="val"
        ).bind("cpu")
        self.collectors: list[AsyncMetricCollector[Metric[Any]]] = [self.train, self.val]


def subtypes() -> None:
    # A metric is a metric of any wider value type: compute() only hands the value out.
    any_value(MeanMetric())
    any_value(build_f1(3))
    any_value(build_counts(3, per_sample=True))
    f1 = AsyncMetricCollector(confusion_count_metric().multiclass(3).with_f1().build())
    general: AsyncMetricCollector[ConfusionCountMetric] = f1.bind("cpu")
    print(general.metric.compute())  # pyright narrows to the assigned type; mypy does not


def custom_metric() -> None:
    class LabelCounts(Metric[Tensor]):
        def __init__(self, num_classes: int) -> None:
            self._counts = MetricAccumulator(torch.zeros(num_classes, dtype=torch.int64))

        def update(self, labels: Tensor) -> None:
            self._counts.scatter_add(labels, torch.ones_like(labels))

        def compute(self) -> Tensor:
            return self._counts.value.clone()

    as_float(LabelCounts(4))
