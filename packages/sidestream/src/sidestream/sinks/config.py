"""Build sinks by name from the ``sidestream.sinks`` entry points."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points
from importlib.util import find_spec
from typing import Any

from sidestream.sinks.base import Sink
from sidestream.sinks.process import ProcessSink
from sidestream.sinks.support import refuse_unknown_options

__all__ = ["ENTRY_POINT_GROUP", "available_sinks", "install_hint", "sinks_from_config"]

ENTRY_POINT_GROUP = "sidestream.sinks"

# Sinks that live in an optional integration distribution, by entry-point name.
_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}


def install_hint(name: str) -> str:
    """The commands that install the integration of sink ``name``: from an index and a checkout."""
    return (
        f'pip install "sidestream[{_EXTRAS[name]}]" (from a checkout of the repository: pip '
        f"install ./packages/sidestream ./integrations/sidestream-{_EXTRAS[name]})"
    )


SinkConfig = Mapping[str, Mapping[str, Any] | None] | Sequence[str | Mapping[str, Any]]


_KNOWN = {
    "jsonl": "sidestream.sinks.jsonl:JsonlSink",
    "console": "sidestream.sinks.console:ConsoleSink",
    "wandb": "sidestream_wandb:WandbSink",
    "mlflow": "sidestream_mlflow:MlflowSink",
    "tensorboard": "sidestream_tensorboard:TensorBoardSink",
}
"""This repository's sinks by name, the same as their entry points. Used for a name no
installed distribution declares, when its module can be imported: code run from a source tree
(``PYTHONPATH`` on the ``src/`` folders) has no entry points at all."""


def _sink_entry_points() -> dict[str, EntryPoint]:
    """Every sink by name: the installed entry points over this repository's importable ones."""
    found = {
        name: EntryPoint(name, value, ENTRY_POINT_GROUP)
        for name, value in _KNOWN.items()
        if _importable(value.partition(":")[0])
    }
    # An installed entry point wins: it is what the user's environment declares.
    found.update((entry.name, entry) for entry in entry_points(group=ENTRY_POINT_GROUP))
    return found


def _importable(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent; a stub in sys.modules without a spec
        return False


def available_sinks() -> list[str]:
    """Names of every sink that can be built.

    Those installed (entry points), and this repository's own ones whose module can be imported
    (a source tree with nothing installed).
    """
    return sorted(_sink_entry_points())


def sinks_from_config(config: SinkConfig) -> list[Sink]:
    """Build sinks by entry-point name with keyword options.

    Two spellings, in order:

    - a mapping of name to options: ``{"jsonl": {"path": "runs/a.jsonl"}, "console": None}``;
    - a list of names or of option dicts with a ``"type"``:
      ``["console", {"type": "jsonl", "path": "runs/a.jsonl"}]`` (the same type may repeat).

    The option ``"child_process": True`` runs that sink in a child process of its own
    (``ProcessSink``), so its client's Python work never competes with training for the GIL;
    a mapping instead of ``True`` gives ``ProcessSink``'s options
    (``"child_process": {"call_timeout_s": 60}``).

    Everything is checked here, on every rank, before anything opens: each option against the
    sink's constructor (and the client call it forwards options to), and that the tracker's
    client is installed.

    Args:
        config: One of the spellings above.

    Returns:
        The sinks, in the order given.

    Raises:
        LookupError: If a name is not installed, its entry point fails to load (its module's
            import raises, or it names no object: the message names the sink and the entry
            point) or its tracker client is missing; for ``wandb``, ``mlflow`` and
            ``tensorboard`` the message gives the install command from an index
            (``pip install "sidestream[mlflow]"``) and from a checkout.
        TypeError: If the config has the wrong shape, an option is unknown (the message names
            it, the valid options and the nearest match), or the entry point does not make a
            ``Sink``.
    """
    return [_build(name, options) for name, options in _entries(config)]


def _entries(config: SinkConfig) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(config, Mapping):
        entries = []
        for name, options in config.items():
            if options is not None and not isinstance(options, Mapping):
                raise TypeError(
                    f"sinks_from_config: options of {name!r} must be a dict or None, "
                    f"got {type(options).__name__}"
                )
            entries.append((str(name), dict(options or {})))
        return entries
    if isinstance(config, str) or not isinstance(config, Sequence):
        raise TypeError(
            "sinks_from_config: expected {name: options} or a list of names / "
            f"{{'type': name, ...}} dicts, got {type(config).__name__}"
        )
    entries = []
    for item in config:
        if isinstance(item, str):
            entries.append((item, {}))
        elif isinstance(item, Mapping) and isinstance(item.get("type"), str):
            options = dict(item)
            entries.append((options.pop("type"), options))
        else:
            raise TypeError(
                f"sinks_from_config: list items must be names or dicts with a 'type', got {item!r}"
            )
    return entries


def _build(name: str, options: dict[str, Any]) -> Sink:
    # None (YAML's ``child_process: null`` or ``~``) is the default, like a missing key.
    child_process = options.pop("child_process", None)
    if child_process is None:
        child_process = False
    process_options: dict[str, Any] = {}
    if isinstance(child_process, Mapping):
        process_options, child_process = dict(child_process), True
        refuse_unknown_options(
            f"sinks_from_config: sink {name!r}: child_process", process_options, _PROCESS_OPTIONS
        )
    elif not isinstance(child_process, bool):
        raise TypeError(
            f"sinks_from_config: sink {name!r}: child_process must be true, false (or null) or "
            f"a mapping of ProcessSink options, got {child_process!r}"
        )
    try:
        sink = _make(name, options)
    except TypeError as error:
        # Only an option the sink refused: JsonlSink has a flush_every of its own.
        misplaced = [
            option
            for option in sorted(_PROCESS_OPTIONS & options.keys())
            if f"no option {option!r}" in str(error)
        ]
        if not misplaced:
            raise
        raise TypeError(
            f"sinks_from_config: sink {name!r}: {misplaced[0]!r} is an option of the child "
            f"process, not of the sink: give it as child_process: {{{misplaced[0]!r}: ...}}"
        ) from error
    if not child_process:
        return sink
    try:
        return ProcessSink(sink, **process_options)
    except (TypeError, ValueError) as error:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"sinks_from_config: sink {name!r}: child_process: {error}") from error


