"""Install the built wheels into a fresh virtual environment, the way a user would.

Torch first (from the index or ``PIP_FIND_LINKS``, as the install docs say), then
``pip install --find-links DIST "sidestream[tensorboard]"``: the extra's lockstep pin must
resolve from the local wheels. Then every installed sink is built through
``sinks_from_config``, and a sink whose extra is not installed fails at build with both install
commands. ``nox -s build`` does the same for ``sidestream[all]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = [
    "packages/sidestream",
    "integrations/sidestream-wandb",
    "integrations/sidestream-mlflow",
    "integrations/sidestream-tensorboard",
]
TORCH = os.environ.get("SIDESTREAM_TORCH", "torch==2.13.0")

CHECK = textwrap.dedent(
    """
    import sys
    from sidestream.sinks import available_sinks, sinks_from_config

    root = sys.argv[1]
    assert available_sinks() == ["console", "jsonl", "tensorboard"], available_sinks()
    sinks = sinks_from_config(
        {"jsonl": {"path": root + "/a.jsonl"}, "console": None,
         "tensorboard": {"log_dir": root + "/tb"}}
    )
    print([type(sink).__name__ for sink in sinks])
    try:
        sinks_from_config(["mlflow"])
    except LookupError as error:
        print("missing:", error)
    """
)


def _pip(python: Path, *args: str) -> None:
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.timeout(1200)
def test_wheels_install_with_an_extra_into_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist)]
        + [str(ROOT / path) for path in DISTRIBUTIONS],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr
    version = tomllib.loads((ROOT / DISTRIBUTIONS[0] / "pyproject.toml").read_text())["project"][
        "version"
    ]
    assert sorted(p.name for p in dist.iterdir()) == sorted(
        f"{name}-{version}-py3-none-any.whl"
        for name in ["sidestream", *(f"sidestream_{n}" for n in ("wandb", "mlflow", "tensorboard"))]
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    _pip(python, TORCH)
    _pip(python, "--find-links", str(dist), "sidestream[tensorboard]")
    checked = subprocess.run(
        [str(python), "-c", CHECK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the checkout: only what was installed is importable
    )
    assert checked.returncode == 0, checked.stderr
    lines = checked.stdout.splitlines()
    assert lines[0] == "['JsonlSink', 'ConsoleSink', 'TensorBoardSink']"
    assert lines[1].startswith("missing: sink 'mlflow' is not installed: ")
    assert 'pip install "sidestream[mlflow]"' in lines[1]
    assert "pip install ./packages/sidestream ./integrations/sidestream-mlflow" in lines[1]
