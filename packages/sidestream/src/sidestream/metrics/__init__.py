"""Ready-made metrics."""

from sidestream.metrics._nan_strategy import NanPolicy, NanStrategy
from sidestream.metrics.compose import ComposeMetric
from sidestream.metrics.extremum import MaxMetric, MinMetric
from sidestream.metrics.mean import MeanMetric
from sidestream.metrics.sum import SumMetric
from sidestream.metrics.weighted_mean import WeightedMeanMetric

__all__ = [
    "ComposeMetric",
    "MaxMetric",
    "MeanMetric",
    "MinMetric",
    "NanPolicy",
    "NanStrategy",
    "SumMetric",
    "WeightedMeanMetric",
]
