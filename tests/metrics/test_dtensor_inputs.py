"""A ``DTensor`` given to ``update`` is refused naming the argument, before any state changes.

Its ops into a plain state tensor raised a bare ``AssertionError`` (aggregation metrics) or
"got mixed torch.Tensor and DTensor" (classification) after a state had already taken the
batch: a mean's sum doubled, its count not, so every later value was wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from sidestream import MaxMetric, MeanMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    MulticlassConfusionMatrixMetric,
    confusion_count_metric,
)
from sidestream.metrics.language import PerplexityMetric
from sidestream.metrics.regression import MeanSquaredErrorMetric, PearsonCorrelationMetric
from tests.collector.helpers import RecordingSink
from tests.conftest import Pools

_SCORES = torch.linspace(0.05, 0.95, 8)
_LABELS = torch.tensor([0, 1, 0, 1, 1, 0, 1, 0])
_CASES: dict[str, tuple[Callable[[], Any], tuple[torch.Tensor, ...]]] = {
    "mean": (MeanMetric, (_SCORES,)),
    "sum": (SumMetric, (_SCORES,)),
    "max": (MaxMetric, (_SCORES,)),
    "weighted mean": (WeightedMeanMetric, (_SCORES, _SCORES)),
    "auroc": (BinaryAUROCMetric, (_SCORES, _LABELS)),
    "exact auroc": (lambda: BinaryAUROCMetric(exact=True), (_SCORES, _LABELS)),
    "f1": (lambda: confusion_count_metric().binary().with_f1().build(), (_SCORES, _LABELS)),
    "confusion matrix": (
        lambda: MulticlassConfusionMatrixMetric(2),
        (torch.stack([1 - _SCORES, _SCORES], 1), _LABELS),
    ),
    "mse": (MeanSquaredErrorMetric, (_SCORES, _SCORES.flip(0))),
    "pearson": (PearsonCorrelationMetric, (_SCORES, _SCORES.flip(0))),
    "perplexity": (PerplexityMetric, (torch.randn(2, 4, 3), torch.randint(0, 3, (2, 4)))),
}


def _plain_values(metric: Any) -> list[float]:
    value = metric.compute()
    return torch.as_tensor(value, dtype=torch.float64).reshape(-1).tolist()


def _feed_dtensors() -> dict[str, list[tuple[str, bool]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    outcomes: dict[str, list[tuple[str, bool]]] = {}
    for name, (make, inputs) in _CASES.items():
        outcomes[name] = []
        for position in range(len(inputs)):
            metric = make()
            metric.update(*inputs)
            before = _plain_values(metric)
            given = list(inputs)
            given[position] = distribute_tensor(inputs[position], mesh, [Shard(0)])
            try:
                metric.update(*given)
                message = "no error"
            except TypeError as error:
                message = str(error)
            outcomes[name].append((message, _plain_values(metric) == before))
    return outcomes


def test_a_dtensor_input_is_refused_naming_it_before_the_state_changes(pools: Pools) -> None:
    for outcomes in pools.get(2).run(_feed_dtensors):
        for name, per_argument in outcomes.items():
            for message, unchanged in per_argument:
                assert "expected a plain torch.Tensor, got a DTensor" in message, (name, message)
                assert ".to_local()" in message and ".full_tensor()" in message, message
                assert unchanged, name


def _log_a_dtensor() -> tuple[str, list[int]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from sidestream import Run

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sink = RecordingSink()
    with Run([sink]) as run:
        loss = distribute_tensor(torch.tensor(0.5), mesh, [Replicate()])
        try:
            run.log(1, {"loss": loss})
            message = "no error"
        except TypeError as error:
            message = str(error)
        run.log(1, {"loss": loss.full_tensor()})  # the same step, fixed: not taken before
    return message, sink.steps


def test_run_log_refuses_a_dtensor_before_the_step_counts(pools: Pools) -> None:
    for rank, (message, steps) in enumerate(pools.get(2).run(_log_a_dtensor)):
        assert message.startswith("values['loss']: expected a plain torch.Tensor"), message
        if rank == 0:
            assert steps == [1], steps
