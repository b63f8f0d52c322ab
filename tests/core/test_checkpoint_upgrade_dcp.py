"""A ``torch.distributed.checkpoint`` checkpoint of an earlier sidestream, loaded with
``allow_partial_load=True`` (as the docs say for checkpoints saved before a key existed).

DCP loads only the keys the loading metric's ``state_dict()`` has and, partially, leaves the
others at that template's values: a state the checkpoint lacks must not load as the metric's own
numbers. The older ``ConfusionCountMetric`` layout (four ``tp``/``fp``/``fn``/``tn`` vectors,
before the ``(4, C)`` ``counts`` table) is written here as the earlier version's
``state_dict()`` held it: DCP flattens a Stateful's state dict, so the checkpoint's keys are the
same ones (``f1.tp``, ... ``f1.rejected``) as in one saved by that version's metric.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from sklearn.metrics import f1_score
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from sidestream import ComposeMetric, MeanMetric
from sidestream.metric import DTYPES_KEY
from sidestream.metrics.classification import confusion_count_metric


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    preds = torch.rand(200, generator=generator)
    target = (torch.rand(200, generator=generator) < 0.4).long()
    return preds, target


def _older_layout(preds: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """The binary counts as the four-vector layout saved them (one class)."""
    p = preds > 0.5
    t = target == 1
    rows = {"tp": p & t, "fp": p & ~t, "fn": ~p & t, "tn": ~p & ~t}
    saved = {name: row.sum().reshape(1) for name, row in rows.items()}
    saved["rejected"] = torch.tensor(0)
    return saved


def _partial() -> DefaultLoadPlanner:
    return DefaultLoadPlanner(allow_partial_load=True)


def test_an_older_layout_left_out_by_a_partial_dcp_load_is_refused(tmp_path: Path) -> None:
    preds, target = _data()
    dcp.save({"f1": _older_layout(preds, target)}, checkpoint_id=tmp_path / "ckpt")
    metric = confusion_count_metric().binary().with_f1().build()
    metric.update(preds[:50], target[:50])
    before = metric.compute()
    # It loaded the fresh template's counts as saved: F1 0.0 (sklearn: 0.414), no error.
    message = r"\['counts'\] are not in the checkpoint.*dcp_to_torch_save"
    with pytest.raises(KeyError, match=message):
        dcp.load({"f1": metric}, checkpoint_id=tmp_path / "ckpt", planner=_partial())
    assert torch.equal(metric.compute(), before)  # refused before any state changed


def test_an_older_layout_in_a_composition_is_refused_naming_its_key(tmp_path: Path) -> None:
    preds, target = _data()
    saved = {f"f1.{key}": value for key, value in _older_layout(preds, target).items()}
    saved |= {"loss.total": torch.tensor(3.0, dtype=torch.float64)}
    saved |= {"loss.count": torch.tensor(2.0, dtype=torch.float64)}
    dcp.save({"metrics": saved}, checkpoint_id=tmp_path / "ckpt")
    metrics = ComposeMetric(
        {"loss": MeanMetric(), "f1": confusion_count_metric().binary().with_f1().build()}
    )
    with pytest.raises(KeyError, match=r"\['f1.counts'\] are not in the checkpoint"):
        dcp.load({"metrics": metrics}, checkpoint_id=tmp_path / "ckpt", planner=_partial())


def test_the_converted_older_checkpoint_loads_with_the_saved_numbers(tmp_path: Path) -> None:
    # What the error says to do: the plain state dict goes through _upgrade_state_dict.
    preds, target = _data()
    dcp.save({"f1": _older_layout(preds, target)}, checkpoint_id=tmp_path / "ckpt")
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "ckpt.pt")
    metric = confusion_count_metric().binary().with_f1().build()
    metric.load_state_dict(torch.load(tmp_path / "ckpt.pt")["f1"])
    expected = f1_score(target.numpy(), (preds > 0.5).numpy())
    assert metric.compute().item() == pytest.approx(expected, abs=1e-12)


def test_a_partial_load_without_the_newer_keys_still_loads(tmp_path: Path) -> None:
    # A checkpoint saved after counts but before the configuration hash and the dtype record:
    # the keys it lacks are left out, its states load.
    preds, target = _data()
    source = confusion_count_metric().binary().with_f1().build()
    source.update(preds, target)
    saved = {
        key: value
        for key, value in source.state_dict().items()
        if key not in ("configuration", DTYPES_KEY)
    }
    dcp.save({"f1": saved}, checkpoint_id=tmp_path / "ckpt")
    metric = confusion_count_metric().binary().with_f1().build()
    dcp.load({"f1": metric}, checkpoint_id=tmp_path / "ckpt", planner=_partial())
    expected = f1_score(target.numpy(), (preds > 0.5).numpy())
    assert metric.compute().item() == pytest.approx(expected, abs=1e-12)


def test_a_metric_saved_by_dcp_still_pickles_and_copies(tmp_path: Path) -> None:
    # The partial-load check keeps weak references to DCP's template in the metric: a pickle
    # (torch.save of the object, a DataLoader worker) after a dcp.save raised "cannot pickle
    # 'weakref.ReferenceType' object".
    import copy
    import pickle

    import torch.distributed.checkpoint as dcp

    from sidestream import MeanMetric

    metric = MeanMetric()
    metric.update(torch.tensor([1.0, 2.0]))
    dcp.save({"metric": metric}, checkpoint_id=tmp_path / "c")
    for again in (pickle.loads(pickle.dumps(metric)), copy.deepcopy(metric)):
        again.update(torch.tensor([3.0]))
        assert float(again.compute()) == 2.0
    assert float(metric.compute()) == 1.5


def test_a_child_added_to_a_composition_since_starts_fresh_under_a_partial_load(
    tmp_path: Path,
) -> None:
    # A metric the checkpoint has no key of is not in it at all: it keeps its own values, as
    # such a partial load always did; the children the checkpoint has load their numbers.
    saved = ComposeMetric({"loss": MeanMetric()})
    saved["loss"].update(torch.tensor([1.0, 3.0]))
    dcp.save({"metrics": saved}, checkpoint_id=tmp_path / "ckpt")
    grown = ComposeMetric({"loss": MeanMetric(), "extra": MeanMetric()})
    dcp.load({"metrics": grown}, checkpoint_id=tmp_path / "ckpt", planner=_partial())
    grown["extra"].update(torch.tensor([5.0]))
    result = grown.compute()
    assert float(result["loss"]) == 2.0
    assert float(result["extra"]) == 5.0
