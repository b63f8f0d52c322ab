"""MlflowSink against a tracking server that refuses, misleads or goes away at the wrong moment."""

from __future__ import annotations

import contextlib
import http.server
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidestream.sinks import PermanentSinkError, Report, RunInfo
from tests._ports import quiet_port

mlflow = pytest.importorskip("mlflow")
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.protos.databricks_pb2 import UNAUTHENTICATED  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from sidestream_mlflow import MlflowSink  # noqa: E402

_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


@contextlib.contextmanager
def _http_server(status: int, body: bytes = b"") -> Iterator[str]:
    """A plain HTTP server on 127.0.0.1 answering every request with ``status``; its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", quiet_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _report(step: int) -> Report:
    return Report(step=step, values={"loss": 0.5}, time=time.time())


def test_a_server_away_for_a_moment_at_close_still_ends_the_run(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One dropped connection (a 503, a restart) at the final set_terminated left the run
    # RUNNING for good, close returned False at once although its timeout had time to spare.
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    original = MlflowClient.set_terminated
    calls = {"n": 0}

    def away_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("connection refused")  # never reached the server
        return original(self, *args, **kwargs)

    sink = MlflowSink(tracking_uri=uri, experiment="away-at-close")
    sink.open(RunInfo(name="away"))
    sink.write(_report(0))
    run_id = sink.run_id
    monkeypatch.setattr(MlflowClient, "set_terminated", away_once)
    assert sink.close(timeout=10) is True
    assert calls["n"] == 2
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FINISHED"


def test_a_refused_close_says_the_values_are_in_and_how_to_end_the_run(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Credentials changed before the close (HTTP 401): not retried, and the warning says the
    # run holds every value and how to end it, not only that the close failed.
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise MlflowException("You are not authenticated", error_code=UNAUTHENTICATED)

    sink = MlflowSink(tracking_uri=uri, experiment="refused-at-close")
    sink.open(RunInfo(name="refused"))
    sink.write(_report(0))
    run_id = sink.run_id
    monkeypatch.setattr(MlflowClient, "set_terminated", refused)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        assert sink.close(timeout=10) is False
    assert time.monotonic() - started < 5, "a refusal is not retried until the timeout"
    assert f"set_terminated({run_id!r}, status='FINISHED')" in caplog.text
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "RUNNING"


def test_https_to_a_plain_http_server_fails_for_good_naming_the_fix() -> None:
    # The TLS handshake against a plain HTTP server fails the same way every time: it was
    # retried (a transient RuntimeError) until the job's close, its reports left in a spool.
    with _http_server(200) as url:
        sink = MlflowSink(tracking_uri=url.replace("http://", "https://"), experiment="tls")
        with pytest.raises(PermanentSinkError, match=r"make tracking_uri http://"):
            sink.open(RunInfo(name="tls"))


def test_a_url_copied_from_the_ui_is_refused_when_the_sink_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # MLflow appends its API paths after the fragment: every request got the UI's page.
    with pytest.raises(ValueError, match=r"use the server's URL, 'http://127.0.0.1:5000'"):
        MlflowSink(tracking_uri="http://127.0.0.1:5000/#/experiments/1")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000/?experiment=1")
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_URI"):
        MlflowSink()
    MlflowSink(tracking_uri="http://127.0.0.1:5000/mlflow/")  # a path prefix is fine


@pytest.mark.parametrize(
    ("status", "environment", "expected"),
    [
        (401, {}, "no credentials were given: set MLFLOW_TRACKING_USERNAME"),
        (
            401,
            {"MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": "wrong-pw"},
            "refused the credentials: check MLFLOW_TRACKING_USERNAME ('bob')",
        ),
        (
            403,
            {"MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": "right-pw"},
            "user 'bob' may not write to experiment 'shared'",
        ),
    ],
)
def test_refused_credentials_name_the_setting_to_fix(
    monkeypatch: pytest.MonkeyPatch, status: int, environment: dict[str, str], expected: str
) -> None:
    # MLflow's own message is only "You are not authenticated" / "Permission denied".
    for name in _CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with _http_server(status, b"Permission denied") as url:
        sink = MlflowSink(tracking_uri=url, experiment="shared")
        with pytest.raises(PermanentSinkError) as raised:
            sink.open(RunInfo(name="auth"))
    assert expected in str(raised.value)
    assert "wrong-pw" not in str(raised.value) and "right-pw" not in str(raised.value)


def test_a_deleted_experiment_names_the_restore_command(shm_path: Path) -> None:
    # MLflow's refusal named the experiment's id and state only.
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment("gone")
    client.delete_experiment(experiment_id)
    sink = MlflowSink(tracking_uri=uri, experiment="gone")
    with pytest.raises(
        PermanentSinkError, match=rf"mlflow experiments restore --experiment-id {experiment_id}"
    ):
        sink.open(RunInfo(name="gone"))
