"""Input handling shared by the language-model metrics."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from sidestream._validation import (
    check_int,
    clamped,
    expected_text,
    ignore_index_of,
)
from sidestream.state import MetricAccumulator

__all__: list[str] = []

_BOOL = torch.bool
_INT64 = torch.int64
_where = torch.where
"""Read by ``check_logits`` and ``token_weights`` instead of through ``torch``: a compiled update
that reaches the torch module through this module's globals and another's pays an identity
guard, run in Python, on every call."""


def count_under(ignore_index: int | None, *states: MetricAccumulator) -> None:
    """Mark ``states`` as counted under ``ignore_index`` (their configuration).

    Which tokens count depends on it: a checkpoint (and a peer rank) counted under another one
    is refused instead of mixed in.
    """
    for state in states:
        state.set_configuration(f"ignore_index={ignore_index}")


def check_ignore_index(ignore_index: int | None) -> None:
    """Raise unless ``ignore_index`` is ``None`` or an int that int64 token ids can hold.

    Past int64 it matched no token but failed the first update, far from its cause, with
    ``cross_entropy``'s "Overflow when unpacking long long" (token accuracy took it).
    """
    if ignore_index is not None and (
        isinstance(ignore_index, bool) or not isinstance(ignore_index, int)
    ):
        raise TypeError(f"ignore_index: expected an int or None, got {ignore_index!r}")
    limits = torch.iinfo(_INT64)
    if ignore_index is not None and not limits.min <= ignore_index <= limits.max:
        raise ValueError(
            f"ignore_index: expected an int64 id (in [{limits.min}, {limits.max}]) or None, "
            f"got {ignore_index}"
        )


def check_vocab_size(vocab_size: int | None) -> None:
    """Raise unless ``vocab_size`` is ``None`` or an int >= 1.

    ``TypeError`` for another type (a float, a str, a bool), ``ValueError`` for an int < 1.
    """
    if vocab_size is not None:
        check_int("vocab_size", vocab_size, 1)


def check_logits(logits: Tensor, target: Tensor, vocab_size: int | None) -> None:
    """Raise naming the argument unless logits are ``(..., V)`` floats and target ``(...)`` ints."""
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating-point tensor, got dtype {logits.dtype}")
    if target.is_floating_point() or target.dtype == _BOOL:
        raise TypeError(f"target: expected integer token ids, got dtype {target.dtype}")
    if logits.ndim < 1 or tuple(logits.shape[:-1]) != tuple(target.shape):
        hint = ""
        if logits.ndim >= 2 and (logits.shape[0], *logits.shape[2:]) == tuple(target.shape):
            # cross_entropy's layout, (N, V, ...): the vocabulary second, not last.
            moved = (logits.shape[0], *logits.shape[2:], logits.shape[1])
            hint = (
                f"; logits laid out (N, vocab, ...), as F.cross_entropy takes them, go in as "
                f".movedim(1, -1), a view of shape {moved}"
            )
        raise ValueError(
            f"logits: expected shape target.shape + (vocab,) = "
            f"({', '.join([*(str(size) for size in target.shape), 'vocab'])}), "
            f"got {tuple(logits.shape)}{hint}"
        )
    if logits.shape[-1] == 0:
        raise ValueError(
            "logits: expected at least one entry (a token's score) in the last dimension, got "
            f"shape {tuple(logits.shape)}"
        )
    if vocab_size is not None and logits.shape[-1] != vocab_size:
        raise ValueError(
            f"logits: expected vocab_size={vocab_size} entries in the last dimension, "
            f"got {logits.shape[-1]}"
        )


def token_masks(target: Tensor, vocab: int, ignore_index: int | None) -> tuple[Tensor, Tensor]:
    """The ``(counted, bad)`` token masks of a batch of target ids.

    Counted: in ``[0, vocab)`` and not ``ignore_index``. Bad input: outside ``[0, vocab)`` and
    not ``ignore_index`` either.
    """
    in_vocab = clamped(target, 0, vocab - 1) == target
    ignore_index = ignore_index_of(target, ignore_index)
    if ignore_index is None:
        return in_vocab, ~in_vocab
    if 0 <= ignore_index < vocab:  # an out-of-vocabulary id is never the ignored one
        return in_vocab & (target != ignore_index), ~in_vocab
    # The ignored id is never in the vocabulary: every in-vocabulary token counts.
    return in_vocab, ~(in_vocab | (target == ignore_index))


def token_weights(
    target: Tensor, vocab: int, ignore_index: int | None
) -> tuple[Tensor, Tensor, int]:
    """What each target id adds to a token count, for the device path; ``token_masks``' rules.

    One weight per token, 1 if counted, 0 if ignored, inf if its id is bad input, so the
    weights' sum is both the token count and the batch's verdict, in fewer ops than the masks.

    Returns:
        ``(weights, ids, skipped)``: the float weights of ``target``'s shape; the int64 ids,
        flat, every token that is not counted set to ``skipped``, the ``ignore_index`` to give
        ``cross_entropy`` (no out-of-bounds gather on the device).
    """
    ignore = ignore_index_of(target, ignore_index)
    in_vocab = clamped(target, 0, vocab - 1) == target
    skipped = -100  # an id outside the vocabulary: ignored, or bad (the batch is dropped)
    if ignore is None:
        weights = _where(in_vocab, 1.0, math.inf)
    elif 0 <= ignore < vocab:
        weights = _where(target == ignore, 0.0, _where(in_vocab, 1.0, math.inf))
        skipped = ignore
    else:
        weights = _where(in_vocab, 1.0, _where(target == ignore, 0.0, math.inf))
    ids = target if target.dtype == _INT64 else target.long()  # before -100: uint8
    return weights, _where(in_vocab, ids, skipped).reshape(-1), skipped


WORK_ELEMENTS = 2**24
"""Logits per block of ``summed_nll`` (64 MiB of float32 work): its float copy of half-precision
logits and ``cross_entropy``'s log-softmax, made for the whole batch at once, cost 4x a bfloat16
batch (2 GB for 4 x 2048 x 32,000 logits), where a block's cost is this, whatever the batch."""


