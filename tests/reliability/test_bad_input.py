"""Every metric's ``update`` under bad input (see ``fuzz.py``)."""

from __future__ import annotations

import pytest

from tests.reliability.fuzz import KNOWN_GAPS, cases, run_case

CASES = [
    pytest.param(
        *case,
        marks=[pytest.mark.xfail(reason=KNOWN_GAPS[key], strict=False)]
        if (key := (case[0], case[1], case[2].name)) in KNOWN_GAPS
        else [],
    )
    for case in cases()
]


@pytest.mark.parametrize(
    ("metric", "argument", "mutation"), CASES, ids=lambda x: getattr(x, "name", x)
)
def test_bad_input_is_a_correct_update_or_a_clear_error_before_any_change(
    metric: str, argument: str, mutation: object
) -> None:
    outcome = run_case(metric, argument, mutation)  # type: ignore[arg-type]
    assert outcome.ok, f"{outcome.problem}: {outcome.result}"
