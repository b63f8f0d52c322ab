"""Classification metrics: ranking curves in constant memory and calibration error."""

from sidestream.metrics.classification.binary_auroc import BinaryAUROCMetric
from sidestream.metrics.classification.binary_average_precision import (
    BinaryAveragePrecisionMetric,
)
from sidestream.metrics.classification.binary_calibration_error import (
    BinaryCalibrationErrorMetric,
)
from sidestream.metrics.classification.multiclass_auroc import MulticlassAUROCMetric
from sidestream.metrics.classification.multiclass_average_precision import (
    MulticlassAveragePrecisionMetric,
)
from sidestream.metrics.classification.multiclass_calibration_error import (
    MulticlassCalibrationErrorMetric,
)
from sidestream.metrics.classification.multilabel_auroc import MultilabelAUROCMetric
from sidestream.metrics.classification.multilabel_average_precision import (
    MultilabelAveragePrecisionMetric,
)

__all__ = [
    "BinaryAUROCMetric",
    "BinaryAveragePrecisionMetric",
    "BinaryCalibrationErrorMetric",
    "MulticlassAUROCMetric",
    "MulticlassAveragePrecisionMetric",
    "MulticlassCalibrationErrorMetric",
    "MultilabelAUROCMetric",
    "MultilabelAveragePrecisionMetric",
]
