"""compute() results to flat names and back to Python numbers."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from sidestream.collector import flatten_tree


class Pair(NamedTuple):
    low: torch.Tensor
    high: torch.Tensor


def test_nested_names_and_per_class_elements() -> None:
    tree = {
        "train": {"loss": torch.tensor(0.5), "acc": 0.25},
        "f1": torch.tensor([0.1, 0.2, 0.3, 0.4]),
        "cm": torch.arange(4).reshape(2, 2),
        "range": Pair(torch.tensor(1.0), torch.tensor(2.0)),
        "seq": [torch.tensor(3.0)],
    }
    flat = flatten_tree(tree)
    assert flat.paths == ("train/loss", "train/acc", "f1", "cm", "range/low", "range/high", "seq/0")
    assert flat.element_names("val") == [
        "val/train/loss",
        "val/train/acc",
        *[f"val/f1/class_{i}" for i in range(4)],
        "val/cm/0_0",
        "val/cm/0_1",
        "val/cm/1_0",
        "val/cm/1_1",
        "val/range/low",
        "val/range/high",
        "val/seq/0",
    ]
    rebuilt = flat.rebuild(
        [leaf.tolist() if torch.is_tensor(leaf) else leaf for leaf in flat.leaves]
    )
    assert rebuilt == {
        "train": {"loss": 0.5, "acc": 0.25},
        "f1": pytest.approx([0.1, 0.2, 0.3, 0.4]),
        "cm": [[0, 1], [2, 3]],
        "range": Pair(1.0, 2.0),  # type: ignore[arg-type]
        "seq": [3.0],
    }
    assert isinstance(rebuilt["cm"][0][0], int), "integer results stay integers"


def test_bare_tensor_takes_the_prefix_or_value() -> None:
    flat = flatten_tree(torch.tensor(1.0))
    assert flat.element_names() == ["value"]
    assert flat.element_names("loss") == ["loss"]


def test_unsupported_leaf_names_its_place() -> None:
    with pytest.raises(TypeError, match="'a/b'"):
        flatten_tree({"a": {"b": "text"}})
