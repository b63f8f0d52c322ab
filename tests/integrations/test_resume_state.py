"""Every tracker sink refuses a malformed resume state with an error naming the key."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def _sinks() -> list[tuple[object, str]]:
    from sidestream_mlflow import MlflowSink
    from sidestream_tensorboard import TensorBoardSink
    from sidestream_wandb import WandbSink

    return [
        (WandbSink(project="p", mode="offline"), "run_id"),
        (MlflowSink(tracking_uri="sqlite:///unused.db", experiment="e"), "run_id"),
        (TensorBoardSink(), "log_dir"),
    ]


@pytest.mark.parametrize("index", range(3))
def test_bad_resume_state_names_the_key(index: int) -> None:
    sink, id_key = _sinks()[index]
    with pytest.raises(ValueError, match="last_step"):
        sink.load_state_dict({id_key: "x"})  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=id_key):
        sink.load_state_dict({id_key: 3, "last_step": 1})  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="last_step"):
        sink.load_state_dict({id_key: "x", "last_step": "7"})  # type: ignore[attr-defined]
    sink.load_state_dict({id_key: "x", "last_step": 7})  # type: ignore[attr-defined]
    assert sink.state_dict()["last_step"] == 7  # type: ignore[attr-defined]
    # The per-stream form, and a stream delivered after an old-form checkpoint.
    with pytest.raises(ValueError, match="last_steps"):
        sink.load_state_dict({id_key: "x", "last_steps": {"train": "7"}})  # type: ignore[attr-defined]
    sink.load_state_dict({id_key: "x", "last_steps": {"train": 7, "": 3}})  # type: ignore[attr-defined]
    assert sink.state_dict()["last_steps"] == [["", 3], ["train", 7]]  # type: ignore[attr-defined]
    for bad in (0, False, "", b"", [["train", 9], ["train", 3]], [["train"]], [[3, 1]]):
        with pytest.raises(ValueError, match="last_steps"):
            sink.load_state_dict({id_key: "x", "last_steps": bad})  # type: ignore[attr-defined]
    sink.load_state_dict({id_key: "x", "last_steps": [["train", 9], ["", 2]]})  # type: ignore[attr-defined]
    assert sink.state_dict()["last_steps"] == [["", 2], ["train", 9]]  # type: ignore[attr-defined]
