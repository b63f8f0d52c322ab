"""Helpers shared by tracker sinks: config, length limits, redaction, resume state, timeouts."""

from __future__ import annotations

import difflib
import errno
import hashlib
import itertools
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

import torch

from sidestream._exit import KILLED_EXIT_CODE, close_before_backends_exit, failed_exit_code
from sidestream._logs import get_logger

__all__ = [
    "KILLED_EXIT_CODE",
    "NOT_WRITABLE_ERRNOS",
    "HistogramEdges",
    "call_within",
    "check_directory_path",
    "check_name_lengths",
    "check_option_types",
    "check_seconds",
    "checked_histogram_edges",
    "close_before_backends_exit",
    "failed_exit_code",
    "flatten_config",
    "name_digest",
    "parse_resume_state",
    "histogram_counts",
    "histogram_edges",
    "redact",
    "refuse_unknown_options",
    "secrets_in",
    "shorten",
    "silence_thread_errors",
    "uri_without_password",
    "working_directory_hint",
]

_PLAIN = (bool, int, float, str)

NOT_WRITABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
"""Opening or making a file refused for good: no permission, or a read-only file system (a
retry cannot help, unlike a full disk)."""


def flatten_config(
    config: Mapping[str, Any],
    separator: str = ".",
    plain_types: tuple[type, ...] = _PLAIN,
) -> dict[str, Any]:
    """Flatten nested mappings into ``{"a.b.c": value}``; other values become strings.

    Args:
        config: Hyper-parameters, possibly nested.
        separator: Joins the keys of nested levels.
        plain_types: Value types the backend takes as they are; anything else (lists, tensors,
            objects, ``None``) is stored as ``str(value)``.

    Raises:
        ValueError: If two entries flatten to one name (``{"opt.lr": 0.1, "opt": {"lr": 0.2}}``
            both become ``opt.lr``): a tracker would keep only one of them.
    """
    flat: dict[str, Any] = {}
    paths: dict[str, str] = {}  # flattened name: where it came from, for the message

    def visit(prefix: str, path: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, child in value.items():
                name = f"{prefix}{separator}{key}" if prefix else str(key)
                visit(name, f"{path}[{key!r}]", child)
            return
        if prefix in flat:
            raise ValueError(
                f"{paths[prefix]} and {path} both become {prefix!r} once flattened (the name a "
                "tracker keeps a hyper-parameter under), so one would be lost; rename one"
            )
        paths[prefix] = path
        value = _as_python_number(value)
        flat[prefix] = value if isinstance(value, plain_types) else str(value)

    for key, value in config.items():
        visit(str(key), f"config[{key!r}]", value)
    return flat


def _as_python_number(value: Any) -> Any:
    """A numpy scalar or a 0-dim real tensor as the Python number it holds; else ``value``.

    ``np.float32(2.5)`` and ``torch.tensor(0.1)`` are numbers to the user: a tracker should
    chart and compare them as such, not keep ``'tensor(0.1000)'``.
    """
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.is_complex() or value.device.type == "meta":
            return value
        number = value.item()
        if isinstance(number, float) and value.dtype != torch.float64:
            return _shortest(number, lambda x: torch.tensor(x, dtype=value.dtype).item())
        return number
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        number = value.item()  # numpy's scalar types, bool_ included
        if isinstance(number, float):
            return _shortest(number, lambda x: type(value)(x).item())
        return number if isinstance(number, bool | int) else value
    return value


def _shortest(number: float, same_dtype: Callable[[float], float]) -> float:
    """The shortest decimal that is ``number`` in its own dtype (``same_dtype`` rounds to it).

    0.0003 as written, not float32's exact 0.0003000000142492354.
    """
    for digits in range(1, 18):
        shorter = float(f"{number:.{digits}g}")
        if same_dtype(shorter) == number:
            return shorter
    return number


def name_digest(name: str) -> str:
    """8 hex digits of ``name``'s SHA-1: what a sink appends to a name it had to change.

    Two names that change into the same text (``acc@1`` and ``acc#1``) stay two.
    """
    return hashlib.sha1(name.encode()).hexdigest()[:8]


def shorten(text: str, limit: int) -> str:
    """``text`` if it fits in ``limit`` characters, else a prefix plus a digest of the whole.

    The digest keeps two long names that share a prefix distinct after shortening.
    """
    if len(text) <= limit:
        return text
    digest = name_digest(text)
    if limit < 16:
        return digest[:limit]
    return f"{text[: limit - 9]}-{digest}"


def uri_without_password(uri: str | None) -> str | None:
    """``uri`` with any ``user:password@`` user information replaced by ``***@``.

    Read from the text, not parsed: a URI that does not parse (a port that is not a number, a
    password with ``/`` in it, which SQLAlchemy takes) is redacted all the same, for the
    message that says it is wrong.
    """
    if uri is None:
        return None
    span = _user_information(uri)
    if span is None:
        return uri
    return f"{uri[: span[0]]}***{uri[span[1] :]}"


def secrets_in(env_names: Iterable[str], uris: Iterable[str | None] = ()) -> list[str]:
    """The secret strings to keep out of messages: values of ``env_names`` and URI passwords.

    Values shorter than 4 characters are ignored, so redaction never mangles ordinary text.
    """
    found = [os.environ.get(name, "") for name in env_names]
    for uri in uris:
        span = _user_information(uri) if uri else None
        if uri and span is not None:
            username, _, password = uri[span[0] : span[1]].partition(":")
            found += [password, username]
    return sorted({secret for secret in found if len(secret) >= 4}, key=len, reverse=True)


_AFTER_SCHEME = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.\-]*:)?//")


