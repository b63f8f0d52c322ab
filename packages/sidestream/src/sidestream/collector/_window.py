"""What the training thread hands the dispatcher for one logging window."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from sidestream.collector._slot import Slot
from sidestream.metric import Metric
from sidestream.metrics._screened import NanScreenedMetric, ScreenedMetric
from sidestream.metrics.compose import ComposeMetric
from sidestream.sync import SyncHandle

__all__ = [
    "Window",
    "rejected_names",
    "rejected_on_host",
    "rejected_to_host",
    "without_frames",
]

#: The counts a report carries, when not zero, named after the metric's path: batches dropped
#: for bad values (CUDA), and NaN elements left out or replaced (``nan_strategy``).
COUNTS = ("rejected_updates", "nan_count")


@dataclass
class Window:
    """One scheduled collection.

    CPU: ``batch`` holds the started collectives; the dispatcher waits on it and computes on
    ``slot.metric``. CUDA: the reduction was queued on ``side``; the dispatcher queues
    ``compute()`` and the copies to pinned memory there too, sets ``rejected`` (the reduced
    counts of dropped batches, see ``rejected_to_host``) and ``done``, then waits on ``done``.

    ``started`` is set just before the first collective is issued, ``batch`` as soon as its
    start returns: a call interrupted in between (Ctrl-C) may have collectives in flight with
    no handle to wait on, so its slot is never reused. ``staged`` says the live state was
    copied out (and reset) for this window. ``error``: the window failed on the training thread
    after its updates were taken from the live metric; the dispatcher reports it as failed
    (a copy of the error without traceback frames: see ``without_frames``).
    ``kept_updates``: the live state still holds the failed window's updates (resetting it
    after the failure failed too). ``queued``: handed to the dispatcher (a Ctrl-C as the
    hand-off began leaves it unset).
    """

    step: int
    time: float
    slot: Slot
    batch: SyncHandle | None = None
    side: torch.cuda.Stream | None = None
    done: torch.cuda.Event | None = None
    rejected: Tensor | None = None
    started: bool = False
    staged: bool = False
    error: BaseException | None = None
    kept_updates: bool = False
    queued: bool = False


def without_frames(error: BaseException, _depth: int = 0) -> BaseException:
    """A copy of ``error`` that holds no traceback, nor does its cause or context.

    A failure kept for ``collect_results`` must not keep the frames of the call that failed:
    their locals hold the window's slot (a full copy of the metric), which would then outlive
    ``max_slots``. The notes are kept; an error that cannot be copied (its class takes other
    arguments than it keeps) becomes a ``RuntimeError`` naming its type and message.
    """
    try:
        clone = copy.copy(error)
    except Exception:
        clone = None
    if type(clone) is not type(error) or clone is error:
        clone = RuntimeError(f"{type(error).__name__}: {error}")
        for note in getattr(error, "__notes__", ()):
            clone.add_note(note)
    assert clone is not None
    clone.__traceback__ = None
    if _depth < _CHAINED_KEPT:
        for attribute in ("__cause__", "__context__"):
            chained = getattr(error, attribute)
            if chained is not None:
                setattr(clone, attribute, without_frames(chained, _depth + 1))
    else:
        clone.__cause__ = clone.__context__ = None
    clone.__suppress_context__ = error.__suppress_context__
    return clone


_CHAINED_KEPT = 8  # causes and contexts copied with an error (a chain may be a cycle)


_COUNTERS_OF_THE_LIBRARY = (
    ScreenedMetric.rejected_updates,
    NanScreenedMetric.rejected_updates,
    NanScreenedMetric.nan_count,
)

# Found once per staging copy: walking the metric tree per window would cost the training thread.
_COUNTERS: weakref.WeakKeyDictionary[
    Metric[Any], list[tuple[str, weakref.ref[Metric[Any]], str]]
] = weakref.WeakKeyDictionary()


def _walk(metric: Metric[Any], path: str) -> Iterator[tuple[str, Metric[Any], str]]:
    if isinstance(metric, ComposeMetric):
        for name, child in metric.items():
            yield from _walk(child, "/".join(part for part in (path, name) if part))
        return
    for attribute in COUNTS:
        # The library's counters only: a metric of one's own may have a property of that name
        # that is something else. A nan_strategy that counts nothing gives a nan_count of None.
        counted = getattr(type(metric), attribute, None) in _COUNTERS_OF_THE_LIBRARY
        if counted and getattr(metric, attribute) is not None:
            yield path, metric, attribute
    # A metric of one's own may hold library metrics (a loss mean with a nan_strategy): their
    # counts are reported under its path too.
    for name, value in metric._declared_items():
        if isinstance(value, Metric):
            yield from _walk(value, "/".join(part for part in (path, name) if part))


def _counters(metric: Metric[Any]) -> list[tuple[str, Metric[Any], str]]:
    found = _COUNTERS.get(metric)
    if found is None:
        # Weak references only: a value that refers to its own weak key keeps the key alive,
        # so every staging copy ever made (slots are freed and made again as the backlog
        # drains and grows) stayed in memory for good. The metric itself is such a value, and
        # so is any metric inside it: its state arena refers to the root (a ComposeMetric's).
        found = _COUNTERS[metric] = [
            (path, weakref.ref(child), count) for path, child, count in _walk(metric, "")
        ]
    # Alive while the metric is: it holds the metrics inside it.
    return [(path, cast("Metric[Any]", child()), count) for path, child, count in found]


def rejected_names(metric: Metric[Any], prefix: str) -> list[str]:
    """Report names of the metric's counts: ``[prefix/][path/]rejected_updates`` (or nan_count)."""
    return ["/".join(p for p in (prefix, path, count) if p) for path, _, count in _counters(metric)]


def _stacked(metric: Metric[Any]) -> Tensor | None:
    counts = [
        getattr(child, count).reshape(()).to(torch.int64) for _, child, count in _counters(metric)
    ]
    return torch.stack(counts) if counts else None


def rejected_to_host(metric: Metric[Any]) -> Tensor | None:
    """Start copying the reduced dropped-batch counts to the host (CUDA, current stream).

    Call after the window's reduction was queued and before its ``done`` event is recorded;
    read the result only after that event.
    """
    counts = _stacked(metric)
    return None if counts is None else counts.to("cpu", non_blocking=True)


def rejected_on_host(window: Window) -> list[int]:
    """The window's reduced dropped-batch counts (after ``done`` on CUDA, after sync on CPU)."""
    if window.done is not None:
        return [] if window.rejected is None else window.rejected.tolist()
    counts = _stacked(window.slot.metric)
    return [] if counts is None else counts.tolist()
