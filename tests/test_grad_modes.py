"""Every metric family under autograd's modes: inference_mode, no_grad, enable_grad, autocast.

A metric built (or bound, synced, copied, loaded) inside ``torch.inference_mode()`` and used
outside it afterwards, or the reverse, must work and give the numbers of scikit-learn, scipy,
numpy or torchmetrics' functional API on the same data: states made as inference tensors would
refuse every in-place update outside inference mode.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from scipy.stats import pearsonr
from sklearn import metrics as skm
from torch import Tensor

from sidestream import (
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    Metric,
    MinMetric,
    Run,
    SumMetric,
    WeightedMeanMetric,
)
from sidestream.collector import AsyncMetricCollector
from sidestream.collector._slot import clone_metric
from sidestream.metrics import classification as cls
from sidestream.metrics import language, regression
from sidestream.sinks import JsonlSink, read_jsonl
from sidestream.state import MetricAccumulator
from tests.conftest import Pools

Batch = tuple[Tensor, ...]


@dataclass(frozen=True)
class Case:
    """A metric, how its batches look, and an independent reference on concatenated batches."""

    factory: Callable[[], Metric[Any]]
    batch: Callable[[torch.Generator], Batch]
    reference: Callable[[list[Batch]], Any]
    tolerance: float = 1e-6


def _scores(g: torch.Generator) -> Batch:
    return torch.rand(8, generator=g), torch.rand(8, generator=g)


def _binary(g: torch.Generator) -> Batch:
    return torch.rand(16, generator=g), torch.randint(0, 2, (16,), generator=g)


def _multiclass(g: torch.Generator) -> Batch:
    return torch.randn(16, 3, generator=g).softmax(-1), torch.randint(0, 3, (16,), generator=g)


def _multilabel(g: torch.Generator) -> Batch:
    return torch.rand(16, 3, generator=g), torch.randint(0, 2, (16, 3), generator=g)


def _paired(g: torch.Generator) -> Batch:
    return torch.randn(16, generator=g), torch.randn(16, generator=g)


def _tokens(g: torch.Generator) -> Batch:
    return torch.randn(4, 5, 7, generator=g), torch.randint(0, 7, (4, 5), generator=g)


def _cat(batches: list[Batch], index: int) -> np.ndarray:
    return torch.cat([b[index] for b in batches]).double().numpy()


def _labels(batches: list[Batch]) -> np.ndarray:
    return torch.cat([b[1] for b in batches]).numpy()


def _hard(batches: list[Batch]) -> np.ndarray:
    return (_cat(batches, 0) >= 0.5).astype(int)


def _ovr(score: Callable[..., float], batches: list[Batch]) -> float:
    scores, labels = _cat(batches, 0), _labels(batches)
    one_hot = labels[:, None] == np.arange(3) if labels.ndim == 1 else labels
    return float(np.mean([score(one_hot[:, c], scores[:, c]) for c in range(3)]))


def _perplexity(batches: list[Batch]) -> float:
    logits = torch.cat([b[0].reshape(-1, 7) for b in batches]).double()
    return float(torch.exp(F.cross_entropy(logits, torch.cat([b[1].reshape(-1) for b in batches]))))


def _token_accuracy(batches: list[Batch]) -> float:
    logits = torch.cat([b[0].reshape(-1, 7) for b in batches])
    return float(
        (logits.argmax(-1) == torch.cat([b[1].reshape(-1) for b in batches])).double().mean()
    )


def _torchmetrics(name: str) -> Callable[[], Metric[Any]]:
    def make() -> Metric[Any]:
        torchmetrics = pytest.importorskip("torchmetrics")
        bridge = pytest.importorskip("sidestream_torchmetrics")
        if name == "accuracy":
            return bridge.wrap(torchmetrics.classification.BinaryAccuracy(validate_args=False))
        return bridge.wrap(
            torchmetrics.MetricCollection(
                {
                    "acc": torchmetrics.classification.BinaryAccuracy(validate_args=False),
                    "f1": torchmetrics.classification.BinaryF1Score(validate_args=False),
                }
            )
        )

    return make


def _calibration(batches: list[Batch], classes: int) -> float:
    from torchmetrics.functional import classification as tmc

    preds, target = torch.from_numpy(_cat(batches, 0)), torch.from_numpy(_labels(batches))
    if classes == 2:
        return float(tmc.binary_calibration_error(preds, target, n_bins=15))
    return float(tmc.multiclass_calibration_error(preds, target, num_classes=classes, n_bins=15))


CASES: dict[str, Case] = {
    "sum": Case(SumMetric, _scores, lambda b: _cat(b, 0).sum()),
    "mean": Case(MeanMetric, _scores, lambda b: _cat(b, 0).mean()),
    "weighted_mean": Case(
        WeightedMeanMetric, _scores, lambda b: (_cat(b, 0) * _cat(b, 1)).sum() / _cat(b, 1).sum()
    ),
    "max": Case(MaxMetric, _scores, lambda b: _cat(b, 0).max()),
    "min": Case(MinMetric, _scores, lambda b: _cat(b, 0).min()),
    "compose": Case(
        lambda: ComposeMetric({"mean": MeanMetric(), "max": MaxMetric()}),
        _scores,
        lambda b: {"mean": _cat(b, 0).mean(), "max": _cat(b, 0).max()},
    ),
    "confusion_builder": Case(
        lambda: cls.confusion_count_metric().multiclass(3).with_f1().macro().build(),
        _multiclass,
        lambda b: skm.f1_score(
            _labels(b), _cat(b, 0).argmax(-1), average="macro", labels=[0, 1, 2]
        ),
    ),
    "binary_precision_recall": Case(
        lambda: cls.confusion_count_metric().binary().with_precision().with_recall().build(),
        _binary,
        lambda b: {
            "precision": skm.precision_score(_labels(b), _hard(b), zero_division=0),
            "recall": skm.recall_score(_labels(b), _hard(b), zero_division=0),
        },
    ),
    "auroc_binned": Case(
        cls.BinaryAUROCMetric, _binary, lambda b: skm.roc_auc_score(_labels(b), _cat(b, 0)), 1e-3
    ),
    "auroc_exact": Case(
        lambda: cls.BinaryAUROCMetric(exact=True),
        _binary,
        lambda b: skm.roc_auc_score(_labels(b), _cat(b, 0)),
    ),
    "average_precision_binned": Case(
        cls.BinaryAveragePrecisionMetric,
        _binary,
        lambda b: skm.average_precision_score(_labels(b), _cat(b, 0)),
        1e-3,
    ),
    "multiclass_auroc_exact": Case(
        lambda: cls.MulticlassAUROCMetric(3, exact=True),
        _multiclass,
        lambda b: _ovr(skm.roc_auc_score, b),
    ),
    "multilabel_average_precision_exact": Case(
        lambda: cls.MultilabelAveragePrecisionMetric(3, exact=True),
        _multilabel,
        lambda b: _ovr(skm.average_precision_score, b),
    ),
    "calibration": Case(cls.BinaryCalibrationErrorMetric, _binary, lambda b: _calibration(b, 2)),
    "multiclass_calibration": Case(
        lambda: cls.MulticlassCalibrationErrorMetric(3), _multiclass, lambda b: _calibration(b, 3)
    ),
    "cohen_kappa": Case(
        lambda: cls.MulticlassCohenKappaMetric(3, weights="quadratic"),
        _multiclass,
        lambda b: skm.cohen_kappa_score(_labels(b), _cat(b, 0).argmax(-1), weights="quadratic"),
    ),
    "matthews": Case(
        cls.BinaryMatthewsCorrCoefMetric,
        _binary,
        lambda b: skm.matthews_corrcoef(_labels(b), _hard(b)),
    ),
    "confusion_matrix": Case(
        lambda: cls.MulticlassConfusionMatrixMetric(3, normalize="true"),
        _multiclass,
        lambda b: skm.confusion_matrix(
            _labels(b), _cat(b, 0).argmax(-1), labels=[0, 1, 2], normalize="true"
        ),
    ),
    "mse": Case(
        regression.MeanSquaredErrorMetric,
        _paired,
        lambda b: skm.mean_squared_error(_cat(b, 1), _cat(b, 0)),
    ),
    "r2": Case(regression.R2ScoreMetric, _paired, lambda b: skm.r2_score(_cat(b, 1), _cat(b, 0))),
    "pearson": Case(
        regression.PearsonCorrelationMetric,
        _paired,
        lambda b: pearsonr(_cat(b, 0), _cat(b, 1)).statistic,
    ),
    "perplexity": Case(language.PerplexityMetric, _tokens, _perplexity),
    "token_accuracy": Case(language.TokenAccuracyMetric, _tokens, _token_accuracy),
    "torchmetrics_wrap": Case(
        _torchmetrics("accuracy"), _binary, lambda b: skm.accuracy_score(_labels(b), _hard(b))
    ),
    "torchmetrics_collection": Case(
        _torchmetrics("collection"),
        _binary,
        lambda b: {
            "acc": skm.accuracy_score(_labels(b), _hard(b)),
            "f1": skm.f1_score(_labels(b), _hard(b)),
        },
    ),
}


def _update(metric: Metric[Any], batch: Batch) -> None:
    if type(metric) is ComposeMetric:  # not the torchmetrics bridge's collection
        metric["mean"].update(batch[0])
        metric["max"].update(batch[0])
    elif isinstance(metric, (SumMetric, MeanMetric, MaxMetric, MinMetric)):
        metric.update(batch[0])
    else:
        metric.update(*batch)


def _batches(name: str, seed: int = 0, count: int = 3) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [CASES[name].batch(generator) for _ in range(count)]


def _assert_matches(name: str, value: Any, batches: list[Batch]) -> None:
    expected = CASES[name].reference(batches)
    tolerance = CASES[name].tolerance
    if isinstance(expected, dict):
        assert sorted(value) == sorted(expected)
        for key in expected:
            np.testing.assert_allclose(
                torch.as_tensor(value[key]).double().numpy(), expected[key], atol=tolerance
            )
    else:
        np.testing.assert_allclose(
            torch.as_tensor(value).double().numpy(), expected, atol=tolerance, rtol=tolerance
        )


STEPS = (
    "construct",
    "to",
    "first update",
    "update",
    "compute",
    "reset",
    "state_dict",
    "load_state_dict",
    "clone_metric",
)


def _life(name: str, inside: set[str]) -> None:
    """A metric's life with the steps in ``inside`` under inference mode, the rest outside."""

    def mode(step: str) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode() if step in inside else contextlib.nullcontext()

    b0, b1, b2 = _batches(name)
    factory = CASES[name].factory
    with mode("construct"):
        metric = factory()
    with mode("to"):
        metric.to("cpu")
    with mode("first update"):
        _update(metric, b0)
    with mode("update"):
        _update(metric, b1)
    with mode("compute"):
        _assert_matches(name, metric.compute(), [b0, b1])
    with mode("reset"):
        metric.reset()
    with mode("update"):
        _update(metric, b2)
    with mode("compute"):
        _assert_matches(name, metric.compute(), [b2])
    with mode("state_dict"):
        saved = metric.state_dict()
    with mode("load_state_dict"):
        loaded = factory()
        loaded.load_state_dict(saved)
    with mode("update"):
        _update(loaded, b0)
    with mode("compute"):
        _assert_matches(name, loaded.compute(), [b2, b0])
    with mode("clone_metric"):
        copied = clone_metric(metric)
    with mode("update"):
        _update(copied, b1)
        _update(metric, b0)
    with mode("compute"):
        _assert_matches(name, copied.compute(), [b2, b1])
        _assert_matches(name, metric.compute(), [b2, b0])