def _user_information(uri: str) -> tuple[int, int] | None:
    """Where ``user:password`` is in ``uri`` (before the ``@``), or ``None`` if it has none.

    Usually up to the last ``@`` of the authority (a password may hold ``@``). A password may
    also hold ``/``, ``?`` or ``#``, which SQLAlchemy takes unencoded; such a URI has no ``@``
    before them, so the last ``@`` of the whole URI counts when what comes before its first
    ``/`` is ``user:password``, not ``host:port``.
    """
    scheme = _AFTER_SCHEME.match(uri)
    if scheme is None:
        return None
    start = scheme.end()
    authority = _AUTHORITY_END.search(uri, start)
    stop = len(uri) if authority is None else authority.start()
    at = uri.rfind("@", start, stop)
    if at != -1:
        return start, at
    at = uri.rfind("@", start)
    if at == -1:
        return None
    head = _AUTHORITY_END.split(uri[start:at], maxsplit=1)[0]
    _, colon, password = head.partition(":")
    if not colon or not password or password.isdigit():
        return None  # host:port, or no password: the "@" is in the path or the query
    return start, at


_AUTHORITY_END = re.compile(r"[/?#]")


def redact(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each secret replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    # Authorization headers can appear in exception text from HTTP libraries.
    return re.sub(
        r"(?i)(authorization['\"]?\s*[:=]\s*['\"]?)(bearer |basic )?[^\s'\",}]+", r"\1***", text
    )


def histogram_edges(num_bins: int, edges: Iterable[float] | None) -> list[float]:
    """Bin edges for ``num_bins`` counts: ``edges`` when given, else ``0, 1, ..., num_bins``.

    Raises:
        ValueError: If ``edges`` does not hold ``num_bins + 1`` increasing values.
    """
    if edges is None:
        return [float(i) for i in range(num_bins + 1)]
    result = [float(edge) for edge in edges]
    if len(result) != num_bins + 1 or not _finite_and_increasing(result):
        raise ValueError(
            f"histogram_edges: expected {num_bins + 1} finite increasing edges for {num_bins} "
            f"bins, got {len(result)}"
        )
    return result


def histogram_counts(counts: Sequence[float]) -> list[float]:
    """A histogram's bin counts as floats, checked: each finite and at least 0.

    A tracker draws a NaN or negative count as a shape that no data has (TensorBoard's mean
    and spread come out NaN or off), so a sink leaves such a histogram out, with a warning,
    rather than draw it.

    Raises:
        ValueError: Naming the first bad bin and its count.
    """
    result = [float(count) for count in counts]
    for index, count in enumerate(result):
        if not (math.isfinite(count) and count >= 0):
            raise ValueError(
                f"expected bin counts that are finite and >= 0, got {count} in bin {index} "
                f"of {len(result)}"
            )
    return result


def _finite_and_increasing(edges: list[float]) -> bool:
    # NaN compares false both ways, so an order check alone lets it through.
    return all(map(math.isfinite, edges)) and all(a < b for a, b in itertools.pairwise(edges))


def checked_histogram_edges(
    edges: Mapping[str, Iterable[float]] | None,
) -> dict[str, list[float]]:
    """A sink's ``histogram_edges`` option, checked when the sink is made.

    Raises:
        TypeError: If it is not a mapping of names to sequences of numbers.
        ValueError: If a sequence has fewer than two values or does not increase.
    """
    if edges is None:
        return {}
    if not isinstance(edges, Mapping):
        raise TypeError(f"histogram_edges: expected a mapping of name to edges, got {edges!r}")
    checked: dict[str, list[float]] = {}
    for name, values in edges.items():
        try:
            result = [float(edge) for edge in values]
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"histogram_edges[{name!r}]: expected a sequence of numbers, got {values!r}"
            ) from error
        if len(result) < 2 or not _finite_and_increasing(result):
            raise ValueError(
                f"histogram_edges[{name!r}]: expected at least 2 finite increasing edges, got "
                f"{result}"
            )
        checked[str(name)] = result
    return checked


