"""A checkpoint refused by ``load_state_dict`` names the key, and says what is wrong with it.

Older-layout hooks (``_upgrade_state_dict``): the regression metrics fill a missing count of
updates from the saved ``count``, and the confusion-count metrics stack the four
``tp``/``fp``/``fn``/``tn`` vectors of the older layout. Both read the saved values before
``load_state_dict``'s own checks, and raised torch's errors naming no key ("new(): invalid data
type 'str'", "Cannot copy out of meta tensor", "stack expects each tensor to be equal size").
So did an exact metric's rows (a ``SavedRows`` of something else, or on the meta device), and a
configuration hash on the meta device was refused as not being an int64 tensor. The metric is
left as it was.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sidestream import Metric
from sidestream._samples import SavedRows
from sidestream.metric import DTYPES_KEY
from sidestream.metrics.classification import BinaryAUROCMetric, confusion_count_metric
from sidestream.metrics.regression import PearsonCorrelationMetric, R2ScoreMetric

_REGRESSION = [R2ScoreMetric, PearsonCorrelationMetric]


def _fed(factory: Callable[[], Metric[Any]]) -> Metric[Any]:
    metric = factory()
    generator = torch.Generator().manual_seed(0)
    metric.update(torch.randn(12, generator=generator), torch.randn(12, generator=generator))
    return metric


def _refused(
    metric: Metric[Any], state_dict: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    before = metric.state_dict()
    with pytest.raises(error, match=pattern):
        metric.load_state_dict(state_dict)
    after = metric.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, SavedRows):
            assert torch.equal(value.rows, after[key].rows)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key])
        else:
            assert value == after[key]


@pytest.mark.parametrize("factory", _REGRESSION, ids=lambda f: f.__name__)
@pytest.mark.parametrize("key", ["count", "updates"])
def test_a_regression_state_of_the_wrong_kind_is_named(
    factory: Callable[[], Metric[Any]], key: str
) -> None:
    saved = _fed(factory).state_dict()
    _refused(
        _fed(factory),
        {**saved, key: "not a tensor"},
        TypeError,
        rf"state_dict\['{key}'\]: expected a tensor",
    )


@pytest.mark.parametrize("factory", _REGRESSION, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "updates",
    [float("inf"), torch.tensor(float("-inf")), torch.tensor(1 + 1j)],
    ids=["inf", "tensor_-inf", "complex"],
)
def test_a_count_of_updates_that_is_no_finite_number_is_named(
    factory: Callable[[], Metric[Any]], updates: Any
) -> None:
    # Read by the older-layout hook before load_state_dict's checks: Python's "cannot convert
    # float infinity to integer" (torch's overflow for a complex), naming no key.
    saved = _fed(factory).state_dict()
    _refused(_fed(factory), {**saved, "updates": updates}, ValueError, r"state_dict\['updates'\]")


@pytest.mark.parametrize("factory", _REGRESSION, ids=lambda f: f.__name__)
@pytest.mark.parametrize("older", [False, True], ids=["current", "without_updates"])
def test_a_regression_checkpoint_loaded_onto_meta_is_named(
    factory: Callable[[], Metric[Any]], older: bool
) -> None:
    saved = _fed(factory).state_dict()
    if older:  # the layout before the count of updates was kept
        saved = {k: v for k, v in saved.items() if k not in ("updates", DTYPES_KEY)}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    on_meta = torch.load(buffer, weights_only=True, map_location="meta")
    _refused(
        _fed(factory), on_meta, ValueError, r"state_dict\['\w+'\]: a meta tensor holds no values"
    )


def test_a_regression_checkpoint_without_updates_still_loads() -> None:
    saved = _fed(R2ScoreMetric).state_dict()
    older = {k: v for k, v in saved.items() if k not in ("updates", DTYPES_KEY)}
    metric = R2ScoreMetric()
    metric.load_state_dict(older)
    reference = _fed(R2ScoreMetric).compute()
    assert torch.allclose(metric.compute(), reference, rtol=1e-12, atol=0.0)


def _older_confusion(rows: dict[str, Any]) -> tuple[Metric[Any], dict[str, Any]]:
    def build() -> Metric[Any]:
        return confusion_count_metric().multiclass(3).with_f1().build()

    source = build()
    source.update(torch.tensor([0, 1, 2, 2, 1]), torch.tensor([0, 2, 2, 1, 1]))
    saved = source.state_dict()
    counts = saved.pop("counts")
    saved.pop(DTYPES_KEY)
    older = {**saved, **dict(zip(("tp", "fp", "fn", "tn"), counts.unbind(), strict=True))}
    metric = build()
    metric.update(torch.tensor([1, 1]), torch.tensor([0, 1]))
    return metric, {**older, **rows}


def test_an_older_confusion_row_of_the_wrong_kind_is_named() -> None:
    metric, older = _older_confusion({"tn": "not a tensor"})
    _refused(metric, older, TypeError, r"state_dict\['tn'\]: expected a tensor")


def test_an_older_confusion_row_of_another_shape_is_named() -> None:
    metric, older = _older_confusion({"fn": torch.zeros(5, dtype=torch.int64)})
    _refused(metric, older, ValueError, r"state_dict\['fn'\]: expected shape \(3,\)")


def test_an_older_confusion_checkpoint_still_loads() -> None:
    metric, older = _older_confusion({})
    metric.load_state_dict(older)
    # The reference: the counts of the five samples, by hand (classes 0, 1, 2).
    # preds 0 1 2 2 1 / target 0 2 2 1 1 -> tp [1, 1, 1], fp [0, 1, 1], fn [0, 1, 1]
    counts = metric.counts()  # type: ignore[attr-defined]
    assert counts["tp"].tolist() == [1, 1, 1]
    assert counts["fp"].tolist() == [0, 1, 1]
    assert counts["fn"].tolist() == [0, 1, 1]


def _exact() -> Metric[Any]:
    metric = BinaryAUROCMetric(exact=True)
    metric.update(torch.tensor([0.1, 0.8, 0.4, 0.6]), torch.tensor([0, 1, 1, 0]))
    return metric


@pytest.mark.parametrize("field", ["scores", "labels"])
def test_exact_rows_of_the_wrong_kind_or_on_meta_are_named(field: str) -> None:
    saved = _exact().state_dict()
    _refused(
        _exact(),
        {**saved, field: SavedRows("not a tensor")},  # type: ignore[arg-type]
        TypeError,
        rf"state_dict\['{field}'\]: expected rows",
    )
    meta = SavedRows(torch.empty(saved[field].rows.shape, device="meta"))
    _refused(
        _exact(), {**saved, field: meta}, ValueError, rf"state_dict\['{field}'\]: a meta tensor"
    )


def test_a_configuration_on_meta_is_named_as_such() -> None:
    # It is an int64 tensor: "expected a configuration hash (an int64 tensor)" misled.
    saved = _exact().state_dict()
    meta = torch.empty((), dtype=torch.int64, device="meta")
    _refused(
        _exact(),
        {**saved, "configuration": meta},
        ValueError,
        r"state_dict\['configuration'\]: a meta tensor holds no values",
    )
