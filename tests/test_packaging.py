"""The distributions share one version and the core's extras pull the integrations."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ["wandb", "mlflow", "tensorboard", "torchmetrics"]


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def test_one_version_and_extras_pinned() -> None:
    core = _project(ROOT / "packages/sidestream/pyproject.toml")
    version = core["version"]
    extras = core["optional-dependencies"]
    for name in INTEGRATIONS:
        integration = _project(ROOT / f"integrations/sidestream-{name}/pyproject.toml")
        assert integration["name"] == f"sidestream-{name}"
        assert integration["version"] == version
        assert f"sidestream=={version}" in integration["dependencies"]
        assert extras[name] == [f"sidestream-{name}=={version}"]
        assert f"sidestream-{name}=={version}" in extras["all"]


def test_every_package_is_typed() -> None:
    assert (ROOT / "packages/sidestream/src/sidestream/py.typed").exists()
    for name in INTEGRATIONS:
        assert (ROOT / f"integrations/sidestream-{name}/src/sidestream_{name}/py.typed").exists()
