"""A notebook cell executed again makes a second Run while its first is still open: warned."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from sidestream import Run
from sidestream.sinks import JsonlSink

# ipykernel names a cell's code after a hash of its text: the same cell run again has it too.
_CELL = "/tmp/ipykernel_4242/1234567890.py"
_MAKES_A_RUN = "run = Run([JsonlSink(path)], spool_dir=spool)\nrun.log(1, {'x': 1.0})\n"
_CLOSES_FIRST = "if 'run' in globals():\n    run.close()\n" + _MAKES_A_RUN


def _execute(source: str, cell: str, namespace: dict[str, Any], path: Path) -> None:
    namespace.update(Run=Run, JsonlSink=JsonlSink, path=path)
    exec(compile(source, cell, "exec"), namespace)


def _execute_twice(
    source: str,
    made: str,
    namespace: dict[str, Any],
    folder: Path,
    caplog: pytest.LogCaptureFixture,
) -> list[Any]:
    """Execute the cell ``source`` twice (warnings captured); what each execution made."""
    found = []
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        for index in range(2):
            _execute(source, _CELL, namespace, folder / f"{index}.jsonl")
            found.append(namespace[made])
    return found


def _cell_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "notebook cell" in r.getMessage()]


@pytest.fixture
def notebook(monkeypatch: pytest.MonkeyPatch) -> None:
    """An IPython shell is running (as in a Jupyter kernel)."""
    shell = types.ModuleType("IPython")
    shell.get_ipython = lambda: object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", shell)


@pytest.mark.usefixtures("notebook")
def test_a_cell_run_again_warns_that_its_earlier_run_is_open(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the first run stayed open with no word, its tracker run shown as running until
    # the kernel exited.
    namespace: dict[str, Any] = {"spool": str(tmp_path)}
    runs = _execute_twice(_MAKES_A_RUN, "run", namespace, tmp_path, caplog)
    try:
        warned = _cell_warnings(caplog)
        assert len(warned) == 1, caplog.text
        assert "still open" in warned[0] and "run.close()" in warned[0]
        assert "with Run(...) as run:" in warned[0]
    finally:
        for run in runs:
            assert run.close()


@pytest.mark.usefixtures("notebook")
def test_a_cell_that_closes_first_and_other_cells_are_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    namespace: dict[str, Any] = {"spool": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        for index in range(2):
            _execute(_CLOSES_FIRST, _CELL, namespace, tmp_path / f"{index}.jsonl")
        other: dict[str, Any] = {"spool": str(tmp_path)}  # another cell: a second run on purpose
        _execute(_MAKES_A_RUN, "/tmp/ipykernel_4242/99.py", other, tmp_path / "other.jsonl")
        unstarted: dict[str, Any] = {"spool": str(tmp_path)}
        for index in range(2):  # a run never started holds nothing
            _execute("run = Run([JsonlSink(path)])\n", _CELL, unstarted, tmp_path / f"u{index}")
    assert "notebook cell" not in caplog.text
    assert namespace["run"].close() and other["run"].close()


def test_a_script_making_runs_at_one_line_is_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "IPython", raising=False)  # no shell: a script's loop
    namespace: dict[str, Any] = {"spool": str(tmp_path)}
    runs = []
    with caplog.at_level(logging.WARNING, logger="sidestream"):
        for index in range(2):
            _execute(_MAKES_A_RUN, "train.py", namespace, tmp_path / f"{index}.jsonl")
            runs.append(namespace["run"])
    assert "notebook cell" not in caplog.text
    assert all(run.close() for run in runs)


class _Shell:
    """IPython's shell, as far as the check reads it: the count of the cell executing now."""

    execution_count = 1


_HELPER = (
    "def make_run(name):\n    return Run([JsonlSink(f'{folder}/{name}.jsonl')], spool_dir=folder)\n"
)
_TRAIN_AND_EVAL = (
    "train = make_run('train')\ntrain.log(1, {'x': 1.0})\n"
    "val = make_run('val')\nval.log(1, {'x': 1.0})\n"
)
_FOLDS = (
    "folds = []\nfor k in range(3):\n"
    "    fold = Run([JsonlSink(f'{folder}/{next(names)}.jsonl')], spool_dir=folder)\n"
    "    fold.log(1, {'x': 1.0})\n    folds.append(fold)\n"
)


def test_runs_made_by_a_helper_or_a_loop_of_one_execution_are_not_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: every Run a helper function made counted as made by one cell (the helper's line),
    # so a train and an eval run open together were warned about, as were the runs a loop of
    # one cell keeps open on purpose (one warning per run after the first).
    shell = types.ModuleType("IPython")
    shell.get_ipython = lambda: _Shell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", shell)
    namespace: dict[str, Any] = {"Run": Run, "JsonlSink": JsonlSink, "folder": str(tmp_path)}
    namespace["names"] = iter(range(100))

    def execute(source: str, cell: str) -> None:
        exec(compile(source, cell, "exec"), namespace)
        _Shell.execution_count += 1

    with caplog.at_level(logging.WARNING, logger="sidestream"):
        execute(_HELPER, "/tmp/ipykernel_4242/1.py")
        execute(_TRAIN_AND_EVAL, "/tmp/ipykernel_4242/2.py")
        execute(_FOLDS, "/tmp/ipykernel_4242/3.py")
        runs = [namespace["train"], namespace["val"], *namespace["folds"]]
        assert "notebook cell" not in caplog.text
        execute(_FOLDS, "/tmp/ipykernel_4242/3.py")  # executed again: its runs are still open
        runs += namespace["folds"]
    try:
        warned = [r for r in caplog.records if "notebook cell" in r.getMessage()]
        assert len(warned) == 1, caplog.text
    finally:
        assert all(run.close() for run in runs)


_MAKES_A_COLLECTOR = (
    "collector = AsyncMetricCollector(SumMetric(), [JsonlSink(path)], spool_dir=spool)\n"
    "collector.bind('cpu')\n"
)


@pytest.mark.usefixtures("notebook")
def test_a_cell_that_makes_a_collector_with_sinks_again_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: only Run was checked; a collector with sinks of its own made again by its cell
    # kept the earlier one's threads and tracker run without a word.
    from sidestream import AsyncMetricCollector
    from sidestream.metrics import SumMetric

    namespace: dict[str, Any] = {
        "spool": str(tmp_path),
        "AsyncMetricCollector": AsyncMetricCollector,
        "SumMetric": SumMetric,
    }
    collectors = _execute_twice(_MAKES_A_COLLECTOR, "collector", namespace, tmp_path, caplog)
    try:
        warned = _cell_warnings(caplog)
        assert len(warned) == 1, caplog.text
        assert warned[0].startswith("AsyncMetricCollector:")
        assert "collector.close()" in warned[0]
    finally:
        for collector in collectors:
            assert collector.close(10)
