"""Documented usage type-checks under ``mypy --strict``, as many training teams run it.

The packages ship ``py.typed``, yet ``confusion_count_metric().multiclass(3).with_f1().macro()
.build().compute()`` was ``Tensor | dict[str, Tensor]`` (a cast for every ``float(...)``),
``run.collector(compose).metric["loss"]`` and ``compose["train"]["tokens"]`` were refused as not
indexable, ``wrap(collection)["f1"]`` too, and ``pool.run(f)`` was ``list[Any]``. The metric
and collector type parameters were invariant: a built ``ConfusionCountMetric[Tensor]`` was no
``ConfusionCountMetric`` (a factory's return type), a ``MeanMetric`` no ``Metric[Tensor | dict[str,
Tensor]]``, and ``run.collector(MeanMetric(), prefix="train").bind(device)`` no
``AsyncMetricCollector[Metric[Tensor]]`` (a trainer's attribute), to mypy and pyright alike. The
snippets in ``tests/typed_usage`` are checked with one mypy run against the packages this test
imports.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_type_hints import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = ROOT / "tests" / "typed_usage"


def _source_roots() -> list[str]:
    """The folders the packages are imported from (a checkout's ``src``, or site-packages)."""
    roots = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None:
            roots.append(str(Path(spec.origin).parents[1]))
    return list(dict.fromkeys(roots))


@pytest.mark.timeout(600)
def test_documented_usage_passes_mypy_strict() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (nox -s typecheck has it)")
    # Relative to the root, as mypy then names them in its messages.
    snippets = SNIPPETS.relative_to(ROOT)
    files = [snippets / "documented_usage.py"]
    if importlib.util.find_spec("torchmetrics") is not None:
        files.append(snippets / "torchmetrics_usage.py")
    env = {**os.environ, "MYPYPATH": os.pathsep.join(_source_roots())}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", str(ROOT / "pyproject.toml")]
        + [str(path) for path in files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    # Only the snippets' lines: the packages' own errors are `nox -s typecheck`'s to report.
    errors = [
        line
        for line in done.stdout.splitlines()
        if line.startswith(str(snippets)) and ": error:" in line
    ]
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert not errors, "\n".join(errors)
