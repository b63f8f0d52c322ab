"""Update overhead: µs per ``update`` against the same arithmetic as raw ops, and torchmetrics.

Every implementation gets the same tensors. *Raw ops* is the state arithmetic of the metric
written by hand (no input checks, whole-batch conversions): a reference, not a floor (at large
sizes sidestream's cache-sized chunks take less time). torchmetrics runs with
its checks off (``validate_args=False``, ``nan_strategy="disable"``; the weighted means
``"ignore"``, which keeps the weights), and each row checks that both computed the same value
after timing. *Compiled* wraps the
update (sidestream: ``metric.update``; raw: the hand-written function) in
``torch.compile(fullgraph=True)`` (inductor). The exact BinaryAUROC row (a growing state
against torchmetrics' exact metric, both emptied between timed blocks) is eager only.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from benchmarks._goals import goal_line, machine_note
from benchmarks._threads import one_thread
from sidestream.metrics import MaxMetric, MeanMetric, WeightedMeanMetric
from sidestream.metrics.classification import BinaryAUROCMetric, confusion_count_metric
from sidestream.metrics.language import PerplexityMetric

SIZES = (64, 1_000_000)
ROUNDS = 7
CLASSES = 10
BINS = 10_000
VOCAB = 1024
F64 = torch.float64
EXACT_ROW = "BinaryAUROC exact"


@dataclass
class Case:
    """One metric at one size: each implementation's update, and how to empty its state."""

    raw: Callable[[], None]
    ours: Callable[..., None]
    args: tuple[torch.Tensor, ...]
    peer: Callable[[], None]
    peer_reset: Callable[[], None] = lambda: None
    compiled: dict[str, Callable[[], None]] = field(default_factory=dict)
    ours_reset: Callable[[], None] = lambda: None
    """Empties a growing state (exact mode) between blocks, as ``peer_reset`` does."""
    raw_reset: Callable[[], None] = lambda: None
    agree: Callable[[], tuple[object, object]] | None = None
    """sidestream's and the peer's ``compute()`` after the timing: the same metric, checked."""
    tolerance: float = 1e-4
    """Relative and absolute: float32 sums (torchmetrics), bins against exact scores."""
    metrics: tuple[object, object] = ()
    """sidestream's metric and the peer (each with ``reset``): reset, then updated once each
    for a second check of ``agree``, which the same inputs over many blocks cannot give (a lost
    update leaves the value of the others)."""


