"""A close run inside ``schedule_collection`` while it copies the metric into a new slot.

A signal handler's ``close`` runs between two bytecodes of the call on its own thread; the
collector's close takes ``_bound_prefix`` out of the metric's ``__dict__``. Landing while the
call deep-copied that ``__dict__`` for a new staging slot, it made the call fail with Python's
"dictionary changed size during iteration" instead of the documented closed-collector error
(the same error met a checkpoint's first ``state_dict`` on another thread, which adds a key).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sidestream import AsyncMetricCollector, MeanMetric


class _CloseWhenCopied:
    """An attribute whose deep copy runs ``close`` once: a handler landing mid-copy."""

    def __init__(self) -> None:
        self.close: Callable[[], object] | None = None
        self.closed: list[object] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> _CloseWhenCopied:
        close, self.close = self.close, None
        if close is not None:
            self.closed.append(close())
        return self


class _GatedMean(MeanMetric):
    """A mean whose ``compute`` waits for ``gate``: the windows keep their slots meanwhile."""

    gate = threading.Event()

    def compute(self) -> Any:
        assert self.gate.wait(10.0)
        return super().compute()


def test_a_close_while_a_new_slot_is_copied_raises_the_closed_error() -> None:
    metric = _GatedMean()
    hook = _CloseWhenCopied()
    metric.__dict__["_test_hook"] = hook  # copied before the _bound_prefix that bind adds
    collector = AsyncMetricCollector(metric, max_slots=8).bind("cpu")

    def close() -> bool:
        _GatedMean.gate.set()  # the windows in flight may finish: the close waits for them
        return collector.close(5.0)

    _GatedMean.gate.clear()
    try:
        # The slots made at bind are held by these windows (the first one's compute waits),
        # so the next call copies the metric into a new slot.
        step = 0
        while not collector._free_slots.empty():
            step += 1
            metric.update(torch.tensor([1.0]))
            collector.schedule_collection(step)
        hook.close = close
        metric.update(torch.tensor([1.0]))
        with pytest.raises(RuntimeError, match="closed") as raised:
            collector.schedule_collection(step + 1)
        assert "dictionary changed size" not in str(raised.value)
        assert hook.closed == [True]  # every window scheduled before it was delivered
    finally:
        _GatedMean.gate.set()
        collector.close(5.0)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_close_while_waiting_for_a_slot_raises_the_closed_error_and_warns_of_no_lost_slot(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A signal handler's close while the call waited for a free slot: the call took the
    slots the close dropped for lost ones ("0 staging slot(s) lost to an interrupted call;
    made anew", a warning about nothing) before it raised."""
    import sidestream.collector.collector as collector_module

    monkeypatch.setattr(collector_module, "_SLOT_WAIT_QUIET_S", 0.05)
    metric = _GatedMean()
    collector = AsyncMetricCollector(metric, max_slots=2).bind("cpu")
    closed: list[bool] = []

    def close_in_handler(signum: int, frame: object) -> None:
        _GatedMean.gate.set()
        closed.append(collector.close(5.0))

    _GatedMean.gate.clear()
    previous = signal.signal(signal.SIGALRM, close_in_handler)
    try:
        for step in (1, 2):
            metric.update(torch.tensor([1.0]))
            collector.schedule_collection(step)
        metric.update(torch.tensor([1.0]))
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # while the next call waits for a slot
        with (
            caplog.at_level(logging.WARNING, logger="sidestream"),
            pytest.raises(RuntimeError, match="closed"),
        ):
            collector.schedule_collection(3)
        assert closed == [True]
        assert "lost to an interrupted call" not in caplog.text
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _GatedMean.gate.set()
        collector.close(5.0)
