"""Every ranking, regression and language metric with a valid and a bad batch, on the CPU.

Shared by the CUDA test (``test_gpu_sync_free``: updates under ``set_sync_debug_mode``) and the
meta-device test (``test_meta_sync_free``: the same updates where no value can be read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    BinaryCalibrationErrorMetric,
    BinaryCohenKappaMetric,
    BinaryConfusionMatrixMetric,
    BinaryMatthewsCorrCoefMetric,
    MulticlassAUROCMetric,
    MulticlassAveragePrecisionMetric,
    MulticlassCalibrationErrorMetric,
    MulticlassConfusionMatrixMetric,
    MultilabelAUROCMetric,
    MultilabelAveragePrecisionMetric,
    MultilabelConfusionMatrixMetric,
    MultilabelMatthewsCorrCoefMetric,
    confusion_count_metric,
)
from sidestream.metrics.language import PerplexityMetric, TokenAccuracyMetric
from sidestream.metrics.regression import (
    MeanAbsoluteErrorMetric,
    MeanSquaredErrorMetric,
    PearsonCorrelationMetric,
    R2ScoreMetric,
    RootMeanSquaredErrorMetric,
)

C = 5


def device_cases() -> list[tuple[str, Callable[[], Any], dict[str, Any], dict[str, Any]]]:
    """(name, factory, valid kwargs, bad kwargs) on the CPU."""
    g = torch.Generator().manual_seed(0)
    n = 4096
    scores = torch.rand(n, generator=g)
    binary = torch.randint(0, 2, (n,), generator=g)
    probs = torch.softmax(torch.randn(n, C, generator=g), dim=1)
    labels = torch.randint(0, C, (n,), generator=g)
    label_matrix = torch.randint(0, 2, (n, C), generator=g)
    preds, target = torch.randn(n, 2, generator=g), torch.randn(n, 2, generator=g)
    logits = torch.randn(4, 16, 50, generator=g)
    tokens = torch.randint(0, 50, (4, 16), generator=g)
    tokens[:, -3:] = -100
    bad_tokens = tokens.clone()
    bad_tokens[0, 0] = 50
    bad_scores = scores.clone()
    bad_scores[7] = 1.5
    bad_preds = preds.clone()
    bad_preds[3, 1] = float("nan")
    bin_ok = {"preds": scores, "target": binary}
    bin_bad = {"preds": bad_scores, "target": binary}
    mc_ok = {"preds": probs, "target": labels}
    mc_bad = {"preds": probs, "target": torch.where(labels == 0, C, labels)}
    ml_ok = {"preds": probs, "target": label_matrix}
    ml_bad = {"preds": probs, "target": label_matrix * 2}
    reg_ok = {"preds": preds, "target": target}
    reg_bad = {"preds": bad_preds, "target": target}
    lm_ok = {"logits": logits, "target": tokens}
    lm_bad = {"logits": logits, "target": bad_tokens}
    # The options of issue 13: logits, ignore_index -100, multidim (N, C, X) inputs.
    logit_scores = torch.randn(n // 8, C, 8, generator=g)
    padded = torch.randint(0, C, (n // 8, 8), generator=g)
    padded[:, -2:] = -100
    nan_logits = logit_scores.clone()
    nan_logits[1, 2, 3] = float("nan")
    md_ok = {"preds": logit_scores, "target": padded}
    md_bad = {"preds": nan_logits, "target": padded}
    flat_logits = torch.randn(n, generator=g)
    bin_padded = torch.where(torch.arange(n) % 7 == 0, -100, binary)
    lg_ok = {"preds": flat_logits, "target": bin_padded}
    lg_bad = {
        "preds": torch.where(torch.arange(n) == 5, float("nan"), flat_logits),
        "target": bin_padded,
    }
    ml_logits = torch.randn(n, C, generator=g)
    mll_ok = {"preds": ml_logits, "target": label_matrix}
    mll_bad = {"preds": ml_logits, "target": label_matrix + 1}
    last = torch.movedim(logit_scores, 1, -1)  # class-last scores for the confusion family
    cm_ok = {"preds": last, "target": padded}
    cm_bad = {"preds": torch.movedim(nan_logits, 1, -1), "target": padded}
    losses = torch.rand(64, generator=g)
    loss_ok = {"losses": losses, "weights": torch.randint(0, 3, (64,), generator=g)}
    loss_bad = {"losses": losses, "weights": -torch.ones(64)}
    return [
        ("auroc", lambda: BinaryAUROCMetric(), bin_ok, bin_bad),
        ("ap", lambda: BinaryAveragePrecisionMetric(), bin_ok, bin_bad),
        ("ece", lambda: BinaryCalibrationErrorMetric(), bin_ok, bin_bad),
        ("mc_auroc", lambda: MulticlassAUROCMetric(C, average="weighted"), mc_ok, mc_bad),
        ("mc_ap", lambda: MulticlassAveragePrecisionMetric(C), mc_ok, mc_bad),
        ("mc_ece", lambda: MulticlassCalibrationErrorMetric(C), mc_ok, mc_bad),
        ("ml_auroc", lambda: MultilabelAUROCMetric(C), ml_ok, ml_bad),
        ("ml_ap", lambda: MultilabelAveragePrecisionMetric(C, average="none"), ml_ok, ml_bad),
        ("mse", lambda: MeanSquaredErrorMetric(2), reg_ok, reg_bad),
        ("rmse", lambda: RootMeanSquaredErrorMetric(2), reg_ok, reg_bad),
        ("mae", lambda: MeanAbsoluteErrorMetric(2), reg_ok, reg_bad),
        ("r2", lambda: R2ScoreMetric(2, shift=0.5), reg_ok, reg_bad),
        ("pearson", lambda: PearsonCorrelationMetric(2, shift=[0.1, 0.2]), reg_ok, reg_bad),
        (
            "md_auroc",
            lambda: MulticlassAUROCMetric(C, logits=True, ignore_index=-100),
            md_ok,
            md_bad,
        ),
        (
            "md_ap",
            lambda: MulticlassAveragePrecisionMetric(C, 64, logits=True, ignore_index=-100),
            md_ok,
            md_bad,
        ),
        (
            "md_ece",
            lambda: MulticlassCalibrationErrorMetric(C, norm="max", logits=True, ignore_index=-100),
            md_ok,
            md_bad,
        ),
        (
            "auroc_fpr",
            lambda: BinaryAUROCMetric(max_fpr=0.2, logits=True, ignore_index=-100),
            lg_ok,
            lg_bad,
        ),
        (
            "ap_edges",
            lambda: BinaryAveragePrecisionMetric(
                thresholds=[0.1, 0.5, 0.9], logits=True, ignore_index=-100
            ),
            lg_ok,
            lg_bad,
        ),
        (
            "ece_l2",
            lambda: BinaryCalibrationErrorMetric(norm="l2", logits=True, ignore_index=-100),
            lg_ok,
            lg_bad,
        ),
        (
            "ml_micro",
            lambda: MultilabelAUROCMetric(C, average="micro", logits=True),
            mll_ok,
            mll_bad,
        ),
        # Exact mode: the rows of a dropped batch are kept, marked skipped (no boolean mask).
        ("exact_auroc", lambda: BinaryAUROCMetric(exact=True, max_fpr=0.5), bin_ok, bin_bad),
        (
            "exact_md_ap",
            lambda: MulticlassAveragePrecisionMetric(C, logits=True, ignore_index=-100, exact=True),
            md_ok,
            md_bad,
        ),
        (
            "exact_ml_micro",
            lambda: MultilabelAUROCMetric(C, average="micro", logits=True, exact=True),
            mll_ok,
            mll_bad,
        ),
        (
            "b_matrix",
            lambda: BinaryConfusionMatrixMetric(0.4, "true", logits=True, ignore_index=-100),
            lg_ok,
            lg_bad,
        ),
        (
            "b_mcc",
            lambda: BinaryMatthewsCorrCoefMetric(logits=True, ignore_index=-100),
            lg_ok,
            lg_bad,
        ),
        (
            "b_kappa",
            lambda: BinaryCohenKappaMetric(weights="linear", logits=True, ignore_index=-100),
            lg_ok,
            lg_bad,
        ),
        (
            "ml_matrix",
            lambda: MultilabelConfusionMatrixMetric(C, normalize="pred", logits=True),
            mll_ok,
            mll_bad,
        ),
        ("ml_mcc", lambda: MultilabelMatthewsCorrCoefMetric(C, logits=True), mll_ok, mll_bad),
        (
            "mc_matrix",
            lambda: MulticlassConfusionMatrixMetric(C, "all", ignore_index=-100),
            cm_ok,
            cm_bad,
        ),
        (
            "samplewise_f1",
            lambda: (
                confusion_count_metric(ignore_index=-100, multidim_average="samplewise")
                .multiclass(C)
                .with_f1()
                .build()
            ),
            cm_ok,
            cm_bad,
        ),
        (
            "r2_adjusted",
            lambda: R2ScoreMetric(2, adjusted=2, multioutput="variance_weighted"),
            reg_ok,
            reg_bad,
        ),
        ("perplexity", lambda: PerplexityMetric(), lm_ok, lm_bad),
        ("perplexity_losses", lambda: PerplexityMetric(), loss_ok, loss_bad),
        ("token_accuracy", lambda: TokenAccuracyMetric(), lm_ok, lm_bad),
    ]
