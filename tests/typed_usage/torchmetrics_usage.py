"""docs/integrations/torchmetrics.md as a user's ``mypy --strict`` sees it."""

from __future__ import annotations

from typing import assert_type

import torch
import torchmetrics
from torchmetrics.classification import BinaryAccuracy, MulticlassF1Score

from sidestream_torchmetrics import TorchmetricsCollection, TorchmetricsMetric, wrap


def bridge() -> None:
    metrics = wrap(
        torchmetrics.MetricCollection(
            {"f1": MulticlassF1Score(num_classes=3), "loss": torchmetrics.MeanMetric()},
            prefix="val/",
        )
    )
    assert_type(metrics, TorchmetricsCollection)
    metrics["f1"].update(torch.randn(8, 3), torch.randint(0, 3, (8,)))
    metrics["loss"].update(torch.rand(8))
    assert_type(wrap(BinaryAccuracy()), TorchmetricsMetric)
