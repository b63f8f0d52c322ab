"""Classification metrics.

Confusion-count statistics (built with ``confusion_matrix_metric()``), the confusion matrix, MCC
and kappa, ranking curves (AUROC, average precision) in constant memory and calibration error.
"""

from sidestream.metrics.classification.binary_auroc import BinaryAUROCMetric
from sidestream.metrics.classification.binary_average_precision import (
    BinaryAveragePrecisionMetric,
)
from sidestream.metrics.classification.binary_calibration_error import (
    BinaryCalibrationErrorMetric,
)
from sidestream.metrics.classification.builder import (
    ConfusionMatrixMetricBuilder,
    confusion_matrix_metric,
)
from sidestream.metrics.classification.cohen_kappa import CohenKappaMetric
from sidestream.metrics.classification.confusion_count import ConfusionCountMetric
from sidestream.metrics.classification.matthews_corrcoef import MatthewsCorrCoefMetric
from sidestream.metrics.classification.multiclass_auroc import MulticlassAUROCMetric
from sidestream.metrics.classification.multiclass_average_precision import (
    MulticlassAveragePrecisionMetric,
)
from sidestream.metrics.classification.multiclass_calibration_error import (
    MulticlassCalibrationErrorMetric,
)
from sidestream.metrics.classification.multiclass_confusion_matrix import (
    MulticlassConfusionMatrixMetric,
)
from sidestream.metrics.classification.multilabel_auroc import MultilabelAUROCMetric
from sidestream.metrics.classification.multilabel_average_precision import (
    MultilabelAveragePrecisionMetric,
)

__all__ = [
    "BinaryAUROCMetric",
    "BinaryAveragePrecisionMetric",
    "BinaryCalibrationErrorMetric",
    "CohenKappaMetric",
    "ConfusionCountMetric",
    "ConfusionMatrixMetricBuilder",
    "MatthewsCorrCoefMetric",
    "MulticlassAUROCMetric",
    "MulticlassAveragePrecisionMetric",
    "MulticlassCalibrationErrorMetric",
    "MulticlassConfusionMatrixMetric",
    "MultilabelAUROCMetric",
    "MultilabelAveragePrecisionMetric",
    "confusion_matrix_metric",
]
