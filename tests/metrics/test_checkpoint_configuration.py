"""A checkpoint loads only into a metric configured as the one that saved it.

Counts of a binary threshold of 0.5 loaded into a metric of 0.9 (or top-2 counts into top-1)
mix two problems' counts into numbers of neither: refused, before any state changes. So is a
checkpoint of another constant (``MetricAccumulator.constant``), whatever the metric.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from sklearn.metrics import f1_score

from sidestream import Metric, MetricAccumulator
from sidestream._samples import SavedRows
from sidestream.metrics import ComposeMetric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryCalibrationErrorMetric,
    BinaryConfusionMatrixMetric,
    MulticlassConfusionMatrixMetric,
    MultilabelAUROCMetric,
    MultilabelConfusionMatrixMetric,
    confusion_count_metric,
)
from tests._checkpoints import states_only

_BINARY = (torch.rand(40, generator=torch.Generator().manual_seed(1)), torch.arange(40) % 2)
_MULTICLASS = (torch.randn(40, 4, generator=torch.Generator().manual_seed(2)), torch.arange(40) % 4)
_MULTILABEL = (
    torch.rand(40, 4, generator=torch.Generator().manual_seed(3)),
    torch.eye(4)[torch.arange(40) % 4].long(),
)

# (saving metric, loading metric of another configuration, batch both take)
_PAIRS: dict[str, tuple[Callable[[], Metric[Any]], Callable[[], Metric[Any]], Any]] = {
    "binary threshold": (
        lambda: confusion_count_metric().binary(0.5).with_f1().build(),
        lambda: confusion_count_metric().binary(0.9).with_f1().build(),
        _BINARY,
    ),
    "binary logits": (
        lambda: BinaryConfusionMatrixMetric(),
        lambda: BinaryConfusionMatrixMetric(logits=True),
        _BINARY,
    ),
    "multiclass top-k": (
        lambda: confusion_count_metric().multiclass(4, top_k=2).with_recall().build(),
        lambda: confusion_count_metric().multiclass(4).with_recall().build(),
        _MULTICLASS,
    ),
    "ignore_index": (
        lambda: MulticlassConfusionMatrixMetric(4),
        lambda: MulticlassConfusionMatrixMetric(4, ignore_index=3),
        _MULTICLASS,
    ),
    "multilabel threshold": (
        lambda: MultilabelConfusionMatrixMetric(4),
        lambda: MultilabelConfusionMatrixMetric(4, threshold=0.2),
        _MULTILABEL,
    ),
    "samplewise beta": (
        lambda: (
            confusion_count_metric(multidim_average="samplewise")
            .multiclass(4)
            .with_fbeta(0.5)
            .build()
        ),
        lambda: (
            confusion_count_metric(multidim_average="samplewise")
            .multiclass(4)
            .with_fbeta(2.0)
            .build()
        ),
        (
            torch.randn(5, 8, 4, generator=torch.Generator().manual_seed(4)),
            torch.arange(40).view(5, 8) % 4,
        ),
    ),
    "calibration threshold-free, logits": (
        lambda: BinaryCalibrationErrorMetric(),
        lambda: BinaryCalibrationErrorMetric(logits=True),
        _BINARY,
    ),
    "ranking ignore_index": (
        lambda: BinaryAUROCMetric(),
        lambda: BinaryAUROCMetric(ignore_index=-1),
        _BINARY,
    ),
    # Stored scores of another scale: logits ranked among probabilities.
    "exact ranking logits": (
        lambda: BinaryAUROCMetric(exact=True, logits=True),
        lambda: BinaryAUROCMetric(exact=True),
        _BINARY,
    ),
    "exact ranking kind": (
        lambda: MultilabelAUROCMetric(4, exact=True),
        lambda: MultilabelAUROCMetric(4, exact=True, ignore_index=-1),
        _MULTILABEL,
    ),
}


def _states(metric: Metric[Any]) -> dict[str, torch.Tensor]:
    states = {name: state.local.clone() for name, state in metric.named_accumulators()}
    for prefix, store in metric.named_sample_stores():
        states.update({prefix + name: rows.clone() for name, rows in store.local().items()})
    return states


def _tensor(value: Any) -> torch.Tensor:
    return value.rows if isinstance(value, SavedRows) else value


@pytest.mark.parametrize("pair", list(_PAIRS))
def test_a_checkpoint_of_another_configuration_is_refused(pair: str) -> None:
    make_saving, make_other, batch = _PAIRS[pair]
    source = make_saving()
    source.update(*batch)
    saved = source.state_dict()
    assert isinstance(saved["configuration"], torch.Tensor)  # a checkpoint stays all tensors
    other = make_other()
    other.update(*batch)
    before = _states(other)
    with pytest.raises(ValueError, match=r"state_dict\['configuration'\]: saved by a metric "):
        other.load_state_dict(saved)
    after = _states(other)
    assert all(torch.equal(before[name], after[name]) for name in before)  # unchanged

    twin = make_saving()
    twin.load_state_dict(saved)  # the same configuration loads
    resaved = twin.state_dict()
    assert all(
        torch.equal(_tensor(resaved[key]), _tensor(value))
        for key, value in states_only(saved).items()
    )
    older = {key: value for key, value in saved.items() if key != "configuration"}
    twin = make_saving()
    twin.load_state_dict(older)  # saved before the configuration was: loads as it is
    assert torch.equal(twin.state_dict()["rejected"], saved["rejected"])


def test_the_resumed_counts_are_of_one_problem_inside_a_tree() -> None:
    """In a tree the key has the child's prefix; the same configuration resumes exactly."""
    preds, target = _BINARY

    def tree(threshold: float) -> ComposeMetric:
        f1 = confusion_count_metric().binary(threshold).with_f1().build()
        return ComposeMetric({"val": ComposeMetric({"f1": f1})})

    first = tree(0.3)
    first["val"]["f1"].update(preds[:25], target[:25])
    saved = first.state_dict()
    assert "val.f1.configuration" in saved
    with pytest.raises(ValueError, match=r"'val\.f1\.configuration'.*threshold=0\.7"):
        tree(0.7).load_state_dict(saved)
    resumed = tree(0.3)
    resumed.load_state_dict(saved)
    resumed["val"]["f1"].update(preds[25:], target[25:])
    expected = f1_score(target.numpy(), (preds >= 0.3).long().numpy())
    assert resumed.compute()["val"]["f1"].item() == pytest.approx(expected)


