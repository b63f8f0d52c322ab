"""sidestream's loggers: a logging handler that raises never stops sidestream's own work."""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any

__all__ = ["SafeLogger", "get_logger"]


class SafeLogger:
    """A ``logging.Logger`` whose calls never raise an ``Exception``.

    sidestream logs from its own threads (a sink's, a spooler's, a collector's dispatcher) and
    in the middle of ``close``. ``logging`` lets a handler's ``emit`` raise through the call
    that logged (a log shipper of one's own that skips the ``handleError`` its docs ask for):
    such a handler ended a sink's thread and its spooler (their reports stayed in memory,
    never spooled) and made ``Run.close()`` raise half way. Here the handler's error is
    printed to stderr with the record, as ``logging`` prints the errors it catches itself
    (when ``logging.raiseExceptions`` is true, its default), and the work goes on. A
    ``BaseException`` (Ctrl-C, ``SystemExit``) still propagates.

    Levels, handlers, filters and ``propagate`` stay those of the ``logging.Logger`` of the
    same name, which is what users configure.
    """

    def __init__(self, name: str) -> None:
        """Wrap ``logging.getLogger(name)``."""
        self._logger = logging.getLogger(name)

    @property
    def name(self) -> str:
        """The logger's name (``sidestream.sinks``, ...)."""
        return self._logger.name

    def isEnabledFor(self, level: int) -> bool:
        """Whether a record of ``level`` would be handled."""
        return self._logger.isEnabledFor(level)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        """Log at DEBUG."""
        self._emit(logging.DEBUG, msg, args, kwargs)

    def info(self, msg: object, *args: object, **kwargs: Any) -> None:
        """Log at INFO."""
        self._emit(logging.INFO, msg, args, kwargs)

    def warning(self, msg: object, *args: object, **kwargs: Any) -> None:
        """Log at WARNING."""
        self._emit(logging.WARNING, msg, args, kwargs)

    def error(self, msg: object, *args: object, **kwargs: Any) -> None:
        """Log at ERROR."""
        self._emit(logging.ERROR, msg, args, kwargs)

    def _emit(self, level: int, msg: object, args: tuple[object, ...], kwargs: Any) -> None:
        if not self._logger.isEnabledFor(level):
            return
        # Three frames up (this one, the level's method): the record names the caller's line.
        kwargs.setdefault("stacklevel", 3)
        try:
            self._logger.log(level, msg, *args, **kwargs)
        except Exception:
            _handler_failed(self._logger.name, level, msg, args)


def get_logger(name: str) -> SafeLogger:
    """The logger ``name`` (under ``sidestream``), for sidestream's own modules."""
    return SafeLogger(name)


def _handler_failed(name: str, level: int, msg: object, args: tuple[object, ...]) -> None:
    """Print a failed record and its handler's error to stderr, as ``Handler.handleError`` does."""
    if not logging.raiseExceptions:
        return
    try:
        text = str(msg) % args if args else str(msg)
    except Exception:
        text = f"{msg!r} % {args!r}"
    try:
        stream = sys.stderr
        if stream is None:  # started with its stderr closed
            return
        stream.write(f"--- Logging error: a handler of logger {name!r} raised ---\n")
        traceback.print_exc(file=stream)
        stream.write(f"{logging.getLevelName(level)}:{name}:{text}\n")
        stream.flush()
    except Exception:  # stderr closed or full: nowhere left to say it
        pass
