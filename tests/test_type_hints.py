"""Every public function's type hints resolve at run time.

Tools that read hints (``typing.get_type_hints``: pydantic, typer, sphinx-autodoc, jsonargparse)
failed with ``NameError: name 'DeviceMesh' is not defined`` on ``SumMetric``, ``SyncBatch.add``
and others: the shared ``Group`` alias was a string naming modules the users did not import.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from collections.abc import Iterator
from types import ModuleType

import pytest

PACKAGES = [
    "sidestream",
    "sidestream_wandb",
    "sidestream_mlflow",
    "sidestream_tensorboard",
    "sidestream_torchmetrics",
]


def _public_modules() -> Iterator[ModuleType]:
    for top in PACKAGES:
        package = importlib.import_module(top)
        yield package
        for info in pkgutil.walk_packages(package.__path__, f"{top}."):
            if not any(part.startswith("_") for part in info.name.split(".")):
                yield importlib.import_module(info.name)


def _hinted(module: ModuleType) -> Iterator[tuple[str, object]]:
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name)
        if inspect.isclass(value):
            yield name, value
            for attribute, member in vars(value).items():
                if inspect.isfunction(member) and (
                    not attribute.startswith("_") or attribute == "__init__"
                ):
                    yield f"{name}.{attribute}", member
        elif inspect.isfunction(value):
            yield name, value


@pytest.mark.parametrize("module", list(_public_modules()), ids=lambda module: module.__name__)
def test_public_type_hints_resolve(module: ModuleType) -> None:
    failures = []
    for name, value in _hinted(module):
        try:
            typing.get_type_hints(value)
        except Exception as error:  # every failure is reported together
            failures.append(f"{module.__name__}.{name}: {error!r}")
    assert not failures, "\n".join(failures)
