from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from sidestream.sinks import Sink


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