@pytest.mark.parametrize("name", CASES)
def test_each_step_under_inference_mode_and_the_others_outside(name: str) -> None:
    """One step inside ``torch.inference_mode()``, every other outside, and the reverse."""
    for step in STEPS:
        _life(name, {step})
        _life(name, set(STEPS) - {step})


def test_a_metric_built_in_an_evaluation_function_updates_in_training() -> None:
    """The reported case: validation metrics built lazily inside ``@torch.inference_mode()``."""
    with torch.inference_mode():
        metric = MaxMetric()
    metric.update(torch.tensor([0.5, 2.0]))
    assert metric.compute().item() == 2.0


def test_stand_alone_states_made_moved_or_copied_under_inference_mode() -> None:
    """``MetricAccumulator`` and metrics made by pickle, deepcopy or ``to`` inside it."""
    with torch.inference_mode():
        made = MetricAccumulator(torch.zeros(3))
        unpickled = pickle.loads(pickle.dumps(MetricAccumulator(torch.zeros(3))))
        metric = pickle.loads(pickle.dumps(MeanMetric()))
        deep = copy.deepcopy(MeanMetric())
    moved = MetricAccumulator(torch.zeros(3))
    with torch.inference_mode():
        moved.to("meta")  # another device: a copy made in inference mode
    for state in (made, unpickled):
        state.accumulate(torch.ones(3))
        assert state.value.tolist() == [1.0, 1.0, 1.0]
    moved.accumulate(torch.ones(3, device="meta"))
    for mean in (metric, deep):
        mean.update(torch.tensor([1.0, 3.0]))
        assert mean.compute().item() == 2.0


