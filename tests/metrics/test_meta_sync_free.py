"""Every built-in update on the meta device: the CUDA path, where no value can be read.

The ``gpu`` tests prove that updates do not sync with the host under
``torch.cuda.set_sync_debug_mode("error")``, but only where a GPU is lent. The meta device takes
the same device path (``checks_stay_on_device``: checks count and drop, nothing raises on a
value) and holds no data, so any host read fails there: ``.item()``, ``bool(t)``, a copy to the
CPU. The ops that read values to size their output (``nonzero``, boolean masks, ``bincount``,
``unique``) are caught by name as they are dispatched. This runs in CI on every commit, so a
host read slipped into a device path fails here long before a GPU session sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sidestream import MaxMetric, MeanMetric, MinMetric, SumMetric, WeightedMeanMetric
from tests.metrics.confusion_cases import bad_batch, device_metrics, make_shards, to_torch
from tests.metrics.device_cases import device_cases
from tests.metrics.test_compiled_updates import CASES as EVERY_METRIC

META = torch.device("meta")

# The aten ops whose output size or result depends on values: each syncs CUDA with the host.
HOST_READS = frozenset(
    {
        "_local_scalar_dense",  # .item(), float(t), bool(t), int(t)
        "is_nonzero",
        "nonzero",
        "nonzero_static",
        "masked_select",
        "bincount",
        "histc",
        "unique",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "equal",
        "allclose",
        "repeat_interleave",
    }
)


# Indexing by a bool mask finds the set elements (nonzero) inside the op: no op of its own.
_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def _masks(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
        for index in indices
    )


class _HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Fails at the first dispatched op of ``HOST_READS``, naming it (before meta runs it)."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = func.__name__.split(".")[0]
        if name in HOST_READS or (name in _INDEXING and _masks(args)):
            raise AssertionError(f"an op that reads values on the host: {name}")
        return func(*args, **(kwargs or {}))


def _on_meta(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(META) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _assert_no_host_read(update: Callable[[], object]) -> None:
    with _HostReads():
        update()


def test_the_detector_sees_a_host_read() -> None:
    # The test below cannot pass by seeing nothing: each kind of read is caught on meta.
    flags = torch.ones(4, dtype=torch.bool, device=META)
    reads: list[Callable[[], object]] = [
        lambda: flags.nonzero(),
        lambda: torch.bincount(flags.long()),
        lambda: bool(flags.any()),
        lambda: flags.sum().item(),
        lambda: torch.ones(4, device=META)[flags],
    ]
    for read in reads:
        with pytest.raises(AssertionError, match="reads values on the host"):
            _assert_no_host_read(read)


@pytest.mark.parametrize("case", device_cases(), ids=lambda case: case[0])
def test_ranking_regression_and_language_updates_read_nothing_on_the_host(
    case: tuple[str, Callable[[], Any], dict[str, Any], dict[str, Any]],
) -> None:
    _, factory, ok, bad = case
    metric = factory().to(META)
    ok, bad = _on_meta(ok), _on_meta(bad)

    def updates() -> None:
        metric.update(**ok)
        metric.update(**bad)  # dropped on the device and counted, not raised
        metric.update(**ok)
        metric.reset()  # the collector resets on the training thread too
        metric.update(**ok)

    _assert_no_host_read(updates)


@pytest.mark.parametrize("index", range(len(device_metrics())))
def test_confusion_updates_read_nothing_on_the_host(index: int) -> None:
    case, metric = device_metrics()[index]
    metric.to(META)
    batches = [to_torch(case, b) for shard in make_shards(case, 5, 1) for b in shard]
    bad = bad_batch(case)

    def updates() -> None:
        for preds, target in batches:
            metric.update(preds.to(META), target.to(META))
        if bad is not None:
            metric.update(bad[0].to(META), bad[1].to(META))
        metric.reset()

    _assert_no_host_read(updates)


@pytest.mark.parametrize("factory", [SumMetric, MeanMetric, MaxMetric, MinMetric])
def test_aggregation_updates_read_nothing_on_the_host(factory: Callable[[], Any]) -> None:
    metric = factory().to(META)
    values = torch.randn(64).to(META)

    def updates() -> None:
        metric.update(values)
        metric.update(values[0])
        metric.update(2.5)  # a Python number is not copied from the host either
        metric.reset()

    _assert_no_host_read(updates)


def test_weighted_mean_updates_read_nothing_on_the_host() -> None:
    metric = WeightedMeanMetric().to(META)
    values = torch.randn(64).to(META)
    weights = torch.randint(0, 10, (64,)).to(META)

    def updates() -> None:
        metric.update(values=values, weights=weights)
        metric.update(values=values, weights=-weights)  # dropped on the device and counted
        metric.update(values=values)
        metric.update(values=values, weights=3)
        metric.update(values=1.5, weights=0.5)
        metric.reset()

    _assert_no_host_read(updates)


@pytest.mark.parametrize("name", sorted(EVERY_METRIC))
def test_every_built_in_update_reads_nothing_on_the_host(name: str) -> None:
    # The compile tests' catalogue: one configuration of every built-in metric.
    factory, batch = EVERY_METRIC[name]
    metric = factory().to(META)
    generator = torch.Generator().manual_seed(5)
    inputs = [
        tuple(v.to(META) if isinstance(v, torch.Tensor) else v for v in batch(generator))
        for _ in range(2)
    ]

    def updates() -> None:
        metric.update(*inputs[0])
        metric.reset()
        metric.update(*inputs[1])

    _assert_no_host_read(updates)
