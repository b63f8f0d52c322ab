"""Defects a probe of unusual tensor layouts and wrappers found (views, sparse, nested, moves)."""

from __future__ import annotations

import warnings

import pytest
import torch

from sidestream._samples import SampleStore
from sidestream.metrics import MaxMetric, MeanMetric, MinMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryCalibrationErrorMetric,
    BinaryConfusionMatrixMetric,
    confusion_count_metric,
)
from sidestream.metrics.language import PerplexityMetric, TokenAccuracyMetric
from sidestream.metrics.regression import (
    MeanSquaredErrorMetric,
    PearsonCorrelationMetric,
    R2ScoreMetric,
)


def test_a_borrowed_row_changed_in_place_before_a_move_still_raises() -> None:
    """``to`` copies borrowed rows to the new device: a change the caller made in place before
    the move was taken into the copy and its version forgotten, so ``compute`` on the moved
    metric (``to("cuda")`` of an exact metric updated on the CPU) used the changed rows
    silently. The meta device stands in for another device here."""
    store = SampleStore(
        scores=torch.zeros((0, 1), dtype=torch.float64),
        labels=torch.zeros((0, 1), dtype=torch.int8),
    )
    scores = torch.tensor([0.2, 0.8, 0.4])
    store.borrow(scores=scores, labels=torch.tensor([0, 1, 1], dtype=torch.int8))
    scores.mul_(0.5)  # a reused input buffer
    store.to(torch.device("meta"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="modified in place"):
            store.local()
    store.clear()  # as reset: forgets the change
    assert store.local()["scores"].shape == (0, 1)


def test_an_unchanged_borrowed_row_moves_and_is_the_stores_own() -> None:
    store = SampleStore(scores=torch.zeros((0, 1)), labels=torch.zeros((0, 1), dtype=torch.int8))
    scores = torch.tensor([0.2, 0.8])
    store.borrow(scores=scores, labels=torch.tensor([0, 1], dtype=torch.int8))
    store.to(torch.device("meta"))
    scores.zero_()  # after the move: the store holds a copy
    assert store.local()["scores"].device.type == "meta"


_DENSE = torch.tensor([0.1, 0.9, 0.8, 0.3])
_TARGET = torch.tensor([0, 1, 0, 0])

_UPDATES = {
    "SumMetric": lambda wrap: SumMetric().update(wrap(_DENSE)),
    "MeanMetric": lambda wrap: MeanMetric().update(wrap(_DENSE)),
    "MaxMetric": lambda wrap: MaxMetric().update(wrap(_DENSE)),
    "MinMetric": lambda wrap: MinMetric().update(wrap(_DENSE)),
    "WeightedMeanMetric": lambda wrap: WeightedMeanMetric().update(wrap(_DENSE), torch.ones(4)),
    "MeanSquaredErrorMetric": lambda wrap: MeanSquaredErrorMetric().update(wrap(_DENSE), _DENSE),
    "R2ScoreMetric": lambda wrap: R2ScoreMetric().update(wrap(_DENSE), _DENSE),
    "PearsonCorrelationMetric": lambda wrap: PearsonCorrelationMetric().update(
        wrap(_DENSE), _DENSE
    ),
    "f1": lambda wrap: (
        confusion_count_metric().binary().with_f1().build().update(wrap(_DENSE), _TARGET)
    ),
    "BinaryConfusionMatrixMetric": lambda wrap: BinaryConfusionMatrixMetric().update(
        wrap(_DENSE), _TARGET
    ),
    "BinaryAUROCMetric": lambda wrap: BinaryAUROCMetric().update(wrap(_DENSE), _TARGET),
    "exact BinaryAUROCMetric": lambda wrap: BinaryAUROCMetric(exact=True).update(
        wrap(_DENSE), _TARGET
    ),
    "BinaryCalibrationErrorMetric": lambda wrap: BinaryCalibrationErrorMetric().update(
        wrap(_DENSE), _TARGET
    ),
}


def _nested(tensor: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype warning of strided nested tensors
        return torch.nested.nested_tensor([tensor[:2], tensor[:3]])


def _masked(tensor: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype warning of torch.masked
        return torch.masked.masked_tensor(tensor, tensor < 0.85)


_WRAPS = {
    "masked": _masked,
    "sparse_coo": lambda tensor: tensor.to_sparse(),
    "nested": _nested,
    "jagged": lambda tensor: torch.nested.nested_tensor(
        [tensor[:2], tensor[:3]], layout=torch.jagged
    ),
}


@pytest.mark.parametrize("wrap", sorted(_WRAPS))
@pytest.mark.parametrize("metric", sorted(_UPDATES))
def test_sparse_and_nested_inputs_are_refused_naming_the_argument(metric: str, wrap: str) -> None:
    """Aggregation and regression inputs had no layout check (sparse COO died in ``aten::amax``
    or ``reshape``), a nested tensor of the default layout reports ``torch.strided``, so it
    passed the classification check and died in "NestedTensorImpl doesn't support sizes", and a
    MaskedTensor died in its ``__torch_dispatch__`` (state unchanged, but no argument named)."""
    aggregation = {"SumMetric", "MeanMetric", "MaxMetric", "MinMetric", "WeightedMeanMetric"}
    argument = "values" if metric in aggregation else "preds"
    expected = "a plain torch.Tensor, got a torch.masked" if wrap == "masked" else "a dense tensor"
    with pytest.raises(TypeError, match=f"^{argument}: expected {expected}"):
        _UPDATES[metric](_WRAPS[wrap])


@pytest.mark.parametrize("metric", [PerplexityMetric, TokenAccuracyMetric])
@pytest.mark.parametrize("which", ["logits", "target"])
def test_nested_language_inputs_are_refused_naming_the_argument(metric: type, which: str) -> None:
    logits, target = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if which == "logits":
            logits = torch.nested.nested_tensor(list(logits))
        else:
            target = torch.nested.nested_tensor(list(target))
    with pytest.raises(TypeError, match=f"^{which}: expected a dense tensor, got a nested"):
        metric().update(logits, target)


def test_sparse_weights_and_losses_are_refused_naming_the_argument() -> None:
    with pytest.raises(TypeError, match=r"^weights: expected a dense tensor"):
        WeightedMeanMetric().update(_DENSE, torch.ones(4).to_sparse())
    with pytest.raises(TypeError, match=r"^losses: expected a dense tensor"):
        PerplexityMetric().update(losses=_DENSE.to_sparse(), weights=torch.ones(4))
    with pytest.raises(TypeError, match=r"^target: expected a dense tensor"):
        MeanSquaredErrorMetric().update(_DENSE, _DENSE.to_sparse())
