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


def test_version_from_a_source_tree_with_nothing_installed(monkeypatch, tmp_path) -> None:
    """The GPU machine imports the packages from ``src/`` folders on PYTHONPATH, unbuilt."""
    import importlib
    from importlib.metadata import PackageNotFoundError

    from sidestream import _version

    def not_installed(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(_version, "version", not_installed)
    packages = {"sidestream": ROOT / "packages/sidestream/pyproject.toml"}
    for name in INTEGRATIONS:
        packages[f"sidestream-{name}"] = ROOT / f"integrations/sidestream-{name}/pyproject.toml"
    for distribution, pyproject in packages.items():
        package = importlib.import_module(distribution.replace("-", "_"))
        expected = _project(pyproject)["version"]
        assert _version.distribution_version(distribution, package.__file__) == expected
    # Another distribution's pyproject, or none at all, is no answer.
    tree = tmp_path / "pkg" / "src" / "pkg"
    tree.mkdir(parents=True)
    init = tree / "__init__.py"
    assert _version.distribution_version("pkg", str(init)) == _version.UNKNOWN
    (tmp_path / "pkg" / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9"\n')
    assert _version.distribution_version("pkg", str(init)) == _version.UNKNOWN
    (tmp_path / "pkg" / "pyproject.toml").write_text('[project]\nname = "pkg"\nversion = "2.5"\n')
    assert _version.distribution_version("pkg", str(init)) == "2.5"


def test_every_distribution_ships_the_license() -> None:
    # Declared Apache-2.0, shipped without its text: hatchling puts a LICENSE next to each
    # pyproject into the sdist and the wheel (License-File).
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    folders = [ROOT / "packages/sidestream"]
    folders += [ROOT / f"integrations/sidestream-{name}" for name in INTEGRATIONS]
    for folder in folders:
        assert (folder / "LICENSE").read_text() == text, folder
        assert _project(folder / "pyproject.toml")["license"] == "Apache-2.0"


# Tracker releases a requirement must leave out: they fail with what pip installs beside them.
# tensorboard 2.16.x and 2.17.0 with NumPy 2 (pip's pick): the hparams summary the sink writes
# at open raised AttributeError (np.string_), failing the sink for the whole job.
# mlflow 2.16.0 to 3.8.1 with SQLAlchemy 2.1 (pip's pick: they take any sqlalchemy<3): their
# database store imports sqlalchemy.pool.FallbackAsyncAdaptedQueuePool, which 2.1 removed, so a
# sqlite:/// tracking URI failed at open and `mlflow server` with a database store did not start.
BROKEN_RELEASES = {
    "sidestream-tensorboard": {"tensorboard": ["2.16.0", "2.16.2", "2.17.0"]},
    "sidestream-mlflow": {"mlflow": ["2.16.0", "2.22.5", "3.0.0", "3.8.0", "3.8.1"]},
}


def test_tracker_requirements_leave_out_broken_releases() -> None:
    from packaging.requirements import Requirement

    for distribution, broken in BROKEN_RELEASES.items():
        project = _project(ROOT / f"integrations/{distribution}/pyproject.toml")
        requirements = {
            requirement.name: requirement.specifier
            for requirement in map(Requirement, project["dependencies"])
        }
        for client, versions in broken.items():
            allowed = [version for version in versions if version in requirements[client]]
            assert not allowed, f"{distribution} allows {client} {allowed}"


def test_install_page_names_each_trackers_lowest_release() -> None:
    # docs/install.md: `pip install "sidestream[mlflow]"  # ... (and mlflow 3.9+)`, the lowest
    # release each integration's requirement takes.
    import re

    from packaging.requirements import Requirement

    text = (ROOT / "docs/install.md").read_text()
    pattern = r'"sidestream\[(\w+)\]" +#.*\(and (\w+) ([\d.]+)\+'
    named = {extra: (client, lowest) for extra, client, lowest in re.findall(pattern, text)}
    assert set(named) == set(INTEGRATIONS), named
    for name, (client, lowest) in named.items():
        project = _project(ROOT / f"integrations/sidestream-{name}/pyproject.toml")
        specifiers = {
            requirement.name: {str(spec) for spec in requirement.specifier}
            for requirement in map(Requirement, project["dependencies"])
        }
        assert f">={lowest}" in specifiers[client], (name, client, lowest, specifiers[client])
