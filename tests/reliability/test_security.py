"""Secrets stay out of logs, errors, spool files, state dicts and tracker files; nothing
unpickles data a network peer could write."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from sidestream import AsyncMetricCollector, MeanMetric
from sidestream.sinks import JsonlSink
from tests._ports import quiet_port

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "planted-pass-7f3e1d"
TOKEN = "planted-token-9c2b44aa"


def test_planted_secrets_never_leave_the_sinks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from sidestream_mlflow import MlflowSink
    from sidestream_tensorboard import TensorBoardSink

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    uri = f"http://alice:{PASSWORD}@127.0.0.1:{quiet_port()}"
    sinks = [
        MlflowSink(uri, experiment="secrets", http_timeout=1),
        JsonlSink(tmp_path / "m.jsonl"),
        TensorBoardSink(tmp_path / "tb"),
    ]
    metric = MeanMetric()
    collector = AsyncMetricCollector(
        metric,
        sinks=sinks,
        prefix="loss",
        spool_dir=str(tmp_path / "spool"),
        sink_capacity=2,  # most reports go through the spool file
        sink_retry_initial_s=0.05,
        sink_retry_max_s=0.1,
    )
    errors: list[str] = []
    with caplog.at_level(logging.DEBUG):
        collector.bind("cpu")
        for step in range(1, 21):
            metric.update(torch.tensor([float(step)]))
            collector.schedule_collection(step)
        state = collector.state_dict(timeout=1.0)
        assert collector.close(timeout=2.0) is False, "MLflow is unreachable"
        for sink in sinks:
            try:
                sink.write(next(iter([])))  # type: ignore[call-overload]
            except Exception as error:
                errors.append(f"{error!r} {error}")
    kept = list((tmp_path / "spool").iterdir())
    assert kept, "the undelivered MLflow reports are kept in a spool file"
    texts = {
        "logs": caplog.text,
        "errors": " ".join(errors),
        "state_dict": repr(state),
        "sinks": " ".join(repr(s) for s in sinks),
    }
    for path in tmp_path.rglob("*"):
        if path.is_file():
            texts[str(path)] = path.read_bytes().decode("utf-8", errors="replace")
    for where, text in texts.items():
        assert PASSWORD not in text, where
        assert TOKEN not in text, where
    assert "***" in caplog.text, "the URI is shown redacted"


# Every place the library unpickles, with why its bytes cannot come from the network.
REVIEWED_UNPICKLING = {
    ("sinks/process.py", "sink = pickle.loads(sink_bytes)"): "spawn's pipe, from the parent",
    ("sinks/process.py", "trial: Sink = pickle.loads(self._sink_bytes)"): (
        "bytes this ProcessSink pickled itself from the sink it was given"
    ),
    ("sinks/process.py", "pickle.loads(self._sink_bytes)"): (
        "bytes this ProcessSink pickled itself just before, from the sink it was given"
    ),
    ("sinks/process.py", "operation, argument = pickle.loads(conn.recv_bytes())"): (
        "multiprocessing Pipe (a socketpair) from the parent"
    ),
    ("sinks/process.py", "status, *payload = pickle.loads(self._conn.recv_bytes())"): (
        "multiprocessing Pipe from its own child"
    ),
    ("testing/_pool.py", "ok, payload = pickle.loads(outcome)"): (
        "a rank's own multiprocessing Pipe, or TorchrunPool results verified with the pool's "
        "HMAC key first"
    ),
    ("testing/_pool.py", "function, args, kwargs = pickle.loads(task)"): (
        "mp.Queue, or TorchrunPool tasks verified with the pool's HMAC key first"
    ),
}


def test_every_unpickling_site_is_reviewed() -> None:
    found = set()
    for base in (ROOT / "packages", ROOT / "integrations"):
        for path in base.rglob("*.py"):
            for line in path.read_text().splitlines():
                if re.search(r"pickle\.loads?\(|torch\.load\(", line):
                    relative = path.as_posix().split("/src/sidestream/")[-1]
                    found.add((relative, line.strip()))
    assert found == set(REVIEWED_UNPICKLING), "a new unpickling site needs a review"
