"""Notebook cells executed again while what they made earlier is still open.

IPython names a cell's code after a hash of its text, so a cell executed again (the usual way
to start over) makes its ``Run`` (or collector with sinks) at the same file and line. The
earlier one stayed open with no word: its threads, files and tracker run (which MLflow and W&B
showed as running) kept until the kernel exited.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from sidestream._exit import in_ipython, ipython_shell
from sidestream._logs import SafeLogger

__all__ = ["note_made_in_cell"]

# (kind, cell, line) -> the object made there, and the execution (IPython's count) that made it.
_MADE: dict[tuple[str, str, int], tuple[weakref.ref[Any], int | None]] = {}
_IPYTHON_INPUT = re.compile(r"^<ipython-input-\d+-(\w+)>$")


def note_made_in_cell(
    made: object,
    caller: FrameType | None,
    kind: str,
    still_open: Callable[[Any], bool],
    advice: str,
    log: SafeLogger,
) -> None:
    """In a notebook, warn when a cell makes ``kind`` again while its earlier one is open.

    Only an object made by a cell's own code (not inside a function), in a later execution: a
    helper defined in a cell makes everything at its one line (a train and an eval run open
    together are not a mistake), and a loop in one execution makes several on purpose.
    Scripts are not checked.

    Args:
        made: The new object.
        caller: The frame that made it.
        kind: What it is, for the key and the message (``"Run"``).
        still_open: Whether an earlier object still holds threads, files or a tracker run.
        advice: How to close the earlier one, for the message.
        log: The logger of the module that made it.
    """
    if caller is None or caller.f_code.co_name != "<module>" or not in_ipython():
        return
    # A terminal IPython's name also holds the execution count (<ipython-input-7-1a2b3c>);
    # ipykernel's (a notebook's) is the hash alone.
    name = _IPYTHON_INPUT.sub(r"<ipython-input-\1>", caller.f_code.co_filename)
    place = (kind, name, caller.f_lineno)
    execution = _execution_count()
    previous, made_in = _MADE.get(place, (None, None))
    earlier = previous() if previous is not None else None
    for key in [key for key, (ref, _) in _MADE.items() if ref() is None]:
        del _MADE[key]
    _MADE[place] = (weakref.ref(made), execution)
    if earlier is None or not still_open(earlier):
        return
    if execution is not None and execution == made_in:
        return  # the same execution of the cell: a loop making several
    log.warning(
        "%s: this notebook cell made a %s before, which is still open (%r): it keeps its "
        "sink threads, files and tracker run (shown as running) until it is closed or the "
        "kernel exits. %s",
        kind,
        kind,
        earlier,
        advice,
    )


def _execution_count() -> int | None:
    """The IPython shell's count of the cell executing now (``None``: not known)."""
    count = getattr(ipython_shell(), "execution_count", None)
    return count if isinstance(count, int) else None
