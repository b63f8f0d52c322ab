"""A checkpoint that cannot load as saved is refused before any state changes, on every rank.

Through ``torch.distributed.checkpoint`` too, which converts each saved tensor into the dtype of
the metric it loads into: only the checkpoint's dtype record tells such a load.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sklearn.metrics import roc_auc_score

from sidestream import MaxMetric, MeanMetric, Metric, ReduceOp
from sidestream._samples import SavedRows
from sidestream.metric import DTYPES_KEY
from sidestream.metrics.classification import BinaryAUROCMetric
from sidestream.sync import CallFingerprint, RankMismatchError
from sidestream.testing import RankPool


class _Total(Metric[torch.Tensor]):
    def __init__(self, dtype: torch.dtype) -> None:
        self._total = self.add_state("total", torch.zeros((), dtype=dtype), op=ReduceOp.MAX)

    def update(self, values: torch.Tensor) -> None:
        self._total.accumulate(values.to(self._total.local.dtype).max())

    def compute(self) -> torch.Tensor:
        return self._total.value


@pytest.mark.parametrize(
    ("saved_dtype", "loaded_dtype", "value"),
    [
        (torch.int64, torch.int32, 2**33 + 5),  # DCP wrapped it to 5
        (torch.float64, torch.int64, 2.7),  # truncated to 2
        (torch.int64, torch.bool, 7),  # became True
        (torch.float64, torch.float16, 1e5),  # overflowed to inf
    ],
)
def test_dcp_refuses_a_checkpoint_of_another_dtype(
    tmp_path: Path, saved_dtype: torch.dtype, loaded_dtype: torch.dtype, value: float
) -> None:
    source = _Total(saved_dtype)
    source.update(torch.tensor([value], dtype=saved_dtype))
    dcp.save({"metric": source}, checkpoint_id=str(tmp_path))
    target = _Total(loaded_dtype)
    target.update(torch.ones(1, dtype=loaded_dtype))
    with pytest.raises(ValueError, match=rf"state_dict\['total'\]: expected dtype {loaded_dtype}"):
        dcp.load({"metric": target}, checkpoint_id=str(tmp_path))
    assert target.compute().item() == 1  # untouched


def test_dcp_refuses_a_state_of_another_dtype_and_loads_a_narrower_one(tmp_path: Path) -> None:
    values = torch.full((1000,), 100.0, dtype=torch.float64)
    source = MaxMetric()  # a float64 state: an extremum keeps its dtype
    source.update(values)
    dcp.save({"metric": source}, checkpoint_id=str(tmp_path / "wide"))
    with pytest.raises(ValueError, match=r"'max'.*saved as torch.float64"):
        dcp.load({"metric": MaxMetric(dtype=torch.float32)}, checkpoint_id=str(tmp_path / "wide"))
    narrow = MaxMetric(dtype=torch.float32)
    narrow.update(values.float())
    dcp.save({"metric": narrow}, checkpoint_id=str(tmp_path / "narrow"))
    wide = MaxMetric()
    dcp.load({"metric": wide}, checkpoint_id=str(tmp_path / "narrow"))  # widens exactly
    assert wide.compute().item() == 100.0


def test_dcp_loads_a_mean_into_any_dtype(tmp_path: Path) -> None:
    # A mean's sums are float64 whatever its dtype (a float16 sum overflowed past 65504, a
    # float32 one past 3.4e38): a checkpoint of one loads into another exactly.
    values = torch.full((1000,), 100.0, dtype=torch.float64)
    source = MeanMetric()
    source.update(values)
    dcp.save({"metric": source}, checkpoint_id=str(tmp_path / "wide"))
    for dtype in (torch.float16, torch.float32):
        loaded = MeanMetric(dtype=dtype)
        dcp.load({"metric": loaded}, checkpoint_id=str(tmp_path / "wide"))
        assert loaded.compute().item() == 100.0
        assert loaded.compute().dtype == dtype


def test_dcp_refuses_a_checkpoint_holding_states_the_metric_lacks(tmp_path: Path) -> None:
    # DCP loads only the keys the loading metric has: a MeanMetric's checkpoint went into a
    # SumMetric (its count dropped), a 3-child composition's into a 2-child one, silently.
    from sidestream import ComposeMetric, SumMetric

    mean = MeanMetric()
    mean.update(torch.tensor([1.0, 3.0]))
    dcp.save({"metric": mean}, checkpoint_id=str(tmp_path / "mean"))
    target = SumMetric()
    target.update(torch.tensor([5.0]))
    with pytest.raises(KeyError, match=r"holds states \['count'\] that this SumMetric lacks"):
        dcp.load({"metric": target}, checkpoint_id=str(tmp_path / "mean"))
    assert target.compute().item() == 5.0  # untouched
    three = ComposeMetric({name: SumMetric() for name in "abc"})
    dcp.save({"metric": three}, checkpoint_id=str(tmp_path / "three"))
    two = ComposeMetric({name: SumMetric() for name in "ab"})
    with pytest.raises(KeyError, match=r"\['c.total'\] that this ComposeMetric lacks"):
        dcp.load({"metric": two}, checkpoint_id=str(tmp_path / "three"))
    same = MeanMetric()
    dcp.load({"metric": same}, checkpoint_id=str(tmp_path / "mean"))  # the same metric loads
    assert same.compute().item() == 2.0


def test_a_checkpoint_without_the_record_still_loads() -> None:
    source = _Total(torch.int64)
    source.update(torch.tensor([3]))
    older = {key: value for key, value in source.state_dict().items() if key != DTYPES_KEY}
    target = _Total(torch.int64)
    target.load_state_dict(older)
    assert target.compute().item() == 3


def test_a_python_float_past_a_states_range_is_refused() -> None:
    metric = _Total(torch.float16)
    with pytest.raises(
        ValueError,
        match=r"'total'\]: 10000000000.0 is past the range of this state's torch.float16",
    ):
        metric.load_state_dict({"total": 1e10})
    metric.load_state_dict({"total": 2.5})
    assert metric.compute().item() == 2.5


@pytest.mark.parametrize("cut", ["scores", "labels"])
def test_exact_rows_of_different_lengths_are_refused(cut: str) -> None:
    scores, labels = [0.1, 0.9, 0.4, 0.8], [0, 1, 1, 0]
    source = BinaryAUROCMetric(exact=True)
    source.update(torch.tensor(scores), torch.tensor(labels))
    saved = source.state_dict()
    saved[cut] = SavedRows(saved[cut].rows[:2])
    target = BinaryAUROCMetric(exact=True)
    target.update(torch.tensor(scores), torch.tensor(labels))
    with pytest.raises(ValueError, match=r"one row per sample.*'scores': \d, 'labels': \d"):
        target.load_state_dict(saved)
    assert target.compute().item() == pytest.approx(roc_auc_score(labels, scores))


def _load_bad_rows_then_sync() -> tuple[str, float]:
    metric = BinaryAUROCMetric(exact=True)
    scores = [0.2 + 0.1 * dist.get_rank(), 0.7]
    metric.update(torch.tensor(scores), torch.tensor([0, 1]))
    saved = {
        "rejected": torch.tensor(0),
        "configuration": metric.state_dict()["configuration"],
        "scores": SavedRows(torch.zeros(3, 1, dtype=torch.float32)),  # float64 rows expected
        "labels": SavedRows(torch.zeros(3, 1, dtype=torch.int8)),
    }
    try:
        metric.load_state_dict(saved)
        refused = "accepted"
    except ValueError as error:
        refused = str(error)
    metric.sync()  # the calls still pair: every rank refused the load
    return refused, float(metric.compute())


def test_every_rank_refuses_rows_that_do_not_load(dist_pool: RankPool) -> None:
    results = dist_pool.run(_load_bad_rows_then_sync)
    n = dist_pool.world_size
    scores = [value for rank in range(n) for value in (0.2 + 0.1 * rank, 0.7)]
    expected = roc_auc_score([0, 1] * n, scores)
    for refused, value in results:
        assert "expected dtype torch.float64, got torch.float32" in refused
        assert value == pytest.approx(expected)


def _load_then(how: str, same: bool) -> str:
    # Each rank reads a checkpoint file of its own (written by hand: state_dict is collective).
    total = 10.0 if same or dist.get_rank() == 0 else 20.0
    metric = MeanMetric()
    metric.load_state_dict(
        {"total": torch.tensor(total, dtype=torch.float64), "count": torch.tensor(1.0).double()}
    )
    try:
        if how == "sync":
            metric.sync()
        elif how == "sync at step":
            metric.sync(step=5)
        else:
            metric.state_dict()
    except RankMismatchError as error:
        return str(error)
    metric.sync()  # and the next call is a plain one again
    return f"value {float(metric.compute())}"


@pytest.mark.parametrize("how", ["sync", "sync at step", "state_dict"])
def test_ranks_that_loaded_different_checkpoints_raise(dist_pool: RankPool, how: str) -> None:
    # Each rank went on with rank 0's numbers: 10.0 on both, one checkpoint of 20.0 dropped.
    for outcome in dist_pool.run(_load_then, how, False):
        assert "paired different calls" in outcome, outcome
        if how != "sync at step":
            assert "the ranks loaded different checkpoints" in outcome, outcome
    assert dist_pool.run(_load_then, how, True) == ["value 10.0"] * dist_pool.world_size


def _load_then_bind_or_reset(how: str) -> str:
    from sidestream.collector import AsyncMetricCollector

    total = 20.0 if dist.get_rank() == 0 else 120.0
    metric = MeanMetric()
    metric.load_state_dict(
        {"total": torch.tensor(total, dtype=torch.float64), "count": torch.tensor(2.0).double()}
    )
    if how == "reset":  # the loaded state is dropped: nothing left to compare
        metric.reset()
        metric.update(torch.tensor([1.0 + dist.get_rank()]))
        metric.sync()
        return f"value {float(metric.compute())}"
    try:
        if how == "bind":
            AsyncMetricCollector(metric).bind("cpu").close(timeout=30)
        else:
            metric.start_sync(None, CallFingerprint("sync", 1)).wait()
    except RankMismatchError as error:
        return str(error)
    return "no error"


def test_different_checkpoints_are_caught_at_bind_and_start_sync_and_dropped_by_reset(
    dist_pool: RankPool,
) -> None:
    # Windows of a collector bound after such loads reported rank 0's numbers ([5.5, 1.0] on
    # both ranks); start_sync sent no digest; after reset() the stale digest raised anyway.
    for outcome in dist_pool.run(_load_then_bind_or_reset, "bind"):
        assert "hold different checkpoint loads" in outcome, outcome
    for outcome in dist_pool.run(_load_then_bind_or_reset, "start_sync"):
        assert "the ranks loaded different checkpoints" in outcome, outcome
    n = dist_pool.world_size
    expected = sum(1.0 + rank for rank in range(n)) / n
    assert dist_pool.run(_load_then_bind_or_reset, "reset") == [f"value {expected}"] * n


class _Renamed(_Total):
    """``_Total`` whose state was ``old`` in an older layout (renamed on load, as
    ``ConfusionCountMetric`` stacks ``tp``/``fp``/``fn``/``tn`` into ``counts``)."""

    def _upgrade_state_dict(self, prefix: str, state_dict: dict[str, object]) -> None:
        if prefix + "old" in state_dict and prefix + "total" not in state_dict:
            state_dict[prefix + "total"] = state_dict.pop(prefix + "old")


def test_a_record_naming_the_states_of_an_older_layout_loads() -> None:
    # The record of a checkpoint of the older layout names its states: renamed by
    # _upgrade_state_dict, they are not states the checkpoint holds and the metric lacks.
    saved = {"old": torch.tensor(7, dtype=torch.int64), DTYPES_KEY: '{"old": "int64"}'}
    metric = _Renamed(torch.int64)
    metric.load_state_dict(saved)
    assert metric.compute().item() == 7
    # A record naming a state the dict given lacks (DCP left it out) is still refused.
    with pytest.raises(KeyError, match=r"holds states \['gone'\] that this _Renamed lacks"):
        _Renamed(torch.int64).load_state_dict(
            {"total": torch.tensor(7), DTYPES_KEY: '{"total": "int64", "gone": "int64"}'}
        )


def test_a_child_added_or_removed_since_the_checkpoint_says_how_to_go_on() -> None:
    # Before: only the keys, and no way forward for a script edited between checkpoint and
    # resume. The hint's own recipe must work.
    from sidestream.metrics import ComposeMetric, MeanMetric, SumMetric

    saved = ComposeMetric({"loss": MeanMetric(), "n": SumMetric()}).to("cpu")
    saved["loss"].update(torch.tensor([3.0, 5.0]))
    state = saved.state_dict()
    for children in (
        {"loss": MeanMetric(), "n": SumMetric(), "new": MeanMetric()},
        {"loss": MeanMetric()},
    ):
        metric = ComposeMetric(children).to("cpu")
        with pytest.raises(KeyError, match=r"load the children both have one by one") as error:
            metric.load_state_dict(state)
        assert "['new'] are not in the checkpoint" in str(error.value) or "holds child" in str(
            error.value
        )
        metric["loss"].load_state_dict(
            {k.removeprefix("loss."): v for k, v in state.items() if k.startswith("loss.")}
        )
        assert metric.compute()["loss"].item() == 4.0
    # A child whose states changed (another kind under the same name) is not "added".
    other = ComposeMetric({"loss": MeanMetric(), "n": MeanMetric()}).to("cpu")
    with pytest.raises(KeyError) as error:
        other.load_state_dict(state)
    assert "one by one" not in str(error.value)
