"""Run a Python script of a test in a fresh interpreter, as a user's job would run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The suite's own PYTHONPATH, kept after the root (the GPU machines' source trees:
# .ci/device-check).
_PATH = os.environ.get("PYTHONPATH", "")


def run_python(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """Run this interpreter on ``args`` from the repository root, with ``env`` added."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), _PATH))), **env},
    )