class HistogramEdges:
    """A sink's ``histogram_edges`` option: checked when the sink is made, looked up by name.

    A key is a histogram's name as reported, with its stream's prefix (``train/scores``). A key
    that names no histogram would leave the bins drawn as ``[i, i + 1)`` without a word, so
    the sink warns: at once when a histogram's name ends with ``/`` and a key (the prefix left
    out), and at close for every key no histogram matched.

    Args:
        edges: The option as given (``None`` for none).
        sink: The sink's class name, for messages.

    Raises:
        TypeError, ValueError: As ``checked_histogram_edges``.
    """

    def __init__(self, edges: Mapping[str, Iterable[float]] | None, sink: str) -> None:
        self._edges = checked_histogram_edges(edges)
        self._sink = sink
        # The sink's writing thread adds, close (maybe another thread) copies: each a single
        # set operation under the GIL. No lock: a sink must pickle (ProcessSink).
        self._matched: set[str] = set()
        self._without: set[str] = set()  # histogram names no key matched

    def edges(self, name: str, num_bins: int, warn_once: Callable[[str, str], None]) -> list[float]:
        """The edges of histogram ``name`` of ``num_bins`` bins (``histogram_edges``).

        Raises:
            ValueError: As ``histogram_edges``.
        """
        given = self._edges.get(name)
        if given is not None:
            self._matched.add(name)
        elif self._edges:
            self._without.add(name)
            for key in self._edges:
                if name.endswith("/" + key):
                    warn_once(
                        f"histogram_edges:{name}",
                        f"{self._sink}: histogram {name!r} has no histogram_edges entry, so its "
                        f"bins are drawn as [i, i + 1); the option has {key!r}: its keys are "
                        f"the names as reported, with the stream's prefix ({name!r})",
                    )
                    break
        return histogram_edges(num_bins, given)

    def warn_unmatched(self, warn_once: Callable[[str, str], None]) -> None:
        """Name the keys no histogram matched, if any (a sink's ``close``)."""
        warning = self.unmatched_warning()
        if warning is not None:
            warn_once("histogram_edges", warning)

    def unmatched_warning(self) -> str | None:
        """A warning naming the keys no histogram matched so far, or ``None`` if there are none."""
        unmatched = sorted(set(self._edges) - self._matched.copy())
        written = sorted(self._without.copy())
        if not unmatched:
            return None
        hints = []
        for key in unmatched:
            # The prefix left out first (every stream's name), else the closest spelling.
            close = [name for name in written if name.endswith("/" + key)][:3]
            close = close or difflib.get_close_matches(key, written, n=1)
            guess = " or ".join(map(repr, close))
            hints.append(f"{key!r}" + (f" (did you mean {guess}?)" if close else ""))
        seen = ", ".join(map(repr, written[:5])) + (", ..." if len(written) > 5 else "")
        if written:
            about = f"histograms without edges: {seen}"
        elif self._matched:
            about = "every histogram it wrote had edges"  # the others' names were used
        else:
            about = "it wrote no histogram"
        return (
            f"{self._sink}: histogram_edges {', '.join(hints)} matched no histogram of this run "
            f"({about}); "
            "keys are the names as reported, with the stream's prefix (such as 'train/scores')"
        )


