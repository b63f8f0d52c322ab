"""Bad input for every metric's ``update``: each mutation either updates correctly or raises a
clear error naming the argument, with the state exactly as before the call.

Shared by ``test_bad_input.py`` and the docs/reliability.md generator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sidestream import MaxMetric, MeanMetric, Metric, MinMetric, SumMetric, WeightedMeanMetric
from sidestream.metrics.classification import (
    BinaryAUROCMetric,
    BinaryAveragePrecisionMetric,
    BinaryCalibrationErrorMetric,
    CohenKappaMetric,
    MatthewsCorrCoefMetric,
    MulticlassAUROCMetric,
    MulticlassAveragePrecisionMetric,
    MulticlassCalibrationErrorMetric,
    MulticlassConfusionMatrixMetric,
    MultilabelAUROCMetric,
    MultilabelAveragePrecisionMetric,
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

C = 3  # classes, labels, outputs, vocabulary
N = 6


def _probs(n: int = N) -> Tensor:
    return torch.linspace(0.05, 0.95, n, dtype=torch.float32)


def _class_probs() -> Tensor:
    return torch.softmax(torch.arange(N * C, dtype=torch.float32).reshape(N, C) / 7, dim=-1)


def _labels() -> Tensor:
    return torch.arange(N) % C


def _bits() -> Tensor:
    return torch.arange(N) % 2


def _multibits() -> Tensor:
    return (torch.arange(N * C).reshape(N, C) % 2).long()


def _values() -> Tensor:
    return torch.linspace(-2.0, 3.0, N, dtype=torch.float32)


def _paired() -> dict[str, Tensor]:
    return {"preds": _values().reshape(N // C, C), "target": _values().flip(0).reshape(N // C, C)}


# name -> (factory, valid keyword arguments)
CATALOGUE: dict[str, tuple[Callable[[], Metric[Any]], Callable[[], dict[str, Any]]]] = {
    "SumMetric": (SumMetric, lambda: {"values": _values()}),
    "MeanMetric": (MeanMetric, lambda: {"values": _values()}),
    "MaxMetric": (MaxMetric, lambda: {"values": _values()}),
    "MinMetric": (MinMetric, lambda: {"values": _values()}),
    "WeightedMeanMetric": (
        WeightedMeanMetric,
        lambda: {"values": _values(), "weights": torch.arange(N, dtype=torch.float32)},
    ),
    "MeanSquaredErrorMetric": (lambda: MeanSquaredErrorMetric(C), _paired),
    "RootMeanSquaredErrorMetric": (lambda: RootMeanSquaredErrorMetric(C), _paired),
    "MeanAbsoluteErrorMetric": (lambda: MeanAbsoluteErrorMetric(C), _paired),
    "R2ScoreMetric": (lambda: R2ScoreMetric(C), _paired),
    "PearsonCorrelationMetric": (lambda: PearsonCorrelationMetric(C), _paired),
    "MulticlassConfusionMatrixMetric": (
        lambda: MulticlassConfusionMatrixMetric(C),
        lambda: {"preds": _class_probs(), "target": _labels()},
    ),
    "MatthewsCorrCoefMetric": (
        lambda: MatthewsCorrCoefMetric(C),
        lambda: {"preds": _labels().flip(0), "target": _labels()},
    ),
    "CohenKappaMetric": (
        lambda: CohenKappaMetric(C),
        lambda: {"preds": _labels().flip(0), "target": _labels()},
    ),
    "confusion_count_metric().multiclass(...).with_f1()": (
        lambda: confusion_count_metric().multiclass(C).with_f1().macro().build(),
        lambda: {"preds": _class_probs(), "target": _labels()},
    ),
    "confusion_count_metric().binary().with_recall()": (
        lambda: confusion_count_metric().binary().with_recall().build(),
        lambda: {"preds": _probs(), "target": _bits()},
    ),
    "BinaryAUROCMetric": (
        lambda: BinaryAUROCMetric(num_bins=64),
        lambda: {"preds": _probs(), "target": _bits()},
    ),
    "BinaryAveragePrecisionMetric": (
        lambda: BinaryAveragePrecisionMetric(num_bins=64),
        lambda: {"preds": _probs(), "target": _bits()},
    ),
    "BinaryCalibrationErrorMetric": (
        BinaryCalibrationErrorMetric,
        lambda: {"preds": _probs(), "target": _bits()},
    ),
    "MulticlassAUROCMetric": (
        lambda: MulticlassAUROCMetric(C, num_bins=64),
        lambda: {"preds": _class_probs(), "target": _labels()},
    ),
    "MulticlassAveragePrecisionMetric": (
        lambda: MulticlassAveragePrecisionMetric(C, num_bins=64),
        lambda: {"preds": _class_probs(), "target": _labels()},
    ),
    "MulticlassCalibrationErrorMetric": (
        lambda: MulticlassCalibrationErrorMetric(C),
        lambda: {"preds": _class_probs(), "target": _labels()},
    ),
    "MultilabelAUROCMetric": (
        lambda: MultilabelAUROCMetric(C, num_bins=64),
        lambda: {"preds": _class_probs(), "target": _multibits()},
    ),
    "MultilabelAveragePrecisionMetric": (
        lambda: MultilabelAveragePrecisionMetric(C, num_bins=64),
        lambda: {"preds": _class_probs(), "target": _multibits()},
    ),
    "TokenAccuracyMetric": (
        TokenAccuracyMetric,
        lambda: {
            "logits": torch.randn(2, N, C, generator=torch.Generator().manual_seed(0)),
            "target": _labels().reshape(1, N).repeat(2, 1),
        },
    ),
    "PerplexityMetric": (
        PerplexityMetric,
        lambda: {
            "logits": torch.randn(2, N, C, generator=torch.Generator().manual_seed(1)),
            "target": _labels().reshape(1, N).repeat(2, 1),
        },
    ),
}


@dataclass(frozen=True)
class Mutation:
    """A way to break one argument; ``applies`` says which arguments it fits."""

    name: str
    apply: Callable[[Tensor], Any]
    applies: Callable[[Tensor], bool] = lambda t: True


def _poison(value: float) -> Callable[[Tensor], Tensor]:
    def apply(t: Tensor) -> Tensor:
        out = t.clone().to(torch.float32 if not t.is_floating_point() else t.dtype)
        out.view(-1)[0] = value
        return out

    return apply


def _set_first(value: int) -> Callable[[Tensor], Tensor]:
    def apply(t: Tensor) -> Tensor:
        out = t.clone()
        out.view(-1)[0] = value
        return out

    return apply


MUTATIONS = [
    Mutation("NaN", _poison(float("nan"))),
    Mutation("+inf", _poison(float("inf"))),
    Mutation("-inf", _poison(float("-inf"))),
    Mutation("complex dtype", lambda t: t.to(torch.complex64)),
    Mutation("bool dtype", lambda t: t != 0),
    Mutation("float64 where float32", lambda t: t.double(), lambda t: t.is_floating_point()),
    Mutation("int where float", lambda t: t.round().long(), lambda t: t.is_floating_point()),
    Mutation("float where int", lambda t: t.float(), lambda t: not t.is_floating_point()),
    Mutation("label too large", _set_first(1000), lambda t: not t.is_floating_point()),
    Mutation("negative label", _set_first(-7), lambda t: not t.is_floating_point()),
    Mutation("value > 1", _poison(1.5), lambda t: t.is_floating_point()),
    Mutation("negative value", _poison(-0.5), lambda t: t.is_floating_point()),
    Mutation("one element short", lambda t: t.reshape(-1)[:-1] if t.ndim == 1 else t[:-1]),
    Mutation("extra dimension", lambda t: t.unsqueeze(-1).repeat_interleave(2, -1)),
    Mutation("0-dim", lambda t: t.reshape(-1)[0]),
    Mutation("empty", lambda t: t[:0]),
    Mutation("Python list", lambda t: t.tolist()),
    Mutation("string", lambda t: "0.5"),
    Mutation("None", lambda t: None),
    Mutation("meta device", lambda t: t.to("meta")),
]


@dataclass(frozen=True)
class Outcome:
    metric: str
    argument: str
    mutation: str
    result: str  # "raised TypeError: ..." / "accepted" / "accepted: no-op"
    ok: bool
    problem: str = ""


def _state(metric: Metric[Any]) -> list[Tensor]:
    return [acc.local.clone() for _, acc in metric.named_accumulators()]


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and bool(((x == y) | (x.isnan() & y.isnan()) if x.is_floating_point() else x == y).all())
        for x, y in zip(a, b, strict=True)
    )


def cases() -> Iterator[tuple[str, str, Mutation]]:
    for name, (_, valid) in CATALOGUE.items():
        for argument, tensor in valid().items():
            for mutation in MUTATIONS:
                if mutation.applies(tensor):
                    yield name, argument, mutation


def run_case(name: str, argument: str, mutation: Mutation) -> Outcome:
    factory, valid = CATALOGUE[name]
    metric = factory()
    metric.update(**valid())  # a state worth protecting
    before = _state(metric)
    kwargs = valid()
    kwargs[argument] = mutation.apply(kwargs[argument])
    try:
        metric.update(**kwargs)
    except (TypeError, ValueError) as error:
        message = str(error)
        if not _same(before, _state(metric)):
            return Outcome(name, argument, mutation.name, _short(error), False, "state changed")
        if not any(name_ in message for name_ in kwargs):
            return Outcome(
                name, argument, mutation.name, _short(error), False, "message lacks the argument"
            )
        return Outcome(name, argument, mutation.name, _short(error), True)
    except Exception as error:  # any other type is not a clear error
        return Outcome(name, argument, mutation.name, _short(error), False, "unclear error type")
    return _accepted(name, argument, mutation, metric, before)


def _accepted(
    name: str, argument: str, mutation: Mutation, metric: Metric[Any], before: list[Tensor]
) -> Outcome:
    """An accepted mutation must be a correct update: what a reference reading gives."""
    factory, valid = CATALOGUE[name]
    kwargs = valid()
    original = kwargs[argument]
    if mutation.name in {"+inf", "-inf"} and name in {"MaxMetric", "MinMetric"}:
        return Outcome(name, argument, mutation.name, "accepted: an extremum", True)
    if mutation.name in {"NaN", "+inf", "-inf"} and (
        name in AGGREGATES or name == "PerplexityMetric"
    ):
        # A non-finite value is a value here: it must show in the result, not vanish.
        result = metric.compute()
        ok = not bool(torch.isfinite(torch.as_tensor(result)).all())
        return Outcome(name, argument, mutation.name, "accepted: shows in the result", ok)
    if mutation.name in {"+inf", "-inf"} and argument in {"preds", "logits"}:
        # Scores: the arg max of +-inf is well defined.
        return Outcome(name, argument, mutation.name, "accepted: a score", True)
    if mutation.name == "one element short" and len(kwargs) == 1:
        return Outcome(name, argument, mutation.name, "accepted: fewer values", True)
    if mutation.name == "empty":
        ok = _same(before, _state(metric))
        return Outcome(
            name, argument, mutation.name, "accepted: no-op", ok, "" if ok else "changed"
        )
    if mutation.name in {
        "Python list",
        "float64 where float32",
        "int where float",
        "float where int",
        "bool dtype",
    }:
        # The same numbers in another container or dtype: the update they mean.
        reference = factory()
        reference.update(**valid())
        changed = dict(kwargs)
        mutated = mutation.apply(original)
        changed[argument] = torch.as_tensor(mutated).to(original.dtype)
        try:
            reference.update(**changed)
        except (TypeError, ValueError):
            return Outcome(name, argument, mutation.name, "accepted", False, "reference rejects")
        ok = _close(_state(reference), _state(metric))
        return Outcome(
            name, argument, mutation.name, "accepted: as its values", ok, "" if ok else "differs"
        )
    if mutation.name == "0-dim" and name in {"SumMetric", "MeanMetric", "MaxMetric", "MinMetric"}:
        reference = factory()
        reference.update(**valid())
        reference.update(**{argument: original.reshape(-1)[:1]})
        ok = _close(_state(reference), _state(metric))
        return Outcome(name, argument, mutation.name, "accepted: one value", ok)
    if mutation.name == "extra dimension" and name in {
        "SumMetric",
        "MeanMetric",
        "MaxMetric",
        "MinMetric",
    }:
        return Outcome(name, argument, mutation.name, "accepted: values of any shape", True)
    if mutation.name in {"value > 1", "negative value"} and not _bounded(name, argument):
        return Outcome(name, argument, mutation.name, "accepted: in range", True)
    if mutation.name in {"+inf", "-inf"} and name in {"MaxMetric", "MinMetric"}:
        return Outcome(name, argument, mutation.name, "accepted: an extremum", True)
    if mutation.name == "0-dim" and argument == "weights":
        return Outcome(name, argument, mutation.name, "accepted: broadcast weight", True)
    return Outcome(name, argument, mutation.name, "accepted", False, "accepted bad input")


AGGREGATES = {"SumMetric", "MeanMetric", "MaxMetric", "MinMetric", "WeightedMeanMetric"}

#: Gaps found by this fuzz that are not fixed yet, as ``(metric, argument, mutation): reason``;
#: their cases xfail. Empty: every gap it found (NaN scores as class 0, complex inputs) is fixed.
KNOWN_GAPS: dict[tuple[str, str, str], str] = {}


def _bounded(name: str, argument: str) -> bool:
    """Whether ``argument`` of ``name`` must lie in [0, 1] (probabilities) or be >= 0."""
    if argument == "weights":
        return False  # weights only need to be >= 0: "negative value" is the bad one
    probability = any(k in name for k in ("AUROC", "AveragePrecision", "Calibration", "binary"))
    return argument == "preds" and probability


def _close(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape
        and torch.allclose(x.double(), y.double(), rtol=1e-6, atol=1e-9, equal_nan=True)
        for x, y in zip(a, b, strict=True)
    )


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 110 else text[:107] + "..."
