"""MlflowSink's HTTP settings apply to its own requests only, never to the whole process."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")
from mlflow.utils import rest_utils

from sidestream.sinks import RunInfo
from sidestream_mlflow import MlflowSink
from sidestream_mlflow._http import request_settings


def test_settings_reach_only_calls_inside_the_block_on_that_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(rest_utils, "http_request", lambda **kwargs: calls.append(kwargs))

    def call() -> None:
        rest_utils.http_request(endpoint="/x", max_retries=None)

    with request_settings(timeout=7, max_retries=0):
        call()
        other = threading.Thread(target=call)  # the user's MLflow call on another thread
        other.start()
        other.join()
    call()
    assert calls[0] == {"endpoint": "/x", "max_retries": 0, "timeout": 7}
    assert calls[1] == calls[2] == {"endpoint": "/x", "max_retries": None}


def test_opening_the_sink_changes_no_environment_variable(shm_path: Path) -> None:
    before = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_HTTP")}
    sink = MlflowSink(tracking_uri=f"sqlite:///{shm_path / 'mlflow.db'}", experiment="env")
    sink.open(RunInfo(name="env"))
    assert sink.close(timeout=60)
    assert {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_HTTP")} == before
