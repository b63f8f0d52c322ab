from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from sidestream.sinks import Sink, sinks_from_config


@pytest.mark.parametrize(
    ("name", "module", "cls"),
    [
        ("wandb", "sidestream_wandb", "WandbSink"),
        ("mlflow", "sidestream_mlflow", "MlflowSink"),
        ("tensorboard", "sidestream_tensorboard", "TensorBoardSink"),
    ],
)
def test_each_sink_is_registered_by_name(name: str, module: str, cls: str) -> None:
    found = {ep.name: ep for ep in entry_points(group="sidestream.sinks")}
    assert found[name].value == f"{module}:{cls}"
    loaded = found[name].load()
    assert issubclass(loaded, Sink) and loaded.name == name
    assert cls in __import__(module).__all__


def test_sinks_from_config_builds_each_integration_without_opening_it(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sinks = sinks_from_config(
        {
            "wandb": {"project": "demo", "mode": "offline", "dir": str(tmp_path)},
            "mlflow": {"tracking_uri": uri, "experiment": "demo", "http_timeout": 3},
            "tensorboard": {"log_dir": str(tmp_path / "tb"), "flush_secs": 5},
        }
    )
    assert [sink.name for sink in sinks] == ["wandb", "mlflow", "tensorboard"]
    run_id = sinks[0].run_id  # made by the sink: a checkpoint before open names the run
    assert repr(sinks[0]) == f"WandbSink(project='demo', mode='offline', run_id={run_id!r})"
    assert repr(sinks[1]) == f"MlflowSink(tracking_uri={uri!r}, experiment='demo', run_id=None)"
    assert sinks[2].state_dict() == {
        "log_dir": str(tmp_path / "tb"),
        "last_steps": [],
        "earlier_files": [],
        "skipped_values": [],
    }
    # Building a sink opens nothing (every rank builds them; only rank 0's collector opens).
    assert list(tmp_path.iterdir()) == []
    # The list spelling, and options that do not fit name the sink.
    (same,) = sinks_from_config([{"type": "tensorboard", "log_dir": str(tmp_path / "tb")}])
    assert same.state_dict() == sinks[2].state_dict()
    with pytest.raises(TypeError, match="sink 'mlflow'"):
        sinks_from_config({"mlflow": {"trackinguri": uri}})
