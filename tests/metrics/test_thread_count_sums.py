"""Results do not depend on the number of CPU threads, so ranks with other counts agree.

torch splits a CPU reduction to one number over 32768 elements or more into one part per
thread: an average precision over many distinct scores, a Cohen's kappa of 200 classes or a
macro F1 of 40,000 came out with other bits under 1 and 2 threads, and ranks deciding from
them (``if ap > best: save``) could decide differently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from sidestream import Metric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    MulticlassCohenKappaMetric,
    MultilabelAveragePrecisionMetric,
    confusion_count_metric,
)
from tests.conftest import Pools

SIZE = 60_000  # above 32768: a sum torch splits per thread


def _scores(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    scores = torch.rand(shape, generator=generator, dtype=torch.float64)
    return scores, (torch.rand(shape, generator=generator) < scores * 0.6 + 0.2).long()


def _classes(classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(0, classes, (SIZE,), generator=generator)
    guess = torch.randint(0, classes, (SIZE,), generator=generator)
    return torch.where(torch.rand(SIZE, generator=generator) < 0.5, target, guess), target


CASES: dict[str, tuple[Callable[[], Metric[torch.Tensor]], Callable[[], tuple]]] = {
    "ap_exact": (lambda: BinaryAveragePrecisionMetric(exact=True), lambda: _scores((SIZE,))),
    "partial_auroc_exact": (
        lambda: BinaryAUROCMetric(exact=True, max_fpr=0.5),
        lambda: _scores((SIZE,)),
    ),
    "ap_binned": (
        lambda: BinaryAveragePrecisionMetric(num_bins=100_000),
        lambda: _scores((SIZE,)),
    ),
    "ap_micro": (
        lambda: MultilabelAveragePrecisionMetric(3, exact=True, average="micro"),
        lambda: _scores((SIZE // 3, 3)),
    ),
    "kappa": (lambda: MulticlassCohenKappaMetric(200), lambda: _classes(200, 1)),
    "macro_f1": (
        lambda: confusion_count_metric().multiclass(40_000).with_f1().macro().build(),
        lambda: _classes(40_000, 2),
    ),
}


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _bits(value: torch.Tensor) -> bytes:
    return value.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.usefixtures("threads")
def test_ordered_sum_does_not_depend_on_the_thread_count() -> None:
    from sidestream.metrics._ordered_sum import ordered_sum

    values = torch.rand(3, 100_001, dtype=torch.float64) * torch.logspace(-8, 8, 100_001)
    results = []
    for count in (1, 2, 3):
        torch.set_num_threads(count)
        results.append([_bits(ordered_sum(row)) for row in values] + [_bits(ordered_sum(values))])
    assert results[1] == results[0] and results[2] == results[0]
    torch.testing.assert_close(ordered_sum(values), values.sum(-1), rtol=1e-14, atol=0.0)


@pytest.mark.usefixtures("threads")
def test_compute_does_not_depend_on_the_thread_count() -> None:
    differing = []
    for name, (make, data) in CASES.items():
        metric = make()
        metric.update(*data())
        results = set()
        for count in (1, 2):
            torch.set_num_threads(count)
            results.add(_bits(metric.compute()))
        if len(results) > 1:
            differing.append(name)
    assert differing == []


def _synced_bits(name: str) -> bytes:
    """This rank's result over its share of the data, computed with ``rank + 1`` threads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    before = torch.get_num_threads()
    torch.set_num_threads(rank + 1)  # ranks on machines of other sizes
    try:
        make, data = CASES[name]
        metric = make()
        preds, target = data()
        metric.update(preds[rank::world], target[rank::world])
        metric.sync()
        return _bits(metric.compute())
    finally:
        torch.set_num_threads(before)


def test_ranks_with_other_thread_counts_get_the_same_bits(pools: Pools) -> None:
    results = pools.get(2).run(_synced_bits, "ap_exact")
    assert results[1] == results[0]
