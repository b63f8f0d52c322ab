"""A state from ``add_state`` kept in an attribute cannot be replaced by a tensor.

``docs/metrics.md`` writes metrics as ``self._high = self.add_state("high", ...)`` and says that
assigning anything else to a state's attribute (torchmetrics' ``self.total = self.total + x``)
raises ``TypeError``. It used to hold only for a ``MetricAccumulator`` assigned to the attribute
directly: a state from ``add_state`` was declared with no attribute, so the tensor replaced it,
and ``compute`` read a value that sync, reset and checkpoints never saw.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from sidestream import Metric, MetricAccumulator, ReduceOp


class _Total(Metric[Tensor]):
    def __init__(self, attribute: str) -> None:
        self.attribute = attribute
        setattr(self, attribute, self.add_state("total", 0.0, ReduceOp.SUM))

    def update(self, values: Tensor) -> None:
        state = getattr(self, self.attribute)
        setattr(self, self.attribute, state.value + values.sum())  # torchmetrics' style

    def compute(self) -> Tensor:
        return getattr(self, self.attribute).value.clone()


@pytest.mark.parametrize("attribute", ["_total", "total", "_sum"])
def test_replacing_an_add_state_state_raises_and_keeps_it(attribute: str) -> None:
    metric = _Total(attribute)
    with pytest.raises(TypeError, match=rf"^{attribute}: holds the declared state 'total'"):
        metric.update(torch.tensor([1.0, 2.0]))
    assert isinstance(getattr(metric, attribute), MetricAccumulator)
    assert metric.state_dict()["total"].item() == 0.0


def test_other_attributes_stay_free() -> None:
    metric = _Total("_total")
    metric.scale = torch.tensor(2.0)  # not a state: any value
    metric.scale = None
    metric._total.accumulate(3.0)
    assert metric.compute().item() == 3.0
