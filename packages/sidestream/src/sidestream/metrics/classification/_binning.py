"""Score bins shared by the ranking and calibration metrics: uniform, or at given edges."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real

import torch
from torch import Tensor

from sidestream.metrics.classification import _cpu_path
from sidestream.metrics.classification._problem import check_int

__all__ = ["Bins", "bin_index"]


def bin_index(scores: Tensor, num_bins: int, lift: float = 0.0) -> Tensor:
    """The uniform-bin index of each score, clamped into ``[0, num_bins)``.

    ``torch.bucketize`` on ``linspace(0, 1, num_bins + 1)`` with ``right=True`` (a score on an
    edge opens the bin above), without a boundary tensor or a binary search; see
    ``_cpu_path.bin_scale``. Every score is widened to float64 (exactly) and multiplied by a
    constant, which is monotone, so a higher score never lands in a lower bin, whatever the
    dtypes of the batches, which is all the error bounds rely on. NaN and out-of-range scores
    get a valid index too (their batch is screened out), so a bad value can never index out of
    bounds on the device. ``lift``: as ``_cpu_path.bin_scale``'s.
    """
    work = _cpu_path.binning_scores(scores)
    scale = _cpu_path.bin_scale(num_bins, lift)
    # Scaled in place when widening made a copy: one float64 temporary per score, not two.
    scaled = work * scale if work is scores else work.mul_(scale)
    return scaled.to(torch.int64).clamp_(0, num_bins - 1)


class Bins:
    """``num_bins`` uniform bins over ``[0, 1]``, or the bins between user-given edges.

    With ``edges`` ``e_1 < ... < e_T`` in ``[0, 1]`` there are ``T + 1`` bins: ``[0, e_1)``,
    ``[e_1, e_2)``, ..., ``[e_T, 1]``, so the curves have one point per edge (a score at or
    above ``e_k`` counts as positive there), as torchmetrics' ``thresholds=[...]``. As with
    uniform bins, a score within a relative ``2**-20`` below an edge counts at the edge.

    Args:
        num_bins: Uniform bins (ignored when ``edges`` is given).
        edges: Increasing thresholds in ``[0, 1]``, or ``None`` for uniform bins.
    """

    # The edges the scores are compared with: each user edge divided by ``EDGE_LIFT``, so a
    # score stored a hair below a decimal edge (float32 0.7 is 0.69999998) counts at the edge,
    # as a uniform bin edge's score does, whatever the score's dtype. A class default: a metric
    # pickled before them makes them on its first update.
    _lifted: Tensor | None = None

    def __init__(self, num_bins: int, edges: Sequence[float] | Tensor | None = None) -> None:
        self._edges: Tensor | None = None
        if edges is None:
            check_int("num_bins", num_bins, 2)
            self.count = num_bins
            return
        if isinstance(edges, Real):  # torchmetrics' thresholds=T, a count of edges
            hint = (
                f"; torchmetrics' thresholds={edges} (linspace(0, 1, {edges})) is "
                f"num_bins={edges - 1} here"
                if isinstance(edges, int) and edges > 1
                else ""
            )
            raise TypeError(
                f"thresholds: expected a sequence of edges in [0, 1], got the number {edges!r}"
                f"{hint}"
            )
        try:
            values = torch.as_tensor(edges, dtype=torch.float64).reshape(-1).cpu()
        except (TypeError, ValueError, RuntimeError) as error:
            # A string, None or a ragged list: torch's message ("new(): invalid data type
            # 'str'", "too many dimensions 'str'") named no argument.
            raise TypeError(
                f"thresholds: expected a sequence of numbers in [0, 1] or a tensor, got "
                f"{edges!r} ({error})"
            ) from None
        if values.numel() == 0:
            raise ValueError("thresholds: expected at least one value in [0, 1], got none")
        if not bool(((values >= 0) & (values <= 1)).all()):
            raise ValueError(f"thresholds: expected values in [0, 1], got {values.tolist()}")
        if values.numel() > 1 and not bool((values[1:] > values[:-1]).all()):
            raise ValueError("thresholds: expected strictly increasing values")
        self._edges = values
        self._lifted = values / _cpu_path.EDGE_LIFT
        self.count = values.numel() + 1

    def layout(self) -> Tensor:
        """What the bins are, as float64: ``[num_bins]`` when uniform, else the edges.

        The two never look alike: a uniform count is at least 2, edges are in ``[0, 1]``.
        """
        if self._edges is None:
            return torch.tensor([float(self.count)], dtype=torch.float64)
        return self._edges.cpu().clone()

    @property
    def uniform(self) -> bool:
        """Whether the bins are uniform (the CPU path can then ``bincount`` them)."""
        return self._edges is None

    def to(self, device: torch.device) -> None:
        """Keep the edges on the metric's device (``bucketize`` needs them there)."""
        if self._edges is not None:
            self._edges = self._edges.to(device)
            self._lifted = None if self._lifted is None else self._lifted.to(device)

    def index(self, scores: Tensor) -> Tensor:
        """The int64 bin of each score, in ``[0, count)``; host-sync free."""
        if self._edges is None:
            return bin_index(scores, self.count)
        # Compared in float64 whatever the scores' dtype, as uniform bins are binned: one
        # monotone map for every batch (edges rounded to float32 for float32 scores only put a
        # float32 score at a rounded edge above a higher float64 score below the edge itself).
        if self._lifted is None:
            self._lifted = self._edges.to(torch.float64) / _cpu_path.EDGE_LIFT
        return torch.bucketize(_cpu_path.binning_scores(scores), self._lifted, right=True)
