"""Perplexity and token accuracy against cross_entropy on the concatenated data."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sidestream.metrics.language import PerplexityMetric, TokenAccuracyMetric
from sidestream.testing import RankPool, on_rank_device
from tests._checkpoints import states_only

VOCAB = 11


def _shard(seed: int, batch: int, seq: int = 9) -> dict[str, torch.Tensor]:
    # Drawn on the host with a CPU generator, so every rank and the reference see the same data.
    generator, cpu = torch.Generator().manual_seed(seed), torch.device("cpu")
    logits = torch.randn(batch, seq, VOCAB, generator=generator, dtype=torch.float64, device=cpu)
    target = torch.randint(0, VOCAB, (batch, seq), generator=generator, device=cpu)
    padding = torch.rand(batch, seq, generator=generator, device=cpu) < 0.25
    logits = logits * 2
    target = torch.where(padding, -100, target)
    return {"logits": logits, "target": target}


def _shards(seed: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    sizes = np.random.default_rng(seed).integers(1, 20, size=world_size)
    if world_size > 1:
        sizes[-1] = 0
    return [_shard(seed * 10 + r, int(s)) for r, s in enumerate(sizes)]


def _concat(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([s[k] for s in shards]) for k in shards[0]}


def _reference(data: dict[str, torch.Tensor]) -> tuple[float, float]:
    logits, target = data["logits"].reshape(-1, VOCAB), data["target"].reshape(-1)
    nll = F.cross_entropy(logits, target, ignore_index=-100)  # mean over counted tokens
    counted = target != -100
    accuracy = (logits.argmax(-1) == target)[counted].double().mean()
    return math.exp(nll.item()), accuracy.item()


def _feed(data: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, float]:
    from_logits, from_losses = PerplexityMetric(), PerplexityMetric()
    accuracy = TokenAccuracyMetric(vocab_size=VOCAB)
    device = from_logits.device  # the rank's GPU under NCCL
    logits, target = data["logits"].to(device, dtype), data["target"].to(device)
    half = len(target) // 2
    for part in (slice(0, half), slice(half, None)):
        from_logits.update(logits[part], target[part])
        accuracy.update(logits[part], target[part])
        weights = (target[part] != -100).to(torch.int64)
        safe = torch.where(weights.bool(), target[part], 0)
        losses = F.cross_entropy(
            logits[part].reshape(-1, VOCAB).double(), safe.reshape(-1), reduction="none"
        )
        from_losses.update(losses=losses, weights=weights.reshape(-1))
    metrics = {"logits": from_logits, "losses": from_losses, "accuracy": accuracy}
    if dist.is_initialized():
        for metric in metrics.values():
            metric.sync()
    return {name: metric.compute().item() for name, metric in metrics.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_process_matches_cross_entropy(seed: int, dtype: torch.dtype) -> None:
    data = _shard(seed, 3 + 5 * seed)
    perplexity, accuracy = _reference(data)
    values = _feed(data, dtype)
    rel = 1e-12 if dtype == torch.float64 else 1e-5
    assert values["logits"] == pytest.approx(perplexity, rel=rel)
    assert values["losses"] == pytest.approx(
        perplexity, rel=1e-12 if dtype == torch.float64 else 1e-5
    )
    assert values["accuracy"] == pytest.approx(accuracy, abs=1e-15)


def test_low_precision_logits() -> None:
    data = _shard(4, 6)
    data["logits"] = data["logits"].to(torch.bfloat16).double()  # the reference sees bf16 values
    perplexity, accuracy = _reference(data)
    values = _feed(data, torch.bfloat16)
    assert values["logits"] == pytest.approx(perplexity, rel=1e-5)
    assert values["accuracy"] == pytest.approx(accuracy, abs=1e-15)


def test_ignore_index_inside_the_vocabulary_and_none() -> None:
    data = _shard(5, 4)
    target = torch.where(data["target"] == -100, 0, data["target"])  # pad id 0, in vocab
    metric = PerplexityMetric(ignore_index=0)
    metric.update(data["logits"], target)
    expected = F.cross_entropy(
        data["logits"].reshape(-1, VOCAB), target.reshape(-1), ignore_index=0
    )
    assert metric.compute().item() == pytest.approx(math.exp(expected.item()), rel=1e-12)
    every = TokenAccuracyMetric(ignore_index=None)
    every.update(data["logits"], target)
    assert every.compute().item() == pytest.approx(
        (data["logits"].argmax(-1) == target).double().mean().item(), abs=1e-15
    )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_uint8_ids_are_never_taken_for_a_negative_ignore_index(compiled: bool) -> None:
    # torch compares -100 in uint8 as 156: ids 156 were dropped as padding (compiled and on
    # CUDA for perplexity, everywhere for token accuracy), and an id 156 past the vocabulary
    # was taken for padding instead of refused.
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 200, generator=generator)
    ids = torch.tensor([156, 3, 156, 7, 10, 156])
    perplexity, accuracy = PerplexityMetric(), TokenAccuracyMetric()
    for metric in (perplexity, accuracy):
        update = metric.update
        if compiled:
            update = torch.compile(metric.update, fullgraph=True, backend="aot_eager")
        update(logits, ids.to(torch.uint8))
    expected = math.exp(F.cross_entropy(logits.double(), ids).item())
    assert perplexity.compute().item() == pytest.approx(expected, rel=1e-6)  # float32 losses
    assert accuracy.compute().item() == pytest.approx(
        (logits.argmax(-1) == ids).double().mean().item(), abs=1e-15
    )
    small = TokenAccuracyMetric(vocab_size=100)
    if compiled:
        torch.compile(small.update, fullgraph=True, backend="aot_eager")(
            logits[:, :100], ids.to(torch.uint8)
        )
        assert int(small.rejected_updates) == 1  # dropped and counted, not taken as padding
    else:
        with pytest.raises(ValueError, match=r"^target: expected token ids in \[0, 100\)"):
            small.update(logits[:, :100], ids.to(torch.uint8))


@on_rank_device
def _synced(seeds: list[int]) -> list[dict[str, float]]:
    return [
        _feed(_shards(seed, dist.get_world_size())[dist.get_rank()], torch.float64)
        for seed in seeds
    ]


@pytest.mark.parametrize("kind", [PerplexityMetric, TokenAccuracyMetric])
def test_a_checkpoint_counted_under_another_ignore_index_is_refused(kind: Any) -> None:
    logits = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([[0, 1, 0, 3]])
    saved = kind(ignore_index=0)
    saved.update(logits, target)  # two tokens counted: id 0 is padding here
    other = kind(ignore_index=-100)
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"state_dict\['configuration'\].*ignore_index=-100"):
        other.load_state_dict(saved.state_dict())
    assert all(torch.equal(before[key], other.state_dict()[key]) for key in states_only(before))
    same = kind(ignore_index=0)
    same.load_state_dict(saved.state_dict())
    assert torch.equal(same.compute(), saved.compute())


def test_distributed_matches_cross_entropy_on_all_shards(dist_pool: RankPool) -> None:
    seeds = [8, 9, 10]
    per_rank = dist_pool.run(_synced, seeds)
    for i, seed in enumerate(seeds):
        perplexity, accuracy = _reference(_concat(_shards(seed, dist_pool.world_size)))
        for values in per_rank:
            assert values[i]["logits"] == pytest.approx(perplexity, rel=1e-12)
            assert values[i]["losses"] == pytest.approx(perplexity, rel=1e-12)
            assert values[i]["accuracy"] == pytest.approx(accuracy, abs=1e-15)


def test_bad_input_raises_naming_the_argument_before_state_changes() -> None:
    perplexity, accuracy = PerplexityMetric(vocab_size=VOCAB), TokenAccuracyMetric()
    logits = torch.randn(2, 3, VOCAB)
    for metric in (perplexity, accuracy):
        with pytest.raises(ValueError, match="target"):
            metric.update(logits, torch.tensor([[0, 1, VOCAB], [0, 0, 0]]))
        with pytest.raises(ValueError, match="target"):
            metric.update(logits, torch.tensor([[0, 1, -5], [0, 0, 0]]))
        with pytest.raises(ValueError, match="logits"):
            metric.update(logits, torch.zeros(2, 4, dtype=torch.int64))
        with pytest.raises(TypeError, match="target"):
            metric.update(logits, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="vocab_size=11"):
        perplexity.update(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="weights"):
        perplexity.update(losses=torch.ones(3), weights=torch.tensor([1.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="losses"):
        perplexity.update(losses=torch.tensor([1.0, float("nan")]))
    # Log-probabilities passed as losses: an NLL is never negative (perplexity would be < 1).
    with pytest.raises(ValueError, match=r"^losses: expected finite values >= 0"):
        perplexity.update(losses=torch.tensor([1.0, -2.0]), weights=torch.tensor([1, 1]))
    compiled = PerplexityMetric()  # the device path (as on CUDA): dropped and counted
    update = torch.compile(compiled.update, fullgraph=True, backend="aot_eager")
    update(losses=torch.tensor([1.0, -2.0]), weights=torch.tensor([1, 1]))
    update(losses=torch.tensor([2.0]), weights=torch.tensor([1]))
    assert int(compiled.rejected_updates) == 1 and float(compiled.compute()) == math.exp(2.0)
    with pytest.raises(TypeError, match="either"):
        perplexity.update(logits, losses=torch.ones(3))
    assert torch.isnan(perplexity.compute()) and torch.isnan(accuracy.compute())
    assert perplexity.state_dict()["tokens"].item() == 0


@pytest.mark.parametrize(
    ("vocab_size", "error"),
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("10", TypeError)],
)
@pytest.mark.parametrize("kind", [PerplexityMetric, TokenAccuracyMetric])
def test_vocab_size_is_checked_when_the_metric_is_made(
    kind: Any, vocab_size: Any, error: type[Exception]
) -> None:
    # A wrong type is a TypeError, as num_classes's is (a float, a str and a bool were
    # ValueErrors, unlike every classification count).
    with pytest.raises(error, match="vocab_size: expected an int >= 1"):
        kind(vocab_size=vocab_size)


def test_weights_with_logits_are_refused_not_dropped() -> None:
    """``weights`` belongs to the losses form: with logits it was ignored, and a padding mask
    passed as weights gave the unweighted perplexity with no error."""
    logits, target = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)), torch.arange(4)
    metric = PerplexityMetric()
    with pytest.raises(TypeError, match=r"^weights: only with losses=.*ignore_index"):
        metric.update(logits, target, weights=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    assert metric.state_dict()["tokens"].item() == 0  # refused before any state changed
    metric.update(logits, torch.tensor([0, 1, -100, -100]), weights=1.0)  # the default: fine
    losses = torch.nn.functional.cross_entropy(logits[:2].double(), target[:2], reduction="mean")
    assert metric.compute().item() == pytest.approx(math.exp(losses.item()))


def test_nan_logits_of_padding_are_not_read_and_a_doubly_bad_batch_is_one_rejection() -> None:
    # TokenAccuracy refused a batch whose NaN rows were all padding (perplexity took it), and
    # counted a batch with NaN logits and an out-of-vocabulary target twice when compiled.
    logits = torch.randn(1, 4, VOCAB, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([[3, 5, -100, -100]])
    padded = logits.clone()
    padded[0, 2:] = float("nan")  # padding rows: masked out before the model's loss too
    expected = float((logits[0, :2].argmax(-1) == target[0, :2]).double().mean())
    for compile_it in (False, True):
        metric = TokenAccuracyMetric()
        update = (
            torch.compile(metric.update, fullgraph=True, backend="aot_eager")
            if compile_it
            else metric.update
        )
        update(padded, target)
        assert float(metric.compute()) == expected, compile_it
        assert int(metric.rejected_updates) == 0
    doubly_bad = padded.clone()
    doubly_bad[0, 0, 0] = float("nan")  # a counted token
    with pytest.raises(
        ValueError,
        match=r"^logits: expected no NaN scores at counted tokens; .* \(NaN scores at 1 of 1 ",
    ):
        TokenAccuracyMetric().update(doubly_bad, torch.tensor([[3, VOCAB, -100, -100]]))
    metric = TokenAccuracyMetric()
    update = torch.compile(metric.update, fullgraph=True, backend="aot_eager")
    update(doubly_bad, torch.tensor([[3, VOCAB, -100, -100]]))
    assert int(metric.rejected_updates) == 1 and int(metric.state_dict()["tokens"]) == 0


def test_messages_show_the_expected_shape_and_range_as_they_are() -> None:
    with pytest.raises(ValueError, match=re.escape("= (1, 2, vocab), got (1, 3, 11)")):
        TokenAccuracyMetric().update(torch.randn(1, 3, 11), torch.tensor([[1, 2]]))
    for metric in (PerplexityMetric(ignore_index=None), TokenAccuracyMetric(ignore_index=None)):
        with pytest.raises(ValueError, match=r"^target: expected token ids in \[0, 4\);"):
            metric.update(torch.randn(1, 2, 4), torch.tensor([[1, -100]]))
    for metric in (PerplexityMetric(), TokenAccuracyMetric()):  # a raw reshape/argmax error
        empty_vocab = r"^logits: expected at least one entry .* \(1, 2, 0\)"
        with pytest.raises(ValueError, match=empty_vocab):
            metric.update(torch.randn(1, 2, 0), torch.tensor([[1, 0]]))
    padded = r"^target: expected token ids in \[0, 4\) or ignore_index=-1;"
    with pytest.raises(ValueError, match=padded):
        PerplexityMetric(ignore_index=-1).update(torch.randn(1, 2, 4), torch.tensor([[1, 7]]))


@pytest.mark.parametrize("weights", ["2", "a", [1.0, 1.0], True, object()])
def test_weights_that_are_not_a_number_are_refused_naming_the_argument(weights: Any) -> None:
    """``float()`` took a string ("2" as weight 2.0) and a bool (weight 1), and raised its own
    error, naming no argument, for a list or ``"a"``."""
    metric = PerplexityMetric()
    metric.update(losses=torch.tensor([1.0]))
    with pytest.raises(TypeError, match=r"^weights: expected a torch.Tensor or a number"):
        metric.update(losses=torch.tensor([2.0, 3.0]), weights=weights)
    assert metric.state_dict()["tokens"].item() == 1  # refused before any state changed
    metric.update(losses=torch.tensor([3.0]), weights=np.float32(2.0))  # a numpy number is one
    assert metric.compute().item() == pytest.approx(math.exp(7.0 / 3.0))


@pytest.mark.parametrize("ignore_index", [2**63, -(2**63) - 1, 10**30])
@pytest.mark.parametrize("kind", [PerplexityMetric, TokenAccuracyMetric])
def test_an_ignore_index_past_int64_is_refused_when_the_metric_is_made(
    kind: Any, ignore_index: int
) -> None:
    with pytest.raises(ValueError, match=r"^ignore_index: expected an int64 id"):
        kind(ignore_index=ignore_index)
    kind(ignore_index=2**63 - 1)  # the largest id an int64 target holds: fine


@pytest.mark.parametrize("kind", [PerplexityMetric, TokenAccuracyMetric])
def test_vocabulary_second_logits_get_the_movedim_hint(kind: Any) -> None:
    # F.cross_entropy's (N, V, S) layout was refused with the expected shape alone, where the
    # classification metrics name the view that fixes it. The view then gives cross_entropy's
    # perplexity.
    logits = torch.randn(2, 50, 7, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    metric = kind()
    hint = re.escape(".movedim(1, -1), a view of shape (2, 7, 50)")
    with pytest.raises(ValueError, match=r"got \(2, 50, 7\); logits laid out .*" + hint):
        metric.update(logits, target)
    metric.update(logits.movedim(1, -1), target)
    if kind is PerplexityMetric:
        expected = math.exp(F.cross_entropy(logits.double(), target).item())
        assert metric.compute().item() == pytest.approx(expected, rel=1e-6)
    else:
        expected = (logits.argmax(1) == target).double().mean().item()
        assert metric.compute().item() == pytest.approx(expected)
