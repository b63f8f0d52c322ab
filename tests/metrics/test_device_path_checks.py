"""The device-path value checks (CUDA's count-and-drop), run eagerly on CPU.

Each check here is written in few kernels (a kernel launch is the host cost of a small CUDA
update), so each formulation is checked against the plain one on the cases that could tell
them apart: narrow integer dtypes, NaN and both infinities, huge finite values, ignore_index
inside and outside the vocabulary. References are direct computations on the kept batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import f1_score

from sidestream import _validation
from sidestream.metrics import WeightedMeanMetric, weighted_mean
from sidestream.metrics.classification import _cpu_path, _inputs, confusion_count_metric
from sidestream.metrics.language import PerplexityMetric, TokenAccuracyMetric, _tokens, perplexity
from sidestream.metrics.regression import MeanSquaredErrorMetric, _paired

INF, NAN = math.inf, math.nan


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every check takes the path CUDA takes (drop and count), eagerly on CPU."""
    for module in (_validation, perplexity, _paired, _inputs, weighted_mean):
        monkeypatch.setattr(module, "checks_stay_on_device", lambda device: True)
    monkeypatch.setattr(_cpu_path, "enabled", lambda device: False)
    yield


@pytest.mark.parametrize(
    "values",
    [
        [0.0, -0.0, 1.5, -2.0, 1e308, -1e308, 5e-324],
        [INF],
        [-INF],
        [NAN],
        [1.0, NAN, 2.0],
        [],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_not_finite_is_the_negation_of_isfinite(values: list[float], dtype: torch.dtype) -> None:
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert torch.equal(_validation.not_finite(tensor), ~torch.isfinite(tensor))


@pytest.mark.parametrize(
    ("first", "second"),
    [([1e308, -1e308], [0.5, 2.0]), ([1.0, INF], [0.0, 0.0]), ([0.0], [NAN]), ([], [])],
)
def test_any_not_finite_says_whether_any_element_of_either_is(
    first: list[float], second: list[float]
) -> None:
    a, b = torch.tensor(first, dtype=torch.float64), torch.tensor(second, dtype=torch.float64)
    expected = not bool(torch.isfinite(a).all() and torch.isfinite(b).all())
    flag = _validation.any_not_finite(a, b)
    assert flag.dim() == 0 and flag.item() is expected


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize(("low", "high"), [(0, 1), (0, 999), (-5, 3), (0, 2**40), (-INF, INF)])
def test_clamped_gives_the_in_range_mask_for_every_integer_dtype(
    dtype: torch.dtype, low: float, high: float
) -> None:
    info = torch.iinfo(dtype)
    values = torch.tensor(sorted({info.min, info.min + 1, -6, -5, -1, 0, 1, 2, 3, 4, info.max}))
    values = values.clamp(info.min, info.max).to(dtype)
    inside = (values.double() >= low) & (values.double() <= high)
    assert torch.equal(_validation.clamped(values, low, high) == values, inside)


def test_any_flag_reduces_only_what_is_not_a_reduced_flag() -> None:
    flag = torch.tensor(True)
    assert _validation.any_flag(flag) is flag
    assert _validation.any_flag(torch.tensor([False, True])).item() is True
    assert _validation.any_flag(torch.tensor(0)).dtype == torch.bool  # a number is reduced


@pytest.mark.parametrize("ignore_index", [None, -100, 3, 1000])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int64])
def test_token_masks_for_every_ignore_index_and_narrow_ids(
    ignore_index: int | None, dtype: torch.dtype
) -> None:
    vocab = 300  # past uint8's range: clamp must not refuse the bound
    ids = torch.tensor([0, 1, 3, 255, 299, 300, 1000, -1, -100])
    if dtype == torch.uint8:
        ids = ids[(ids >= 0) & (ids <= 255)]
    ids = ids.to(dtype)
    counted, bad = _tokens.token_masks(ids, vocab, ignore_index)
    wide = ids.long()
    in_vocab = (wide >= 0) & (wide < vocab)
    # torch's own semantics for an ignore_index a dtype cannot hold: never equal.
    ignored = torch.zeros_like(in_vocab) if ignore_index is None else wide == ignore_index
    if dtype == torch.uint8 and ignore_index is not None and ignore_index < 0:
        ignored = torch.zeros_like(in_vocab)  # sidestream's rule: no uint8 id is negative
    assert torch.equal(counted, in_vocab & ~ignored)
    assert torch.equal(bad, ~in_vocab & ~ignored)


def _perplexity_reference(batches: list[tuple[torch.Tensor, torch.Tensor]], ignore: int) -> float:
    logits = torch.cat([x.reshape(-1, x.shape[-1]) for x, _ in batches]).double()
    target = torch.cat([t.reshape(-1) for _, t in batches]).long()
    return math.exp(F.cross_entropy(logits, target, ignore_index=ignore).item())


