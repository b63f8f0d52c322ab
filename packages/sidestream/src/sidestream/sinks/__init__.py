"""Sinks: where finished metric values go."""

from sidestream.sinks.base import Report, RunInfo, Sink

__all__ = ["Report", "RunInfo", "Sink"]
