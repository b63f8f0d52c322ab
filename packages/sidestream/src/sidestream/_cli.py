"""What the command-line tools share."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

__all__ = ["run_command"]


def run_command(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s code; quietly when the reader of stdout exits (``| head``).

    As a Unix tool does: no traceback for a closed pipe, and stdout pointed at ``/dev/null``
    so the interpreter's last flush at exit does not raise again (Python's documented recipe).
    """
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 141  # 128 + SIGPIPE, what a shell reports for a process its pipe stopped
    sys.exit(code)