@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_perplexity_device_path_drops_bad_batches_and_matches_cross_entropy(
    device_path: None, ignore_index: int
) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 7
    good = []
    metric = PerplexityMetric(ignore_index=ignore_index)
    for seed in range(3):
        logits = torch.randn(2, 5, vocab, generator=generator)
        target = torch.randint(0, vocab, (2, 5), generator=generator)
        target[1] = torch.where(target[1] == ignore_index, (ignore_index + 1) % vocab, target[1])
        target[0, seed] = ignore_index  # row 1 holds no ignored token
        logits[0, seed] = NAN  # an ignored token's logits are never read
        good.append((logits, target))
        metric.update(logits, target)
    bad_token = good[0][1].clone()
    bad_token[1, 1] = vocab
    bad_logit = good[1][0].clone()
    bad_logit[1, 2, 0] = NAN
    metric.update(good[0][0], bad_token)
    metric.update(bad_logit, good[1][1])
    assert metric.rejected_updates.item() == 2
    expected = _perplexity_reference(good, ignore_index)
    assert metric.compute().item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("ignore_index", "dtype"),
    [(None, torch.int64), (50, torch.int64), (-100, torch.uint8), (3, torch.int32)],
)
def test_perplexity_device_path_weighs_tokens_for_every_ignore_index(
    device_path: None, ignore_index: int | None, dtype: torch.dtype
) -> None:
    """Counted tokens weigh 1, ignored ones 0, a bad id drops the batch: per ignore setting."""
    generator = torch.Generator().manual_seed(3)
    vocab = 6
    logits = torch.randn(3, 4, vocab, generator=generator)
    target = torch.randint(0, vocab, (3, 4), generator=generator)
    if ignore_index is not None and (dtype != torch.uint8 or ignore_index >= 0):
        target[0, 1] = ignore_index
    metric = PerplexityMetric(ignore_index=ignore_index)
    metric.update(logits, target.to(dtype))
    bad = target.clone()
    # Out of the vocabulary; as uint8, 156 is -100 wrapped: a bad id, never taken for padding.
    bad[2, 3] = vocab + 1 if dtype != torch.uint8 else 156
    metric.update(logits, bad.to(dtype))
    assert metric.rejected_updates.item() == 1
    # uint8 cannot hold -100: nothing is ignored there (and no uint8 id is taken for it).
    applies = ignore_index is not None and (dtype != torch.uint8 or ignore_index >= 0)
    reference = F.cross_entropy(
        logits.reshape(-1, vocab).double(),
        target.reshape(-1),
        ignore_index=ignore_index if applies else -100,
    )
    assert metric.compute().item() == pytest.approx(math.exp(reference.item()), rel=1e-6)


@pytest.mark.parametrize(("loss", "weight"), [(-1.0, 1.0), (NAN, 1.0), (INF, 1.0), (1.0, -2.0)])
def test_perplexity_from_losses_drops_a_bad_batch_on_the_device_path(
    device_path: None, loss: float, weight: float
) -> None:
    metric = PerplexityMetric()
    losses, weights = torch.tensor([0.5, 1.5, 2.0]), torch.tensor([1.0, 2.0, 0.0])
    metric.update(losses=losses, weights=weights)
    metric.update(losses=torch.tensor([loss, 1.0]), weights=torch.tensor([weight, 1.0]))
    assert metric.rejected_updates.item() == 1
    expected = math.exp((0.5 * 1 + 1.5 * 2) / 3)
    assert metric.compute().item() == pytest.approx(expected)


def test_token_accuracy_device_path_keeps_uint8_ids_past_255(device_path: None) -> None:
    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([0, 17, 255, 200, 3, 9], dtype=torch.uint8)
    metric = TokenAccuracyMetric(vocab_size=vocab)
    metric.update(logits, target)
    expected = (logits.argmax(-1) == target.long()).double().mean().item()
    assert metric.compute().item() == pytest.approx(expected)
    assert metric.rejected_updates.item() == 0


def test_paired_regression_keeps_huge_finite_values_and_drops_infinities(
    device_path: None,
) -> None:
    metric = MeanSquaredErrorMetric()
    preds = torch.tensor([1e300, -1e300, 0.5], dtype=torch.float64)
    target = torch.tensor([-1e300, 1e300, 0.25], dtype=torch.float64)
    metric.update(preds, target)  # differences overflow a square, not the check
    for bad in (INF, -INF, NAN):
        metric.update(torch.tensor([bad, 1.0]), torch.tensor([0.0, 1.0]))
        metric.update(torch.tensor([0.0, 1.0]), torch.tensor([1.0, bad]))
    assert metric.rejected_updates.item() == 6
    expected = ((preds - target) ** 2).mean().item()  # inf: the squares overflow
    assert metric.compute().item() == expected


