"""Every problem x statistic x aggregation against scikit-learn, in one process."""

from __future__ import annotations

import numpy as np
import pytest

from tests.metrics.confusion_cases import (
    BALANCED_ACCURACY_CHECKS,
    CASES,
    Case,
    assert_matches,
    make_shards,
    reference,
    run_case,
)


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
