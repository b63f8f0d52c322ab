"""The noxfile's workflows fail, rather than pass, where they cannot run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _options() -> dict[str, object]:
    """``nox.options.NAME = VALUE`` assignments of the noxfile (read, not imported: the test
    environment has no nox)."""
    options: dict[str, object] = {}
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Attribute)
            and target.value.attr == "options"
            and isinstance(target.value.value, ast.Name)
            and target.value.value.id == "nox"
        ):
            options[target.attr] = ast.literal_eval(node.value)
    return options


def test_a_missing_python_fails_the_session() -> None:
    # Outside CI, nox skips a session whose Python is missing and exits 0: the README's two
    # commands on a machine without Python 3.11 would report success having run nothing.
    assert _options().get("error_on_missing_interpreters") is True


def _ci_sessions() -> list[str]:
    """The sessions tagged ``ci`` (what ``nox -t ci`` and ``.ci/run`` run), by function name."""
    names = []
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            tags = [
                keyword.value
                for keyword in getattr(decorator, "keywords", [])
                if keyword.arg == "tags"
            ]
            if tags and "ci" in ast.literal_eval(tags[0]):
                names.append(node.name)
    return names


def test_a_bare_nox_runs_what_ci_runs() -> None:
    # A bare `nox` left out the docs build, which CI runs: it passed where CI could fail.
    assert sorted(_ci_sessions()) == ["docs", "lint", "tests", "typecheck"]
    assert sorted(_options()["sessions"]) == sorted(_ci_sessions())  # type: ignore[arg-type]


def _noxfile_function(name: str) -> object:
    """One function of the noxfile, run with the noxfile's list assignments as its globals."""
    namespace: dict[str, object] = {"Path": Path}
    body = ast.parse((ROOT / "noxfile.py").read_text()).body
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:  # a list built from names: not needed here
                continue
            for target in node.targets:
                if isinstance(target, ast.Name):
                    namespace[target.id] = value
    function = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module(body=[function], type_ignores=[]), "noxfile.py", "exec"), namespace)
    return namespace[name]


def test_the_lowest_session_pins_each_release_the_install_page_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `nox -s lowest` runs the tracker tests on each integration's lowest declared release: a
    # floor raised in a pyproject (or a client added) must move its pin, not leave it behind.
    import re

    monkeypatch.chdir(ROOT)
    lowest_releases = _noxfile_function("lowest_releases")
    pins = dict(pin.split("==") for pin in lowest_releases())  # type: ignore[operator]
    text = (ROOT / "docs/install.md").read_text()
    named = dict(re.findall(r'"sidestream\[\w+\]" +#.*\(and (\w+) ([\d.]+)\+', text))
    assert named.keys() == {"wandb", "mlflow", "tensorboard", "torchmetrics"}
    assert pins == named
