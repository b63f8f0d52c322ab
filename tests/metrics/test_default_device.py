"""A default device set by the caller (``torch.set_default_device``, ``with torch.device``) does
not leak into a metric living elsewhere: its updates and compute stay on its own device.

``meta`` stands in for ``cuda`` here (no data, so any tensor made on the default device instead
of the metric's fails loudly). Cached helper tensors are cleared first, so a cache filled under
the default device would be caught too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_leaves

from sidestream import ComposeMetric, MeanMetric, Metric, SumMetric
from sidestream.metrics.classification import _inputs
from sidestream.testing import OpRecorder, RankPool
from tests.metrics.test_compiled_updates import CASES


def _meta_during(phase: str, now: str) -> AbstractContextManager[object]:
    return torch.device("meta") if phase == now else nullcontext()


@pytest.mark.parametrize("phase", ["update", "compute"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_metric_under_another_default_device(name: str, phase: str) -> None:
    factory, batch = CASES[name]
    generator = torch.Generator().manual_seed(3)
    batches = [batch(generator) for _ in range(2)]
    reference, metric = factory(), factory()
    for arguments in batches:
        reference.update(*arguments)
    _inputs.count_map.cache_clear()
    _inputs._ones.cache_clear()
    with _meta_during(phase, "update"):
        for arguments in batches:
            metric.update(*arguments)
    with _meta_during(phase, "compute"):
        result = metric.compute()
    for ours, theirs in zip(tree_leaves(result), tree_leaves(reference.compute()), strict=True):
        assert ours.device.type == "cpu"
        assert torch.equal(ours, theirs) or torch.allclose(ours, theirs, equal_nan=True)


def _layout(metric: Metric[Any]) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    return [
        (name, tuple(state.local.shape), state.local.dtype, state.local.device.type)
        for name, state in metric.named_accumulators()
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_metric_built_under_a_meta_default_device_is_the_moved_one(name: str) -> None:
    # `with torch.device("meta")` around a model built for its size: the metrics its __init__
    # makes failed with torch's "Tensor.item() cannot be called on meta tensors" (all but
    # MaxMetric and MinMetric), their argument checks reading meta tensors.
    factory, batch = CASES[name]
    arguments = tuple(
        value.to("meta") if isinstance(value, torch.Tensor) else value
        for value in batch(torch.Generator().manual_seed(3))
    )
    moved = factory().to("meta")
    with torch.device("meta"):
        built = factory()
    assert _layout(built) == _layout(moved)
    assert built.device.type == "meta"
    moved.update(*arguments)  # warm-ups: a first update may build what later ones reuse
    built.update(*arguments)
    with OpRecorder() as theirs:
        moved.update(*arguments)
    with OpRecorder() as ours:
        built.update(*arguments)
    assert ours.ops == theirs.ops
    built.compute()
    with pytest.raises(ValueError, match="meta"):
        built.sync()


def test_set_default_device_meta_builds_on_meta_and_cpu_metrics_stay() -> None:
    cpu_child = MeanMetric()
    torch.set_default_device("meta")
    try:
        built = ComposeMetric({"loss": MeanMetric(), "total": SumMetric()})
        kept = ComposeMetric({"loss": cpu_child})  # the caller's CPU metric is not moved
        with torch.device("cpu"):
            on_cpu = SumMetric()
    finally:
        torch.set_default_device(None)
    assert {state.device.type for _, state in built.named_accumulators()} == {"meta"}
    assert cpu_child.device.type == kept.device.type == on_cpu.device.type == "cpu"
    cpu_child.update(torch.tensor([1.0, 3.0]))
    on_cpu.update(torch.tensor([2.0]))
    assert float(kept.compute()["loss"]) == 2.0
    assert float(on_cpu.compute()) == 2.0


@pytest.mark.parametrize("order", ["meta_first", "cpu_first"])
def test_a_tree_of_meta_and_cpu_metrics_built_under_meta_is_refused(order: str) -> None:
    # A metric built in the block is meta; the caller's CPU metric stays on the CPU. Joined,
    # the tree's arena spanned both and every metric reported the first state's device: the
    # CPU metric refused CPU updates ("on the metric's device meta"), or the meta one took
    # them and checkpointed meta tensors.
    cpu_child = MeanMetric()
    with torch.device("meta"):
        in_block = SumMetric()
        children: dict[str, Metric[Any]] = {"built": in_block, "mine": cpu_child}
        if order == "cpu_first":
            children = dict(reversed(children.items()))
        with pytest.raises(ValueError, match=r"meta \('built'.*on cpu \('mine'\)"):
            ComposeMetric(children)
    # Left as they were: each is still a metric of its own, on its own device.
    assert cpu_child.device.type == "cpu" and in_block.device.type == "meta"
    cpu_child.update(torch.tensor([1.0, 3.0]))
    assert float(cpu_child.compute()) == 2.0
    assert float(ComposeMetric({"mine": cpu_child}).compute()["mine"]) == 2.0


def _under_meta_default(rank_data: float) -> list[float]:
    # A CPU metric synced and checkpointed while the caller's default device is meta (a
    # `with torch.device(...)` block, torch.set_default_device): the structure check's buffer
    # and the checkpoint's configuration hash were made there ("Cannot copy out of meta tensor").
    from sidestream.metrics.classification import BinaryAUROCMetric

    mean = MeanMetric()
    mean.update(torch.tensor([rank_data, 2 * rank_data]))
    auroc = BinaryAUROCMetric(exact=True)
    auroc.update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]))
    with torch.device("meta"):
        mean.sync()
        state = auroc.state_dict()
    assert state["configuration"].device.type == "cpu"
    return [float(mean.compute()), float(auroc.compute())]


def test_cpu_metric_syncs_under_a_meta_default_device(dist_pool: RankPool) -> None:
    world = dist_pool.world_size
    results = dist_pool.run(_under_meta_default_for_rank)
    every = [value for rank in range(world) for value in (rank + 1.0, 2 * (rank + 1.0))]
    for mean, auroc in results:
        assert mean == pytest.approx(sum(every) / len(every), rel=1e-12)
        assert auroc == 1.0


def _under_meta_default_for_rank() -> list[float]:
    import torch.distributed as dist

    return _under_meta_default(dist.get_rank() + 1.0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_metric_loads_under_a_meta_default_device(name: str) -> None:
    # torch.as_tensor(saved) without device= moved each saved tensor to the default device:
    # every load was refused as "a meta tensor holds no values".
    factory, batch = CASES[name]
    saving = factory()
    saving.update(*batch(torch.Generator().manual_seed(3)))
    state = saving.state_dict()
    loading = factory()
    with torch.device("meta"):
        loading.load_state_dict(state)
    for ours, theirs in zip(
        tree_leaves(loading.compute()), tree_leaves(saving.compute()), strict=True
    ):
        assert ours.device.type == "cpu"
        assert torch.equal(ours, theirs) or torch.allclose(ours, theirs, equal_nan=True)


def test_python_numbers_load_under_a_meta_default_device() -> None:
    metric = SumMetric()
    with torch.device("meta"):
        metric.load_state_dict({"total": 2.5})
    assert float(metric.compute()) == 2.5


_NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("what", ["run_log", "sync_check"])
@_NEEDS_CUDA[0]
@_NEEDS_CUDA[1]
def test_pinned_host_copies_under_a_cuda_default_device(what: str, tmp_path: Path) -> None:
    # torch.empty(..., pin_memory=True) without device= takes the default device: under
    # torch.set_default_device("cuda") it raised "Only dense CPU tensors can be pinned", on
    # every run.log of a CUDA value and every CUDA sync's fingerprint check.
    from sidestream import Run
    from sidestream.sinks import JsonlSink, read_jsonl
    from sidestream.sync import _to_host

    torch.set_default_device("cuda")
    try:
        if what == "sync_check":
            host = _to_host(torch.arange(3, device="cuda"))
            torch.cuda.synchronize()
            assert host.device.type == "cpu" and host.is_pinned()
            assert host.tolist() == [0, 1, 2]
            return
        with Run([JsonlSink(tmp_path / "run.jsonl")]) as run:
            run.log(1, {"loss": torch.tensor(2.5, device="cuda")})
    finally:
        torch.set_default_device(None)
    assert [record["values"] for record in read_jsonl(tmp_path / "run.jsonl")] == [{"loss": 2.5}]


def test_metrics_are_made_after_the_default_device_is_set_back_to_none() -> None:
    # torch 2.8's get_default_device() raised AttributeError after set_default_device(None),
    # and every metric's __init__ asks it: no metric could be made for the rest of the process.
    torch.set_default_device("meta")
    torch.set_default_device(None)
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 3.0]))
    assert metric.compute().item() == 2.0
    assert metric.device == torch.device("cpu")
