"""The noxfile's workflows fail, rather than pass, where they cannot run."""

from __future__ import annotations

import ast
from pathlib import Path

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
