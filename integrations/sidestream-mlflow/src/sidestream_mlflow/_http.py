"""HTTP settings for the sink's own MLflow requests only, never the process's.

MLflow reads its request timeout and retry count from the environment at every request, so
setting those variables would change every MLflow call in the process, the user's included.
``http_request`` takes both as arguments, so a wrapper fills them in for calls made on a thread
inside ``request_settings`` and leaves every other call as it was.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

from sidestream._logs import get_logger

__all__ = ["request_settings"]

# The sinks' logger, not the module's: every sidestream message is under ``sidestream.*``, so
# one ``logging.getLogger("sidestream")`` setting covers the integrations too.
_log = get_logger("sidestream.sinks")
_local = threading.local()
_install_lock = threading.Lock()


def _install() -> bool:
    """Wrap ``mlflow.utils.rest_utils.http_request`` once; whether the wrapper is in place."""
    with _install_lock:
        try:
            from mlflow.utils import rest_utils
        except ImportError:
            return False
        original = getattr(rest_utils, "http_request", None)
        if original is None:
            _log.debug("mlflow.utils.rest_utils.http_request not found: MLflow's defaults apply")
            return False
        if getattr(original, "_sidestream_wrapper", False):
            return True

        @functools.wraps(original)
        def http_request(*args: Any, **kwargs: Any) -> Any:
            settings = getattr(_local, "settings", None)
            if settings:
                for key, value in settings.items():
                    if kwargs.get(key) is None:
                        kwargs[key] = value
            return original(*args, **kwargs)

        http_request._sidestream_wrapper = True  # type: ignore[attr-defined]
        rest_utils.http_request = http_request
        return True


@contextlib.contextmanager
def request_settings(timeout: int | None, max_retries: int | None) -> Iterator[None]:
    """MLflow requests made on this thread inside the block use these settings.

    ``None`` keeps MLflow's own setting for that value.
    """
    settings = {
        key: value
        for key, value in (("timeout", timeout), ("max_retries", max_retries))
        if value is not None
    }
    if not settings or not _install():
        yield
        return
    previous = getattr(_local, "settings", None)
    _local.settings = settings
    try:
        yield
    finally:
        _local.settings = previous
