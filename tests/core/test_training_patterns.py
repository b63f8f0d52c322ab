"""Metrics updated from common PyTorch training patterns: hooks, custom autograd functions,
optimizer hooks, activation checkpointing (whose recomputation counts an update twice, as
docs/metrics.md says) and DDP with ``Join`` for uneven inputs (docs/collector.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from sidestream import MaxMetric, MeanMetric, SumMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.testing import RankPool

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_hooks_and_autograd_functions_count_each_batch_once() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 2)
    outputs, inputs, grad_norms = MeanMetric(), MeanMetric(), MaxMetric()
    layer.register_forward_hook(lambda module, args, out: outputs.update(out))
    layer.register_forward_pre_hook(lambda module, args: inputs.update(args[0]))
    norms: list[float] = []

    def on_backward(module: nn.Module, grad_in: object, grad_out: tuple[torch.Tensor]) -> None:
        norms.append(grad_out[0].norm().item())
        grad_norms.update(grad_out[0].norm())

    layer.register_full_backward_hook(on_backward)
    seen_forward, seen_backward = SumMetric(), SumMetric()

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            seen_forward.update(x)
            return x * 2

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            seen_backward.update(grad)
            return grad * 2

    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    steps = SumMetric()
    optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.update(torch.ones(())))
    xs, outs = [], []
    for _ in range(3):
        x = torch.randn(5, 4, requires_grad=True)  # the full backward hook then sees inputs
        out = Double.apply(layer(x))
        xs.append(x.detach())
        outs.append(out.detach() / 2)
        out.pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    every_x, every_out = torch.cat(xs).double(), torch.cat(outs).double()
    assert outputs.compute().item() == pytest.approx(every_out.mean().item(), abs=1e-12)
    assert inputs.compute().item() == pytest.approx(every_x.mean().item(), abs=1e-12)
    assert seen_forward.compute().item() == pytest.approx(every_out.sum().item(), abs=1e-9)
    # d(sum((2y)^2))/d(2y) = 4y: what Double.backward receives
    assert seen_backward.compute().item() == pytest.approx(4 * every_out.sum().item(), abs=1e-9)
    assert grad_norms.compute().item() == pytest.approx(max(norms), abs=1e-6)
    assert steps.compute().item() == 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_update_inside_checkpointed_region_counts_twice(reentrant: bool) -> None:
    # What docs/metrics.md says: the recomputation in backward runs the update again.
    layer = nn.Linear(4, 4)
    inside, outside = SumMetric(), SumMetric()

    def block(x: torch.Tensor) -> torch.Tensor:
        hidden = layer(x)
        inside.update(torch.tensor(float(x.shape[0])))
        return hidden.relu()

    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=reentrant)
    outside.update(torch.tensor(float(x.shape[0])))
    assert inside.compute().item() == 3.0  # forward alone: once
    out.sum().backward()
    assert inside.compute().item() == 6.0
    assert outside.compute().item() == 3.0


def test_docs_warn_of_recomputation_and_shadowed_collectives() -> None:
    metrics = (DOCS / "metrics.md").read_text()
    assert "torch.utils.checkpoint.checkpoint" in metrics
    assert "counted twice" in metrics
    collector = (DOCS / "collector.md").read_text()
    assert "torch.distributed.algorithms.join.Join" in collector


class _DdpJob:
    """A small DDP model, its optimizer and a collected mean of the loss, on this rank."""

    def __init__(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(0)
        self.model = DistributedDataParallel(nn.Linear(4, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.metric = MeanMetric()
        self.collector = AsyncMetricCollector(self.metric, prefix="train")
        self._generator = torch.Generator().manual_seed(100 + dist.get_rank())
        self.losses: list[float] = []

    def step(self) -> None:
        """One training step, its loss added to the metric (and kept for the reference)."""
        x = torch.randn(5, 4, generator=self._generator)
        y = torch.randn(5, 1, generator=self._generator)
        loss = (self.model(x) - y).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.metric.update(loss)
        self.losses.append(loss.item())

    def every_ranks_losses(self) -> list[list[float]]:
        everyone: list[list[float]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, self.losses)
        return everyone


def _uneven_join(batches: list[int]) -> tuple[float, list[list[float]]]:
    """Join's default: ranks that ran out shadow DDP; one window after the block."""
    from torch.distributed.algorithms.join import Join

    job = _DdpJob()
    with job.collector.bind("cpu"):
        with Join([job.model]):
            for _ in range(batches[dist.get_rank()]):
                job.step()
        # Once, after Join, on every rank (docs/collector.md): never inside the Join block.
        job.collector.schedule_collection(1)
        value = job.collector.collect_results()
    return value, job.every_ranks_losses()


@pytest.mark.distributed
def test_join_with_uneven_inputs_then_one_window(dist_pool: RankPool) -> None:
    batches = [2 + 2 * rank for rank in range(dist_pool.world_size)]
    results = dist_pool.run(_uneven_join, batches)
    everyone = results[0][1]
    assert [len(losses) for losses in everyone] == batches
    flat = [loss for losses in everyone for loss in losses]
    for value, _ in results:
        assert value == pytest.approx(sum(flat) / len(flat), abs=1e-12)


def _join_throwing(batches: list[int]) -> tuple[dict[int, float], list[list[float]]]:
    """``throw_on_early_termination=True``: a window every step inside the block stays paired."""
    from torch.distributed.algorithms.join import Join

    job = _DdpJob()
    values: dict[int, float] = {}
    with job.collector.bind("cpu"):
        try:
            with Join([job.model], throw_on_early_termination=True):
                for step in range(1, batches[dist.get_rank()] + 1):
                    job.step()
                    job.collector.schedule_collection(step)
                    values[step] = job.collector.collect_results()
        except RuntimeError as error:
            assert "exhausted" in str(error)  # every rank stops at the same step
        assert job.collector.close()
    return values, job.every_ranks_losses()


@pytest.mark.distributed
def test_join_throwing_keeps_per_step_windows_paired(dist_pool: RankPool) -> None:
    batches = [2 + 2 * rank for rank in range(dist_pool.world_size)]
    results = dist_pool.run(_join_throwing, batches)
    everyone = results[0][1]
    assert [len(losses) for losses in everyone] == [min(batches)] * dist_pool.world_size
    for values, _ in results:
        assert sorted(values) == list(range(1, min(batches) + 1))
        for step, value in values.items():
            direct = [losses[step - 1] for losses in everyone]
            assert value == pytest.approx(sum(direct) / len(direct), abs=1e-12)
