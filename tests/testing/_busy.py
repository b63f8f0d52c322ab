"""A task that stays busy, importable by torchrun's ranks (they import tasks by module)."""

from __future__ import annotations

import os
import pathlib
import time


def busy(marks: str) -> None:
    """Say this rank is busy (a file named by its pid in ``marks``), then sleep."""
    pathlib.Path(marks, str(os.getpid())).touch()
    time.sleep(300)
