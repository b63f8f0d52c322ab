"""Spool files: reports as JSON lines a person can read, and replaying them into a sink."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from sidestream._exit import KILLED_EXIT_CODE, exiting_with, failed_exit_code
from sidestream._logs import get_logger
from sidestream.sinks.base import Report, RunInfo, Sink
from sidestream.sinks.process import ProcessSink
from sidestream.sinks.tracker import TrackerSink

logger = get_logger("sidestream.sinks")

__all__ = [
    "SPOOL_FORMAT",
    "STATE_SUFFIX",
    "DamagedLineError",
    "KeptState",
    "ReplayResult",
    "SpoolFormatError",
    "check_spool_format",
    "decode_report",
    "encode_report",
    "read_kept_state",
    "read_spool",
    "replay_spool",
    "write_kept_state",
]

SPOOL_FORMAT = 1
"""The format of the spool lines this version writes (each line's ``"format"``) and the newest
it reads. A writer that adds a field or changes what one means writes a higher number: a
reader refuses such a line (``SpoolFormatError``) instead of dropping what it does not know
(a field that scales the values would be read as wrong numbers without a word). Lines without
it are format 1 (written before it was kept)."""

_FORMAT_KEY = "format"

# Standard JSON has no NaN or infinity: they are written as these strings.
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _number(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _tensor(tensor: Tensor) -> dict[str, Any]:
    flat = tensor.detach().cpu().reshape(-1)
    data = flat.tolist()
    if flat.is_floating_point():
        data = [_number(value) for value in data]
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": list(tensor.shape), "data": data}


def encode_report(report: Report) -> bytes:
    """One report as a line of standard JSON (newline-terminated, UTF-8).

    Values are numbers (``"NaN"``, ``"Infinity"``, ``"-Infinity"`` as strings); a histogram is
    ``{"dtype", "shape", "data"}`` with its elements flat, in row-major order. The line's
    ``"format"`` is ``SPOOL_FORMAT``.
    """
    line: dict[str, Any] = {_FORMAT_KEY: SPOOL_FORMAT}
    for field in dataclasses.fields(report):
        value = getattr(report, field.name)
        if field.name == "values":
            value = {name: _number(float(number)) for name, number in value.items()}
        elif field.name == "histograms":
            value = {name: _tensor(tensor) for name, tensor in value.items()}
        line[field.name] = value
    return (json.dumps(line, allow_nan=False, separators=(",", ":")) + "\n").encode()


def _float(value: float | str) -> float:
    if isinstance(value, str):
        if value not in _NON_FINITE:
            raise ValueError(f"expected a number or one of {sorted(_NON_FINITE)}, got {value!r}")
        return _NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _histogram(item: Mapping[str, Any]) -> Tensor:
    name = item["dtype"]
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch dtype name, got {name!r}")
    if not isinstance(item["data"], list):
        raise TypeError(f"data: expected a list, got {item['data']!r}")
    data = [_float(x) if isinstance(x, str) else x for x in item["data"]]
    return torch.tensor(data, dtype=dtype).reshape(item["shape"])


# The fields Report does not check, with their types: a step that is text would otherwise fail
# far from the file (comparing steps in the sink) instead of as a damaged line.
_FIELD_TYPES = (
    ("step", int, "an int"),
    ("time", int | float, "a number"),
    ("stream", str, "a str"),
)


def _check_fields(kwargs: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` for a field of the wrong type (a missing one: ``Report`` names it)."""
    for name, types, text in _FIELD_TYPES:
        if name not in kwargs:
            continue
        value = kwargs[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise TypeError(f"{name}: expected {text}, got {value!r}")


class SpoolFormatError(ValueError):
    """A spool line of a newer format than this version reads: upgrade sidestream to read it.

    Not damage: every later line of its file is of that format too, so it is never skipped as
    a damaged line is (``skip_damaged``).
    """


def _check_format(data: Any) -> bool:
    """Whether ``data`` (a decoded line) names its format; raise for a newer one.

    Raises:
        SpoolFormatError: If the line is of a newer format than ``SPOOL_FORMAT``.
        TypeError: If its ``"format"`` is not an int >= 1 (a damaged line).
    """
    if not isinstance(data, dict) or _FORMAT_KEY not in data:
        return False
    version = data[_FORMAT_KEY]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TypeError(f"{_FORMAT_KEY}: expected an int >= 1, got {version!r}")
    if version > SPOOL_FORMAT:
        raise SpoolFormatError(
            f"spool format {version}, written by a newer sidestream; this version reads "
            f"format {SPOOL_FORMAT} and older: upgrade sidestream to read it"
        )
    return True


def decode_report(line: bytes | str) -> Report:
    """The report that ``encode_report`` wrote as ``line``.

    Raises:
        SpoolFormatError: If the line is of a newer format than ``SPOOL_FORMAT`` (a
            ``ValueError``).
        ValueError: If the line is not such a report (damaged or cut short, or a field of the
            wrong type or unknown to its format).
    """
    try:
        data = json.loads(line)
        # Only a line of a format this version knows is read: a newer one may mean more
        # by its fields than the names say.
        versioned = _check_format(data)
        kwargs: dict[str, Any] = {}
        names = {field.name for field in dataclasses.fields(Report)}
        for name, value in data.items():
            if name == _FORMAT_KEY:
                continue
            if name not in names:
                if versioned:  # a writer of this format writes no other field: damage
                    raise TypeError(f"unknown field {name!r} for spool format {SPOOL_FORMAT}")
                continue  # a line of before the format was kept: its other fields are old
            if name == "values":
                value = {key: _float(number) for key, number in value.items()}
            elif name == "histograms":
                value = {key: _histogram(item) for key, item in value.items()}
            kwargs[name] = value
        _check_fields(kwargs)
        return Report(**kwargs)
    except (
        TypeError,
        KeyError,
        AttributeError,
        RuntimeError,
        OverflowError,  # an integer too large for a float (10**400)
        json.JSONDecodeError,
    ) as error:
        raise ValueError(f"not a spooled report: {type(error).__name__}: {error}") from error


def check_line_format(line: bytes | str) -> None:
    """Raise ``SpoolFormatError`` if ``line`` is of a newer format; damage is not looked at."""
    try:
        data = json.loads(line)
        _check_format(data)
    except (TypeError, ValueError) as error:
        if isinstance(error, SpoolFormatError):
            raise
        return  # a damaged line: decode_report says so where it is read


def check_spool_format(path: str | os.PathLike[str]) -> None:
    """Raise ``SpoolFormatError`` if the spool file at ``path`` is of a newer format.

    One process writes a spool file, so its first line that is whole JSON tells: called
    before a replay opens its sink, a newer file is refused with nothing delivered.

    Raises:
        SpoolFormatError: Naming the file, the line and the format.
        OSError: If the file cannot be read.
    """
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except ValueError:
                continue  # a damaged line (a cut first line): the next one tells
            try:
                _check_format(data)
            except SpoolFormatError as error:
                raise SpoolFormatError(f"{os.fspath(path)}, line {number}: {error}") from None
            except TypeError:
                continue
            return


class DamagedLineError(ValueError):
    """A line of a spool file that is not a report (``read_spool`` names the file and line)."""


def read_spool(
    path: str | os.PathLike[str], *, damaged: list[str] | None = None
) -> Iterator[Report]:
    """The reports in a spool file, oldest first, reading one line at a time.

    Args:
        path: The spool file.
        damaged: If given, a damaged line is skipped and described here (its number and
            what is wrong) instead of raising.

    Raises:
        DamagedLineError: At a damaged line, naming its number (the reports before it were
            yielded), unless ``damaged`` is given. A ``ValueError``.
        SpoolFormatError: At a line of a newer format than this version reads, naming its
            number, even with ``damaged`` given: it is no damage, and skipping it would skip
            the whole file. A ``ValueError``.
    """
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                report = decode_report(line)
            except SpoolFormatError as error:
                raise SpoolFormatError(f"{os.fspath(path)}, line {number}: {error}") from None
            except ValueError as error:
                message = f"{os.fspath(path)}, line {number}: {error}"
                if damaged is None:
                    raise DamagedLineError(message) from None
                damaged.append(message)
                continue
            yield report


STATE_SUFFIX = ".state.json"
"""Beside a kept spool file (``PATH`` + this): the sink's state and the job's run at close."""


@dataclasses.dataclass
class KeptState:
    """What a close wrote beside the spool file it kept (``read_kept_state``).

    Attributes:
        path: The state file.
        sink: The entry-point name of the sink that kept the spool (``"mlflow"``).
        state: Its ``state_dict`` then (run id, run key, delivered steps), or ``None`` if it
            was not JSON.
        run: The job's ``RunInfo`` (name, config, tags), so a replay names the run as the job
            did; ``None`` in files written before it was kept.
        options: The sink's ``replay_options`` (where its backend is), which the replay
            command uses unless ``--option`` gives them; empty in files written before.
        exit_code: How the job was ending when it kept the file (``failed_exit_code``:
            ``None`` for a success), so a replay's close tells the tracker the same.
    """

    path: str
    sink: str
    state: dict[str, Any] | None
    run: RunInfo | None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    exit_code: int | None = None


def write_kept_state(
    spool_path: str,
    sink: str,
    state: Mapping[str, Any],
    run: RunInfo,
    options: Mapping[str, Any] | None = None,
    *,
    interrupted: bool = False,
) -> str | None:
    """Write ``KeptState`` beside ``spool_path``, owner-only; its path, or ``None`` if it failed.

    Config keys and values JSON cannot hold are kept as their ``str`` (how trackers log them).
    ``interrupted``: the close that keeps it was cut short (Ctrl-C): unless the job is known to
    be ending otherwise, its exit code is a stopped job's (a replay then ends the tracker's run
    as killed, not finished).
    """
    path = spool_path + STATE_SUFFIX
    kept_run: dict[str, Any] | None
    try:
        kept_run = {
            "name": _plain(run.name),
            "config": _plain(run.config),
            "tags": _plain(run.tags),
        }
    except Exception:  # a config that cannot even be walked: keep the state without it
        kept_run = None
    try:
        kept_options = _plain(dict(options or {}))
    except Exception:
        kept_options = {}
    kept = {"sink": sink, "run": kept_run, "options": kept_options}
    # A failed (or stopped) job's run is not ended FINISHED by a replay.
    code = failed_exit_code()
    kept["exit_code"] = KILLED_EXIT_CODE if code is None and interrupted else code
    try:
        text = json.dumps({**kept, "state": dict(state)})
    except (TypeError, ValueError) as error:  # not JSON: the run is still worth keeping
        # Said, not silent: without the state a replay cannot resume the sink's run (its run
        # id, its delivered steps), so it may open a new run or deliver steps again.
        logger.warning(
            "sink %r: its state_dict() is not JSON (%s: %s), so the state kept beside %s "
            "holds none and a replay of it does not resume the sink's run; a sink's "
            "state_dict must hold plain JSON values (str keys, lists, numbers, strings)",
            sink,
            type(error).__name__,
            error,
            spool_path,
        )
        text = json.dumps({**kept, "state": None})
    # Written beside it and renamed over it: a full disk (the usual reason a close keeps a
    # spool) leaves the earlier state file or none, never a cut one that refuses a replay.
    partial = path + ".partial"
    try:
        # Owner-only, like the spool file beside it (a run id, a path, delivered steps).
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        with os.fdopen(os.open(partial, flags, 0o600), "w") as file:
            file.write(text)
        os.replace(partial, path)
    except OSError:  # no room: a replay then needs --sink and --resume-state
        with contextlib.suppress(OSError):
            os.remove(partial)
        return None
    return path


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: keys and unknown objects as their ``str``.

    As trackers log them; containers are walked.
    """
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


def read_kept_state(spool_path: str | os.PathLike[str]) -> KeptState | None:
    """The ``KeptState`` beside ``spool_path``, or ``None`` if there is none.

    Raises:
        ValueError: If the file is there but is not a kept state.
    """
    path = os.fspath(spool_path) + STATE_SUFFIX
    try:
        with open(path, encoding="utf-8") as file:
            kept = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from error
    try:
        sink, state, run = kept["sink"], kept["state"], kept.get("run")
        options = kept.get("options") or {}
        exit_code = kept.get("exit_code")
        if not isinstance(sink, str) or not isinstance(state, dict | None):
            raise TypeError("expected a sink name and a state")
        if exit_code is not None and type(exit_code) is not int:  # a bool is no code
            raise TypeError(f"expected the job's exit code as an integer, got {exit_code!r}")
        if not isinstance(options, dict):
            raise TypeError(f"expected the sink's options as an object, got {options!r}")
        info = None if run is None else _kept_run(path, run)
    except (TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"{path}: not a kept sink state ({error})") from error
    return KeptState(path, sink, state, info, options, exit_code)


def _kept_run(path: str, run: Mapping[str, Any]) -> RunInfo:
    """The job's ``RunInfo`` as kept; its config dropped (with a warning) if it is refused now.

    A file kept before ``RunInfo`` refused two config entries of one flattened name still
    holds the sink's state: the replay must land in the job's run all the same.
    """
    try:
        return RunInfo(run["name"], run["config"], run["tags"])
    except ValueError as error:
        logger.warning("%s: the kept run config is left out (%s)", path, error)
        return RunInfo(run["name"], {}, run["tags"])


@dataclasses.dataclass
class ReplayResult:
    """What ``replay_spool`` did with a spool file.

    Attributes:
        written: Reports handed to the sink that it did not have yet.
        skipped: Reports whose step the sink already had (a tracker sink resumed from the
            checkpoint's state, a spool replayed before, or a backend that holds every value
            of the report at its step), not sent again.
        held: Reports with values a tracker left out because the backend holds those values
            at later steps only (``TrackerSink.held_values``): not sent at all, or sent in
            part. They may be missing from the backend; the command keeps the file then.
        damaged: The damaged lines skipped (with ``skip_damaged``), each described.
        resumed_from: The kept state file the sink resumed from, if it did.
        closed: Whether the backend has every report written: the sink's ``close``
            confirmed it (``False``: the close timed out or failed, and the written reports
            may be missing there; replay the file again). A tracker's close that returned
            ``False`` only because the run lacks values it left out counts as confirmed.
        lacking: The names of values the tracker's run lacks for good (the backend could not
            take them, in this replay or in the job it resumes: ``skip_value``).
    """

    written: int = 0
    skipped: int = 0
    held: int = 0
    damaged: list[str] = dataclasses.field(default_factory=list)
    resumed_from: str | None = None
    closed: bool = False
    lacking: list[str] = dataclasses.field(default_factory=list)


def replay_spool(
    path: str | os.PathLike[str],
    sink: Sink,
    run: RunInfo | None = None,
    *,
    resume_state: Mapping[str, Any] | None = None,
    timeout: float | None = 60.0,
    skip_damaged: bool = False,
    progress: Callable[[ReplayResult], None] | None = None,
    closing: Callable[[ReplayResult], None] | None = None,
) -> ReplayResult:
    """Deliver a kept spool file into ``sink``: load its state, open, write each report, close.

    Use it after a job warned that reports were "kept in" a spool file, with the sink the job
    used and, for a tracker, the sink state from the job's checkpoint (``resume_state``) so
    the reports land in the same run. Steps the sink already has are skipped by sinks that
    resume (JSONL, TensorBoard, MLflow, W&B), and counted in ``skipped``, as are reports whose
    every value the backend holds at the report's step. Values the backend holds at later
    steps only are left out (MLflow, TensorBoard: a value is never logged below the largest
    step the backend has of it) and their reports counted in ``held``: replay a kept file
    before a resumed job delivers past its steps.

    A close that kept the file wrote the sink's state and the job's run beside it
    (``PATH.state.json``, see ``read_kept_state``): what is not given is taken from there, so
    the reports land in the job's run, named as the job named it, and the sink's close ends
    the run as the job was ending. A file with no state beside it was left by a job that never
    closed (a crash): the run's status is left as it is (``Sink.keep_run_status``), since a
    resumed job may be running the run, or have ended it already.

    Args:
        path: The spool file.
        sink: Where the reports go.
        run: Given to ``sink.open``; ``None``: the kept run, if any, else an empty one.
        resume_state: Given to ``sink.load_state_dict`` before ``open``; ``None``: the kept
            state, if the same kind of sink kept it.
        timeout: Given to ``sink.close``, which waits that long for the backend to confirm.
        skip_damaged: Skip damaged lines (listed in the result) and deliver the rest, instead
            of raising at the first one.
        progress: Called with the result so far after each report (written or skipped), for
            a long replay to show how far it is.
        closing: Called once every report is read and written, before the sink's close waits
            (up to ``timeout``) for its backend: a replay that looks done may wait there.

    Returns:
        How many reports were written and skipped, the damaged lines passed over, and
        whether the sink's close confirmed delivery (``closed``: only then are the written
        reports in the backend).

    Raises:
        DamagedLineError: At a damaged line without ``skip_damaged`` (the reports before it
            were delivered). A ``ValueError``, as are the errors of a ``resume_state`` that
            the sink refuses.
        SpoolFormatError: If the file is of a newer format than this version reads, before
            the sink opens (a ``ValueError``).
        TypeError: If ``sink`` is a ``ProcessSink``: the replay asks the sink itself which
            reports and values its backend has, which a sink in a child process cannot tell.
    """
    if isinstance(sink, ProcessSink):
        raise TypeError(
            "sink: pass the sink itself, not a ProcessSink (child_process): the replay asks it "
            "which reports its backend has already, and a sink in a child process cannot say"
        )
    # Before the sink takes a state or opens (an empty run): a newer file is not read at all.
    check_spool_format(path)
    result = ReplayResult()
    kept = _kept_beside(path) if run is None or resume_state is None else None
    if kept is not None:
        run = run if run is not None else kept.run
        if resume_state is None and kept.state is not None:
            if kept.sink == sink.name:
                resume_state, result.resumed_from = kept.state, kept.path
            else:
                logger.warning(
                    "not resuming from %s: it holds the state of sink %r", kept.path, kept.sink
                )
    if resume_state is not None:
        sink.load_state_dict(resume_state)
    if not os.path.exists(os.fspath(path) + STATE_SUFFIX):
        # Its job never closed (a crash): how it ended is unknown, and a resumed job may be
        # running its run, or have ended it already.
        sink.keep_run_status()
    tracker = sink if isinstance(sink, TrackerSink) else None
    if tracker is not None:
        tracker.replaying = True
    sink.open(run or RunInfo())
    read_all = False
    try:
        for report in read_spool(path, damaged=result.damaged if skip_damaged else None):
            _replay_one(sink, tracker, report, result)
            if progress is not None:
                progress(result)
        read_all = True
    finally:
        if not read_all or result.held:
            sink.leave_unfinished()  # the file is kept: the run still lacks some of it
        try:
            if closing is not None:
                closing(result)
        finally:  # the sink closes even if the callback fails
            # Only a confirmed close means the backend has the reports (W&B's service, or a
            # TensorBoard file, may still hold them before it): the caller must know. The
            # tracker hears how the job ended (a failed job's MLflow run FAILED).
            with exiting_with(None if kept is None else kept.exit_code):
                result.closed = sink.close(timeout)
        if tracker is not None:
            result.lacking = tracker.skipped_values
            # Not the close's False for values the run lacks (every later close says it
            # again): whether the backend confirmed the reports.
            if tracker.backend_confirmed is not None:
                result.closed = tracker.backend_confirmed
    return result


def _replay_one(
    sink: Sink, tracker: TrackerSink | None, report: Report, result: ReplayResult
) -> None:
    """Write ``report`` into ``sink`` unless the sink or its backend has it; count it."""
    if tracker is not None and tracker.is_delivered(report):
        result.skipped += 1
        return
    there = tracker.values_in_backend(report) if tracker is not None else []
    # Held values are among those left out: no second scan when none is.
    held = bool(there) and tracker is not None and bool(tracker.held_values(report))
    result.held += held
    if there and len(there) == len(report.values) + len(report.histograms):
        # Nothing of it would be sent: the backend has all of it at this step (the sink
        # already had it), or some of it only at later steps (held).
        result.skipped += not held
        return
    sink.write(report)
    result.written += 1


def _kept_beside(path: str | os.PathLike[str]) -> KeptState | None:
    try:
        return read_kept_state(path)
    except ValueError as error:  # a damaged state file must not stop the replay
        logger.warning("not resuming from the state kept beside the spool: %s", error)
        return None
