"""The version of a sidestream distribution, installed or imported from a source tree."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["distribution_version"]

UNKNOWN = "0+unknown"


def distribution_version(distribution: str, package_init: str) -> str:
    """``distribution``'s installed version, else the one its source tree's pyproject names.

    A checkout on ``PYTHONPATH`` with nothing installed (how the GPU machine, which reaches no
    package index, runs the tests) has no metadata to read: the version then comes from the
    ``pyproject.toml`` two folders above the package (``src/<package>/__init__.py``).

    Args:
        distribution: The distribution's name, e.g. ``"sidestream-wandb"``.
        package_init: The package's ``__init__.py`` (its ``__file__``).

    Returns:
        The version, or ``"0+unknown"`` when neither source has one.
    """
    try:
        return version(distribution)
    except PackageNotFoundError:
        pyproject = Path(package_init).resolve().parents[2] / "pyproject.toml"
        try:
            with pyproject.open("rb") as file:
                project = tomllib.load(file).get("project", {})
        except (OSError, tomllib.TOMLDecodeError):
            return UNKNOWN
        if project.get("name") != distribution or not isinstance(project.get("version"), str):
            return UNKNOWN
        return str(project["version"])
