"""Regression metrics from float64 sums that add across ranks."""

from sidestream.metrics.regression.mean_absolute_error import MeanAbsoluteErrorMetric
from sidestream.metrics.regression.mean_squared_error import MeanSquaredErrorMetric
from sidestream.metrics.regression.pearson_correlation import PearsonCorrelationMetric
from sidestream.metrics.regression.r2_score import R2ScoreMetric
from sidestream.metrics.regression.root_mean_squared_error import RootMeanSquaredErrorMetric

__all__ = [
    "MeanAbsoluteErrorMetric",
    "MeanSquaredErrorMetric",
    "PearsonCorrelationMetric",
    "R2ScoreMetric",
    "RootMeanSquaredErrorMetric",
]
