"""Perplexity from token-weighted negative log-likelihood."""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor
from torch.compiler import is_compiling

from sidestream._validation import (
    as_tensor,
    check_broadcastable,
    check_floating,
    check_tensor,
    check_weight_number,
    checks_stay_on_device,
    compiled_number,
    drop_invalid,
    found_where,
    ignore_index_of,
    not_finite,
    screen_invalid,
)
from sidestream.metrics._screened import ScreenedMetric
from sidestream.metrics.language._tokens import (
    check_ignore_index,
    check_logits,
    check_vocab_size,
    count_under,
    summed_nll,
    token_masks,
    token_range,
    token_weights,
)
from sidestream.state import MetricAccumulator, accumulate_sums, stacked_sums

__all__ = ["PerplexityMetric"]

_FINITE_LOGITS = "finite logits at counted tokens (no NaN or +inf; -inf not at the target id)"


class PerplexityMetric(ScreenedMetric[Tensor]):
    """``exp(sum of token NLL / number of counted tokens)`` over every update and rank.

    Feed either ``logits`` ``(..., V)`` with integer ``target`` ``(...)`` (the NLL is computed
    in float32 or better with ``cross_entropy``; tokens equal to ``ignore_index`` get weight 0),
    or per-token ``losses`` (natural-log NLL, for example ``reduction="none"`` output of your
    loss) with optional ``weights`` (token counts or a 0/1 mask). State: two float64 sums, so
    the synced perplexity equals the perplexity of all tokens of all ranks.

    Bad input: a shape or vocabulary mismatch raises at once. A target id outside
    ``[0, V)`` other than ``ignore_index``, logits that make a counted token's loss non-finite
    (NaN or +inf, or -inf at the target id), a negative / non-finite weight or loss, or
    finite weights whose total (or whose sum of losses times weights) float64 cannot hold,
    raises on CPU before the state changes;
    on CUDA the batch is dropped and counted in ``rejected_updates``.

    Args:
        ignore_index: The target id of padding tokens (``None``: every token counts).
        vocab_size: If given, ``logits.shape[-1]`` must equal it.

    Example:
        >>> metric = PerplexityMetric()
        >>> metric.update(losses=torch.tensor([1.0, 2.0, 3.0]), weights=torch.tensor([1, 1, 0]))
        >>> metric.compute()
        tensor(4.4817, dtype=torch.float64)
    """

    def __init__(self, ignore_index: int | None = -100, vocab_size: int | None = None) -> None:
        check_ignore_index(ignore_index)
        check_vocab_size(vocab_size)
        self._ignore_index = ignore_index
        self._vocab_size = vocab_size
        self._nll = MetricAccumulator(0.0, dtype=torch.float64)
        self._tokens = MetricAccumulator(0.0, dtype=torch.float64)
        super().__init__()  # the rejected-update counter, declared after the sums as before
        count_under(ignore_index, self._nll, self._tokens)

    def update(
        self,
        logits: Tensor | None = None,
        target: Tensor | None = None,
        *,
        losses: Tensor | None = None,
        weights: Tensor | float | None = None,
    ) -> None:
        """Add a batch: ``update(logits, target)`` or ``update(losses=..., weights=...)``.

        Args:
            logits: ``(..., V)`` unnormalized scores (any float dtype).
            target: ``(...)`` integer token ids, ``ignore_index`` for padding.
            losses: Per-token NLL, any shape, instead of logits and target.
            weights: With ``losses`` only: a scalar or a tensor broadcastable to ``losses``
                (1 by default). With ``logits``, mark padding with ``ignore_index`` instead.

        Raises:
            TypeError: If neither or both input forms are given, ``weights`` comes with
                ``logits``, or on a wrong dtype.
            ValueError: See the class docstring.
        """
        if (logits is None) == (losses is None) or (logits is None) != (target is None):
            raise TypeError(
                "update: pass either logits and target, or losses (with optional weights)"
            )
        if logits is not None and target is not None:
            if weights is not None and not (type(weights) in (int, float) and weights == 1):
                # It would be dropped: the logits path weights every counted token by 1 (the
                # default, which passed explicitly means nothing else).
                raise TypeError(
                    "weights: only with losses=...; with logits and target, leave padding "
                    "out with ignore_index (or pass losses= and weights=)"
                )
            self._update_logits(logits, target)
        elif losses is not None:
            self._update_losses(losses, 1.0 if weights is None else weights)

    def _update_logits(self, logits: Tensor, target: Tensor) -> None:
        # Tensors only, as the classification metrics take (a Python number failed on shape).
        logits_t = check_tensor("logits", logits, self.device)
        target_t = check_tensor("target", target, self.device)
        check_logits(logits_t, target_t, self._vocab_size)
        vocab = logits_t.shape[-1]
        if not checks_stay_on_device(logits_t.device):
            self._update_logits_on_host(logits_t, target_t, vocab)
            return
        self._update_logits_on_device(logits_t, target_t, vocab)

    def _update_logits_on_device(self, logits: Tensor, target: Tensor, vocab: int) -> None:
        """CUDA, or compiled on any device: no host read, a bad batch is dropped and counted.

        Few ops (each a kernel launch on CUDA, and each value a compiled update keeps costs it
        per call): one weight per token (``token_weights``), so the token total is also the
        batch's verdict. Every token that is not counted gets an id ``cross_entropy`` ignores
        (loss 0, and no out-of-bounds gather on the device).
        """
        weights, ids, skipped = token_weights(target, vocab, self._ignore_index)
        # A separate any() would cost compiled code another reduction and its buffer per call.
        tokens = weights.sum(dtype=torch.float64)
        work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        # In blocks: a float copy and the log-softmax of the whole batch cost 4x bf16 logits.
        nll = summed_nll(logits, ids, skipped, work_dtype)
        # Bad logits (NaN, +inf, or -inf at a target token) make the summed loss non-finite,
        # and a bad token made tokens inf. Both sums as one tensor: one drop, one add.
        invalid = not_finite(nll + tokens)
        sums = stacked_sums(nll, tokens)
        drop_invalid(invalid, self._rejected, sums)
        accumulate_sums((self._nll, self._tokens), sums)

    def _update_logits_on_host(self, logits: Tensor, target: Tensor, vocab: int) -> None:
        """CPU, eager: values are on the host, so one fused range check and few kernels.

        The token ids' range is read with one ``aminmax``; only when it leaves ``[0, vocab)``
        are the ids compared one by one with ``ignore_index``. ``cross_entropy`` skips ignored
        tokens itself (loss 0), so no weights are built.
        """
        flat = target.reshape(-1)
        ignore = self._ignore_index
        ignored = 0
        if flat.numel():
            smallest, largest = torch.aminmax(flat)
            low, high = smallest.item(), largest.item()
            if low < 0 or high >= vocab or (ignore is not None and low <= ignore <= high):
                counted, bad = token_masks(flat, vocab, ignore)
                screen_invalid(
                    bool(bad.any()),
                    self._rejected,
                    "target",
                    token_range(vocab, ignore_index_of(flat, ignore)),
                    found_where(flat, bad),
                )
                ignored = flat.numel() - int(counted.sum())
        work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        ids = flat if flat.dtype == torch.int64 else flat.long()
        # In blocks, the float copy of half-precision logits and the log-softmax bounded by
        # WORK_ELEMENTS instead of 4x a bf16 batch. None: no -100 got past the check.
        skipped = -100 if ignore is None else ignore
        total = summed_nll(logits, ids, skipped, work_dtype)
        if not math.isfinite(total.item()):
            raise ValueError(
                f"logits: expected {_FINITE_LOGITS}; this batch's loss is {total.item()}"
            )
        self._nll.accumulate(total)
        # full, not torch.tensor: a fill, without parsing a Python object into a tensor.
        counted = torch.full(
            (), float(flat.numel() - ignored), dtype=torch.float64, device=total.device
        )
        self._tokens.accumulate(counted)

    def _update_losses(self, losses: Tensor, weights: Tensor | float) -> None:
        if not (isinstance(weights, Tensor) or is_compiling()) and (
            isinstance(weights, bool) or not isinstance(weights, Real)
        ):
            # float() below took a string ("2" as weight 2.0) and a bool (weight 1), and named
            # no argument for the rest: refused as WeightedMeanMetric's weights are. (Compiling,
            # Dynamo hands a numpy scalar in as an array, which float() takes.)
            raise TypeError(f"weights: expected a torch.Tensor or a number, got {type(weights)}")
        check_weight_number("weights", weights)
        losses_t = as_tensor("losses", losses, self.device, floating=True)
        check_floating("losses", losses_t)
        losses_64 = losses_t.to(torch.float64)
        number: Tensor | None = None  # a Python weight as a tensor, compiling
        if isinstance(weights, Tensor):
            weights_t = as_tensor("weights", weights, self.device)
            check_broadcastable("weights", weights_t, losses_t, "losses")
            weights_64 = weights_t.to(torch.float64).expand(losses_t.shape)
        elif is_compiling() and isinstance(weights, float):
            # full_like would make the float a constant of the graph (see compiled_number).
            number = compiled_number(weights, torch.float64, self.device)
            weights_64 = number.expand(losses_64.shape)
        else:
            # A Python weight is filled on the device: no host-to-device copy (a CUDA sync).
            weights_64 = torch.full_like(losses_64, float(weights))
        on_device = checks_stay_on_device(self.device)
        if not on_device:
            # An NLL is never negative: a negative loss (log-probabilities passed as losses)
            # would give a perplexity below 1.
            screen_invalid(
                (losses_64 < 0) | ~torch.isfinite(losses_64),
                self._rejected,
                "losses",
                "finite values >= 0 (per-token NLL)",
                values=losses_64,
            )
            screen_invalid(
                (weights_64 < 0) | ~torch.isfinite(weights_64),
                self._rejected,
                "weights",
                "finite values >= 0",
                values=weights_64,
            )
        nll, tokens = (losses_64 * weights_64).sum(), weights_64.sum()
        if not on_device and not math.isfinite(tokens.item()):
            # Finite weights whose total overflows: the token count would be inf, and the
            # perplexity NaN (inf / inf) for good.
            raise ValueError(
                "weights: expected a total that torch.float64 holds; this batch's finite "
                f"weights sum to {tokens.item()} (scale the weights down)"
            )
        if not on_device and not math.isfinite(nll.item()):
            # Finite losses >= 0 at finite weights whose weighted sum overflows (a loss of 2 at
            # weight 1e308): the NLL total would be inf, and the perplexity inf for good, where
            # the mean NLL is 2.
            raise ValueError(
                "losses, weights: expected losses * weights to total what torch.float64 "
                f"holds; this batch's finite losses and weights sum to {nll.item()} (scale "
                "the losses or weights down)"
            )
        if on_device:
            bad_losses = (losses_64 < 0) | not_finite(losses_64)
            invalid = bad_losses | (weights_64 < 0) | not_finite(weights_64)
            # A total past float64 (finite weights, or finite losses at them) is bad input as
            # on the CPU: with every loss and weight finite and >= 0, only overflow makes inf.
            invalid = invalid.any() | (tokens == torch.inf) | (nll == torch.inf)
            if is_compiling() and not isinstance(weights, Tensor):
                # A number is a graph input, unchecked on the host; an empty batch's filled
                # weights hold none of it, so it is checked on its own.
                if number is None:  # an int (a float's is made above)
                    number = torch.full((), float(weights), dtype=torch.float64, device=self.device)
                invalid = invalid.any() | ~((number >= 0) & (number < torch.inf))
            drop_invalid(invalid, self._rejected, nll, tokens)
        self._nll.accumulate(nll)
        self._tokens.accumulate(tokens)

    def compute(self) -> Tensor:
        """The perplexity; NaN when no token was counted."""
        return torch.exp(self._nll.value / self._tokens.value)
