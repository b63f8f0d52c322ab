"""Costs that must grow linearly (or not at all), checked by counting calls, never by timing."""

from __future__ import annotations

import cProfile
import pstats
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from sidestream import MeanMetric, Metric


class _ManyStates(Metric[Any]):
    """A metric of ``k`` states, each kept in an attribute as the docs show (add_state)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        for i in range(k):
            setattr(self, f"_s{i}", self.add_state(f"s{i}", 0.0))

    def update(self, value: float) -> None:
        self._s0.accumulate(value)

    def compute(self) -> torch.Tensor:
        return self._s0.value


def _calls(fn: Any) -> int:
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return pstats.Stats(profile).total_calls  # type: ignore[attr-defined]


def test_building_a_metric_of_many_states_costs_linear_calls() -> None:
    # Each `self._x = self.add_state(...)` used to build a set of every declaration made so
    # far: k states cost k * k / 2 id() calls (1024 states: half a million).
    _calls(lambda: _ManyStates(8))  # imports and caches out of the way
    small, large = _calls(lambda: _ManyStates(128)), _calls(lambda: _ManyStates(1024))
    assert large / small < 8 * 1.5, (small, large)


def test_many_states_still_refuse_a_declared_state_assigned_again() -> None:
    metric = _ManyStates(4)
    metric._again = metric._s1  # the same declared state under another attribute: allowed
    assert metric._again is metric._s1
    assert sum(1 for _ in metric.named_accumulators()) == 4
    with pytest.raises(ValueError, match="already a state of a metric"):
        metric._foreign = _ManyStates(2)._s1  # another metric's: still refused


class _ToCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.to_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.to:
            self.to_calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("dtype", "conversions"), [(torch.float64, 0), (torch.float32, 1)])
def test_mean_compute_converts_only_a_narrower_mean(dtype: torch.dtype, conversions: int) -> None:
    # The count is float64 whatever the dtype: a float64 mean needs no .to(), which cost the
    # default MeanMetric's compute 1.8x its time (and a composition's compute with it).
    metric = MeanMetric(dtype=dtype)
    metric.update(torch.tensor([1.0, 2.0, 4.0]))
    metric.compute()
    with _ToCalls() as mode:
        result = metric.compute()
    assert mode.to_calls == conversions
    assert result.dtype == dtype
    assert result.item() == pytest.approx(7.0 / 3.0)
