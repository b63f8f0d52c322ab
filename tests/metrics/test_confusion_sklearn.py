"""Every problem x statistic x aggregation against scikit-learn, in one process."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.metrics.confusion_cases import (
    AGGREGATIONS,
    BALANCED_ACCURACY_CHECKS,
    Case,
    assert_matches,
    make_shards,
    reference,
    run_case,
)


def _binary_cases() -> list[Case]:
    variants = [
        {},
        {"threshold": 0.3, "dtype": "float16"},
        {"logits": True, "dtype": "bfloat16", "ignore": True},
        {"logits": True, "threshold": 0.7, "target_dtype": "bool", "extra_dims": (3,)},
        {"preds_format": "labels", "target_dtype": "uint8", "zero_division": 1.0},
        {"ignore": True, "target_dtype": "int32", "extra_dims": (2, 3), "dtype": "float64"},
    ]
    return [Case("binary", **variant) for variant in variants]


def _multiclass_cases() -> list[Case]:
    variants = [
        {"classes": 5},
        {"classes": 4, "dtype": "bfloat16", "ignore": True},
        {"classes": 7, "dtype": "float16", "target_dtype": "one_hot"},
        {"classes": 3, "preds_format": "labels", "target_dtype": "int32", "zero_division": 1.0},
        {"classes": 6, "extra_dims": (4,), "ignore": True, "zero_division": float("nan")},
        {"classes": 6, "top_k": 2, "dtype": "float64"},
        {"classes": 8, "top_k": 3, "ignore": True, "zero_division": 1.0},
    ]
    return [
        Case("multiclass", aggregation=aggregation, **variant)
        for variant, aggregation in itertools.product(variants, AGGREGATIONS)
    ]


def _multilabel_cases() -> list[Case]:
    variants = [
        {"classes": 4},
        {"classes": 5, "logits": True, "dtype": "bfloat16", "ignore": True},
        {"classes": 3, "threshold": 0.4, "extra_dims": (3,), "target_dtype": "bool"},
        {"classes": 6, "preds_format": "labels", "ignore": True, "zero_division": 1.0},
    ]
    return [
        Case("multilabel", aggregation=aggregation, **variant)
        for variant, aggregation in itertools.product(variants, AGGREGATIONS)
    ]


CASES = _binary_cases() + _multiclass_cases() + _multilabel_cases()


def _case_id(case: Case) -> str:
    defaults = Case(case.kind)
    changed = [
        f"{field}={getattr(case, field)}"
        for field in Case.__dataclass_fields__
        if field != "kind" and getattr(case, field) != getattr(defaults, field)
    ]
    return "-".join([case.kind, *changed])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_sklearn(case: Case) -> None:
    for seed in range(3):
        batches = [batch for shard in make_shards(case, seed, 3) for batch in shard]
        assert_matches(run_case(case, batches, sync=False), reference(case, batches), seed)


def test_cases_cover_absent_and_unseen_classes() -> None:
    """The data must exercise the presence rule and zero divisions, or the tests prove little."""
    case = Case("multiclass", classes=5, aggregation="per_class")
    unseen = []
    for seed in range(3):
        batches = [batch for shard in make_shards(case, seed, 1) for batch in shard]
        truth = np.concatenate([batch["target"].reshape(-1) for batch in batches])
        assert 0 not in truth
        unseen.append(1 not in truth)
    assert any(unseen) and not all(unseen)


def test_macro_accuracy_is_balanced_accuracy() -> None:
    """Macro accuracy against balanced_accuracy_score on data where every class is a target."""
    BALANCED_ACCURACY_CHECKS.clear()
    case = Case("multiclass", classes=3, aggregation="macro", dtype="bfloat16")
    for seed in range(4):
        batches = [batch for shard in make_shards(case, seed, 2) for batch in shard]
        assert_matches(run_case(case, batches, sync=False), reference(case, batches), seed)
    assert BALANCED_ACCURACY_CHECKS
