"""Classification metrics.

Confusion-count statistics (built with ``confusion_count_metric()``), confusion matrices, MCC
and kappa, ranking curves (AUROC, average precision) in constant memory and calibration error.
Each family has one generic class taking a ``Problem`` and thin Binary/Multiclass/Multilabel
classes named as in torchmetrics.
"""

from sidestream.metrics.classification._problem import Problem, ProblemKind
from sidestream.metrics.classification.builder import (
    ConfusionCountMetricBuilder,
    NoStatistic,
    confusion_count_metric,
    confusion_matrix_metric,
)
from sidestream.metrics.classification.calibration import (
    BinaryCalibrationErrorMetric,
    CalibrationErrorMetric,
    MulticlassCalibrationErrorMetric,
)
from sidestream.metrics.classification.cohen_kappa import (
    BinaryCohenKappaMetric,
    CohenKappaMetric,
    MulticlassCohenKappaMetric,
)
from sidestream.metrics.classification.confusion_count import ConfusionCountMetric
from sidestream.metrics.classification.confusion_matrix import (
    BinaryConfusionMatrixMetric,
    ConfusionMatrixMetric,
    MulticlassConfusionMatrixMetric,
    MultilabelConfusionMatrixMetric,
)
from sidestream.metrics.classification.matthews_corrcoef import (
    BinaryMatthewsCorrCoefMetric,
    MatthewsCorrCoefMetric,
    MulticlassMatthewsCorrCoefMetric,
    MultilabelMatthewsCorrCoefMetric,
)
from sidestream.metrics.classification.ranking import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    Curve,
    Estimate,
    MulticlassAUROCMetric,
    MulticlassAveragePrecisionMetric,
    MultilabelAUROCMetric,
    MultilabelAveragePrecisionMetric,
    RankingMetric,
)
from sidestream.metrics.classification.samplewise import SamplewiseConfusionCountMetric
from sidestream.metrics.classification.statistics import (
    Accuracy,
    Counts,
    FBeta,
    Precision,
    Recall,
    Specificity,
    Statistic,
)

__all__ = [
    "Accuracy",
    "BinaryAUROCMetric",
    "BinaryAveragePrecisionMetric",
    "BinaryCalibrationErrorMetric",
    "BinaryCohenKappaMetric",
    "BinaryConfusionMatrixMetric",
    "BinaryMatthewsCorrCoefMetric",
    "CalibrationErrorMetric",
    "CohenKappaMetric",
    "ConfusionCountMetric",
    "ConfusionCountMetricBuilder",
    "ConfusionMatrixMetric",
    "Counts",
    "Curve",
    "Estimate",
    "FBeta",
    "MatthewsCorrCoefMetric",
    "MulticlassAUROCMetric",
    "MulticlassAveragePrecisionMetric",
    "MulticlassCalibrationErrorMetric",
    "MulticlassCohenKappaMetric",
    "MulticlassConfusionMatrixMetric",
    "MulticlassMatthewsCorrCoefMetric",
    "MultilabelAUROCMetric",
    "MultilabelAveragePrecisionMetric",
    "MultilabelConfusionMatrixMetric",
    "MultilabelMatthewsCorrCoefMetric",
    "NoStatistic",
    "Precision",
    "Problem",
    "ProblemKind",
    "RankingMetric",
    "Recall",
    "SamplewiseConfusionCountMetric",
    "Specificity",
    "Statistic",
    "confusion_count_metric",
    "confusion_matrix_metric",
]
