"""A metric, collector or run nested in the dict given to torch.distributed.checkpoint.

DCP calls ``state_dict()`` / ``load_state_dict()`` only on that dict's top-level values and
pickles the rest whole. A nested metric was pickled with its rank's local state, one rank's
copy kept: a 4-rank save loaded on 4 ranks gave rank 0's data counted four times, with no
error. Such objects now refuse DCP's pickling (and unpickling), naming the fix.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import sidestream.metric
from sidestream import MeanMetric, Run
from sidestream.collector import AsyncMetricCollector
from sidestream.metrics.classification import BinaryAUROCMetric
from tests.conftest import Pools


def _raises_nested(call: object) -> str:
    # CheckpointException derives from BaseException, not Exception.
    with pytest.raises(BaseException, match="nested in the dict given to dcp") as caught:
        call()  # type: ignore[operator]
    return str(caught.value)


def test_a_nested_metric_refuses_dcp_save(tmp_path: Path) -> None:
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    message = _raises_nested(
        lambda: dcp.save({"app": {"metrics": {"loss": metric}}}, checkpoint_id=tmp_path / "c")
    )
    assert "top level" in message
    metric.update(torch.tensor([3.0]))  # the metric is untouched and still works
    assert float(metric.compute()) == 2.0


def test_a_nested_metric_refuses_dcp_async_save(tmp_path: Path) -> None:
    metric = BinaryAUROCMetric(exact=True)
    metric.update(torch.tensor([0.2, 0.8]), torch.tensor([0, 1]))
    future = dcp.async_save({"app": {"auroc": metric}}, checkpoint_id=tmp_path / "c")
    _raises_nested(future.result)


def test_a_checkpoint_holding_a_pickled_metric_refuses_to_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One written before the check (simulated by turning it off for the save)."""
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    with monkeypatch.context() as patch:
        patch.setattr(sidestream.metric, "refuse_dcp_pickle", lambda *_: None)
        dcp.save({"app": {"loss": metric}}, checkpoint_id=tmp_path / "c")
    _raises_nested(lambda: dcp.load({"app": {"loss": MeanMetric()}}, checkpoint_id=tmp_path / "c"))


def test_top_level_metrics_still_save_and_load(tmp_path: Path) -> None:
    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    dcp.save({"loss": metric, "model": {"w": torch.ones(2)}}, checkpoint_id=tmp_path / "c")
    loaded = MeanMetric()
    dcp.load({"loss": loaded, "model": {"w": torch.zeros(2)}}, checkpoint_id=tmp_path / "c")
    assert float(loaded.compute()) == 1.5


def test_a_nested_run_or_collector_says_how_to_checkpoint_it(tmp_path: Path) -> None:
    run = Run([])
    collector = AsyncMetricCollector(MeanMetric())
    try:
        for key, value in (("run", run), ("collector", collector)):
            message = _raises_nested(
                lambda key=key, value=value: dcp.save(
                    {"app": {key: value}}, checkpoint_id=tmp_path / key
                )
            )
            assert type(value).__name__ in message
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            pickle.dumps(run)
        # A LightningModule holding one, pickled by ddp_spawn: says where to make it instead.
        with pytest.raises(TypeError, match=r"ddp_spawn .*make it in that process"):
            pickle.dumps(collector)
    finally:
        run.close()
        collector.close()


def _nested_save_on_every_rank(path: str) -> str:
    metric = MeanMetric()
    metric.update(torch.full((3,), float(dist.get_rank())))
    try:
        dcp.save({"app": {"loss": metric}}, checkpoint_id=path)
    except BaseException as error:
        return "refused" if "nested in the dict given to dcp" in str(error) else repr(error)
    loaded = MeanMetric()
    holder = {"app": {"loss": loaded}}
    dcp.load(holder, checkpoint_id=path)
    result = holder["app"]["loss"]
    result.sync()
    return f"loaded {float(result.compute())}"


def test_a_nested_metric_is_refused_on_every_rank(pools: Pools, tmp_path: Path) -> None:
    """Before: saved rank 0's local state only, and loading counted it on every rank."""
    results = pools.get(2).run(_nested_save_on_every_rank, os.fspath(tmp_path / "c"), timeout=120)
    assert results == ["refused", "refused"]
