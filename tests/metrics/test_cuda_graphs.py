"""CUDA only: every built-in metric's update replays from a CUDA graph and compiles sync-free.

The catalogue is the compile tests' (``test_compiled_updates.CASES``): each metric is updated
from a captured graph (the state arena's views never move, so a graph writes the live state)
and, separately, by ``torch.compile(fullgraph=True)``, both under
``torch.cuda.set_sync_debug_mode("error")``, and must end in the state an eager twin reaches on
the same batches. Skipped without a GPU (``nox -s gpu`` runs them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo

from sidestream import Metric
from tests.metrics.test_compiled_updates import CASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REPLAYS = 3


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    # Ten cases share RankingMetric.update's code: without a reset, the ninth compile of it
    # would hit torch's recompile limit, which fails a fullgraph=True compile.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _on_cuda(batch: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(value.cuda() if isinstance(value, torch.Tensor) else value for value in batch)


def _assert_same_state(name: str, ours: Metric[Any], theirs: Metric[Any]) -> None:
    # The rejected-update counter is one of the states: no batch here is dropped.
    for (key, mine), (_, expected) in zip(
        ours.named_accumulators(), theirs.named_accumulators(), strict=True
    ):
        if mine.local.is_floating_point():  # a kernel may order a float reduction differently
            assert torch.allclose(mine.local, expected.local, rtol=1e-6, atol=1e-9), (name, key)
        else:
            assert torch.equal(mine.local, expected.local), (name, key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_update_replays_from_a_cuda_graph(name: str) -> None:
    factory, batch = CASES[name]
    captured, eager = factory().to("cuda"), factory().to("cuda")
    generator = torch.Generator().manual_seed(5)
    static = _on_cuda(batch(generator))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as CUDA graphs require
        captured.update(*static)
        eager.update(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.update(*static)
    eager.update(*static)  # the capture itself did not run the update
    graph.replay()
    fresh = [_on_cuda(batch(generator)) for _ in range(REPLAYS)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for arguments in fresh:
            for into, value in zip(static, arguments, strict=True):
                into.copy_(value)
            graph.replay()
            eager.update(*arguments)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    _assert_same_state(name, captured, eager)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_update_on_cuda_has_no_host_sync(name: str) -> None:
    factory, batch = CASES[name]
    compiled, eager = factory().to("cuda"), factory().to("cuda")
    # aot_eager: dynamo and functionalization, the graph inductor would get, without a
    # Triton build per metric (the benchmark compiles six updates with inductor).
    step = torch.compile(compiled.update, fullgraph=True, backend="aot_eager")
    generator = torch.Generator().manual_seed(6)
    first = _on_cuda(batch(generator))
    step(*first)  # compiled outside sync-debug mode
    eager.update(*first)
    fresh = [_on_cuda(batch(generator)) for _ in range(REPLAYS)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for arguments in fresh:
            step(*arguments)
            eager.update(*arguments)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    _assert_same_state(name, compiled, eager)
