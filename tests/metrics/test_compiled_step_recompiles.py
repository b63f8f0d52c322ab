"""A training step compiled whole compiles a fixed number of times, not once per step.

Found by a recompile probe of compiled training steps (``torch.compile(step, fullgraph=True)``
calling several metrics' updates). Two per-step recompiles, each failing the step at torch's
recompile limit (8):

- a Python float argument (a learning rate, a token count as a float) was made a constant of
  the graph by the update's own ``torch.full``, although torch 2.13 passes floats into the
  graph as inputs: every new value compiled again;
- each metric's freshness flag was read by the graph, so metrics synced on their own
  schedules (a loss every 2 steps, an accuracy every 3, a maximum every 5) compiled a graph
  for every combination of flags set before a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import Tensor

from sidestream import Metric, MetricAccumulator
from sidestream.metrics import MaxMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    MulticlassAveragePrecisionMetric,
    MultilabelAUROCMetric,
    confusion_count_metric,
)
from sidestream.metrics.language import PerplexityMetric, _tokens

_RATES = [0.5 + 0.25 * i for i in range(12)]  # 12 distinct floats: past the limit of 8


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _RateAverage(Metric[Tensor]):
    """A user's metric that accumulates a Python float (the learning rate)."""

    def __init__(self) -> None:
        self._total = MetricAccumulator(0.0)
        self._steps = MetricAccumulator(0)

    def update(self, rate: float) -> None:
        self._total.accumulate(rate)
        self._steps.accumulate(1)

    def compute(self) -> Tensor:
        return self._total.value / self._steps.value


def _values(step: int) -> Tensor:
    return torch.arange(1.0, 5.0, dtype=torch.float64) + step


# name: (metric, the compiled call given a batch and a float, the expected value)
_FLOAT_CASES: dict[str, tuple[Callable[[], Metric[Tensor]], Callable[..., None], float]] = {
    "weighted mean weights": (
        WeightedMeanMetric,
        lambda m, x, w: m.update(x, weights=w),
        sum(float(_values(i).sum()) * w for i, w in enumerate(_RATES)) / (4 * sum(_RATES)),
    ),
    "sum values": (SumMetric, lambda m, x, w: m.update(w), sum(_RATES)),
    "perplexity weights": (
        PerplexityMetric,
        lambda m, x, w: m.update(losses=x, weights=w),
        math.exp(
            sum(float(_values(i).sum()) * w for i, w in enumerate(_RATES)) / (4 * sum(_RATES))
        ),
    ),
    "accumulate a float": (_RateAverage, lambda m, x, w: m.update(w), sum(_RATES) / 12),
}


@pytest.mark.parametrize("name", sorted(_FLOAT_CASES))
def test_a_python_float_argument_compiles_twice_not_once_per_value(name: str) -> None:
    make, call, expected = _FLOAT_CASES[name]
    metric = make()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda x, w: call(metric, x, w), backend=counter, fullgraph=True)
    for index, rate in enumerate(_RATES):
        step(_values(index), rate)  # the 9th failed: FailOnRecompileLimitHit
    # The first value, then one graph with the float as an input (as a Python int compiles).
    assert counter.frame_count <= 2, counter.frame_count
    assert math.isclose(float(metric.compute()), expected, rel_tol=1e-12), name


def test_a_compiled_float_weight_that_is_bad_is_still_counted_and_dropped() -> None:
    # The float reaches the graph as an input now: the device path's check of the number must
    # still see each call's value (negative, inf), not the first one's.
    metric = WeightedMeanMetric()
    step = torch.compile(metric.update, backend="aot_eager", fullgraph=True)
    for weight in (1.0, 2.0, -1.0, 3.0, math.inf, 4.0):
        step(torch.tensor([weight, 2 * weight]), weight)
    assert int(metric.rejected_updates) == 2
    good = (1.0, 2.0, 3.0, 4.0)
    expected = sum(3 * w * w for w in good) / sum(2 * w for w in good)
    assert math.isclose(float(metric.compute()), expected, rel_tol=1e-12)


