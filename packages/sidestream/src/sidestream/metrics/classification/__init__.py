"""Classification metrics: confusion-count statistics, the confusion matrix, MCC and kappa."""

from sidestream.metrics.classification.builder import (
    ConfusionMatrixMetricBuilder,
    confusion_matrix_metric,
)
from sidestream.metrics.classification.cohen_kappa import CohenKappaMetric
from sidestream.metrics.classification.confusion_count import ConfusionCountMetric
from sidestream.metrics.classification.matthews_corrcoef import MatthewsCorrCoefMetric
from sidestream.metrics.classification.multiclass_confusion_matrix import (
    MulticlassConfusionMatrixMetric,
)

__all__ = [
    "CohenKappaMetric",
    "ConfusionCountMetric",
    "ConfusionMatrixMetricBuilder",
    "MatthewsCorrCoefMetric",
    "MulticlassConfusionMatrixMetric",
    "confusion_matrix_metric",
]