def check_directory_path(
    name: str, directory: str | os.PathLike[str], *, written: bool = True
) -> None:
    """Raise ``ValueError`` if ``directory`` cannot be made and written by a sink.

    It is refused if empty, if it holds a NUL byte, if it or a folder above it exists as
    something else or is a symbolic link to nothing, or if the nearest folder of it that exists
    cannot be written (a read-only folder or file system) while ``written``: false for the
    folder of a file that exists already, which is written without the folder.

    Making the directory later would fail for good (``FileExistsError``) on every retry, so a
    sink option naming one is refused when the sink is made.
    """
    text = os.fspath(directory)
    if not text or "\0" in text:
        # Empty, it would silently become a default (the working directory, SummaryWriter's
        # runs/...); a NUL byte fails at open, after training started.
        raise ValueError(f"{name}: expected a directory path, got {text!r}")
    if "://" not in text:  # a URL (s3://...) names no local folder or file
        check_name_lengths(name, text)
    path = Path(directory)
    for place in (path, *path.parents):
        if place.is_symlink() and not place.exists():
            # exists() follows the link: making the directory would fail on every retry.
            raise ValueError(
                f"{name}: {str(place)!r} is a symbolic link to nothing (in {str(path)!r})"
            )
        if place.exists():
            if not place.is_dir():
                raise ValueError(
                    f"{name}: {str(place)!r} is a file, not a directory (in {str(path)!r})"
                )
            if written and not os.access(place, os.W_OK | os.X_OK):
                # A read-only folder (or file system): every write would fail, and a spool
                # would drop each report past its queue, after training started.
                raise ValueError(
                    f"{name}: {str(place)!r} is not writable by this process (in {str(path)!r})"
                )
            return


def check_name_lengths(name: str, path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError`` naming ``name`` if ``path`` is longer than its file system takes.

    A folder or file name over the file system's limit (255 bytes on most, as UTF-8: 85 CJK
    characters) or a path over ``PATH_MAX`` made the checks of a sink's path raise a bare
    ``OSError`` ("File name too long") naming no option, or, below a folder not made yet,
    passed them: every open on rank 0 then failed and was retried until ``close``.
    """
    if not hasattr(os, "pathconf"):
        # Windows: its limits count UTF-16 units (255 a name on NTFS, 85 CJK characters would
        # be refused as UTF-8 bytes) and long paths may be enabled: left to the open.
        return
    absolute = os.path.abspath(os.fspath(path))
    existing = absolute
    while not os.path.isdir(existing):  # False for a name too long too: its folder answers
        existing = os.path.dirname(existing)  # ends at the root, a folder on POSIX
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):  # no such setting here: Linux's
        name_max, path_max = 255, 4096
    # -1: a limit the file system does not state (every name was refused as over it).
    name_max = name_max if name_max > 0 else sys.maxsize
    path_max = path_max if path_max > 0 else sys.maxsize
    for part in absolute.split(os.sep):
        if len(os.fsencode(part)) > name_max:
            raise ValueError(
                f"{name}: {absolute!r} has a folder or file name of {len(os.fsencode(part))} "
                f"bytes; this file system takes names of at most {name_max} (as UTF-8)"
            )
    if len(os.fsencode(absolute)) >= path_max:
        raise ValueError(
            f"{name}: {absolute!r} is {len(os.fsencode(absolute))} bytes long; this file "
            f"system takes paths shorter than {path_max}"
        )


def working_directory_hint(error: BaseException) -> str:
    """A note for ``error`` when it comes from this process's deleted working directory.

    MLflow and wandb read the working directory when they open a run, even for absolute
    paths; once it is deleted their open fails with a ``FileNotFoundError`` that names no
    path, so the retried open said nothing of the cause. ``""`` for any other error.
    """
    if not isinstance(error, FileNotFoundError) or error.filename is not None:
        return ""
    try:
        os.getcwd()
    except FileNotFoundError:
        return (
            " (this process's working directory was deleted, and the client reads it: "
            "os.chdir to a folder that exists, or start the job from one)"
        )
    except OSError:
        return ""
    return ""


def check_seconds(name: str, seconds: object) -> None:
    """Raise naming ``name`` unless ``seconds`` is a real, non-NaN number of seconds."""
    if isinstance(seconds, bool) or not isinstance(seconds, Real):
        raise TypeError(f"{name}: expected a number of seconds, got {seconds!r}")
    if math.isnan(seconds):
        raise ValueError(f"{name}: expected a number of seconds, got NaN")


MAX_RETRY_WAIT_S = 86_400.0
"""The longest wait between a sink's retries taken (a day): a backoff far beyond it is a
mistake, and one past ``threading.TIMEOUT_MAX`` (about 292 years) cannot be waited, which ended
the sink's thread."""