_PROCESS_OPTIONS = {
    name
    for name, parameter in inspect.signature(ProcessSink).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
}
"""``ProcessSink``'s own options (``call_timeout_s``, ...), given in ``child_process``."""


def _make(name: str, options: dict[str, Any]) -> Sink:
    entry = _sink_entry_points().get(name)
    if entry is None:
        if name in _EXTRAS:
            raise LookupError(f"sink {name!r} is not installed: {install_hint(name)}")
        installed = available_sinks()
        missing = sorted(set(_EXTRAS) - set(installed))  # only extras not installed yet
        known = [*installed, *missing]
        # Case first: "JSONL" is too far from "jsonl" for difflib, and sink names are lowercase.
        nearest = [n for n in known if n.lower() == name.lower()]
        nearest = nearest or difflib.get_close_matches(name, known, n=1)
        raise LookupError(
            f"sink {name!r} is unknown"
            + (f" (did you mean {nearest[0]!r}?)" if nearest else "")
            + f"; installed sinks: {', '.join(installed) or 'none'}"
            + (
                f' (optional: {", ".join(missing)} via pip install "sidestream[NAME]")'
                if missing
                else ""
            )
        )
    try:
        factory = entry.load()
    except ImportError as error:
        hint = (
            install_hint(name)
            if name in _EXTRAS
            else f"reinstall the package that provides {entry.value}"
        )
        raise LookupError(f"sink {name!r} could not be imported ({error}); {hint}") from error
    except Exception as error:
        # A third-party plugin's own fault (an error raised at its import, a syntax error, an
        # entry point naming no object): said with the sink and the entry point it came from,
        # where the bare error named neither.
        raise LookupError(
            f"sink {name!r}: loading its entry point {entry.value!r} failed: "
            f"{type(error).__name__}: {error}"
        ) from error
    check_available = getattr(factory, "check_available", None)
    if callable(check_available):
        try:
            check_available()
        except ImportError as error:
            hint = install_hint(name) if name in _EXTRAS else "install the tracker's client"
            # A message that gives a command already (the integrations' own: an install, or
            # an upgrade of a client older than the sink needs) gets no second one.
            said = "pip install" in str(error)
            raise LookupError(f"sink {name!r}: {error}" + ("" if said else f" ({hint})")) from None
        except Exception as error:
            # A client whose own import fails otherwise (a broken install raising an
            # AttributeError, a version check's RuntimeError): named with the sink.
            raise LookupError(
                f"sink {name!r}: checking its tracker client failed: "
                f"{type(error).__name__}: {error}"
            ) from error
    _check_options(name, factory, options)
    try:
        sink = factory(**options)
    except TypeError as error:
        # Only once the factory itself refused: one that fills an option itself (a decorated
        # __init__, a function wrapping the class with functools.wraps) shows the class's
        # signature, whose required options it does not need.
        _refuse_missing_options(name, factory, options, error)
        raise TypeError(f"sinks_from_config: sink {name!r}: {error}") from error
    except ValueError as error:  # a subclass (pydantic's) may not take a plain message
        raise ValueError(f"sinks_from_config: sink {name!r}: {error}") from error
    if not isinstance(sink, Sink):
        raise TypeError(
            f"sinks_from_config: entry point {name!r} made a {type(sink).__name__}, not a Sink"
        )
    return sink


def _check_options(name: str, factory: Any, options: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` for an option ``factory`` does not take, naming the nearest one."""
    option_names = getattr(factory, "option_names", None)
    if callable(option_names):
        accepted = option_names()
    else:
        try:
            parameters = inspect.signature(factory).parameters.values()
        except (TypeError, ValueError):
            return
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return
        accepted = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    for option in options:
        if not isinstance(option, str):  # a YAML key read as a number (1: 2)
            raise TypeError(
                f"sinks_from_config: sink {name!r}: option names must be text, got {option!r}"
            )
    if accepted is not None:
        accepted = accepted | {"child_process"}
    refuse_unknown_options(f"sinks_from_config: sink {name!r}", options, accepted)


def _refuse_missing_options(
    name: str, factory: Any, options: Mapping[str, Any], error: TypeError
) -> None:
    """Raise ``TypeError`` naming the required options that ``options`` lacks.

    Python's own error ("__init__() missing 1 required positional argument") names neither
    the sink nor how to give the option in a config (or to the replay command).
    """
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return
    required = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [
        p.name
        for p in parameters
        if p.kind in required and p.default is inspect.Parameter.empty and p.name not in options
    ]
    if missing and "missing" in str(error):
        example = ", ".join(f"{option!r}: ..." for option in missing)
        raise TypeError(
            f"sinks_from_config: sink {name!r}: missing required option(s) {missing}: give "
            f"them in its options ({{{name!r}: {{{example}}}}}; to the replay command: "
            + " ".join(f"--option {option}=..." for option in missing)
            + ")"
        ) from error
