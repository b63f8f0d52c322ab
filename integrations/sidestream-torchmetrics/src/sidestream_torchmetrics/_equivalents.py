"""The sidestream metric to suggest when a torchmetrics metric cannot be wrapped."""

from __future__ import annotations

import inspect

__all__ = ["suggestion"]

_CLASSIFICATION = "sidestream.metrics.classification"
_REGRESSION = "sidestream.metrics.regression"

_EQUIVALENTS = {
    "BinaryAUROC": f"{_CLASSIFICATION}.BinaryAUROCMetric",
    "MulticlassAUROC": f"{_CLASSIFICATION}.MulticlassAUROCMetric",
    "MultilabelAUROC": f"{_CLASSIFICATION}.MultilabelAUROCMetric",
    "BinaryAveragePrecision": f"{_CLASSIFICATION}.BinaryAveragePrecisionMetric",
    "MulticlassAveragePrecision": f"{_CLASSIFICATION}.MulticlassAveragePrecisionMetric",
    "MultilabelAveragePrecision": f"{_CLASSIFICATION}.MultilabelAveragePrecisionMetric",
    "BinaryCalibrationError": f"{_CLASSIFICATION}.BinaryCalibrationErrorMetric",
    "MulticlassCalibrationError": f"{_CLASSIFICATION}.MulticlassCalibrationErrorMetric",
    "PearsonCorrCoef": f"{_REGRESSION}.PearsonCorrelationMetric",
    "R2Score": f"{_REGRESSION}.R2ScoreMetric",
    "MeanMetric": "sidestream.metrics.MeanMetric",
}

# torchmetrics' exact (thresholds=None) curves whose sidestream class has an exact mode too.
_EXACT = {"AUROC", "AveragePrecision"}


def suggestion(kind: type) -> str:
    """A sentence naming what to use instead of the torchmetrics class ``kind``."""
    class_name = kind.__name__
    hints = []
    if class_name in _EQUIVALENTS:
        hints.append(f"use {_EQUIVALENTS[class_name]} (fixed-size state)")
        if class_name == "PearsonCorrCoef":
            # torchmetrics gives one r per output; sidestream averages them by default.
            hints.append(
                "for num_outputs=D give it num_outputs=D, multioutput='raw_values' (one r per "
                "output, as torchmetrics)"
            )
        if class_name == "R2Score":
            hints.append("for D outputs per sample give it num_outputs=D (and multioutput=)")
        if any(class_name.endswith(curve) for curve in _EXACT):
            hints.append(
                f"or {_EQUIVALENTS[class_name]}(exact=True) for the exact value (it stores every "
                "sample, as torchmetrics does: unbounded memory)"
            )
    if _takes_thresholds(kind):
        # Every curve-based metric (AUROC, ROC, EER, precision at fixed recall, ...) takes it.
        hints.append(
            f"{'or ' if hints else ''}pass thresholds=<int or list> to {class_name}, whose "
            "binned states are sums"
        )
    if not hints:
        return "sidestream has no fixed-size equivalent; keep this metric outside the bridge"
    return "; ".join(hints)


def _takes_thresholds(kind: type) -> bool:
    """Whether ``kind``'s constructor takes ``thresholds`` (torchmetrics' binned curves)."""
    try:
        return "thresholds" in inspect.signature(kind).parameters
    except (TypeError, ValueError):  # no signature to read
        return False