def test_metrics_synced_on_their_own_schedules_compile_a_fixed_number_of_graphs() -> None:
    loss = WeightedMeanMetric()
    accuracy = confusion_count_metric().multiclass(3).with_accuracy().micro().build()
    largest = MaxMetric()
    weights = torch.tensor([[1.0, -1.0, 0.5], [0.0, 2.0, -1.0]])

    def train_step(x: Tensor, target: Tensor) -> None:
        logits = x @ weights
        losses = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        loss.update(losses, weights=4)
        accuracy.update(logits, target)
        largest.update(losses)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(train_step, backend=counter, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    xs, targets = [], []
    for index in range(1, 31):
        x = torch.randn(6, 2, generator=generator)
        target = torch.randint(0, 3, (6,), generator=generator)
        step(x, target)  # a graph per combination of set flags: 7 by step 30 before
        xs.append(x)
        targets.append(target)
        # Every update made its metric's synced value stale, whichever flags were set.
        for metric in (loss, accuracy, largest):
            assert all(state.synced is None for _, state in metric.named_accumulators())
        for metric, every in ((loss, 2), (accuracy, 3), (largest, 5)):
            if index % every == 0:
                metric.sync()
    assert counter.frame_count <= 2, counter.frame_count
    logits = torch.cat(xs).double() @ weights.double()
    target = torch.cat(targets)
    losses = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    assert math.isclose(float(loss.compute()), float(losses.mean()), rel_tol=1e-6)
    assert float(accuracy.compute()) == float((logits.argmax(1) == target).double().mean())
    assert math.isclose(float(largest.compute()), float(losses.max()), rel_tol=1e-6)


# name: (metric, a batch of n samples): binned ranking metrics, whose updates on CUDA (and
# compiled on CPU for batches smaller than the histogram) add slots with index_add_.
_RankingBatch = Callable[[int, torch.Generator], tuple[Tensor, Tensor]]
_RANKING_CASES: dict[str, tuple[Callable[[], Metric[Tensor]], _RankingBatch]] = {
    "binary": (
        BinaryAUROCMetric,
        lambda n, g: (torch.rand(n, generator=g), torch.randint(0, 2, (n,), generator=g)),
    ),
    "multiclass": (
        lambda: MulticlassAveragePrecisionMetric(num_classes=4),
        lambda n, g: (
            torch.randn(n, 4, generator=g).softmax(-1),
            torch.randint(0, 4, (n,), generator=g),
        ),
    ),
    "multilabel": (
        lambda: MultilabelAUROCMetric(num_labels=3, ignore_index=-1),
        lambda n, g: (torch.rand(n, 3, generator=g), torch.randint(-1, 2, (n, 3), generator=g)),
    ),
}


@pytest.mark.parametrize("name", sorted(_RANKING_CASES))
def test_a_binned_ranking_update_compiles_once_for_every_batch_size(name: str) -> None:
    # The device path's loop over row blocks ran range() over the batch's symbolic row count,
    # which specialized it: a graph per batch size (a varying last batch, sequence lengths),
    # failing at torch's recompile limit (8) with fullgraph=True.
    make, batch = _RANKING_CASES[name]
    compiled, eager = make(), make()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda p, t: compiled.update(p, t), backend=counter, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    for rows in range(8, 28, 2):  # 10 sizes, all smaller than the histogram
        preds, target = batch(rows, generator)
        step(preds, target)
        eager.update(preds, target)
    # The first size, then one graph with the rows as a symbol.
    assert counter.frame_count <= 2, counter.frame_count
    assert torch.equal(compiled.compute(), eager.compute())


def test_a_compiled_perplexity_of_logits_past_a_block_compiles_once_per_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An eager update sums the loss in blocks of WORK_ELEMENTS logits; compiled, the loop over
    # blocks made the batch's sizes constants: a graph per sequence length (fullgraph failed at
    # the 9th), for every language-model batch past 16M logits.
    monkeypatch.setattr(_tokens, "WORK_ELEMENTS", 64)  # every batch below is past a block
    metric = PerplexityMetric(ignore_index=-100)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = torch.compile(lambda x, t: metric.update(x, t), backend=counter, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    nll, tokens = 0.0, 0
    for length in range(8, 28, 2):  # 10 sequence lengths
        logits = torch.randn(2, length, 11, generator=generator).bfloat16()
        target = torch.randint(0, 11, (2, length), generator=generator)
        target[0, :3] = -100
        step(logits, target)
        counted = target != -100
        log_probs = logits.double().log_softmax(-1)[counted]
        nll -= float(log_probs.gather(-1, target[counted].unsqueeze(-1)).sum())
        tokens += int(counted.sum())
    assert counter.frame_count <= 2, counter.frame_count
    assert math.isclose(float(metric.compute()), math.exp(nll / tokens), rel_tol=1e-6)
