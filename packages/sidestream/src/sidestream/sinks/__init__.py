"""Sinks: where finished metric values go."""

from sidestream.sinks._spool_format import (
    KeptState,
    ReplayResult,
    read_kept_state,
    read_spool,
    replay_spool,
)
from sidestream.sinks.base import Report, RunInfo, Sink
from sidestream.sinks.config import available_sinks, sinks_from_config
from sidestream.sinks.console import ConsoleSink
from sidestream.sinks.jsonl import JsonlSink, read_jsonl
from sidestream.sinks.process import ProcessSink, SinkProcessError
from sidestream.sinks.runner import SinkRunner
from sidestream.sinks.status import PermanentSinkError, SinkStatus, is_permanent
from sidestream.sinks.tracker import TrackerSink, UnconfirmedBacklogError

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "KeptState",
    "PermanentSinkError",
    "ProcessSink",
    "Report",
    "RunInfo",
    "Sink",
    "SinkProcessError",
    "SinkRunner",
    "SinkStatus",
    "TrackerSink",
    "UnconfirmedBacklogError",
    "available_sinks",
    "is_permanent",
    "read_jsonl",
    "read_kept_state",
    "ReplayResult",
    "read_spool",
    "replay_spool",
    "sinks_from_config",
]
