"""``thresholds=`` takes edges: a bare number (torchmetrics' ``thresholds=T``) is refused.

torchmetrics' ``BinaryAUROC(thresholds=1001)`` means ``linspace(0, 1, 1001)``. Given here, the
number used to be read as one edge and refused as "expected values in [0, 1], got [1001.0]"
(and ``thresholds=1`` taken as the single edge 1.0), which never said what to pass instead.
"""

from __future__ import annotations

import pytest

from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    MulticlassAveragePrecisionMetric,
)


def test_torchmetrics_count_of_thresholds_names_num_bins() -> None:
    with pytest.raises(TypeError, match=r"got the number 1001; .* is num_bins=1000 here"):
        BinaryAUROCMetric(thresholds=1001)
    with pytest.raises(TypeError, match=r"got the number 11; .* is num_bins=10 here"):
        MulticlassAveragePrecisionMetric(3, thresholds=11)


@pytest.mark.parametrize("number", [1, 0.5])
def test_a_bare_number_is_no_edge(number: float) -> None:
    with pytest.raises(
        TypeError, match=rf"expected a sequence of edges in \[0, 1\], got the number {number}$"
    ):
        BinaryAUROCMetric(thresholds=number)


def test_edges_still_work() -> None:
    assert BinaryAUROCMetric(thresholds=[0.5]).num_bins == 2
    assert BinaryAUROCMetric(thresholds=(0.0, 0.5, 1.0)).num_bins == 4
