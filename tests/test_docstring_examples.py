"""Every ``Example:`` in the packages' docstrings runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

PACKAGES = (
    "sidestream",
    "sidestream_torchmetrics",
    "sidestream_mlflow",
    "sidestream_tensorboard",
    "sidestream_wandb",
)


def _modules() -> list[str]:
    names = []
    for root in PACKAGES:
        package = importlib.import_module(root)
        names.append(root)
        names.extend(
            info.name
            for info in pkgutil.walk_packages(package.__path__, root + ".")
            if not info.name.endswith("__main__")
        )
    return names


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples that write (runs/a.jsonl) write here
    module = importlib.import_module(name)
    result = doctest.testmod(
        module,
        extraglobs={"torch": torch},  # examples assume `import torch`, as the docs do
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        report=True,
    )
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
