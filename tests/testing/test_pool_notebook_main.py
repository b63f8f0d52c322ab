"""A function defined in a notebook's ``__main__`` (no script file) is refused at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = """
import sys
from sidestream.testing import DistributedPool
def rank_sum():
    return 1
pool = DistributedPool(2)
try:
    pool.run(rank_sum, timeout=60)
except ValueError as error:
    print("REFUSED", error)
finally:
    pool.close()
"""


@pytest.mark.timeout(120)
def test_function_of_a_fileless_main_is_refused_before_the_pool_starts() -> None:
    # python -c: __main__ has no file, as in a Jupyter kernel or a REPL.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=100
    )
    assert "REFUSED function: rank_sum is defined in __main__" in done.stdout, done.stderr[-3000:]
    assert "import it from there" in done.stdout
