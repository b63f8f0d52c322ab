"""``SinkStatus``: how a sink's delivery is going, and which failures are permanent."""

from __future__ import annotations

import contextlib
import urllib.error
from dataclasses import dataclass
from typing import Literal

__all__ = ["PermanentSinkError", "SinkStatus", "http_status", "is_permanent"]


@dataclass(frozen=True)
class SinkStatus:
    """The delivery status of one sink (``SinkRunner.status``, ``Run.sink_status``).

    Attributes:
        state: ``"healthy"`` (delivering, or nothing to deliver), ``"retrying"`` (the last
            attempt failed with a transient error; reports are kept and retried with backoff)
            or ``"failed"`` (a permanent error: nothing more is delivered to this sink, and
            ``close`` returns ``False``; also when the sink's own ``close`` raised, and after a
            ``close`` that kept reports in a spool file).
        last_error: The last failure as text (credentials removed by the sink), if any; a
            flush or close that raised or returned ``False`` is named here too. It stays
            after the sink recovers (``state`` is then ``"healthy"`` again).
    """

    state: Literal["healthy", "retrying", "failed"]
    last_error: str | None = None


class PermanentSinkError(RuntimeError):
    """A sink failure that retrying cannot fix (a bad option, a missing client, HTTP 4xx).

    Sinks raise it (with a message that says the fix) when they turn a backend error into a
    message of their own, so the pipeline still knows not to retry.
    """


# HTTP statuses that a retry may fix: request timeout and too many requests.
_TRANSIENT_4XX = {408, 429}

# Errors of the sink's code or its options, not of the backend's availability: the same call
# raises them again on every retry (a path that is a directory, a stream without write()).
_PERMANENT_ERRORS = (
    PermanentSinkError,
    ImportError,
    TypeError,
    ValueError,
    AttributeError,
    # An assert of the sink's own code: under ``python -O`` the same code goes on to fail with
    # another error of this list (AttributeError on a None), so it must not depend on -O.
    AssertionError,
    KeyError,
    IndexError,
    ArithmeticError,  # OverflowError, ZeroDivisionError: the same numbers overflow again
    NameError,
    NotImplementedError,
    IsADirectoryError,
    NotADirectoryError,
    FileExistsError,  # a file where a directory is made (mkdir with exist_ok)
)


def is_permanent(error: BaseException) -> bool:
    """Whether retrying the call that raised ``error`` cannot help.

    Permanent: ``PermanentSinkError``, ``ImportError`` (a client not installed), ``TypeError``
    and ``ValueError`` (bad arguments), errors of the sink's own code (``AttributeError``,
    ``AssertionError``, ``KeyError``, ``NameError``, ``NotImplementedError``), a path that is
    a directory where a file is wanted or the reverse (``IsADirectoryError``,
    ``NotADirectoryError``, ``FileExistsError``), and HTTP
    errors with a 4xx status other than 408/429 (read from ``status_code``,
    ``response.status_code``, ``get_http_status_code()``, or the standard library's
    ``urllib.error.HTTPError.code``). Everything else (connection
    errors, timeouts, 5xx, a full disk) is transient.
    """
    if isinstance(error, _PERMANENT_ERRORS):
        return True
    status = http_status(error)
    return status is not None and 400 <= status < 500 and status not in _TRANSIENT_4XX


def http_status(error: BaseException) -> int | None:
    """The HTTP status an error of a client carries, where it carries one (see ``is_permanent``)."""
    candidates: list[object] = [
        getattr(error, "status_code", None),
        getattr(getattr(error, "response", None), "status_code", None),
    ]
    if isinstance(error, urllib.error.HTTPError):
        # The standard library's (``urlopen``): a sink of one's own written with it raised an
        # OSError with ``code``, read as transient, so an HTTP 400 was retried until close.
        candidates.append(error.code)
    getter = getattr(error, "get_http_status_code", None)
    if callable(getter):
        with contextlib.suppress(Exception):
            candidates.append(getter())
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
