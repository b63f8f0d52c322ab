"""Every built-in metric under ``torch.use_deterministic_algorithms(True)``.

On CUDA torch refuses some ops in deterministic mode (``RuntimeError``, or a warning with
``warn_only=True``): a floating-point ``cumsum``, ``bincount`` with weights, ``histc``, ``put_``
and others (the list in ``torch.use_deterministic_algorithms``' docs). Where a GPU is lent, the
``gpu`` test runs every update and ``compute`` on CUDA in deterministic mode. Everywhere else
the meta device stands in: it takes the same device path as CUDA, and the ops it dispatches are
checked against that list by name, so a refused op slipped into a device path or a ``compute``
fails on every commit, long before a GPU session sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sidestream import ComposeMetric
from sidestream.collector import AsyncMetricCollector
from sidestream.metrics.classification import BinaryAUROCMetric, MulticlassAveragePrecisionMetric
from tests.collector.helpers import RecordingSink
from tests.metrics.device_cases import device_cases
from tests.metrics.test_compiled_updates import CASES as EVERY_METRIC

META = torch.device("meta")


def _refused_on_cuda(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether CUDA raises for this forward op under ``torch.use_deterministic_algorithms(True)``.

    The forward ops of torch's documented list (``torch.use_deterministic_algorithms``), with
    the conditions aten checks before ``alertNotDeterministic``.
    """
    first = args[0] if args else None
    if name in ("cumsum", "cumsum_"):  # cumsum_cuda_kernel: floating point or complex
        return isinstance(first, torch.Tensor) and (first.is_floating_point() or first.is_complex())
    if name == "bincount":  # _bincount_cuda: with weights
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        return weights is not None
    if name in ("median", "nanmedian"):  # the overloads with indices (a dim)
        return len(args) > 1 or "dim" in kwargs
    if name in ("scatter_reduce", "scatter_reduce_"):
        return (args[4] if len(args) > 4 else kwargs.get("reduce")) == "prod"
    if name in ("nll_loss2d", "nll_loss2d_forward"):  # sum or mean reductions
        return (args[3] if len(args) > 3 else kwargs.get("reduction", 1)) != 0
    return name in ("histc", "put", "put_", "max_unpool2d", "max_unpool3d")


