from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidestream.sinks import Report, RunInfo
from sidestream.testing import DistributedPool
from tests.integrations._driver import RetryingDriver
from tests.integrations._workload import RUN_INFO, expected, train
from tests.integrations.conftest import MlflowServer

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from sidestream_mlflow import MlflowSink  # noqa: E402

STEPS = 200


def _spec(uri: str, experiment: str) -> tuple[str, str, dict[str, Any]]:
    return ("sidestream_mlflow", "MlflowSink", {"tracking_uri": uri, "experiment": experiment})


def _histories(client: Any, run_id: str, keys: list[str]) -> dict[str, list[Any]]:
    return {key: client.get_metric_history(run_id, key) for key in keys}


def _check_run(client: Any, experiment: str, steps: range) -> str:
    """One run in ``experiment`` whose every metric has each step of ``steps`` once, right."""
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"expected one run, got {len(runs)}"
    run = runs[0]
    keys = list(expected(0)[0])
    assert sorted(run.data.metrics) == sorted(keys)
    for key, history in _histories(client, run.info.run_id, keys).items():
        got_steps = [m.step for m in sorted(history, key=lambda m: (m.timestamp, m.step))]
        assert got_steps == list(steps), key
        for metric in history:
            want = expected(metric.step)[0][key]
            np.testing.assert_allclose(
                metric.value, want, rtol=1e-12, err_msg=f"{key}@{metric.step}"
            )
    return str(run.info.run_id)


def test_two_ranks_every_window_once_through_server(
    mlflow_server: MlflowServer, pool2: DistributedPool
) -> None:
    results = pool2.run(train, _spec(mlflow_server.uri, "dist"), range(STEPS), timeout=240)
    assert [r["opened_sink"] for r in results] == [True, False]
    assert results[0]["closed"] is True and results[0]["failures"] == 0
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = _check_run(client, "dist", range(STEPS))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "integration"
    assert run.data.params["optimizer.lr"] == "0.0003"
    assert run.data.params["optimizer.betas"] == "[0.9, 0.95]"
    assert run.data.tags["suite"] == "integration"
    assert results[0]["state"] == {"run_id": run_id, "last_step": STEPS - 1}
    print(f"\nno-fault run: max submit time {results[0]['max_submit_s'] * 1e6:.1f} us")


