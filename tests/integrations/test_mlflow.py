from __future__ import annotations

import asyncio
import logging
import os
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidestream.sinks import Report, RunInfo
from sidestream.testing import RankPool
from tests._ports import quiet_port
from tests.integrations._workload import expected, resume_with_names_like_streams, train
from tests.integrations.conftest import MlflowServer

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from sidestream_mlflow import MlflowSink  # noqa: E402

STEPS = 200
STEP_SECONDS = 0.01  # the training work between two collections


def _config(uri: str, experiment: str, **options: Any) -> dict[str, Any]:
    return {"mlflow": {"tracking_uri": uri, "experiment": experiment, **options}}


def _check_run(client: Any, experiment: str, steps: range) -> str:
    """One run in ``experiment`` whose every metric has each step of ``steps`` once, right."""
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, f"expected one run, got {len(runs)}"
    run = runs[0]
    keys = list(expected(0)[0])
    # MLflow has no histogram type: the "scores" histogram is not logged, not even per bin.
    assert sorted(run.data.metrics) == sorted(keys)
    for key in keys:
        history = client.get_metric_history(run.info.run_id, key)
        got_steps = [m.step for m in sorted(history, key=lambda m: (m.timestamp, m.step))]
        assert got_steps == list(steps), key
        for metric in history:
            want = expected(metric.step)[0][key]
            np.testing.assert_allclose(
                metric.value, want, rtol=1e-12, err_msg=f"{key}@{metric.step}"
            )
    return str(run.info.run_id)


def _timing(result: dict[str, Any]) -> str:
    seconds = result["schedule_seconds"]
    return f"max {max(seconds) * 1e3:.2f} ms, median {statistics.median(seconds) * 1e3:.3f} ms"


