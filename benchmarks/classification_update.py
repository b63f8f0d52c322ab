"""Update throughput of confusion-count metrics: sidestream vs torchmetrics on the same inputs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._threads import one_thread
from sidestream.metrics.classification import confusion_count_metric

ROUNDS = 15
BLOCK = 10
BATCH = 4096
CLASSES = 10
LARGE_BATCH = 1 << 20
"""A large batch (an evaluation pass over a big validation set, or many tokens at once)."""


def _seconds_per_update(
    implementations: dict[str, Callable[[], None]], device: torch.device
) -> dict[str, float]:
    """Best time per update of each implementation, timed in interleaved blocks.

    Interleaving spreads the noise of other processes over every implementation alike; the
    best block resists it.
    """
    best = dict.fromkeys(implementations, float("inf"))
    for update in implementations.values():
        for _ in range(5):  # warm-up: allocator, first-call dispatch
            update()
    for _ in range(ROUNDS):
        for name, update in implementations.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(BLOCK):
                update()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - start) / BLOCK)
    return best


def _check_agreement(metric: str, values: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Raise unless every implementation computed sidestream's value after the same updates.

    Each implementation ran the same number of updates on the same tensors, so a lost or
    wrong update (a confusion count off by one batch) shows here: in the counts, which the
    scores' cases return with their value (a score is the same after one update as after many).
    """
    ours = values["sidestream"]().double().cpu()
    for name, value in values.items():
        theirs = value().double().cpu()
        if not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6):
            raise AssertionError(
                f"{metric}: sidestream computed {ours.tolist()}, {name} {theirs.tolist()}; "
                "a comparison of their update times is only fair for the same metric"
            )


Cases = dict[str, tuple[dict[str, Callable[[], None]], dict[str, Callable[[], torch.Tensor]]]]


def _cases(device: torch.device) -> Cases:
    from torchmetrics.classification import (
        BinaryAccuracy,
        BinaryConfusionMatrix,
        MulticlassF1Score,
    )

    from sidestream.metrics.classification import BinaryConfusionMatrixMetric

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, CLASSES, generator=generator).to(device)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator).to(device)
    probabilities = torch.rand(BATCH * 16, generator=generator).to(device)
    truth = torch.randint(0, 2, (BATCH * 16,), generator=generator).to(device)
    large = LARGE_BATCH
    large_probabilities = torch.rand(large, generator=generator).to(device)
    large_truth = torch.randint(0, 2, (large,), generator=generator).to(device)

    f1 = confusion_count_metric().multiclass(CLASSES).with_f1().macro().build().to(device)
    f1_default = MulticlassF1Score(num_classes=CLASSES, average="macro").to(device)
    f1_fast = MulticlassF1Score(num_classes=CLASSES, average="macro", validate_args=False)
    f1_fast = f1_fast.to(device)
    accuracy = confusion_count_metric().binary().with_accuracy().build().to(device)
    accuracy_default = BinaryAccuracy().to(device)
    accuracy_fast = BinaryAccuracy(validate_args=False).to(device)
    matrix = BinaryConfusionMatrixMetric().to(device)
    matrix_default = BinaryConfusionMatrix().to(device)
    matrix_fast = BinaryConfusionMatrix(validate_args=False).to(device)

    names = ("sidestream", "torchmetrics (default)", "torchmetrics (validate_args=False)")

    def computed(*metrics: Any) -> dict[str, Callable[[], torch.Tensor]]:
        return {name: metric.compute for name, metric in zip(names, metrics, strict=True)}

    def with_counts(ours: Any, *peers: Any) -> dict[str, Callable[[], torch.Tensor]]:
        """The value, then the tp, fp, fn, tn counts: a score is a ratio of counts, the same
        after one update as after many identical ones, so only the counts show a lost update."""

        def flat(value: torch.Tensor, counts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([t.double().flatten() for t in (value, *counts)])

        def peer_counts(peer: Any) -> Callable[[], torch.Tensor]:
            return lambda: flat(peer.compute(), [peer.tp, peer.fp, peer.fn, peer.tn])

        out = {names[0]: lambda: flat(ours.compute(), list(ours.counts().values()))}
        out.update((name, peer_counts(peer)) for name, peer in zip(names[1:], peers, strict=True))
        return out

    return {
        f"multiclass F1 macro, logits ({BATCH}, {CLASSES}) float32": (
            {
                "sidestream": lambda: f1.update(logits, labels),
                "torchmetrics (default)": lambda: f1_default.update(logits, labels),
                "torchmetrics (validate_args=False)": lambda: f1_fast.update(logits, labels),
            },
            with_counts(f1, f1_default, f1_fast),
        ),
        f"binary accuracy, probabilities ({BATCH * 16},) float32": (
            {
                "sidestream": lambda: accuracy.update(probabilities, truth),
                "torchmetrics (default)": lambda: accuracy_default.update(probabilities, truth),
                "torchmetrics (validate_args=False)": lambda: accuracy_fast.update(
                    probabilities, truth
                ),
            },
            with_counts(accuracy, accuracy_default, accuracy_fast),
        ),
        f"binary confusion matrix, probabilities ({large:,},) float32": (
            {
                "sidestream": lambda: matrix.update(large_probabilities, large_truth),
                "torchmetrics (default)": lambda: matrix_default.update(
                    large_probabilities, large_truth
                ),
                "torchmetrics (validate_args=False)": lambda: matrix_fast.update(
                    large_probabilities, large_truth
                ),
            },
            computed(matrix, matrix_default, matrix_fast),
        ),
    }


@one_thread
def run() -> str:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    lines = [
        "## Classification update throughput\n",
        f"One `update` per call on the same tensors; best of {ROUNDS} interleaved blocks of "
        f"{BLOCK} updates, one CPU thread. Ratio = time per update / sidestream's. After "
        "timing, every implementation's value (after the same updates) is checked against "
        "sidestream's, and for F1 and accuracy its tp, fp, fn and tn counts too (a score is "
        "the same after one update as after many).\n",
        "| device | metric | implementation | µs per update | time / sidestream |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for device in devices:
        for metric, (implementations, values) in _cases(device).items():
            times = _seconds_per_update(implementations, device)
            _check_agreement(metric, values)
            ours = times["sidestream"]
            for name, seconds in times.items():
                lines.append(
                    f"| {device.type} | {metric} | {name} | {seconds * 1e6:.1f} | "
                    f"{seconds / ours:.2f}x |"
                )
    print("\n".join(lines))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run()
