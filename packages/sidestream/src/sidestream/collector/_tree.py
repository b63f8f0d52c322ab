"""A ``compute()`` result (a tensor or a pytree of tensors) to flat names and Python numbers."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from sidestream._text import check_encodable

__all__ = ["FlatTree", "flatten_tree"]


@dataclass(frozen=True)
class _Node:
    """How to rebuild one level of the tree: a mapping, a sequence, or a leaf (``kind``)."""

    kind: str  # "leaf", "dict", "list", "tuple", "namedtuple"
    keys: tuple[Any, ...] = ()
    children: tuple[_Node, ...] = ()
    rebuild_type: type | None = None


@dataclass(frozen=True)
class FlatTree:
    """The leaves of a result tree, their flat names, and how to rebuild the tree.

    Attributes:
        leaves: Tensors (or Python numbers) in depth-first order (mappings in insertion order).
        paths: One name per leaf: the path of keys joined with ``/`` (``"val/f1"``).
        spec: The structure, for ``rebuild``.
    """

    leaves: tuple[Any, ...]
    paths: tuple[str, ...]
    spec: _Node

    def element_names(self, prefix: str = "") -> list[str]:
        """One flat name per element of every leaf, in ``reshape(-1)`` order.

        A scalar leaf is named by its path; a vector's elements are ``path/class_i``; higher
        dimensional leaves get ``path/i_j``. ``prefix`` goes in front (``"train"`` gives
        ``"train/loss"``); a bare tensor result is named ``prefix`` or ``"value"``.

        Raises:
            ValueError: If two values would get the same name, or a name cannot be encoded as
                UTF-8 (a lone surrogate in a key).
        """
        names: list[str] = []
        for path, leaf in zip(self.paths, self.leaves, strict=True):
            base = "/".join(part for part in (prefix, path) if part) or "value"
            shape = tuple(leaf.shape) if isinstance(leaf, Tensor) else ()
            if not shape:
                names.append(base)
            elif len(shape) == 1:
                names.extend(f"{base}/class_{i}" for i in range(shape[0]))
            else:
                for index in itertools.product(*(range(n) for n in shape)):
                    names.append(f"{base}/" + "_".join(str(i) for i in index))
        for name in names:
            check_encodable("compute() result: a name", name)
        if len(set(names)) != len(names):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(
                f"compute() result: the names {twice} are given to more than one value (a key "
                "with '/' next to a nested one, a vector next to a '<name>/class_<i>' key, or "
                "keys 1 and '1'); rename the keys so each value has its own name"
            )
        return names

    def rebuild(self, leaves: list[Any]) -> Any:
        """The tree with ``leaves`` (same order as ``self.leaves``) in place of the originals."""
        position = iter(leaves)
        return _rebuild(self.spec, position)


def flatten_tree(tree: Any) -> FlatTree:
    """Flatten a tensor, number, mapping, list, tuple or named tuple of those.

    Raises:
        TypeError: If a leaf is neither a tensor nor a real number, or a mapping key is not a
            string or an int.
    """
    leaves: list[Any] = []
    paths: list[str] = []
    spec = _flatten(tree, "", leaves, paths)
    return FlatTree(tuple(leaves), tuple(paths), spec)


def _flatten(tree: Any, path: str, leaves: list[Any], paths: list[str]) -> _Node:
    if isinstance(tree, Tensor) and tree.dtype.is_complex:
        # Checked here, on every rank: the sinks' float() of it failed on the writer alone.
        raise TypeError(
            f"compute() result: a complex tensor at {path or 'the root'!r}; values are real "
            "numbers: return its .real, .imag or .abs() (or each under a key of its own)"
        )
    if isinstance(tree, Tensor | int | float):  # bool is an int
        leaves.append(tree)
        paths.append(path)
        return _Node("leaf")
    if isinstance(tree, numbers.Real) and hasattr(tree, "item"):  # a numpy scalar
        leaves.append(tree.item())
        paths.append(path)
        return _Node("leaf")
    if isinstance(tree, Mapping):
        for key in tree:
            if not isinstance(key, str | int):
                raise TypeError(f"compute() result: mapping keys must be str or int, got {key!r}")
        keys = tuple(tree)
        children = tuple(_flatten(tree[k], _join(path, str(k)), leaves, paths) for k in keys)
        return _Node("dict", keys, children)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        keys = tuple(tree._fields)
        children = tuple(_flatten(getattr(tree, k), _join(path, k), leaves, paths) for k in keys)
        return _Node("namedtuple", keys, children, type(tree))
    if isinstance(tree, list | tuple):
        children = tuple(
            _flatten(item, _join(path, str(i)), leaves, paths) for i, item in enumerate(tree)
        )
        return _Node("list" if isinstance(tree, list) else "tuple", (), children)
    raise TypeError(
        f"compute() result: expected tensors, numbers, or dicts/lists/tuples of them, "
        f"got {type(tree).__name__} at {path or 'the root'!r}"
    )


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


def _rebuild(node: _Node, leaves: Any) -> Any:
    if node.kind == "leaf":
        return next(leaves)
    children = [_rebuild(child, leaves) for child in node.children]
    if node.kind == "dict":
        return dict(zip(node.keys, children, strict=True))
    if node.kind == "namedtuple":
        assert node.rebuild_type is not None
        return node.rebuild_type(*children)
    return children if node.kind == "list" else tuple(children)