def check_retry_waits(initial_name: str, max_name: str, initial: object, maximum: object) -> None:
    """Raise naming both unless ``0 < initial <= maximum <= MAX_RETRY_WAIT_S`` (seconds)."""
    check_seconds(initial_name, initial)
    check_seconds(max_name, maximum)
    assert isinstance(initial, Real) and isinstance(maximum, Real)
    if not 0 < float(initial) <= float(maximum) <= MAX_RETRY_WAIT_S:
        raise ValueError(
            f"{initial_name}, {max_name}: expected 0 < initial <= max <= "
            f"{MAX_RETRY_WAIT_S:.0f} seconds (a day), got {initial}, {maximum}"
        )


def check_option_types(
    owner: str, options: Mapping[str, Any], expected: Mapping[str, tuple[type, ...]]
) -> None:
    """Raise ``TypeError`` naming the option unless each given one is ``None`` or of its types.

    For options a sink forwards to its tracker's client, which would only fail when rank 0
    opens the sink, after training started (``bool`` counts as ``int`` only where listed).
    """
    for option, types in expected.items():
        value = options.get(option)
        if value is None:
            continue
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(kind.__name__ for kind in types)
            raise TypeError(
                f"{owner}: {option}: expected {names} (or None), got {value!r} "
                f"({type(value).__name__})"
            )


def refuse_unknown_options(owner: str, options: Iterable[str], accepted: set[str] | None) -> None:
    """Raise ``TypeError`` for an option not in ``accepted``, naming the nearest one.

    ``accepted`` ``None`` (a client that takes any keyword) accepts everything.
    """
    if accepted is None:
        return
    valid = sorted(accepted)
    for option in options:
        if option not in accepted:
            nearest = difflib.get_close_matches(option, valid, n=1)
            hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
            raise TypeError(
                f"{owner} has no option {option!r}{hint} (valid options: {', '.join(valid)})"
            )


def parse_resume_state(
    state_dict: Mapping[str, Any], id_key: str, sink: str
) -> tuple[str | None, int | None]:
    """Validate a tracker sink's ``{id_key, "last_step"}`` state and return both values.

    Raises:
        ValueError: Naming the key, if either is missing or has the wrong type.
    """
    if not isinstance(state_dict, Mapping) or {id_key, "last_step"} - set(state_dict):
        raise ValueError(
            f"state_dict: expected a mapping with {id_key!r} and 'last_step' (from "
            f"{sink}.state_dict), got {state_dict!r}"
        )
    identity, last_step = state_dict[id_key], state_dict["last_step"]
    if identity is not None and not isinstance(identity, str):
        raise ValueError(f"state_dict[{id_key!r}]: expected a str or None, got {identity!r}")
    if last_step is not None and (isinstance(last_step, bool) or not isinstance(last_step, int)):
        raise ValueError(f"state_dict['last_step']: expected an int or None, got {last_step!r}")
    return identity, last_step