def summed_nll(logits: Tensor, ids: Tensor, skipped: int, work_dtype: torch.dtype) -> Tensor:
    """The float64 sum of ``cross_entropy``'s per-token loss, in blocks of ``WORK_ELEMENTS``.

    Eager only: a compiled update computes the batch whole (see the body).

    The loss of each token is computed in ``work_dtype`` as one ``cross_entropy`` over the
    whole batch computes it (a row's log-softmax reads only that row), so the numbers are the
    same; only the float64 sum adds per block.

    Args:
        logits: ``(..., V)`` scores, of any layout (a non-contiguous block is copied alone).
        ids: The flat int64 target ids, one per row of ``logits``, ``skipped`` where not
            counted.
        skipped: The ``ignore_index`` to give ``cross_entropy`` (loss 0).
        work_dtype: float32 or float64: what the logits are converted to, block by block.

    Returns:
        A 0-dim float64 tensor on the logits' device.
    """
    # Whole for the usual batch (the ops of an unblocked update), and when compiling: a loop
    # over blocks would make the batch's symbolic sizes constants of the graph (a recompile
    # per sequence length; fullgraph fails at the 9th), and inductor fuses the float
    # conversion and the log-softmax into the loss (measured: no extra memory for
    # 2048 x 32,000 bf16 logits on CPU).
    if logits.numel() <= WORK_ELEMENTS or torch.compiler.is_compiling():
        return _nll(logits, ids, skipped, work_dtype)
    total: Tensor | None = None
    for scores, targets in _blocks(logits, ids.reshape(logits.shape[:-1]), WORK_ELEMENTS):
        nll = _nll(scores, targets.reshape(-1), skipped, work_dtype)
        total = nll if total is None else total + nll
    assert total is not None  # _blocks gives at least one block
    return total


def _nll(logits: Tensor, ids: Tensor, skipped: int, work_dtype: torch.dtype) -> Tensor:
    scores = logits.reshape(-1, logits.shape[-1])
    if scores.dtype != work_dtype:  # skipped when already fine: a no-op call costs a dispatch
        scores = scores.to(work_dtype)
    nll = F.cross_entropy(scores, ids, ignore_index=skipped, reduction="none")
    return nll.sum(dtype=torch.float64)


def _blocks(logits: Tensor, ids: Tensor, limit: int) -> list[tuple[Tensor, Tensor]]:
    """``(logits, ids)`` views along the leading dimensions, each of at most ``limit`` logits.

    Sliced along the first dimension (a view, whatever the layout, so reshaping a block copies
    at most the block), and within one entry of it where one alone holds more. A batch within
    the limit is one block: the ops (each a kernel launch on CUDA) of an unblocked update. A
    list, not a generator: older Dynamo releases break a compiled graph at a generator.
    """
    if logits.numel() <= limit or logits.ndim == 1:
        return [(logits, ids)]
    per_entry = logits[0].numel()
    if per_entry > limit and logits.ndim > 2:
        return [
            block
            for index in range(logits.shape[0])
            for block in _blocks(logits[index], ids[index], limit)
        ]
    step = max(1, limit // max(per_entry, 1))
    return [
        (logits[start : start + step], ids[start : start + step])
        for start in range(0, logits.shape[0], step)
    ]


def token_range(vocab: int, ignore_index: int | None) -> str:
    """What a target id must be, for an error message: in ``[0, vocab)`` or ``ignore_index``."""
    if ignore_index is None:
        return expected_text("token ids in [0, {})", vocab)
    return expected_text("token ids in [0, {}) or ignore_index={}", vocab, ignore_index)