def _ranks_in_modes(name: str, step: str, inside: bool, folder: str) -> list[Any]:
    """Each rank: update, sync, compute, save and load (DCP), with ``step`` in or out of
    inference mode and the rest the other way."""
    rank = dist.get_rank()

    def mode(this: str) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode() if (this == step) == inside else contextlib.nullcontext()

    b0, b1, b2 = _batches(name, seed=rank)
    factory = CASES[name].factory
    with mode("construct"):
        metric = factory()
    with mode("update"):
        _update(metric, b0)
    with mode("sync"):
        metric.sync()
    first = metric.compute()
    with mode("update"):
        _update(metric, b1)
    with mode("sync"):
        metric.sync()
    second = metric.compute()
    with mode("save"):
        dcp.save({"metric": metric}, checkpoint_id=folder)
    with mode("load"):
        loaded = factory()
        dcp.load({"metric": loaded}, checkpoint_id=folder)
    with mode("update"):
        _update(loaded, b2)
    with mode("sync"):
        loaded.sync()
    return [first, second, loaded.compute()]


@pytest.mark.parametrize("name", ["mean", "max", "auroc_exact", "confusion_builder", "r2"])
def test_sync_and_checkpoints_under_either_mode(name: str, pools: Pools, tmp_path: Path) -> None:
    """A first sync (which lays out the sync's buffers) or a DCP load inside inference mode,
    and later syncs outside it, on 2 gloo ranks, against the reference on every rank's data."""
    pool = pools.get(2)
    shards = [_batches(name, seed=rank) for rank in range(2)]
    for step in ("construct", "update", "sync", "save", "load"):
        for inside in (True, False):
            folder = str(tmp_path / f"{step}-{inside}")
            results = pool.run(_ranks_in_modes, name, step, inside, folder)
            for first, second, third in results:
                _assert_matches(name, first, [shard[0] for shard in shards])
                _assert_matches(name, second, [b for shard in shards for b in shard[:2]])
                _assert_matches(name, third, [b for shard in shards for b in shard])


