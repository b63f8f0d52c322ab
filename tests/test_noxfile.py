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