class _CudaRefuses(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Fails at the first dispatched op CUDA refuses in deterministic mode, naming it."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = func.__name__.split(".")[0]
        if _refused_on_cuda(name, args, kwargs or {}):
            raise AssertionError(f"CUDA refuses this op in deterministic mode: {func.__name__}")
        return func(*args, **(kwargs or {}))


def _on_meta(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(META) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.fixture
def deterministic() -> Iterator[None]:
    """Deterministic mode for one test (torch's global setting, restored after)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def test_the_detector_sees_what_cuda_refuses() -> None:
    # The tests below cannot pass by seeing nothing; and what CUDA runs deterministically (the
    # integer cumsum, index_add_ and scatter_add_ of the counts) passes.
    floats = torch.ones(4, device=META)
    index = torch.zeros(4, dtype=torch.int64, device=META)
    refused: list[Callable[[], object]] = [
        lambda: floats.cumsum(0),
        lambda: torch.cumsum(floats.double(), 0),
        lambda: torch.bincount(index, weights=floats),
        lambda: torch.histc(floats),
        lambda: floats.median(0),
        lambda: floats.clone().put_(index, floats),
        lambda: floats.clone().scatter_reduce(0, index, floats, "prod"),
    ]
    for call in refused:
        with pytest.raises(AssertionError, match="refuses this op"), _CudaRefuses():
            call()
    with _CudaRefuses():
        index.cumsum(0)
        floats.clone().index_add_(0, index, floats)
        floats.clone().scatter_add_(0, index, floats)
        floats.median()  # no indices: deterministic


@pytest.mark.parametrize("case", device_cases(), ids=lambda case: case[0])
def test_device_path_updates_and_compute_use_no_op_cuda_refuses(
    case: tuple[str, Callable[[], Any], dict[str, Any], dict[str, Any]],
) -> None:
    _, factory, ok, bad = case
    metric = factory().to(META)
    with _CudaRefuses():
        metric.update(**_on_meta(ok))
        metric.update(**_on_meta(bad))  # dropped on the device and counted
        metric.compute()


@pytest.mark.parametrize("name", sorted(EVERY_METRIC))
def test_every_built_in_metric_uses_no_op_cuda_refuses(name: str) -> None:
    factory, batch = EVERY_METRIC[name]
    metric = factory().to(META)
    generator = torch.Generator().manual_seed(5)
    inputs = tuple(v.to(META) if isinstance(v, torch.Tensor) else v for v in batch(generator))
    with _CudaRefuses():
        metric.update(*inputs)
        metric.compute()


@pytest.mark.parametrize("exact", [False, True], ids=["binned", "exact"])
def test_ranking_values_are_the_same_in_deterministic_mode(
    exact: bool, deterministic: None
) -> None:
    # The running totals are int64 now: the same numbers, bit for bit, as float64 ones.
    g = torch.Generator().manual_seed(3)
    scores = torch.softmax(torch.randn(500, 4, generator=g), 1)
    scores[:100] = torch.round(scores[:100] * 10) / 10  # ties
    target = torch.randint(0, 4, (500,), generator=g)

    def values() -> list[torch.Tensor]:
        made = [
            BinaryAUROCMetric(exact=exact),
            BinaryAUROCMetric(exact=exact, max_fpr=0.3),
            MulticlassAveragePrecisionMetric(4, exact=exact, average="none"),
        ]
        for metric in made[:2]:
            metric.update(scores[:, 0], (target == 0).long())
        made[2].update(scores, target)
        return [metric.compute() for metric in made]

    on = values()
    torch.use_deterministic_algorithms(False)
    off = values()
    for got, expected in zip(on, off, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("case", device_cases(), ids=lambda case: case[0])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_updates_and_compute_in_deterministic_mode(
    case: tuple[str, Callable[[], Any], dict[str, Any], dict[str, Any]], deterministic: None
) -> None:
    name, factory, ok, bad = case
    metric = factory().to("cuda")
    ok_cuda = {k: v.cuda() for k, v in ok.items()}
    bad_cuda = {k: v.cuda() for k, v in bad.items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the deterministic routes add no host sync
    try:
        metric.update(**ok_cuda)
        metric.update(**bad_cuda)
        metric.update(**ok_cuda)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    value = metric.compute()
    reference = factory()
    reference.update(**ok)
    reference.update(**ok)
    expected = reference.compute()
    assert metric.rejected_updates.item() == 1, name
    assert torch.allclose(value.cpu(), expected, rtol=1e-6, atol=1e-9, equal_nan=True), name


@pytest.mark.parametrize("name", sorted(EVERY_METRIC))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_built_in_metric_on_cuda_in_deterministic_mode(
    name: str, deterministic: None
) -> None:
    factory, batch = EVERY_METRIC[name]
    metric, reference = factory().to("cuda"), factory()
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        inputs = batch(generator)
        reference.update(*inputs)
        metric.update(*(v.cuda() if isinstance(v, torch.Tensor) else v for v in inputs))
    got, expected = metric.compute(), reference.compute()
    for a, b in zip(tree_leaves(got), tree_leaves(expected), strict=True):
        assert torch.allclose(a.cpu().double(), b.double(), rtol=1e-6, equal_nan=True), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_collector_windows_in_deterministic_mode(deterministic: None) -> None:
    # compute() runs on the collector's side stream: a refused op there failed every window.
    def metric() -> ComposeMetric:
        return ComposeMetric(
            {
                "auroc": BinaryAUROCMetric(),
                "exact_auroc": BinaryAUROCMetric(exact=True),
                "ap": MulticlassAveragePrecisionMetric(3),
            }
        )

    g = torch.Generator().manual_seed(9)
    batches = [
        (torch.rand(256, generator=g), torch.randint(0, 2, (256,), generator=g)) for _ in range(4)
    ]
    reports = []
    for device in ("cuda", "cpu"):
        tree = metric()
        sink = RecordingSink()
        collector = AsyncMetricCollector(tree, sinks=[sink]).bind(device)
        for step, (scores, labels) in enumerate(batches, start=1):
            scores, labels = scores.to(device), labels.to(device)
            tree["auroc"].update(scores, labels)
            tree["exact_auroc"].update(scores, labels)
            three = torch.stack((1 - scores, scores / 2, scores / 2), 1)
            tree["ap"].update(three, labels)
            collector.schedule_collection(step)
        assert collector.close(timeout=60)
        reports.append(sink.reports)
    on_gpu, on_cpu = reports
    assert [r.step for r in on_gpu] == [1, 2, 3, 4]
    for gpu_report, cpu_report in zip(on_gpu, on_cpu, strict=True):
        assert gpu_report.values == pytest.approx(cpu_report.values, rel=1e-9)
