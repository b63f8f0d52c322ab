"""sidestream: distributed training metrics that never stall the training loop."""

from importlib.metadata import version

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

__version__ = version("sidestream")