def _keyless(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sink states without their run key (a random id each sink makes) and experiment."""
    return [{k: v for k, v in s.items() if k not in ("run_key", "experiment")} for s in states]


def _check_ranks(results: list[dict[str, Any]]) -> None:
    """Rank 0 ran one sink thread and closed in time; rank 1 never opened its sink."""
    assert [r["sink_threads"] for r in results] == [1, 0]
    assert [r["closed"] for r in results] == [True, True]
    (state,) = results[1]["sink_states"]
    assert state.pop("run_key").isalnum()  # the key of a run this sink would create
    assert isinstance(state.pop("experiment"), str)  # where it would create it
    assert state == {"run_id": None, "last_steps": []}


def _check_run_details(client: Any, run_id: str) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"  # closed on rank 0 within the timeout
    assert run.info.run_name == "integration"
    assert run.data.params["optimizer.lr"] == "0.0003"
    assert run.data.params["optimizer.betas"] == "[0.9, 0.95]"
    assert run.data.tags["suite"] == "integration"


def test_two_ranks_every_window_once_sqlite(shm_path: Path, pool2: RankPool) -> None:
    # The no-fault run. Against SQLite, not the server: the sink thread then does its writes in
    # this process (more Python, so more GIL competition for the training thread than HTTP
    # waits), and the suite saves a minute of server requests; the server run is the fault run.
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    results = pool2.run(
        train, _config(uri, "dist"), range(STEPS), step_seconds=STEP_SECONDS, timeout=280
    )
    _check_ranks(results)
    assert results[0]["delivered"] == [STEPS] and results[0]["sink_warnings"] == []
    client = MlflowClient(tracking_uri=uri)
    run_id = _check_run(client, "dist", range(STEPS))  # one run: rank 1 created none
    _check_run_details(client, run_id)
    assert _keyless(results[0]["sink_states"]) == [
        {"run_id": run_id, "last_steps": [["", STEPS - 1]]}
    ]
    # Very generous: in-process SQLite writes compete for the GIL on a loaded machine.
    assert max(results[0]["schedule_seconds"]) < 1.5
    print(f"\nno-fault run, training thread in schedule_collection: {_timing(results[0])}")


def _control_outage(server: MlflowServer, signals: Path, errors: list[BaseException]) -> None:
    """Kill the server when rank 0 has collected step 50; start it again at step 120."""

    def reached(name: str) -> None:
        deadline = time.monotonic() + 240
        while not (signals / name).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 never reached {name}")
            time.sleep(0.01)

    try:
        reached("step_50")
        server.kill()
        (signals / "step_50.done").touch()
        reached("step_120")
        (signals / "step_120.done").touch()  # training goes on while the server comes back
        server.start()
    except BaseException as error:
        errors.append(error)


@pytest.mark.timeout(600)
def test_server_down_from_step_50_to_120_delivers_all_once_in_order(
    mlflow_server: MlflowServer, pool2: RankPool, tmp_path: Path
) -> None:
    password = "hunter2-fake-password"
    uri = mlflow_server.uri.replace("://", f"://alice:{password}@")
    config = _config(uri, "fault", http_timeout=2)
    errors: list[BaseException] = []
    controller = threading.Thread(target=_control_outage, args=(mlflow_server, tmp_path, errors))
    controller.start()
    try:
        results = pool2.run(
            train,
            config,
            range(STEPS),
            step_seconds=STEP_SECONDS,
            signals=str(tmp_path),
            signal_steps=(50, 120),
            sink_capacity=4,  # most of the outage's reports wait in the spool file
            timeout=500,
        )
    finally:
        controller.join(timeout=240)
        if not mlflow_server.running:
            mlflow_server.start()  # the later tests need it
    assert errors == []
    _check_ranks(results)
    rank0 = results[0]
    assert rank0["delivered"] == [STEPS]
    assert rank0["most_spooled"] > 0, "reports piled up while the server was away"
    warnings = rank0["sink_warnings"]
    streaks = [w for w in warnings if "retrying with backoff" in w]
    recoveries = [w for w in warnings if "recovered after" in w]
    # Dozens of failed attempts, reported once per failure streak (a server just restarted on
    # a loaded machine may fail a few more requests), never per attempt.
    attempts = [int(n) for w in recoveries for n in re.findall(r"after (\d+) failed", w)]
    assert 1 <= len(streaks) == len(recoveries), warnings
    assert max(attempts) >= 10 and len(streaks) < sum(attempts) / 5, warnings
    # The kill may land while the sink is still opening its run (creating a run is several
    # requests): then opening is what is retried. Either way the URI's password is redacted.
    assert "log_batch" in streaks[0] or "open failed" in streaks[0], streaks
    assert "***@127.0.0.1" in streaks[0]
    assert password not in " ".join(warnings) + repr(rank0["sink_states"])
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = _check_run(client, "fault", range(STEPS))  # one run: rank 1 created none
    _check_run_details(client, run_id)
    assert _keyless(rank0["sink_states"]) == [{"run_id": run_id, "last_steps": [["", STEPS - 1]]}]
    # Generous: the training thread never waits for the tracker, down or not.
    assert max(rank0["schedule_seconds"]) < 1.5
    print(f"\nserver down 50..120, training thread in schedule_collection: {_timing(rank0)}")


def test_resume_from_collector_checkpoint_continues_the_same_run(
    shm_path: Path, pool2: RankPool
) -> None:
    config = _config(f"sqlite:///{shm_path / 'mlflow.db'}", "resume")
    # Stop after step 100's update with a checkpoint; step 100 is not logged yet.
    first = pool2.run(train, config, range(101), checkpoint_at=100, timeout=280)
    _check_ranks(first)
    checkpoint = first[0]["checkpoint"]
    saved = checkpoint["sinks"]["mlflow"]
    assert saved["last_steps"] == [["", 99]]
    second = pool2.run(train, config, range(100, STEPS), checkpoint, timeout=280)
    _check_ranks(second)
    assert second[0]["sink_states"] == [
        {
            "run_id": saved["run_id"],
            "last_steps": [["", STEPS - 1]],
            "run_key": saved["run_key"],
            "experiment": "resume",
        }
    ]
    client = MlflowClient(tracking_uri=config["mlflow"]["tracking_uri"])
    assert _check_run(client, "resume", range(STEPS)) == saved["run_id"]
    assert client.get_run(saved["run_id"]).info.status == "FINISHED"


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


def test_backlog_goes_out_in_few_requests_without_duplicates(shm_path: Path) -> None:
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    sink = MlflowSink(tracking_uri=uri, experiment="backlog")
    sink.open(RunInfo(name="backlog"))
    reports = [
        Report(step=step, values={f"v{i}": step + i / 10 for i in range(8)}, time=1000.0 + step)
        for step in range(250)
    ]
    client = sink._client
    requests: list[int] = []
    original = client.log_batch

    def lost_once(*args: Any, **kwargs: Any) -> Any:
        requests.append(len(kwargs["metrics"]))
        result = original(*args, **kwargs)
        if len(requests) == 2:
            raise ConnectionError("reply lost")  # the second request landed anyway
        return result

    client.log_batch = lost_once
    assert sink.max_batch == 100
    for start in range(0, 250, sink.max_batch):
        batch = reports[start : start + sink.max_batch]
        for _ in range(3):  # the pipeline retries the same batch
            try:
                sink.write_batch(batch)
                break
            except RuntimeError as error:
                assert "reply lost" in str(error) and "steps 100..199" in str(error)
    sink.write_batch(reports[:10])  # already delivered: nothing is sent
    # Batches of 100, 100 and 50 reports of 8 values, each under 1000 values: one request each.
    expected = [len(reports[s : s + 100]) * 8 for s in range(0, 250, 100)]
    assert requests == expected == [800, 800, 400], "none sent twice"
    assert sink.close(timeout=30)
    reader = MlflowClient(tracking_uri=uri)
    for i in (0, 7):
        history = sorted(
            (m.step, m.value, m.timestamp) for m in reader.get_metric_history(sink.run_id, f"v{i}")
        )
        assert history == [(r.step, r.step + i / 10, int(r.time * 1000)) for r in reports]


def test_lost_create_run_reply_does_not_make_a_second_run(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    original = MlflowClient.create_run
    calls = {"n": 0}

    def reply_lost_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        created = original(self, *args, **kwargs)  # the run exists on the server...
        if calls["n"] == 1:
            raise ConnectionError("reply lost")  # ...but the sink never hears of it
        return created

    monkeypatch.setattr(MlflowClient, "create_run", reply_lost_once)
    sink = MlflowSink(tracking_uri=uri, experiment="lost")
    with pytest.raises(RuntimeError, match="reply lost"):
        sink.open(RunInfo(name="lost"))
    sink.open(RunInfo(name="lost"))  # the pipeline's retry
    sink.write(Report(step=0, values={"loss": 0.5}, time=time.time()))
    assert sink.close(timeout=30)
    reader = MlflowClient(tracking_uri=uri)
    experiment = reader.get_experiment_by_name("lost")
    runs = reader.search_runs([experiment.experiment_id])
    assert calls["n"] == 1, "the retry found the run instead of creating another"
    assert [run.info.run_id for run in runs] == [sink.run_id]
    assert runs[0].data.metrics == {"loss": 0.5}


@pytest.mark.parametrize("lands", [True, False])
def test_a_lost_reply_to_the_final_set_terminated_is_checked_with_the_server(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch, lands: bool
) -> None:
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    original = MlflowClient.set_terminated

    def reply_lost(self: Any, *args: Any, **kwargs: Any) -> Any:
        if lands:
            original(self, *args, **kwargs)  # the run is FINISHED on the server...
        raise ConnectionError("reply lost")  # ...but the sink never hears of it

    sink = MlflowSink(tracking_uri=uri, experiment="finish")
    sink.open(RunInfo(name="finish"))
    sink.write(Report(step=0, values={"loss": 0.5}, time=time.time()))
    run_id = sink.run_id
    monkeypatch.setattr(MlflowClient, "set_terminated", reply_lost)
    # A reply that never comes is retried until the close's timeout: a short one here.
    assert sink.close(timeout=30 if lands else 1.0) is lands
    status = MlflowClient(tracking_uri=uri).get_run(run_id).info.status
    assert status == ("FINISHED" if lands else "RUNNING")


def test_a_final_set_terminated_cancelled_in_the_client_is_a_failed_close(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # asyncio.CancelledError is a BaseException: it ended the close's worker thread silently,
    # and close said True while the run stayed RUNNING.
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"

    def cancelled(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise asyncio.CancelledError()

    sink = MlflowSink(tracking_uri=uri, experiment="cancelled")
    sink.open(RunInfo(name="cancelled"))
    sink.write(Report(step=0, values={"loss": 0.5}, time=time.time()))
    run_id = sink.run_id
    monkeypatch.setattr(MlflowClient, "set_terminated", cancelled)
    assert sink.close(timeout=30) is False
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "RUNNING"


def test_long_names_and_odd_config_values_are_kept_within_limits(shm_path: Path) -> None:
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
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
    # An MLflow 2.16 server refuses a tag value over 5000 characters (later ones allow 8000).
    long_tag = next(v for k, v in run.data.tags.items() if k.startswith("ttt"))
    assert 0 < len(long_tag) <= 5000


def test_run_name_and_run_key_tags_are_settled_not_refused_at_open(
    shm_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: a RunInfo tag mlflow.runName other than the name made MLflow refuse create_run,
    # a permanent failure at open once training had started; a sidestream.run_key tag was
    # replaced by the sink's without a word.
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        sink = MlflowSink(tracking_uri=uri, experiment="tags")
        tags = {"mlflow.runName": "other", "sidestream.run_key": "mine", "team": "a"}
        sink.open(RunInfo(name="named", tags=tags))
        sink.write(Report(step=1, values={"x": 1.0}, time=time.time()))
        assert sink.close(timeout=30)
    run = client.get_run(sink.run_id)
    assert run.info.run_name == "named" and run.data.tags["team"] == "a"
    assert run.data.tags["sidestream.run_key"] != "mine"
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "'mlflow.runName' ('other') differs" in messages and "'mine' is not set" in messages
    # With no name, the tag names the run.
    unnamed = MlflowSink(tracking_uri=uri, experiment="tags")
    unnamed.open(RunInfo(tags={"mlflow.runName": "from-tag"}))
    assert unnamed.close(timeout=30)
    assert client.get_run(unnamed.run_id).info.run_name == "from-tag"


def test_the_sinks_own_tags_are_checked_when_it_is_built() -> None:
    with pytest.raises(ValueError, match=r"^tags: 'sidestream.run_key' is the sink's own tag"):
        MlflowSink(tracking_uri="http://127.0.0.1:5000", tags={"sidestream.run_key": "x"})
    with pytest.raises(ValueError, match=r"^tags: 'mlflow.runName' is 'a' but run_name is 'b'"):
        MlflowSink(tracking_uri="http://127.0.0.1:5000", run_name="b", tags={"mlflow.runName": "a"})
    MlflowSink(tracking_uri="http://127.0.0.1:5000", run_name="a", tags={"mlflow.runName": "a"})


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
    dead_port = quiet_port()
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


def test_mlflow_2_prints_no_run_url_with_the_tracking_uris_password(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    mlflow_server: MlflowServer,
) -> None:
    """MLflow 2.x (below this package's requirement, 3.9, yet an environment can hold it) has
    no MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT: ending the run printed "View run ... at:
    http://alice:PASSWORD@..." (logged up to 2.17, on stdout from 2.18)."""
    from mlflow import environment_variables
    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    if hasattr(environment_variables, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"):
        # MLflow 3 here: made to look like 2.22, which has no variable and prints the URL.
        monkeypatch.delattr(environment_variables, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")

        def log_url(self: Any, run_id: str) -> None:
            print(f"View run at: {self.tracking_uri}/#/experiments/0/runs/{run_id}")

        monkeypatch.setattr(TrackingServiceClient, "_log_url", log_url)
    else:
        monkeypatch.setattr(TrackingServiceClient, "_log_url", TrackingServiceClient._log_url)
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    caplog.set_level(logging.INFO)
    password = "hunter2-fake-password"
    sink = MlflowSink(tracking_uri=mlflow_server.uri.replace("://", f"://alice:{password}@"))
    sink.open(RunInfo(name="creds"))
    assert sink.close(timeout=30)
    plain = MlflowClient(tracking_uri=mlflow_server.uri)  # no password: printed as before
    plain.set_terminated(plain.create_run("0").info.run_id)
    out, err = capsys.readouterr()
    assert password not in out + err + caplog.text
    assert f"{mlflow_server.uri}/#/experiments/0/runs/" in out + err + caplog.text


class _ClosedPipe:
    """A job's stdout whose reader exited (``python train.py | head -1``)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_close_ends_the_run_when_stdout_is_a_closed_pipe(
    monkeypatch: pytest.MonkeyPatch, mlflow_server: MlflowServer
) -> None:
    """MLflow prints the run's URL to stdout before it ends the run: a broken stdout made every
    try of the close fail with BrokenPipeError, and the run stayed RUNNING."""
    # Set, then removed: the teardown removes what the close sets for the process.
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "")
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT")
    sink = MlflowSink(tracking_uri=mlflow_server.uri, experiment="closed-stdout")
    sink.open(RunInfo(name="closed-stdout"))
    sink.write(Report(step=1, values={"loss": 0.5}, time=time.time()))
    run_id = sink.state_dict()["run_id"]
    monkeypatch.setattr("sys.stdout", _ClosedPipe())
    assert sink.close(timeout=30)
    run = MlflowClient(tracking_uri=mlflow_server.uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"loss": 0.5}


def test_resume_skips_steps_delivered_after_the_checkpoint(shm_path: Path) -> None:
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
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


def _checkpoint_of_one_step(uri: str, experiment: str) -> dict[str, Any]:
    """The state of a closed sink that delivered step 1 (loss 1.0) to a run in ``experiment``."""
    first = MlflowSink(tracking_uri=uri, experiment=experiment)
    first.open(RunInfo(name=experiment))
    first.write(Report(step=1, values={"loss": 1.0}, time=time.time()))
    checkpoint = first.state_dict()
    assert first.close(timeout=30)
    return checkpoint


def test_a_resume_of_another_jobs_run_or_config_says_so(
    shm_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another job's checkpoint loaded by mistake: JSONL and TensorBoard warned, MLflow went on
    in that job's run (skipping its steps) without a word, and dropped this job's changed
    params (MLflow keeps a run's first value of each)."""
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    first = MlflowSink(tracking_uri=uri, experiment="e")
    first.open(RunInfo(name="X", config={"lr": 0.1, "layers": 4}))
    checkpoint = first.state_dict()
    assert first.close(timeout=30)
    same = MlflowSink(tracking_uri=uri, experiment="e")
    same.load_state_dict(checkpoint)
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        same.open(RunInfo(name="X", config={"lr": 0.1, "layers": 4}))  # the job resumed
    assert same.close(timeout=30)
    # The sink's own records: MLflow 2.x logs its database migrations (alembic) at INFO.
    assert not [record for record in caplog.records if record.name.startswith("sidestream")]
    other = MlflowSink(tracking_uri=uri, experiment="e")
    other.load_state_dict(checkpoint)
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        other.open(RunInfo(name="Y", config={"lr": 0.5, "layers": 4, "new": 1}))
    assert other.close(timeout=30)
    text = caplog.text
    assert f"the checkpoint's run {checkpoint['run_id']} is named 'X', this job 'Y'" in text
    assert "keeps its params ['lr']" in text
    params = MlflowClient(tracking_uri=uri).get_run(checkpoint["run_id"]).data.params
    assert params == {"lr": "0.1", "layers": "4", "new": "1"}


def test_a_replay_of_a_kept_spool_does_not_warn_of_another_job_or_config(
    shm_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The kept config comes back from JSON (a tuple as a list) and the kept options lacked
    run_name: every replay warned of changed params and of another job's run."""
    from sidestream.sinks import replay_spool
    from sidestream.sinks._spool_format import encode_report, read_kept_state, write_kept_state

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    info = RunInfo(name="job", config={"optim": {"betas": (0.9, 0.95)}, "lr": 0.1})
    sink = MlflowSink(tracking_uri=uri, experiment="e", run_name="my-run")
    sink.open(info)
    sink.write(Report(step=1, values={"loss": 1.0}, time=0.0))
    spool = shm_path / "job.spool.jsonl"
    spool.write_bytes(encode_report(Report(step=2, values={"loss": 2.0}, time=0.0)))
    write_kept_state(str(spool), "mlflow", sink.state_dict(), info, sink.replay_options())
    sink.leave_unfinished()
    assert sink.close(timeout=30)
    kept = read_kept_state(spool)
    assert kept is not None and kept.options["run_name"] == "my-run"
    replayed = MlflowSink(**kept.options)
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        assert replay_spool(spool, replayed, skip_damaged=True).closed
    assert not [r for r in caplog.records if "MlflowSink" in r.getMessage()], caplog.text
    # A file kept before run_name was kept: the replay's sink lacks it, the run is the job's.
    spool.write_bytes(encode_report(Report(step=3, values={"loss": 3.0}, time=0.0)))
    write_kept_state(str(spool), "mlflow", replayed.state_dict(), info, {"tracking_uri": uri})
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        assert replay_spool(spool, MlflowSink(tracking_uri=uri, experiment="e")).closed
    assert not [r for r in caplog.records if "MlflowSink" in r.getMessage()], caplog.text


def test_a_resume_configured_with_another_experiment_continues_the_run_where_it_is(
    shm_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The run stayed in its experiment, silently, and the sink's state named the configured
    # one, where no run was.
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    checkpoint = _checkpoint_of_one_step(uri, "first")
    resumed = MlflowSink(tracking_uri=uri, experiment="second")
    resumed.load_state_dict(checkpoint)
    assert "resumed there, not in the configured 'second'" in caplog.text
    resumed.open(RunInfo(name="moved"))
    resumed.write(Report(step=2, values={"loss": 2.0}, time=time.time()))
    assert resumed.state_dict()["experiment"] == "first"
    assert resumed.close(timeout=30)
    client = MlflowClient(tracking_uri=uri)
    assert client.get_experiment_by_name("second") is None
    run = client.get_run(checkpoint["run_id"])
    assert run.info.experiment_id == client.get_experiment_by_name("first").experiment_id
    history = client.get_metric_history(checkpoint["run_id"], "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0)]
    # A run in MLflow's default experiment (none configured), resumed with one configured.
    default = MlflowSink(tracking_uri=uri)
    default.open(RunInfo(name="default"))
    saved = default.state_dict()
    assert default.close(timeout=30)
    named = MlflowSink(tracking_uri=uri, experiment="third")
    named.load_state_dict(saved)
    assert "in MLflow's default experiment; it is resumed there" in caplog.text
    assert named.state_dict()["experiment"] is None


def test_resuming_a_run_deleted_on_the_server_fails_for_good_saying_how_to_go_on(
    shm_path: Path,
) -> None:
    from sidestream.sinks import is_permanent

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    checkpoint = _checkpoint_of_one_step(uri, "deleted")
    MlflowClient(tracking_uri=uri).delete_run(checkpoint["run_id"])
    resumed = MlflowSink(tracking_uri=uri, experiment="deleted")
    resumed.load_state_dict(checkpoint)
    with pytest.raises(RuntimeError, match="was deleted on the server") as raised:
        resumed.open(RunInfo(name="deleted"))
    assert is_permanent(raised.value)  # retrying cannot help
    assert f"mlflow runs restore --run-id {checkpoint['run_id']}" in str(raised.value)
    # Purged for good (mlflow gc): the run is not there at all.
    import subprocess
    import sys

    # The store in the variable, not --tracking-uri: MLflow 2.x's gc has no such option.
    gc = [sys.executable, "-m", "mlflow", "gc", "--backend-store-uri", uri]
    environment = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    subprocess.run(gc, check=True, capture_output=True, timeout=120, env=environment)
    purged = MlflowSink(tracking_uri=uri, experiment="deleted")
    purged.load_state_dict(checkpoint)
    with pytest.raises(RuntimeError, match="is not on the server") as raised:
        purged.open(RunInfo(name="deleted"))
    assert is_permanent(raised.value)


def test_replay_counts_values_the_server_holds_at_later_steps_and_keeps_the_file(
    shm_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value at or below the largest step the server holds of it is not sent (how a resumed
    job avoids duplicates), even where the server lacks that very step: replay counts such
    reports as held, and the command keeps the file instead of marking it replayed. Reports
    the server holds at their very steps count as had."""
    import json

    from sidestream.sinks import replay_spool
    from sidestream.sinks._spool_format import encode_report
    from sidestream.sinks.replay import main

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    first = MlflowSink(tracking_uri=uri, experiment="replay")
    first.open(RunInfo(name="replay"))
    for step in (1, 2, 3, 4, 7, 8):  # 5 and 6 never reach the server
        first.write(Report(step=step, values={"loss": float(step)}, time=0.0, stream="train"))
        if step == 3:
            checkpoint = first.state_dict()
    assert first.close(timeout=30)

    def report(step: int, **values: float) -> Report:
        return Report(step=step, values=values, time=0.0, stream="train")

    reports = [report(step, loss=100.0 + step) for step in range(4, 8)]
    reports += [report(8, loss=108.0, extra=1.0)]  # extra is new, loss is held
    reports += [report(step, loss=100.0 + step) for step in (9, 10)]
    spool = shm_path / "kept.spool.jsonl"
    spool.write_bytes(b"".join(encode_report(r) for r in reports))
    result = replay_spool(
        spool, MlflowSink(tracking_uri=uri, experiment="replay"), resume_state=checkpoint
    )
    # The server has loss up to 8: at 4 and 7 it is there (had), at 5 and 6 it is not (held);
    # step 8's loss is there at step 8, so only extra goes; 9 and 10 are new.
    assert (result.written, result.skipped, result.held) == (3, 2, 2)
    client = MlflowClient(tracking_uri=uri)
    got = sorted((m.step, m.value) for m in client.get_metric_history(checkpoint["run_id"], "loss"))
    assert got == [(s, float(s)) for s in (1, 2, 3, 4, 7, 8)] + [(9, 109.0), (10, 110.0)]
    assert [
        (m.step, m.value) for m in client.get_metric_history(checkpoint["run_id"], "extra")
    ] == [(8, 1.0)]
    state = shm_path / "state.json"
    state.write_text(json.dumps(checkpoint))
    options = ["--option", f"tracking_uri={uri}", "--option", "experiment=replay"]
    arguments = [str(spool), "--sink", "mlflow", *options, "--resume-state", str(state)]
    capsys.readouterr()
    assert main(arguments) == 1  # nothing is sent, and steps 5 and 6 are held: the file is kept
    assert spool.exists()
    printed = capsys.readouterr()  # exit 1 for this reason, not a failed replay
    assert "delivered 0 report(s)" in printed.out
    assert "5 the sink already had" in printed.out  # 4, 7, 8, 9 and 10 are all there
    assert "2 report(s) had values the backend holds at later steps" in printed.err


def test_replay_of_reports_that_landed_after_all_counts_them_as_had(shm_path: Path) -> None:
    """A batch in flight at close may land after all: its reports are in the kept spool, and
    the server holds them at their very steps. Replay counted them as held ("may be missing")
    and kept the file, although the server had every value."""
    import json

    from sidestream.sinks._spool_format import encode_report
    from sidestream.sinks.replay import main

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    sink = MlflowSink(tracking_uri=uri, experiment="landed")
    sink.open(RunInfo(name="landed"))
    reports = [
        Report(step=step, values={"loss": float(step)}, time=0.0, stream="train")
        for step in range(1, 6)
    ]
    sink.write(reports[0])
    sink.write(reports[1])
    state = sink.state_dict()  # what a close that timed out now keeps beside the spool
    sink.write_batch(reports[2:])  # landed, but the job never learned it
    assert sink.close(timeout=30)
    spool = shm_path / "landed.spool.jsonl"
    spool.write_bytes(b"".join(encode_report(r) for r in reports[2:]))
    (shm_path / "state.json").write_text(json.dumps(state))
    options = ["--option", f"tracking_uri={uri}", "--option", "experiment=landed"]
    arguments = [str(spool), "--sink", "mlflow", *options]
    assert main([*arguments, "--resume-state", str(shm_path / "state.json")]) == 0
    assert not spool.exists()  # replayed: renamed, not kept
    history = MlflowClient(tracking_uri=uri).get_metric_history(state["run_id"], "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, float(s)) for s in range(1, 6)]


def test_a_spool_of_a_job_whose_tracker_was_down_replays_into_its_experiment(
    shm_path: Path,
) -> None:
    """The job's server was down for the whole job: its kept state named the run key but not
    the experiment, so a replay with the tracking URI alone made the run in "Default"."""
    import glob

    from sidestream import Run
    from sidestream.sinks.replay import main

    port = quiet_port()  # nothing listens there
    down = MlflowSink(tracking_uri=f"http://127.0.0.1:{port}", experiment="spooled", http_timeout=1)
    spools = shm_path / "spools"
    run = Run([down], info=RunInfo(name="job"), spool_dir=str(spools))
    for step in range(1, 4):
        run.log(step, {"lr": 0.1 * step})
    assert not run.close(timeout=1.0)
    (kept,) = glob.glob(str(spools / "*.spool.jsonl"))
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    assert main([kept, "--sink", "mlflow", "--option", f"tracking_uri={uri}"]) == 0
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("spooled")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "job"
    history = client.get_metric_history(found.info.run_id, "lr")
    assert sorted(m.step for m in history) == [1, 2, 3]


def test_resume_skips_each_value_delivered_after_the_checkpoint_whatever_its_name(
    shm_path: Path,
) -> None:
    """Values named like another stream (``train`` from the ``train`` collector,
    ``train/grad_norm`` from ``Run.log``) or renamed by MLflow (``val@ema/loss``)."""

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    checkpoint = resume_with_names_like_streams(
        MlflowSink(tracking_uri=uri, experiment="names"),
        MlflowSink(tracking_uri=uri, experiment="names"),
    )
    client = MlflowClient(tracking_uri=uri)
    names = client.get_run(checkpoint["run_id"]).data.metrics
    steps = {
        name: sorted(m.step for m in client.get_metric_history(checkpoint["run_id"], name))
        for name in names
    }
    assert steps == {
        "lr": list(range(1, 11)),
        "train/grad_norm": list(range(1, 11)),
        "train": [2, 4, 6, 8, 10],
        "val_ema/loss-0457e96a": [3, 6, 9],  # a valid key, with sha1 of the name: its own
    }


def test_a_database_uri_sqlalchemy_cannot_read_fails_early_and_for_good(shm_path: Path) -> None:
    # sqlite:/path (one slash) failed only at open, on the sink's thread, and was retried for
    # the whole job while reports piled up.
    from sidestream.sinks import is_permanent

    with pytest.raises(ValueError, match=r"tracking_uri: 'sqlite:/tmp/x.db' is not a database"):
        MlflowSink(tracking_uri="sqlite:/tmp/x.db")
    with pytest.raises(ValueError, match=r"'postgresql://\*\*\*@h:notaport/db' is not") as raised:
        MlflowSink(tracking_uri="postgresql://u:secret@h:notaport/db")
    assert "secret" not in str(raised.value)
    # The same refusal met at open (a URI from MLFLOW_TRACKING_URI) fails the sink for good.
    from sqlalchemy.exc import ArgumentError

    sink = MlflowSink(tracking_uri=f"sqlite:///{shm_path / 'mlflow.db'}")
    failure = sink._failure("open", ArgumentError("Could not parse SQLAlchemy URL"))
    assert is_permanent(failure)


def test_a_history_the_server_cannot_give_is_asked_once_per_key(shm_path: Path) -> None:
    # During a replay each held value asks the server; an unreachable one was asked again for
    # every report, each time with MLflow's own retries instead of the sink's.
    calls: list[str] = []

    class Unreachable:
        def get_metric_history(self, run_id: str, key: str) -> Any:
            calls.append(key)
            raise ConnectionError("refused")

    sink = MlflowSink(tracking_uri=f"sqlite:///{shm_path / 'mlflow.db'}")
    sink._client, sink._run_id = Unreachable(), "run"
    assert not sink.backend_has_step("loss", 3)
    assert not sink.backend_has_step("loss", 4)
    assert calls == ["loss"]


def test_names_of_any_script_keep_their_names(shm_path: Path) -> None:
    # MLflow takes word characters of any script; they were renamed as if refused.
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    sink = MlflowSink(tracking_uri=uri, experiment="unicode")
    sink.open(RunInfo(name="unicode"))
    sink.write(Report(step=1, values={"损失": 0.5, "loss_é": 0.25, "acc@1": 1.0}, time=0.0))
    assert sink.close(timeout=30)
    keys = set(MlflowClient(tracking_uri=uri).get_run(sink.run_id).data.metrics)
    assert {"损失", "loss_é"} <= keys and "acc@1" not in keys, keys


def test_names_mlflow_refuses_or_that_clean_alike_are_logged_apart(shm_path: Path) -> None:
    """``/lr``, ``lr/``, ``opt//lr``, ``opt/./lr`` are not MLflow paths: one of them failed the
    sink for the rest of the job (HTTP 400, taken as permanent). ``acc@1`` and ``acc#1`` both
    became ``acc_1``: one series with two values per step. Each is now its own valid key, the
    same after a resume (its steps are not logged twice)."""
    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    names = ["/lr", "lr/", "opt//lr", "opt/./lr", "..x", "acc@1", "acc#1", "acc_1", "loss"]

    def values(step: int) -> dict[str, float]:
        return {name: step + index / 10 for index, name in enumerate(names)}

    first = MlflowSink(tracking_uri=uri, experiment="names")
    first.open(RunInfo(name="names"))
    for step in range(1, 5):
        first.write(Report(step=step, values=values(step), time=time.time()))
        if step == 2:
            checkpoint = first.state_dict()
    assert first.close(timeout=30)
    resumed = MlflowSink(tracking_uri=uri, experiment="names")
    resumed.load_state_dict(checkpoint)
    resumed.open(RunInfo(name="names"))
    for step in range(3, 7):  # 3 and 4 again, as a job resumed from step 2 recomputes them
        resumed.write(Report(step=step, values=values(step), time=time.time()))
    assert resumed.close(timeout=30) and resumed.run_id == first.run_id
    client = MlflowClient(tracking_uri=uri)
    keys = sorted(client.get_run(first.run_id).data.metrics)
    assert len(keys) == len(names) and {"acc_1", "loss"} <= set(keys)
    by_value: dict[float, list[tuple[int, float]]] = {}
    for key in keys:
        history = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, key))
        assert [step for step, _ in history] == list(range(1, 7)), key  # each step once
        offset = round(history[0][1] - 1, 1)
        assert all(value == pytest.approx(step + offset) for step, value in history), key
        by_value[offset] = history
    assert sorted(by_value) == [index / 10 for index in range(len(names))]  # none merged


def test_a_replay_given_no_tracking_uri_delivers_to_the_jobs_server(
    mlflow_server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay command the close warning names, given no tracking URI: it made a new run in
    MLflow's default store (./mlflow.db), exited 0 and marked the spool replayed."""
    import glob

    from sidestream import Run
    from sidestream.sinks.replay import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    spools = tmp_path / "spools"
    mlflow_server.kill()
    try:
        sink = MlflowSink(tracking_uri=mlflow_server.uri, experiment="no-uri", http_timeout=1)
        run = Run([sink], info=RunInfo(name="job"), spool_dir=str(spools))
        for step in range(1, 4):
            run.log(step, {"lr": 0.1 * step})
        assert not run.close(timeout=1.0)
    finally:
        mlflow_server.start()
    (kept,) = glob.glob(str(spools / "*.spool.jsonl"))
    assert main([kept, "--sink", "mlflow"]) == 0
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name("no-uri")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "job"
    history = client.get_metric_history(found.info.run_id, "lr")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert not list(tmp_path.glob("mlflow.db")) and not list(tmp_path.glob("mlruns"))


def test_a_kept_uri_with_its_password_hidden_must_be_given_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    options = MlflowSink(tracking_uri="http://user:secret@127.0.0.1:1").replay_options()
    assert options == {"tracking_uri": "http://***@127.0.0.1:1"}
    with pytest.raises(ValueError, match=r"tracking_uri: .* a password was hidden"):
        MlflowSink(**options)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:2")
    assert MlflowSink().replay_options() == {"tracking_uri": "http://127.0.0.1:2"}


def test_a_kept_local_store_is_named_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A replay from another directory wrote into a new store of the same relative name.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store, as opted in
    monkeypatch.chdir(tmp_path)
    default = mlflow.get_tracking_uri()  # the default store, where the job ran
    if default == "sqlite:///mlflow.db":  # relative in MLflow 3.9, absolute in 3.17
        default = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for given, kept in [
        ("sqlite:///mlflow.db", f"sqlite:///{tmp_path / 'mlflow.db'}"),
        ("./mlruns", str(tmp_path / "mlruns")),
        (None, default),
    ]:
        options = MlflowSink(tracking_uri=given).replay_options()
        assert options == {"tracking_uri": kept}, given
    assert str(tmp_path) in MlflowSink().replay_options()["tracking_uri"]


@pytest.mark.parametrize("through", ["option", "environment", "driver"])
def test_a_relative_sqlite_file_is_the_one_next_to_the_job_when_built(
    through: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read at open, the relative path (the option, with or without a driver, or
    # MLFLOW_TRACKING_URI, which MLflow reads) followed an os.chdir made after the sink was
    # built: the run went to another database.
    (tmp_path / "job").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "job")
    if through != "environment":
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        scheme = "sqlite+pysqlite" if through == "driver" else "sqlite"
        sink = MlflowSink(tracking_uri=f"{scheme}:///mlflow.db", experiment="relative")
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
        sink = MlflowSink(experiment="relative")
    monkeypatch.chdir(tmp_path / "elsewhere")
    sink.open(RunInfo(name="r"))
    sink.write(Report(step=1, values={"loss": 0.5}, time=time.time()))
    sink.close()
    assert not (tmp_path / "elsewhere" / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'job' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("relative").experiment_id])
    assert [run.data.metrics for run in runs] == [{"loss": 0.5}]


@pytest.mark.parametrize("folder", ["a%41b", "q?x=1"])
def test_a_relative_sqlite_file_in_a_folder_named_like_url_syntax_stays_there(
    folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The working directory went into the URL as it is: SQLAlchemy decoded 'a%41b' as 'aAb'
    # (no such folder: every open retried "unable to open database file" for good) and took
    # '?x=1/sub/m.db' for the query (the run went into a file 'q' beside the folder).
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / folder).mkdir()
    monkeypatch.chdir(tmp_path / folder)
    sink = MlflowSink(tracking_uri="sqlite:///sub/m.db", experiment="escaped")
    sink.open(RunInfo(name="r"))
    sink.write(Report(step=1, values={"loss": 0.5}, time=time.time()))
    assert sink.close(timeout=10)
    database = tmp_path / folder / "sub" / "m.db"
    assert database.is_file()
    assert not (tmp_path / "aAb").exists() and not (tmp_path / "q").exists()
    # MLflow's own URL for the file (its path escaped), as a reader would make it.
    from mlflow.utils.file_utils import path_to_local_sqlite_uri

    client = MlflowClient(tracking_uri=path_to_local_sqlite_uri(str(database)))
    runs = client.search_runs([client.get_experiment_by_name("escaped").experiment_id])
    assert [run.data.metrics for run in runs] == [{"loss": 0.5}]


@pytest.mark.parametrize("scheme", ["sqlite", "sqlite+pysqlite"])
def test_a_sqlite_url_keeps_its_query_out_of_the_path_made_absolute(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The query was made absolute with the path: an empty path (SQLAlchemy's in-memory
    # database) became the working directory, which SQLite cannot open ("unable to open
    # database file" at open), and a relative file's query was normalized as a path.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "job").mkdir()
    monkeypatch.chdir(tmp_path / "job")
    in_memory = MlflowSink(tracking_uri=f"{scheme}:///?timeout=5")
    assert in_memory.replay_options()["tracking_uri"] == f"{scheme}:///?timeout=5"
    sink = MlflowSink(tracking_uri=f"{scheme}:///m.db?timeout=5&x=a//b", experiment="query")
    absolute = f"{scheme}:///{tmp_path / 'job'}/m.db?timeout=5&x=a//b"
    assert sink.replay_options()["tracking_uri"] == absolute
    monkeypatch.chdir(tmp_path)
    sink.open(RunInfo(name="r"))
    sink.write(Report(step=1, values={"loss": 0.5}, time=time.time()))
    sink.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'job' / 'm.db'}")
    runs = client.search_runs([client.get_experiment_by_name("query").experiment_id])
    assert [run.data.metrics for run in runs] == [{"loss": 0.5}]


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("127.0.0.1:5000", r"tracking_uri: '127.0.0.1:5000' has no scheme; .*http://127"),
        ("localhost:5000", r"has no scheme"),
        ("htp://127.0.0.1:5000", r"tracking_uri: MLflow has no tracking store for the scheme"),
        # A relative path to MLflow (its file store), but surely a typo.
        ("http//127.0.0.1:5000", r"lacks the ':' after its scheme; did you mean 'http://127"),
        ("sqlite//mlflow.db", r"did you mean 'sqlite://mlflow.db'"),
        ("./http//x", None),  # a folder of that name, given as a path (file store opted in)
        ("uc:http://localhost:8080", None),  # MLflow's "uc" store, as MLflow parses it
        # The file store, which MLflow refuses unless MLFLOW_ALLOW_FILE_STORE is true.
        ("file:///tmp/mlruns", r"tracking_uri: 'file:///tmp/mlruns' is MLflow's file store"),
        ("./mlruns", r"is MLflow's file store, which this MLflow refuses unless MLFLOW_ALLOW"),
    ],
)
def test_a_tracking_uri_mlflow_has_no_store_for_fails_when_the_sink_is_built(
    uri: str, message: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Accepted, it failed on rank 0's sink thread after training started, saying the file
    # store was "in maintenance mode" or that the model registry was unavailable.
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    if "file store" in (message or ""):
        from mlflow import environment_variables

        if not hasattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE"):
            # MLflow before 3.13 takes its file store as it is: so does the sink.
            MlflowSink(tracking_uri=uri)
            return
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        MlflowSink(tracking_uri=uri)  # opted in: taken, as MLflow takes it
        monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    if message is None:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        MlflowSink(tracking_uri=uri)
        return
    with pytest.raises(ValueError, match=message):
        MlflowSink(tracking_uri=uri)
    from sidestream.sinks import sinks_from_config

    with pytest.raises(ValueError, match=message):
        sinks_from_config({"mlflow": {"tracking_uri": uri}})


_ENDINGS = """
import contextlib, os, signal, sys, time
from sidestream import Run
from sidestream.sinks import RunInfo, sinks_from_config
uri, mode, ending = sys.argv[1:4]
options = {"tracking_uri": uri, "experiment": "endings", "child_process": mode == "child"}
run = Run(sinks_from_config({"mlflow": options}), info=RunInfo(name=f"{mode}-{ending}"))
with run if ending == "raise in with" else contextlib.nullcontext():
    for step in range(1, 4):
        run.log(step, {"x": float(step)})
    # Waits until the sink has every step: a loaded machine may take longer than the run's
    # checkpoint_timeout (10 s) to start the child and open the run, and a job killed then
    # leaves a run without them.
    run.state_dict(timeout=120)
    if ending == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if ending.startswith("raise"):
        raise RuntimeError("training crashed")
"""


@pytest.mark.parametrize("mode", ["thread", "child"])
@pytest.mark.parametrize("ending", ["return", "raise", "raise in with", "killed"])
def test_a_run_ends_as_the_job_did(shm_path: Path, mode: str, ending: str) -> None:
    """FINISHED only for a job that ended well: a crashed job's run is FAILED, as MLflow's own
    end_run marks it. A killed trainer whose sink runs in a child process left a FINISHED run
    (the child closed it when its pipe broke); it is KILLED now (in a thread, nothing is left
    to close it: RUNNING)."""
    import subprocess
    import sys
    import textwrap

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_ENDINGS), uri, mode, ending],
        capture_output=True,
        text=True,
        timeout=240,
    )
    expected_code = {"return": 0, "raise": 1, "raise in with": 1, "killed": -9}[ending]
    assert done.returncode == expected_code, done.stderr[-3000:]
    client = MlflowClient(tracking_uri=uri)
    expected_status = {
        "return": "FINISHED",
        "raise": "FAILED",
        "raise in with": "FAILED",  # closed by the with block, before the exception is uncaught
        "killed": "KILLED" if mode == "child" else "RUNNING",
    }[ending]
    deadline = time.monotonic() + 60  # an orphaned child closes the run after its trainer
    while True:
        (run,) = client.search_runs([client.get_experiment_by_name("endings").experiment_id])
        if run.info.status == expected_status or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert run.info.status == expected_status, done.stderr[-3000:]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "x")] == [1, 2, 3]


def test_a_close_that_leaves_reports_for_a_replay_leaves_the_run_running(
    shm_path: Path,
) -> None:
    """A pipeline that gave up (its reports kept in a spool) ended the run FINISHED once the
    server answered, and so did a replay stopped at a damaged line: the run looked whole."""
    from sidestream.sinks import replay_spool
    from sidestream.sinks._spool_format import DamagedLineError, encode_report, write_kept_state

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    sink = MlflowSink(tracking_uri=uri, experiment="unfinished")
    sink.open(RunInfo(name="unfinished"))
    sink.write(Report(step=1, values={"loss": 1.0}, time=0.0, stream="train"))
    saved = sink.state_dict()
    sink.leave_unfinished()  # what a runner that gave up calls before its close
    assert sink.close(timeout=30)
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(saved["run_id"]).info.status == "RUNNING"
    spool = shm_path / "kept.spool.jsonl"
    report = encode_report(Report(step=2, values={"loss": 2.0}, time=0.0, stream="train"))
    spool.write_bytes(report + b"{cut\n")
    replayed = MlflowSink(tracking_uri=uri, experiment="unfinished")
    with pytest.raises(DamagedLineError):
        replay_spool(spool, replayed, resume_state=saved)
    assert client.get_run(saved["run_id"]).info.status == "RUNNING"
    history = client.get_metric_history(saved["run_id"], "loss")
    assert [point.step for point in history] == [1, 2]
    spool.write_bytes(encode_report(Report(step=3, values={"loss": 3.0}, time=0.0, stream="train")))
    # What a close that kept its file writes beside it: the job closed, so its replay ends it.
    write_kept_state(str(spool), "mlflow", replayed.state_dict(), RunInfo(name="unfinished"), {})
    assert replay_spool(
        spool,
        MlflowSink(tracking_uri=uri, experiment="unfinished"),
        resume_state=replayed.state_dict(),
    ).closed
    assert client.get_run(saved["run_id"]).info.status == "FINISHED"


@pytest.mark.parametrize("resumed_ending", [None, "FINISHED", "FAILED"])
def test_a_replay_of_a_crashed_jobs_spool_leaves_the_runs_status_alone(
    shm_path: Path, resumed_ending: str | None
) -> None:
    """A crashed job's spool (no state file beside it) was replayed with the run ended FINISHED:
    over a resumed job's FAILED, under a resumed job still running, or for a job that crashed
    and was never resumed. How the job ended is not known: the status is left as it is."""
    from sidestream._exit import ending_with
    from sidestream.sinks import replay_spool
    from sidestream.sinks._spool_format import encode_report

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    crashed = MlflowSink(tracking_uri=uri, experiment="crashed")
    crashed.open(RunInfo(name="crashed"))
    crashed.write(Report(step=1, values={"loss": 1.0}, time=0.0))
    checkpointed = crashed.state_dict()  # the job is killed here: nothing closes its run
    spool = shm_path / "crashed.spool.jsonl"
    spool.write_bytes(encode_report(Report(step=2, values={"loss": 2.0}, time=0.0)))
    client = MlflowClient(tracking_uri=uri)
    if resumed_ending is not None:
        resumed = MlflowSink(tracking_uri=uri, experiment="crashed")
        resumed.load_state_dict(checkpointed)
        resumed.open(RunInfo(name="crashed"))
        with ending_with(None if resumed_ending == "FINISHED" else RuntimeError):
            assert resumed.close(timeout=30)
        assert client.get_run(checkpointed["run_id"]).info.status == resumed_ending
    replayed = replay_spool(
        spool, MlflowSink(tracking_uri=uri, experiment="crashed"), resume_state=checkpointed
    )
    assert replayed.closed and replayed.written == 1
    assert client.get_run(checkpointed["run_id"]).info.status == (resumed_ending or "RUNNING")
    history = client.get_metric_history(checkpointed["run_id"], "loss")
    assert [point.step for point in history] == [1, 2]


def test_a_replay_of_a_failed_jobs_spool_ends_its_run_failed(shm_path: Path) -> None:
    """The replay ended the run FINISHED: the job's failure was not kept with its spool."""
    from sidestream._exit import ending_with
    from sidestream.sinks import replay_spool
    from sidestream.sinks._spool_format import encode_report, write_kept_state

    uri = f"sqlite:///{shm_path / 'mlflow.db'}"
    sink = MlflowSink(tracking_uri=uri, experiment="failed")
    sink.open(RunInfo(name="failed"))
    sink.write(Report(step=1, values={"loss": 1.0}, time=0.0))
    spool = shm_path / "kept.spool.jsonl"
    spool.write_bytes(encode_report(Report(step=2, values={"loss": 2.0}, time=0.0)))
    with ending_with(RuntimeError):  # a `with Run(...)` block left by an exception
        state = sink.state_dict()
        write_kept_state(str(spool), "mlflow", state, RunInfo(name="failed"), {"tracking_uri": uri})
        sink.leave_unfinished()
        assert sink.close(timeout=30)
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(state["run_id"]).info.status == "RUNNING"
    assert replay_spool(spool, MlflowSink(tracking_uri=uri, experiment="failed")).closed
    assert client.get_run(state["run_id"]).info.status == "FAILED"
    assert [point.step for point in client.get_metric_history(state["run_id"], "loss")] == [1, 2]
