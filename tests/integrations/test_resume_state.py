"""Every tracker sink refuses a malformed resume state with an error naming the key."""

from __future__ import annotations

from typing import Any

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


def _written_states(tmp: str) -> dict[str, dict[str, object]]:
    """What each sink's ``state_dict`` holds after a run (written by hand, as saved)."""
    steps = [["train", 5]]
    return {
        "WandbSink": {"run_id": "abc", "last_steps": steps, "run_dir": f"{tmp}/wandb/run-abc"},
        "MlflowSink": {"run_id": "abc", "last_steps": steps, "run_key": "k", "experiment": "e"},
        "TensorBoardSink": {"log_dir": f"{tmp}/tb", "last_steps": steps},
        "JsonlSink": {"path": f"{tmp}/m.jsonl", "last_steps": steps, "offset": 10},
    }


def test_another_sinks_state_is_refused(tmp_path: Any) -> None:
    """A TensorBoard sink given W&B's state resumed in the current directory's ./runs and
    skipped the steps W&B had; every pair of sinks now refuses the other's state."""
    from sidestream import Run
    from sidestream.sinks import JsonlSink

    sinks = [sink for sink, _ in _sinks()] + [JsonlSink(tmp_path / "m.jsonl")]
    states = _written_states(str(tmp_path))
    for sink in sinks:
        own = type(sink).__name__
        sink.load_state_dict(states[own])  # type: ignore[attr-defined]
        for other, state in states.items():
            if other == own:
                continue
            with pytest.raises(ValueError, match=rf"{own}.state_dict|expected a mapping with"):
                sink.load_state_dict(state)  # type: ignore[attr-defined]
    # Through a Run, and through a sink in a child process: the same refusal, naming the sink.
    from sidestream.sinks import ProcessSink
    from sidestream_tensorboard import TensorBoardSink

    run = Run([ProcessSink(TensorBoardSink(str(tmp_path / "tb")))])
    try:
        with pytest.raises(ValueError, match="tensorboard"):
            run.load_state_dict({"collectors": {}, "sinks": {"tensorboard": states["WandbSink"]}})
    finally:
        run.close()
