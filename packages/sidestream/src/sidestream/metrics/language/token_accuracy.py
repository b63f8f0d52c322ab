"""Next-token accuracy with padding skipped by weight."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import (
    check_tensor,
    checks_stay_on_device,
    ignore_index_of,
    screen_invalid,
)
from sidestream.metrics._screened import ScreenedMetric
from sidestream.metrics.language._tokens import (
    check_ignore_index,
    check_logits,
    check_vocab_size,
    count_under,
    token_masks,
    token_range,
)
from sidestream.state import MetricAccumulator

__all__ = ["TokenAccuracyMetric"]


class TokenAccuracyMetric(ScreenedMetric[Tensor]):
    """The fraction of counted tokens whose arg-max logit is the target id.

    State: int64 counts of correct and counted tokens (exact across ranks). Tokens equal to
    ``ignore_index`` are given weight 0, never removed by boolean masking. Bad input follows
    ``PerplexityMetric``: shape / vocabulary mismatches raise; target ids outside ``[0, V)``
    other than ``ignore_index`` raise on CPU and are dropped and counted in
    ``rejected_updates`` on CUDA.

    Args:
        ignore_index: The target id of padding tokens (``None``: every token counts).
        vocab_size: If given, ``logits.shape[-1]`` must equal it.

    Example:
        >>> metric = TokenAccuracyMetric()
        >>> logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]])
        >>> metric.update(logits, torch.tensor([[0, 0, -100]]))
        >>> metric.compute()
        tensor(0.5000, dtype=torch.float64)
    """

    def __init__(self, ignore_index: int | None = -100, vocab_size: int | None = None) -> None:
        check_ignore_index(ignore_index)
        check_vocab_size(vocab_size)
        self._ignore_index = ignore_index
        self._vocab_size = vocab_size
        self._correct = MetricAccumulator(0, dtype=torch.int64)
        self._tokens = MetricAccumulator(0, dtype=torch.int64)
        super().__init__()  # the rejected-update counter, declared after the sums as before
        count_under(ignore_index, self._correct, self._tokens)

    def update(self, logits: Tensor, target: Tensor) -> None:
        """Add ``(..., V)`` logits (or probabilities) and ``(...)`` integer target ids.

        Raises:
            TypeError: On a wrong dtype.
            ValueError: On a shape or vocabulary mismatch, or (CPU) a target id outside
                ``[0, V)`` other than ``ignore_index`` or a NaN in the logits of a counted
                token (CUDA drops such a batch and counts it in ``rejected_updates`` once;
                the logits of ``ignore_index`` tokens are not read).
        """
        # Tensors only, as the classification metrics take (a Python number failed on shape).
        logits_t = check_tensor("logits", logits, self.device)
        target_t = check_tensor("target", target, self.device)
        check_logits(logits_t, target_t, self._vocab_size)
        vocab = logits_t.shape[-1]
        counted, bad_target = token_masks(target_t, vocab, self._ignore_index)
        # A NaN score has no arg max: bad input at a counted token, as an out-of-vocabulary
        # target is. Padding rows are not read, so they may hold anything (as in perplexity).
        # Read from the arg max, which is a NaN's index in any row holding one (max and argmax
        # propagate NaN): isnan() of the whole batch cost a bool per logit (0.5x bf16 logits).
        best = logits_t.argmax(dim=-1)
        nan_scores = logits_t.gather(-1, best.unsqueeze(-1)).squeeze(-1).isnan() & counted
        if checks_stay_on_device(logits_t.device):
            # One verdict, so a batch bad in both ways is one rejected update.
            keep = screen_invalid(nan_scores | bad_target, self._rejected, "logits", "")
            assert keep is not None  # the device path always returns the keep flag
            counted = counted & keep
        else:  # raises naming the argument, before the state changes
            if bool(nan_scores.any()):
                tokens, of = int(nan_scores.sum()), int(counted.sum())
                screen_invalid(
                    True,
                    self._rejected,
                    "logits",
                    "no NaN scores at counted tokens",
                    found=f" (NaN scores at {tokens} of {of} counted tokens)",
                )
            expected = token_range(vocab, ignore_index_of(target_t, self._ignore_index))
            screen_invalid(bad_target, self._rejected, "target", expected, values=target_t)
        safe = torch.where(counted, target_t, 0).to(torch.int64)
        tally = counted.to(torch.int64)
        correct = (best == safe).to(torch.int64) * tally
        self._correct.accumulate(correct.sum())
        self._tokens.accumulate(tally.sum())

    def compute(self) -> Tensor:
        """Correct / counted tokens; NaN when no token was counted."""
        return self._correct.value.to(torch.float64) / self._tokens.value.to(torch.float64)
