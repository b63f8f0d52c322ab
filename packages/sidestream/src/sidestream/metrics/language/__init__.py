"""Language-model training metrics: perplexity and token accuracy."""

from sidestream.metrics.language.perplexity import PerplexityMetric
from sidestream.metrics.language.token_accuracy import TokenAccuracyMetric

__all__ = ["PerplexityMetric", "TokenAccuracyMetric"]
