"""Next-token accuracy with padding skipped by weight."""

from __future__ import annotations

import torch
from torch import Tensor

from sidestream._validation import as_tensor, screen_invalid
from sidestream.metric import Metric
from sidestream.metrics.language._tokens import check_ignore_index, check_logits, token_weights
from sidestream.state import MetricAccumulator

__all__ = ["TokenAccuracyMetric"]


class TokenAccuracyMetric(Metric[Tensor]):
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
        self._ignore_index = ignore_index
        self._vocab_size = vocab_size
        self._correct = MetricAccumulator(0, dtype=torch.int64)
        self._tokens = MetricAccumulator(0, dtype=torch.int64)
        self._rejected = MetricAccumulator(0, dtype=torch.int64)

    @property
    def rejected_updates(self) -> Tensor:
        """How many updates were dropped for bad values (CUDA only; CPU raises instead)."""
        return self._rejected.value

    def update(self, logits: Tensor, target: Tensor) -> None:
        """Add ``(..., V)`` logits (or probabilities) and ``(...)`` integer target ids.

        Raises:
            TypeError: On a wrong dtype.
            ValueError: On a shape or vocabulary mismatch, or (CPU) a target id outside
                ``[0, V)`` other than ``ignore_index`` or a NaN in ``logits`` (CUDA drops such
                a batch and counts it in ``rejected_updates``).
        """
        logits_t = as_tensor("logits", logits, self.device)
        target_t = as_tensor("target", target, self.device)
        check_logits(logits_t, target_t, self._vocab_size)
        # A NaN score has no arg max: bad input, as an out-of-vocabulary target is.
        keep = screen_invalid(logits_t.isnan().any(), self._rejected, "logits", "no NaN scores")
        vocab = logits_t.shape[-1]
        safe, weights, _ = token_weights(target_t, vocab, self._ignore_index, self._rejected)
        counted = weights.to(torch.int64)
        if keep is not None:
            counted = counted * keep.to(torch.int64)
        correct = (logits_t.argmax(dim=-1) == safe).to(torch.int64) * counted
        self._correct.accumulate(correct.sum())
        self._tokens.accumulate(counted.sum())

    def compute(self) -> Tensor:
        """Correct / counted tokens; NaN when no token was counted."""
        return self._correct.value.to(torch.float64) / self._tokens.value.to(torch.float64)
