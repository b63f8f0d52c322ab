"""sidestream: distributed training metrics that never stall the training loop."""

from sidestream._version import distribution_version
from sidestream.collector import AsyncMetricCollector
from sidestream.metric import Metric
from sidestream.metrics import (
    ComposeMetric,
    MaxMetric,
    MeanMetric,
    MinMetric,
    SumMetric,
    WeightedMeanMetric,
)
from sidestream.run import Run
from sidestream.state import MetricAccumulator, ReduceOp

__all__ = [
    "AsyncMetricCollector",
    "ComposeMetric",
    "MaxMetric",
    "MeanMetric",
    "Metric",
    "MetricAccumulator",
    "MinMetric",
    "ReduceOp",
    "Run",
    "SumMetric",
    "WeightedMeanMetric",
    "__version__",
]

__version__ = distribution_version("sidestream", __file__)