def _cases(size: int, device: str = "cpu") -> dict[str, Case]:
    """Each metric's implementations at ``size`` input elements, data and states on ``device``."""
    from torchmetrics.aggregation import MaxMetric as TmMax
    from torchmetrics.aggregation import MeanMetric as TmMean
    from torchmetrics.classification import BinaryAUROC, MulticlassF1Score
    from torchmetrics.text import Perplexity

    g = torch.Generator().manual_seed(0)
    values, weights = torch.randn(size, generator=g), torch.rand(size, generator=g)
    rows = max(size // CLASSES, 1)
    logits = torch.randn(rows, CLASSES, generator=g)
    labels = torch.randint(0, CLASSES, (rows,), generator=g)
    scores, truth = torch.rand(size, generator=g), torch.randint(0, 2, (size,), generator=g)
    tokens = max(size // VOCAB, 2) if size >= VOCAB else 2
    vocab = VOCAB if size >= VOCAB else size // 2
    lm_logits = torch.randn(1, tokens, vocab, generator=g)
    lm_target = torch.randint(0, vocab, (1, tokens), generator=g)
    values, weights, logits, labels, scores, truth, lm_logits, lm_target = (
        t.to(device) for t in (values, weights, logits, labels, scores, truth, lm_logits, lm_target)
    )

    # Raw state: shape (1,), not 0-dim (compiled in-place updates of 0-dim float64 are lost).
    pair = torch.zeros(2, dtype=F64, device=device)
    pair_32 = torch.zeros(2, device=device)
    top = torch.full((1,), -torch.inf, dtype=F64, device=device)
    matrix = torch.zeros(CLASSES * CLASSES, dtype=torch.int64, device=device)
    histogram = torch.zeros(2 * BINS, dtype=torch.int64, device=device)
    kept: list[torch.Tensor] = []

    def raw_weighted(v: torch.Tensor, w: torch.Tensor) -> None:
        w64 = w.to(F64)
        pair[0:1].add_((v.to(F64) * w64).sum())
        pair[1:2].add_(w64.sum())

    def raw_weighted_32(v: torch.Tensor, w: torch.Tensor) -> None:
        pair_32[0:1].add_((v * w).sum())
        pair_32[1:2].add_(w.sum())

    def raw_mean(v: torch.Tensor) -> None:
        pair[0:1].add_(v.sum(dtype=F64))
        pair[1:2].add_(v.numel())

    def raw_max(v: torch.Tensor) -> None:
        torch.maximum(top, v.amax(), out=top)

    def raw_f1(x: torch.Tensor, y: torch.Tensor) -> None:
        matrix.add_(torch.bincount(y * CLASSES + x.argmax(1), minlength=CLASSES * CLASSES))

    def raw_auroc(s: torch.Tensor, t: torch.Tensor) -> None:
        index = (s * BINS).long().clamp_(0, BINS - 1) + BINS * t
        histogram.add_(torch.bincount(index, minlength=2 * BINS))

    def raw_exact(s: torch.Tensor, t: torch.Tensor) -> None:
        kept.extend((s, t))  # torchmetrics' exact state: the inputs themselves

    def raw_perplexity(x: torch.Tensor, t: torch.Tensor) -> None:
        nll = F.cross_entropy(x.reshape(-1, x.shape[-1]), t.reshape(-1), reduction="sum")
        pair[0:1].add_(nll.to(F64))
        pair[1:2].add_(t.numel())

    f1 = confusion_count_metric().multiclass(CLASSES).with_f1().macro().build().to(device)
    tm_f1 = MulticlassF1Score(num_classes=CLASSES, average="macro", validate_args=False)
    tm_auroc = BinaryAUROC(thresholds=None, validate_args=False)
    tm_exact = BinaryAUROC(thresholds=None, validate_args=False)
    # "ignore", not "disable": with "disable" torchmetrics 1.9 replaces the weights by ones
    # (its issue #3434) and computes a plain mean. "ignore" also reads isnan(...).any().
    tm_weighted, tm_mean = TmMean(nan_strategy="ignore"), TmMean(nan_strategy="disable")
    tm_max, tm_perplexity = TmMax(nan_strategy="disable"), Perplexity()
    for peer in (tm_f1, tm_auroc, tm_exact, tm_weighted, tm_mean, tm_max, tm_perplexity):
        peer.to(device)
    tm_weighted_32 = TmMean(nan_strategy="ignore").to(device)
    weighted, mean, largest = WeightedMeanMetric(), MeanMetric(), MaxMetric()
    weighted_32 = WeightedMeanMetric(dtype=torch.float32).to(device)
    auroc, perplexity = BinaryAUROCMetric(BINS), PerplexityMetric()
    exact = BinaryAUROCMetric(exact=True).to(device)
    return {
        "WeightedMean (float64 sums; torchmetrics float32)": Case(
            lambda: raw_weighted(values, weights),
            weighted.to(device).update,
            (values, weights),
            lambda: tm_weighted.update(values, weights),
            compiled={"raw": raw_weighted},  # type: ignore[dict-item]
            agree=lambda: (weighted.compute(), tm_weighted.compute()),
            metrics=(weighted, tm_weighted),
        ),
        # Like for like: both sum in float32 (torchmetrics' default, sidestream's dtype=).
        "WeightedMean (dtype=float32, as torchmetrics)": Case(
            lambda: raw_weighted_32(values, weights),
            weighted_32.update,
            (values, weights),
            lambda: tm_weighted_32.update(values, weights),
            compiled={"raw": raw_weighted_32},  # type: ignore[dict-item]
            agree=lambda: (weighted_32.compute(), tm_weighted_32.compute()),
            metrics=(weighted_32, tm_weighted_32),
        ),
        "Mean": Case(
            lambda: raw_mean(values),
            mean.to(device).update,
            (values,),
            lambda: tm_mean.update(values),
            compiled={"raw": raw_mean},  # type: ignore[dict-item]
            agree=lambda: (mean.compute(), tm_mean.compute()),
            metrics=(mean, tm_mean),
        ),
        "Max": Case(
            lambda: raw_max(values),
            largest.to(device).update,
            (values,),
            lambda: tm_max.update(values),
            compiled={"raw": raw_max},  # type: ignore[dict-item]
            agree=lambda: (largest.compute(), tm_max.compute()),
            metrics=(largest, tm_max),
        ),
        f"F1 macro ({CLASSES} classes; size = logits elements, whole rows)": Case(
            lambda: raw_f1(logits, labels),
            f1.update,
            (logits, labels),
            lambda: tm_f1.update(logits, labels),
            compiled={"raw": raw_f1},  # type: ignore[dict-item]
            agree=lambda: (f1.compute(), tm_f1.compute()),
            metrics=(f1, tm_f1),
        ),
        f"BinaryAUROC ({BINS} bins; torchmetrics exact)": Case(
            lambda: raw_auroc(scores, truth),
            auroc.to(device).update,
            (scores, truth),
            lambda: tm_auroc.update(scores, truth),
            tm_auroc.reset,
            compiled={"raw": raw_auroc},  # type: ignore[dict-item]
            agree=lambda: (auroc.compute(), tm_auroc.compute()),
            metrics=(auroc, tm_auroc),
            tolerance=1e-3,  # 10,000 bins against exact scores
        ),
        # Like for like: both store every sample. Not compiled (a growing state).
        f"{EXACT_ROW} (torchmetrics exact)": Case(
            lambda: raw_exact(scores, truth),
            exact.update,
            (scores, truth),
            lambda: tm_exact.update(scores, truth),
            tm_exact.reset,
            ours_reset=exact.reset,
            raw_reset=kept.clear,
            agree=lambda: (exact.compute(), tm_exact.compute()),
            metrics=(exact, tm_exact),
        ),
        f"Perplexity (vocab {vocab}; size = logits elements)": Case(
            lambda: raw_perplexity(lm_logits, lm_target),
            perplexity.to(device).update,
            (lm_logits, lm_target),
            lambda: tm_perplexity.update(lm_logits, lm_target),
            compiled={"raw": raw_perplexity},  # type: ignore[dict-item]
            agree=lambda: (perplexity.compute(), tm_perplexity.compute()),
            metrics=(perplexity, tm_perplexity),
        ),
    }


def _best_us(
    implementations: dict[str, Callable[[], None]], resets: dict[str, Callable[[], None]], size: int
) -> dict[str, float]:
    """Best µs per update of each implementation, timed in interleaved blocks."""
    block = 300 if size < 10_000 else 3
    best = dict.fromkeys(implementations, float("inf"))
    for update in implementations.values():
        for _ in range(3):
            update()
    for _ in range(ROUNDS):
        for name, update in implementations.items():
            resets.get(name, lambda: None)()
            start = time.perf_counter()
            for _ in range(block):
                update()
            best[name] = min(best[name], (time.perf_counter() - start) / block * 1e6)
    return best


def _measure(size: int, compiled: bool) -> list[tuple[str, dict[str, float]]]:
    out = []
    for name, case in _cases(size).items():
        arguments = case.args
        implementations: dict[str, Callable[[], None]] = {
            "raw": case.raw,
            "ours": lambda c=case, a=arguments: c.ours(*a),
            "torchmetrics": case.peer,
        }
        if compiled and case.compiled:
            torch._dynamo.reset()
            raw_step = torch.compile(case.compiled["raw"], fullgraph=True)
            our_step = torch.compile(case.ours, fullgraph=True)
            implementations["raw compiled"] = lambda f=raw_step, a=arguments: f(*a)
            implementations["ours compiled"] = lambda f=our_step, a=arguments: f(*a)
        resets = {"torchmetrics": case.peer_reset, "ours": case.ours_reset, "raw": case.raw_reset}
        out.append((name, _best_us(implementations, resets, size)))
        _check_agreement(name, size, case)
        # And from a fresh state after one update each, eager and compiled: an update that
        # was lost (or did nothing) leaves no trace in the value of many identical ones.
        updates = {"eager": implementations["ours"]}
        if "ours compiled" in implementations:
            updates["compiled"] = implementations["ours compiled"]
        for how, update in updates.items():
            _check_one_update(f"{name} ({how}, one update)", size, case, update)
    return out


def _check_one_update(name: str, size: int, case: Case, ours: Callable[[], object]) -> None:
    """From a fresh state, ``ours`` (one sidestream update) and one peer update agree."""
    for metric in case.metrics:
        metric.reset()  # type: ignore[attr-defined]
    ours()
    case.peer()
    _check_agreement(name, size, case)


def _check_agreement(name: str, size: int, case: Case) -> None:
    """Raise if sidestream and its peer computed different values: then they are not peers."""
    if case.agree is None:
        return
    ours, theirs = (float(value) for value in case.agree())  # type: ignore[arg-type]
    if not math.isclose(ours, theirs, rel_tol=case.tolerance, abs_tol=case.tolerance):
        raise AssertionError(
            f"{name} at size {size:,}: sidestream computed {ours!r}, torchmetrics {theirs!r}; "
            "a comparison of their update times is only fair for the same metric"
        )


def run(compiled: bool = True) -> str:
    """The markdown section (also printed row by row); ``compiled=False`` skips compiling."""
    return one_thread(lambda: _table(compiled))()


def _table(compiled: bool) -> str:
    lines = [
        "## Update overhead against raw ops and torchmetrics\n",
        "`benchmarks/update_overhead.py`: µs per `update` on the same tensors, best of "
        f"{ROUNDS} interleaved blocks, one CPU thread, torch {torch.__version__}. *Raw ops* is "
        "the state arithmetic written by hand with no input checks (whole-batch conversions: "
        "a reference, not a floor; at 1M elements sidestream's cache-sized chunks take less "
        "time); */ raw* is sidestream / raw, above 1 when sidestream takes longer (the "
        "torchmetrics column is torchmetrics / sidestream). torchmetrics runs with "
        '`validate_args=False` where it has it and `nan_strategy="disable"`, except the '
        'weighted means: `nan_strategy="ignore"`, since with `"disable"` torchmetrics 1.9 '
        "replaces the weights by ones (its issue #3434). After timing, each row checks that "
        "sidestream and torchmetrics computed the same value, and again from a fresh state "
        "after one update each (eager, and compiled); *compiled* is "
        "`torch.compile(fullgraph=True)` (inductor) of the update and of the raw function. "
        "Size = input elements. sidestream's eager update includes its input checks (CPU "
        "reads them on the host and raises before the state changes). *BinaryAUROC exact* "
        "(`exact=True`, every sample stored, like its torchmetrics peer; raw ops: appending "
        "the inputs, a floor with no arithmetic, so no ratio to it) is eager only. Machine: "
        f"{machine_note()}; compare ratios within a row, not absolute numbers across rows.\n",
        "| metric | size | raw µs | sidestream µs | / raw | torchmetrics µs | torchmetrics / "
        "sidestream | raw compiled µs | sidestream compiled µs | / raw compiled |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    measured: list[tuple[str, int, dict[str, float]]] = []
    for size in SIZES:
        for name, us in _measure(size, compiled):
            measured.append((name, size, us))
            # An exact store has no state arithmetic: its raw ops are a bare list append, shown
            # as the floor but not as a ratio (its peer is torchmetrics' exact metric).
            over_raw = "—" if name.startswith(EXACT_ROW) else f"{us['ours'] / us['raw']:.2f}x"
            row = (
                f"| {name} | {size:,} | {us['raw']:.1f} | {us['ours']:.1f} | {over_raw} | "
                f"{us['torchmetrics']:.1f} | {us['torchmetrics'] / us['ours']:.2f}x |"
            )
            if "ours compiled" in us:
                row += (
                    f" {us['raw compiled']:.1f} | {us['ours compiled']:.1f} | "
                    f"{us['ours compiled'] / us['raw compiled']:.2f}x |"
                )
            else:
                row += " | | |"
            lines.append(row)
            print(row, flush=True)
    lines += ["", "Goals (issue 12), from the ratios above as printed:", "", *goals(measured)]
    return "\n".join(lines) + "\n"


def goals(measured: list[tuple[str, int, dict[str, float]]]) -> list[str]:
    """Issue 12's update goals, decided on ``(row name, size, µs by implementation)``."""

    def worst(rows: list[tuple[str, int, float]], highest: bool) -> tuple[str, float]:
        name, size, ratio = (max if highest else min)(rows, key=lambda row: row[2])
        return f"{ratio:.2f}x ({name}, {size:,})", round(ratio, 2)

    small = min(SIZES)
    eager = [
        (name, size, us["ours"] / us["raw"])
        for name, size, us in measured
        if size == small and not name.startswith(EXACT_ROW)
    ]
    built = [
        (name, size, us["ours compiled"] / us["raw compiled"])
        for name, size, us in measured
        if "ours compiled" in us
    ]
    peer = [(name, size, us["torchmetrics"] / us["ours"]) for name, size, us in measured]
    out = []
    if eager:
        figure, ratio = worst(eager, highest=True)
        out.append(
            goal_line(f"eager, within 2x of raw ops at {small} elements", figure, ratio <= 2)
        )
    if built:
        figure, ratio = worst(built, highest=True)
        out.append(goal_line("compiled, within 1.2x of the raw compiled ops", figure, ratio <= 1.2))
    else:
        out.append("- compiled, within 1.2x of the raw compiled ops: not measured in this run.")
    if peer:
        figure, ratio = worst(peer, highest=False)
        slower = sum(round(r, 2) < 1 for _, _, r in peer)
        figure = f"lowest torchmetrics / sidestream {figure}; {slower} of {len(peer)} rows below 1x"
        out.append(goal_line("never slower than torchmetrics", figure, ratio >= 1))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--no-compile", action="store_true")
    print(run(compiled=not parser.parse_args().no_compile))
