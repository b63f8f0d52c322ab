"""Run a benchmark on one intra-op thread, then restore the caller's setting."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def one_thread(run: Callable[[], str]) -> Callable[[], str]:
    """On a shared machine, waking a thread pool for each small op costs more than the op and
    swamps the comparison; every implementation in the benchmark runs under the same setting."""

    @functools.wraps(run)
    def single_threaded() -> str:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return run()
        finally:
            torch.set_num_threads(threads)

    return single_threaded