@pytest.mark.parametrize("bad", [-1.0, NAN, INF])
def test_weighted_mean_device_path_drops_a_bad_weight_only(device_path: None, bad: float) -> None:
    metric = WeightedMeanMetric()
    metric.update(torch.tensor([1.0, 3.0]), torch.tensor([3.0, 1.0]))
    metric.update(torch.tensor([-INF, 0.0]), torch.tensor([0.0, 2.0]))  # weights fine: kept
    metric.update(torch.tensor([2.0, 2.0]), torch.tensor([1.0, bad]))
    assert metric.rejected_updates.item() == 1
    assert math.isnan(metric.compute().item())  # -inf * 0 is NaN: the kept batch says so
    fine = WeightedMeanMetric()
    fine.update(torch.tensor([1.0, 3.0]), torch.tensor([3.0, 1.0]))
    fine.update(torch.tensor([5.0, 7.0]), torch.tensor([1.0, bad]))
    assert fine.rejected_updates.item() == 1
    assert fine.compute().item() == pytest.approx(1.5)


@pytest.mark.parametrize("accumulate", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "values_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64]
)
def test_weighted_mean_device_path_widens_values_exactly_and_drops_an_overflowing_total(
    device_path: None, accumulate: torch.dtype, values_dtype: torch.dtype
) -> None:
    # The values are widened inside the product's kernel where that is exact (narrower values),
    # and converted first otherwise; a total that overflows drops the batch as an inf weight.
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(64, generator=generator).to(values_dtype)
    weights = torch.rand(64, generator=generator, dtype=torch.float64).to(torch.float32)
    metric = WeightedMeanMetric(dtype=accumulate)
    metric.update(values, weights)
    huge = torch.full((2,), torch.finfo(accumulate).max, dtype=accumulate)
    metric.update(torch.ones(2, dtype=values_dtype), huge)  # finite weights, an inf total
    assert metric.rejected_updates.item() == 1
    wide_values, wide_weights = values.to(accumulate), weights.to(accumulate)
    expected = (wide_values * wide_weights).sum() / wide_weights.sum()
    assert metric.compute().dtype == accumulate
    assert metric.compute().item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-6)


def test_weighted_mean_device_path_launches_ten_kernels_at_most() -> None:
    # Each op is a kernel launch on CUDA, the host cost of a small update: counted on the meta
    # device, which takes the device path and runs nothing (a guard against regressions).
    from benchmarks.kernel_count import kernels

    metric = WeightedMeanMetric().to("meta")
    values = torch.empty(64, device="meta")
    weights = torch.empty(64, device="meta")
    ops = kernels(lambda: metric.update(values, weights))
    assert len(ops) <= 10, ops


@pytest.mark.parametrize("path", ["cpu", "device"])
@pytest.mark.parametrize("bad", [-1.0, -1, NAN, INF])
def test_a_bad_number_as_weights_raises_on_every_path_and_batch(
    request: pytest.FixtureRequest, path: str, bad: float
) -> None:
    """A Python number is on the host: refused before any state changes, empty batch or not.

    The device path used to take it as the batch's weights (an empty batch has none: kept,
    uncounted), while the CPU raised; a weight tensor is still the batch's (an empty one kept).
    """
    if path == "device":
        request.getfixturevalue("device_path")
    mean, perplexity_ = WeightedMeanMetric(), PerplexityMetric()
    mean.update(torch.tensor([1.0, 3.0]), 2.0)
    perplexity_.update(losses=torch.tensor([0.5, 1.5]), weights=2)
    for values in (torch.zeros(0), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match=r"weights: expected (a )?finite values? >= 0"):
            mean.update(values, bad)
        with pytest.raises(ValueError, match=r"weights: expected (a )?finite values? >= 0"):
            perplexity_.update(losses=values, weights=bad)
    mean.update(torch.zeros(0, 3), torch.tensor([-1.0, 1.0, 1.0]))  # weighs no element
    mean.update(torch.zeros(0), torch.tensor(-1.0))
    assert mean.compute().item() == 2.0 and mean.rejected_updates.item() == 0
    assert perplexity_.compute().item() == pytest.approx(math.exp(1.0))
    assert perplexity_.rejected_updates.item() == 0


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_multiclass_counts_on_the_device_path_for_narrow_targets(
    device_path: None, dtype: torch.dtype
) -> None:
    classes = 10  # the mapped path (a float64 product on the device)
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(40, classes, generator=generator)
    target = torch.randint(0, classes, (40,), generator=generator).to(dtype)
    metric = confusion_count_metric().multiclass(classes).with_f1().macro().build()
    metric.update(logits, target)
    bad = target.clone()
    bad[3] = 200 if dtype == torch.uint8 else -1
    metric.update(logits, bad)
    assert metric.rejected_updates.item() == 1
    expected = f1_score(target.long().numpy(), logits.argmax(-1).numpy(), average="macro")
    assert metric.compute().item() == pytest.approx(expected)
