"""The GPU run (`.ci/device-check`) can collect its tests with the device machine's packages.

That machine reaches no package index: its interpreter has torch, pytest, scikit-learn, scipy,
tensorboard and torchmetrics (numpy with them), nothing else. One test module importing another
package at import time (hypothesis did) stops collection, and no GPU test runs at all. This
follows every module-level import from the test folders the run collects, through the project's
own modules, and fails on a third-party one the machine lacks unless the module skips first
(``pytest.importorskip``) or imports it inside a block (``try``, ``if TYPE_CHECKING``) or
a function.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# typing_extensions: a requirement of torch itself, so wherever torch is installed.
DEVICE_PACKAGES = {
    "torch",
    "typing_extensions",
    "pytest",
    "sklearn",
    "scipy",
    "numpy",
    "tensorboard",
    "torchmetrics",
}
SOURCE_ROOTS = [
    ROOT / "packages" / "sidestream" / "src",
    *sorted((ROOT / "integrations").glob("*/src")),
]


def _device_check_folders() -> list[str]:
    script = (ROOT / ".ci" / "device-check").read_text(encoding="utf-8")
    folders = re.findall(r"\btests/[\w/]+", script)
    assert folders, ".ci/device-check names no test folders"
    return folders


def _path_of(module: str) -> Path | None:
    """The file of a first-party module (the project's packages or ``tests``), else ``None``."""
    parts = module.split(".")
    roots = [ROOT] if parts[0] == "tests" else SOURCE_ROOTS
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _is_first_party(top: str) -> bool:
    return top == "tests" or any((root / top).is_dir() for root in SOURCE_ROOTS)


def _eager_imports(path: Path) -> list[str]:
    """Modules imported when ``path`` is imported, past any module-level ``importorskip``."""
    names: list[str] = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        text = ast.unparse(node)
        if "importorskip(" in text:
            break  # what follows runs only where the skip did not happen
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = _module_name(path)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def _module_name(path: Path) -> str:
    for root in [ROOT, *SOURCE_ROOTS]:
        if path.is_relative_to(root):
            parts = path.relative_to(root).with_suffix("").parts
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(path)


def test_gpu_run_collects_with_the_device_packages() -> None:
    pending = [ROOT / "tests" / "conftest.py"]
    for folder in _device_check_folders():
        pending += sorted((ROOT / folder).rglob("*.py"))
    seen: set[Path] = set()
    missing: set[str] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        for module in _eager_imports(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if _is_first_party(top):
                found = _path_of(module)
                if found is not None:
                    pending.append(found)
                continue
            if top not in DEVICE_PACKAGES:
                missing.add(f"{path.relative_to(ROOT)} imports {top}")
    assert len(seen) > 50, "the walk found too few modules to mean anything"
    assert not missing, "\n".join(sorted(missing))