def test_resume_continues_the_same_run_without_repeats(
    tmp_path: Path, pool2: DistributedPool
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = pool2.run(train, _spec(uri, "resume"), range(101), timeout=240)[0]
    assert first["state"]["last_step"] == 100
    # The job restarts from an earlier checkpoint (step 90): steps 90..100 come again and must
    # be skipped; 101..199 continue the same run.
    second = pool2.run(train, _spec(uri, "resume"), range(90, STEPS), first["state"], timeout=240)[
        0
    ]
    assert second["state"] == {"run_id": first["state"]["run_id"], "last_step": STEPS - 1}
    client = MlflowClient(tracking_uri=uri)
    assert _check_run(client, "resume", range(STEPS)) == first["state"]["run_id"]
    assert client.get_run(first["state"]["run_id"]).info.status == "FINISHED"


def test_server_down_from_step_50_to_120_delivers_all_once_in_order(
    mlflow_server: MlflowServer,
) -> None:
    sink = MlflowSink(tracking_uri=mlflow_server.uri, experiment="fault", http_timeout=2)
    sink.open(RUN_INFO)
    driver = RetryingDriver(sink, initial_backoff=0.05, max_backoff=0.5)
    restart: threading.Thread | None = None
    fail_fast_seconds = None
    try:
        for step in range(STEPS):
            values, _ = expected(step)
            driver.submit(Report(step=step, values=values, time=time.time()))
            if step == 50:
                driver.drain()
                mlflow_server.kill()
                probe = Report(step=10_000, values={"probe": 1.0}, time=time.time())
                started = time.monotonic()
                with pytest.raises(RuntimeError, match="log_batch at step 10000 failed"):
                    sink.write(probe)
                fail_fast_seconds = time.monotonic() - started
            if step == 120:
                # The training thread goes on while the server comes back.
                restart = threading.Thread(target=mlflow_server.start)
                restart.start()
            time.sleep(0.01)  # a training step
        assert restart is not None
        restart.join()
        driver.stop(timeout=120)
    finally:
        if restart is None:
            mlflow_server.start()
    assert driver.failures > 0, "the outage was never seen by the sink"
    # Writes while the server is away fail at once (MLflow's own retries would take minutes),
    # so the retry loop keeps control.
    assert fail_fast_seconds is not None and fail_fast_seconds < 10.0
    assert sink.close(timeout=30)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    _check_run(client, "fault", range(STEPS))
    print(
        f"\nmax submit time: {max(driver.submit_seconds) * 1e6:.1f} us over {STEPS} steps; "
        f"{driver.failures} failed writes retried; failed write took {fail_fast_seconds:.3f} s"
    )


def test_retry_after_failure_midway_does_not_duplicate(mlflow_server: MlflowServer) -> None:
    # A generous timeout: a loaded machine can take seconds for a 1000-metric request.
    sink = MlflowSink(tracking_uri=mlflow_server.uri, experiment="chunks", http_timeout=120)
    sink.open(RunInfo(name="chunks"))
    values = {f"m{i:04d}": float(i) for i in range(2500)}  # three log_batch requests
    report = Report(step=0, values=values, time=time.time())
    client = sink._client
    calls = {"n": 0}
    original = client.log_batch

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            original(*args, **kwargs)  # lands on the server, but the reply is "lost"
            raise ConnectionError("reply lost")
        return original(*args, **kwargs)

    client.log_batch = flaky
    errors = []
    for _ in range(10):  # the pipeline's retries
        try:
            sink.write(report)
            break
        except RuntimeError as error:
            errors.append(str(error))
    assert any("reply lost" in error for error in errors)
    sink.write(report)  # already delivered: skipped
    reader = MlflowClient(tracking_uri=mlflow_server.uri)
    for key in ("m0000", "m0999", "m1000", "m1999", "m2000", "m2499"):
        history = reader.get_metric_history(sink.run_id, key)
        assert [(m.step, m.value) for m in history] == [(0, values[key])]
    assert sink.close(timeout=30)


def test_long_names_and_odd_config_values_are_kept_within_limits(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    long_key = "k" * 400
    sink = MlflowSink(tracking_uri=uri, experiment="limits", run_name="r" * 400)
    config = {"nested": {long_key: "v" * 7000, "obj": object(), "none": None}}
    sink.open(RunInfo(config=config, tags={"t" * 300: "x" * 9000}))
    sink.write(Report(step=3, values={"m" * 300: 1.5, "m" * 299 + "n": 2.5}, time=time.time()))
    assert sink.close(timeout=30)
    run = MlflowClient(tracking_uri=uri).get_run(sink.run_id)
    assert all(len(k) <= 250 for k in run.data.params) and len(run.data.params) == 3
    assert all(len(v) <= 6000 for v in run.data.params.values())
    assert run.data.params["nested.none"] == "None"
    assert sorted(run.data.metrics.values()) == [1.5, 2.5]  # two long names stay distinct
    assert len(run.info.run_name) <= 250


def test_credentials_never_leave_the_sink(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    mlflow_server: MlflowServer,
) -> None:
    token, password = "sk-fake-token-5f3a9c", "hunter2-fake-password"
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", token)
    caplog.set_level(logging.DEBUG)
    # A live server (which ignores the credentials): the run and its state carry none.
    live = MlflowSink(
        tracking_uri=mlflow_server.uri.replace("://", f"://alice:{password}@"), experiment="creds"
    )
    live.open(RunInfo(name="creds"))
    live.write(Report(step=0, values={"loss": 1.0}, time=time.time()))
    state = live.state_dict()
    assert live.close(timeout=30)
    # No server on this port: every failure message is redacted.
    dead_port = mlflow_server.port + 1 if mlflow_server.port < 65535 else 1
    dead = MlflowSink(tracking_uri=f"http://alice:{password}@127.0.0.1:{dead_port}", experiment="x")
    with pytest.raises(RuntimeError) as opened:
        dead.open(RunInfo(name="creds"))
    # The original exception (which may hold the URI) is not chained to the raised one.
    assert opened.value.__cause__ is None and opened.value.__context__ is None
    text = " ".join(
        [repr(state), repr(live), repr(dead), str(opened.value), caplog.text, *capsys.readouterr()]
    )
    assert "***@127.0.0.1" in str(opened.value)
    assert token not in text and password not in text


def test_resume_skips_steps_delivered_after_the_checkpoint(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = MlflowSink(tracking_uri=uri, experiment="late")
    first.open(RunInfo(name="late"))
    for step in range(7):
        first.write(Report(step=step, values={"loss": float(step)}, time=time.time()))
        if step == 3:
            checkpoint = first.state_dict()  # the job goes on delivering after this
    assert first.close(timeout=30)
    resumed = MlflowSink(tracking_uri=uri, experiment="late")
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo(name="late"))
    for step in range(4, 9):  # windows recomputed from the checkpoint
        resumed.write(Report(step=step, values={"loss": 100.0 + step}, time=time.time()))
    assert resumed.close(timeout=30)
    history = MlflowClient(tracking_uri=uri).get_metric_history(checkpoint["run_id"], "loss")
    got = sorted((m.step, m.value) for m in history)
    assert got == [(s, float(s)) for s in range(7)] + [(7, 107.0), (8, 108.0)]