def test_a_bad_configuration_entry_is_named() -> None:
    metric = confusion_count_metric().binary().with_f1().build()
    saved = metric.state_dict()
    saved["configuration"] = "binary"
    with pytest.raises(
        TypeError, match=r"state_dict\['configuration'\]: expected a configuration hash"
    ):
        confusion_count_metric().binary().with_f1().build().load_state_dict(saved)


class _Scaled(Metric[torch.Tensor]):
    """A custom metric whose sum means something only with its scale (a constant)."""

    def __init__(self, scale: list[float]) -> None:
        super().__init__()
        self._scale = MetricAccumulator.constant(torch.tensor(scale))
        self._total = MetricAccumulator(torch.zeros(len(scale)))

    def update(self, values: torch.Tensor) -> None:
        self._total.accumulate(values.sum(0) * self._scale.local)

    def compute(self) -> torch.Tensor:
        return self._total.value


def test_a_custom_metric_refuses_a_checkpoint_of_another_constant() -> None:
    source = _Scaled([1.0, 2.0])
    source.update(torch.ones(3, 2))
    saved = source.state_dict()
    for scale in ([1.0, 3.0], [1.0, 2.0, 3.0]):  # another value, another shape: the same words
        other = _Scaled(scale)
        other.update(torch.ones(1, len(scale)))
        before = _states(other)
        with pytest.raises(ValueError, match=r"state_dict\['scale'\]: saved with \[1\.0, 2\.0\]"):
            other.load_state_dict(saved)
        assert all(torch.equal(before[n], after) for n, after in _states(other).items())
    resumed = _Scaled([1.0, 2.0])
    resumed.load_state_dict({"total": saved["total"]})  # saved before the constant: its own
    assert torch.equal(resumed.compute(), torch.tensor([3.0, 6.0]))


class _Thresholded(Metric[torch.Tensor]):
    """A custom count under a threshold no state holds: its states say it in words."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self._threshold = threshold
        self._hits = MetricAccumulator(0, dtype=torch.int64)
        self._hits.set_configuration(f"threshold={threshold!r}")

    def update(self, scores: torch.Tensor) -> None:
        self._hits.accumulate((scores >= self._threshold).sum())

    def compute(self) -> torch.Tensor:
        return self._hits.value


def test_a_custom_metric_says_its_configuration_and_a_constant_cannot() -> None:
    scores = torch.tensor([0.1, 0.4, 0.6, 0.95])
    source = _Thresholded(0.5)
    source.update(scores)
    saved = source.state_dict()
    assert set(saved) == {"hits", "configuration", "sidestream/dtypes"}
    with pytest.raises(ValueError, match=r"state_dict\['configuration'\].*threshold=0\.9"):
        _Thresholded(0.9).load_state_dict(saved)
    resumed = _Thresholded(0.5)
    resumed.load_state_dict(saved)
    resumed.update(scores)
    assert resumed.compute().item() == 2 * int((scores >= 0.5).sum())  # counted by hand: 4
    with pytest.raises(ValueError, match="a constant's configuration is its value"):
        MetricAccumulator.constant(1.0).set_configuration("x")