def call_within(
    action: Callable[[], object], timeout: float | None, thread_name: str
) -> tuple[bool, Exception | None]:
    """Run ``action`` on a daemon thread and wait at most ``timeout`` seconds for it.

    Backend clients may block for minutes on a dead server; a sink's ``flush``/``close`` must
    honour its timeout anyway, so the call runs on a thread that is abandoned if it overruns.

    Returns:
        ``(finished, error)``: whether it ended in time, and the exception it raised, if any.
        A ``BaseException`` that is no ``Exception`` (``SystemExit`` from a client,
        ``asyncio.CancelledError``) comes back as a ``RuntimeError`` naming it: the call
        failed, and the caller (a checkpoint on the training thread) must not get an
        interpreter exit raised into it.
    """
    errors: list[Exception] = []

    def run() -> None:
        try:
            action()
        except Exception as error:
            errors.append(error)
        except BaseException as error:
            # Caught, or the thread died with it silently (threading ignores SystemExit) and
            # the call read as finished without error: a close that never ended the run,
            # a flush that wrote nothing, counted as done.
            failure = RuntimeError(f"{type(error).__name__}: {error}")
            failure.__cause__ = error
            errors.append(failure)

    worker = threading.Thread(target=run, name=thread_name, daemon=True)
    try:
        worker.start()
    except RuntimeError as error:
        # CPython 3.12.0 and 3.12.1 start no thread once the interpreter's exit has begun,
        # atexit hooks included, where a Run or collector left open is closed (3.12.2 lifted
        # it). Run here, the call would have no timeout and a hung backend would hold the
        # exit for good: it counts as not ended in time, so the caller keeps what is
        # undelivered in its spool file, as for a close at exit that runs out of time.
        _warn_no_thread(thread_name, error)
        return False, None
    worker.join(timeout)
    if worker.is_alive():
        return False, None
    return True, (errors[0] if errors else None)


_no_thread_warned = False


def _warn_no_thread(thread_name: str, error: RuntimeError) -> None:
    """Say once why a bounded call did not run: its thread could not start."""
    global _no_thread_warned
    if _no_thread_warned:
        return
    _no_thread_warned = True
    if "shutdown" in str(error):
        hint = (
            "Python 3.12.0 and 3.12.1 refuse new threads at interpreter exit: close the Run "
            "(or use `with Run(...)`) before the script ends, or use Python 3.12.2 or later"
        )
    else:  # "can't start new thread": the system's limit of threads or memory
        hint = "the process may have reached the system's limit of threads"
    get_logger("sidestream.sinks").warning(
        "%s: could not start its thread (%s); counted as not ended in time (%s)",
        thread_name,
        error,
        hint,
    )


_thread_filters: list[Callable[[threading.Thread], bool]] = []
_excepthook_lock = threading.Lock()


def silence_thread_errors(is_quiet: Callable[[threading.Thread], bool]) -> None:
    """Keep uncaught exceptions of the threads ``is_quiet`` picks off stderr (DEBUG log).

    For a client's worker threads whose errors the sink reports by itself, once per failure
    streak: TensorBoard's writer thread re-raises its first write error, which printed a
    traceback per replaced writer while a disk stayed full. A filter, not a thread: such a
    thread can fail before its constructor returns. Other threads' errors go to the hook that
    was in place. Call it before each new client thread: if another hook replaced this one
    since, a new one goes on top of it, each passing on to the hook it found (no cycle).
    """
    with _excepthook_lock:
        if is_quiet not in _thread_filters:
            _thread_filters.append(is_quiet)
        if not getattr(threading.excepthook, "_sidestream_quiet", False):
            threading.excepthook = _quiet_hook_over(threading.excepthook)


def _quiet_hook_over(
    previous: Callable[[threading.ExceptHookArgs], object],
) -> Callable[[threading.ExceptHookArgs], None]:
    def quiet_excepthook(args: threading.ExceptHookArgs) -> None:
        thread = args.thread
        if thread is not None and any(_picks(is_quiet, thread) for is_quiet in _thread_filters):
            get_logger("sidestream.sinks").debug(
                "thread %s ended with %s: %s", thread.name, args.exc_type.__name__, args.exc_value
            )
            return
        previous(args)

    quiet_excepthook._sidestream_quiet = True  # type: ignore[attr-defined]
    return quiet_excepthook


def _picks(is_quiet: Callable[[threading.Thread], bool], thread: threading.Thread) -> bool:
    try:
        return bool(is_quiet(thread))
    except Exception:  # a filter's bug must not hide another thread's error
        return False


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic`` time; never negative), ``None`` for none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