def _window_values(path: Path, stream: str) -> dict[int, dict[str, float]]:
    return {r["step"]: r["values"] for r in read_jsonl(path) if r["stream"] == stream}


@pytest.mark.parametrize("evaluation_in_inference_mode", [True, False])
def test_run_collectors_bound_in_one_mode_and_used_in_the_other(
    tmp_path: Path, evaluation_in_inference_mode: bool
) -> None:
    """A validation collector bound lazily inside ``@torch.inference_mode()`` evaluation, a
    training one outside (and the reverse); both used in both modes afterwards."""
    path = tmp_path / "run.jsonl"
    run = Run([JsonlSink(path)])
    collectors: dict[str, Any] = {}
    values = {
        step: torch.rand(6, generator=torch.Generator().manual_seed(step)) for step in range(6)
    }
    labels = torch.arange(6) % 2

    def evaluate(step: int) -> None:
        if "val" not in collectors:
            val = ComposeMetric({"max": MaxMetric(), "auc": cls.BinaryAUROCMetric(exact=True)})
            collectors["val"] = run.collector(val, prefix="val").bind("cpu")
        collectors["val"].metric["max"].update(values[step])
        collectors["val"].metric["auc"].update(values[step], labels)
        collectors["val"].schedule_collection(step)
        run.log(step, {"seen": torch.tensor(float(step))})

    def train(step: int) -> None:
        if "train" not in collectors:
            collectors["train"] = run.collector(MeanMetric(), prefix="train").bind("cpu")
        collectors["train"].metric.update(values[step])
        collectors["train"].schedule_collection(step)

    for step in range(6):
        evaluating = step % 2 == 0
        inside = evaluating == evaluation_in_inference_mode
        if step >= 4:
            inside = not inside  # and each in the other mode once bound
        with torch.inference_mode() if inside else contextlib.nullcontext():
            (evaluate if evaluating else train)(step)
    with torch.inference_mode():
        run.state_dict()
    run.state_dict()
    assert run.close()
    val, train_values = _window_values(path, "val"), _window_values(path, "train")
    for step in (0, 2, 4):
        scores = values[step].double().numpy()
        assert val[step]["val/max"] == pytest.approx(scores.max())
        assert val[step]["val/auc"] == pytest.approx(skm.roc_auc_score(labels.numpy(), scores))
    for step in (1, 3, 5):
        assert train_values[step]["train"] == pytest.approx(values[step].double().mean().item())
    assert sorted(_window_values(path, "")) == [0, 2, 4]


