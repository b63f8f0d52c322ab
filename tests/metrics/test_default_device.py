"""A default device set by the caller (``torch.set_default_device``, ``with torch.device``) does
not leak into a metric living elsewhere: its updates and compute stay on its own device.

``meta`` stands in for ``cuda`` here (no data, so any tensor made on the default device instead
of the metric's fails loudly). Cached helper tensors are cleared first, so a cache filled under
the default device would be caught too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
from torch.utils._pytree import tree_leaves

from sidestream.metrics.classification import _inputs
from tests.metrics.test_compiled_updates import CASES


def _meta_during(phase: str, now: str) -> AbstractContextManager[object]:
    return torch.device("meta") if phase == now else nullcontext()


@pytest.mark.parametrize("phase", ["update", "compute"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_metric_under_another_default_device(name: str, phase: str) -> None:
    factory, batch = CASES[name]
    generator = torch.Generator().manual_seed(3)
    batches = [batch(generator) for _ in range(2)]
    reference, metric = factory(), factory()
    for arguments in batches:
        reference.update(*arguments)
    _inputs.count_map.cache_clear()
    _inputs._ones.cache_clear()
    with _meta_during(phase, "update"):
        for arguments in batches:
            metric.update(*arguments)
    with _meta_during(phase, "compute"):
        result = metric.compute()
    for ours, theirs in zip(tree_leaves(result), tree_leaves(reference.compute()), strict=True):
        assert ours.device.type == "cpu"
        assert torch.equal(ours, theirs) or torch.allclose(ours, theirs, equal_nan=True)
