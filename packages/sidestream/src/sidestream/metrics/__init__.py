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

_FAMILIES = frozenset({"classification", "language", "regression"})


def __getattr__(name: str) -> object:
    """``sidestream.metrics.classification`` (and the other families) imported on first use.

    Not imported with the package: ``import sidestream`` stays light for jobs that log a loss.
    """
    if name in _FAMILIES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