@contextlib.contextmanager
def _autocast_no_grad() -> Iterator[None]:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        yield


MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast_no_grad": _autocast_no_grad,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CASES)
def test_values_and_state_dtypes_under_grad_modes_and_autocast(name: str, mode: str) -> None:
    """Update and compute inside the mode: the reference's values, the declared state dtypes."""
    metric = CASES[name].factory()
    declared = {key: state.local.dtype for key, state in metric.named_accumulators()}
    batches = _batches(name)
    with MODES[mode]():
        for batch in batches:
            _update(metric, batch)
        value = metric.compute()
    assert {key: state.local.dtype for key, state in metric.named_accumulators()} == declared
    _assert_matches(name, value, batches)


@pytest.mark.parametrize("name", CASES)
def test_inputs_that_require_grad_leave_no_graph_behind(name: str) -> None:
    """Logits straight from a model: backward works after the update, the graph is freed, and
    no state, kept sample or checkpoint requires grad."""
    metric = CASES[name].factory()
    batches = _batches(name)
    with torch.enable_grad():
        for batch in batches:
            weight = torch.ones((), requires_grad=True)
            inputs = tuple(t * weight if t.is_floating_point() else t for t in batch)
            intermediates = [weakref.ref(t) for t in inputs if t.requires_grad]
            _update(metric, inputs)
            loss = sum(t.sum() for t in inputs if t.requires_grad)
            assert isinstance(loss, Tensor)
            loss.backward()
            assert weight.grad is not None
            del inputs, loss, weight
            gc.collect()
            assert all(ref() is None for ref in intermediates)
        value = metric.compute()
    for _, state in metric.named_accumulators():
        assert not state.local.requires_grad and not state.initial.requires_grad
    for _, store in metric.named_sample_stores():
        assert not any(rows.requires_grad for rows in store.local().values())
    for saved in metric.state_dict().values():
        tensor = getattr(saved, "rows", saved)  # a sample store's SavedRows
        assert not (isinstance(tensor, Tensor) and tensor.requires_grad)
    leaves = value.values() if isinstance(value, dict) else [value]
    assert not any(leaf.requires_grad for leaf in leaves)
    _assert_matches(name, value, batches)


@pytest.mark.parametrize(
    "name", ["auroc_exact", "multiclass_auroc_exact", "mean", "confusion_builder"]
)
def test_inference_tensors_fed_outside_inference_mode(name: str) -> None:
    """Inputs made under inference mode (kept by exact metrics) updated with, concatenated,
    copied and reset outside it."""
    with torch.inference_mode():
        batches = [tuple(t.clone() for t in batch) for batch in _batches(name)]
    metric = CASES[name].factory()
    for batch in batches[:2]:
        _update(metric, batch)
    _assert_matches(name, metric.compute(), batches[:2])
    copied = clone_metric(metric)
    _update(copied, batches[2])
    _assert_matches(name, copied.compute(), batches)
    metric.reset()
    _update(metric, batches[2])
    _assert_matches(name, metric.compute(), batches[2:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_collector_bound_under_inference_mode_delivers_windows_after_it() -> None:
    """The slot's pinned host buffers, first made as ``bind`` runs inside inference mode, are
    written by the dispatcher thread, which is never in inference mode (it is per thread)."""
    maxima: list[float] = []
    with torch.inference_mode():
        collector = AsyncMetricCollector(MaxMetric(), prefix="val").bind("cuda")
    with collector:
        for step in (1, 2):
            scores = torch.rand(8, device="cuda")
            collector.metric.update(scores)
            collector.schedule_collection(step)
            maxima.append(scores.max().item())
            assert collector.collect_results() == pytest.approx(maxima[-1])
