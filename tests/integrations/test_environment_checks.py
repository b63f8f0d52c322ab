"""Tracker settings taken from the environment are checked when the sink is built.

``MLFLOW_TRACKING_URI``, ``WANDB_MODE`` and ``WANDB_DIR`` stand in for options not given; the
clients read them only at open, on rank 0's sink thread once training has started, where a
typo failed the sink for the whole job (or retried it until close, or sent a W&B run silently
to a temporary folder), while the same value given as an option was refused at once.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from sidestream.sinks import RunInfo, sinks_from_config


def test_a_bad_mlflow_tracking_uri_fails_when_the_sink_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    from sidestream_mlflow import MlflowSink

    blocker = tmp_path / "file"
    blocker.write_text("")
    for uri, why in [
        ("sqllite:///x.db", r"no tracking store for the scheme 'sqllite'"),
        ("http//127.0.0.1:5000", r"lacks the ':' after its scheme"),
        (f"sqlite:///{blocker}/m.db", r"is a file, not a directory"),
    ]:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        with pytest.raises(
            ValueError, match=rf"tracking_uri: None uses .*MLFLOW_TRACKING_URI.*{why}"
        ):
            MlflowSink()
        with pytest.raises(ValueError, match=r"sink 'mlflow': .*MLFLOW_TRACKING_URI"):
            sinks_from_config({"mlflow": {}})
        # A tracking_uri given wins over the variable, as in MLflow: nothing to refuse.
        MlflowSink(tracking_uri=f"sqlite:///{tmp_path / 'given.db'}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'ok.db'}")
    MlflowSink()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # empty: MLflow's default store, as unset
    MlflowSink()


def test_a_bad_wandb_mode_or_dir_in_the_environment_fails_when_the_sink_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    from sidestream_wandb import WandbSink

    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offlien")
    with pytest.raises(ValueError, match=r"mode: None uses .*WANDB_MODE.*'offlien'"):
        WandbSink(project="p")
    with pytest.raises(ValueError, match=r"sink 'wandb': mode: .*WANDB_MODE"):
        sinks_from_config({"wandb": {"project": "p"}})
    WandbSink(project="p", mode="offline")  # the option wins over the variable, as in wandb
    WandbSink(project="p", settings={"mode": "offline"})
    monkeypatch.setenv("WANDB_MODE", "offline")

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("WANDB_DIR", str(blocker / "runs"))
    with pytest.raises(ValueError, match=r"WANDB_DIR: '.*/file' is a file, not a directory"):
        WandbSink(project="p")
    WandbSink(project="p", dir=str(tmp_path / "given"))  # the option wins
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "fine"))
    WandbSink(project="p")


def test_a_wandb_dir_from_the_environment_wandb_cannot_use_at_open_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # wandb wrote the run to a temporary folder instead, silently: a run looked for in
    # WANDB_DIR seemed lost (a warning named the folder only for the `dir` option).
    pytest.importorskip("wandb")
    from sidestream_wandb import WandbSink

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    later = tmp_path / "later"
    monkeypatch.setenv("WANDB_DIR", str(later / "runs"))
    sink = WandbSink(project="p", mode="offline")
    later.write_text("")  # a file where the folder was to be, by the time rank 0 opens
    sink.open(RunInfo(name="elsewhere"))
    assert sink.run_dir is not None and not sink.run_dir.startswith(str(later))
    assert "could not write in the environment variable WANDB_DIR=" in caplog.text
    assert sink.run_dir in caplog.text
    assert sink.close(timeout=60)


def test_a_deleted_working_directory_is_named_as_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MLflow and wandb read the working directory at open (and wandb's settings when built),
    # even for absolute paths: deleted, the retried open said only "FileNotFoundError: [Errno
    # 2] No such file or directory", naming no path.
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from sidestream_mlflow import MlflowSink
    from sidestream_wandb import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    sinks = [
        MlflowSink(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}"),
        WandbSink(project="p", dir=str(tmp_path / "w")),
    ]
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    for sink in sinks:
        with pytest.raises(RuntimeError, match="working directory was deleted"):
            sink.open(RunInfo())
    with pytest.raises(FileNotFoundError, match="working directory was deleted"):
        WandbSink(project="p", mode="offline")


def test_a_password_in_mlflow_tracking_uri_is_as_secret_as_one_in_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # tracking_uri=None: MLflow takes the URI from the variable, and its errors name the
    # request's URL with the password in it; the sink redacted (and kept MLflow from printing)
    # only a password given as the option, while its page says none appears in its errors.
    pytest.importorskip("mlflow")
    from sidestream_mlflow import MlflowSink

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    password = "hunter2-fake-password"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:{password}@127.0.0.1:{port}")
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    sink = MlflowSink(experiment="x", http_timeout=2, http_max_retries=0)
    with pytest.raises(RuntimeError, match=r"open failed") as raised:
        sink.open(RunInfo(name="r"))
    assert password not in str(raised.value)
    assert "***" in str(raised.value)
    assert os.environ.get("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT") == "true"


def test_wandb_mode_none_is_wandbs_default_and_reads_wandb_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # mode=None is wandb.init's default (WANDB_MODE, else online): it was refused as a mode
    # wandb does not take, and a bad WANDB_MODE then went unchecked.
    pytest.importorskip("wandb")
    from sidestream_wandb import WandbSink

    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    WandbSink(project="p", mode=None)
    sinks_from_config({"wandb": {"project": "p", "mode": None}})
    monkeypatch.setenv("WANDB_MODE", "offline")
    WandbSink(project="p", mode=None)
    monkeypatch.setenv("WANDB_MODE", "offlien")
    with pytest.raises(ValueError, match=r"mode: None uses .*WANDB_MODE.*'offlien'"):
        WandbSink(project="p", mode=None)
