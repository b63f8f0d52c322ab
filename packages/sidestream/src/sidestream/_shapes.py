"""Shape rules shared by states and input checks (a leaf module: it imports nothing of ours)."""

from __future__ import annotations

__all__ = ["broadcasts_to"]


def broadcasts_to(own: tuple[int, ...], wanted: tuple[int, ...]) -> bool:
    """Whether a tensor of shape ``own`` broadcasts to exactly ``wanted``.

    Compared by hand, not by catching ``torch.broadcast_shapes``' error: torch.compile cannot
    trace a try/except, and would raise torch's message instead of ours.
    """
    return len(own) <= len(wanted) and all(
        size in (1, goal) for size, goal in zip(reversed(own), reversed(wanted), strict=False)
    )
