"""Sinks: where finished metric values go."""

from sidestream.sinks._spool_format import read_spool, replay_spool
from sidestream.sinks.base import Report, RunInfo, Sink
from sidestream.sinks.config import available_sinks, sinks_from_config
from sidestream.sinks.console import ConsoleSink
from sidestream.sinks.jsonl import JsonlSink
from sidestream.sinks.process import ProcessSink, SinkProcessError
from sidestream.sinks.runner import SinkRunner

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "ProcessSink",
    "Report",
    "RunInfo",
    "Sink",
    "SinkProcessError",
    "SinkRunner",
    "available_sinks",
    "read_spool",
    "replay_spool",
    "sinks_from_config",
]
