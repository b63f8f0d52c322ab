"""Importing and using sidestream never imports torch.distributed.checkpoint; DCP still takes it.

Importing ``torch.distributed.checkpoint`` (torch 2.13) makes a gloo process under torchrun
abort at exit ("terminate called without an active exception", SIGABRT) in about one run of
three, even after ``destroy_process_group()``; it also took 0.7 s of the import. A ``Metric``
is a DCP ``Stateful`` by its methods (the protocol is structural), not by inheriting it.
"""

from __future__ import annotations

import subprocess
import sys

from torch.distributed.checkpoint.stateful import Stateful

from sidestream import MeanMetric
from sidestream.metrics.classification import confusion_count_metric

_IMPORTS = (
    "import sidestream, sidestream.collector, sidestream.sinks, sidestream.metrics, "
    "sidestream.metrics.classification, sidestream.metrics.regression, "
    "sidestream.metrics.language, sidestream.testing, sidestream.run, "
    "sidestream_mlflow, sidestream_tensorboard, sidestream_wandb"
)


_USE = (
    "import os, tempfile, torch; from sidestream import Run, MeanMetric; "
    "from sidestream.sinks import JsonlSink; "
    "run = Run([JsonlSink(os.path.join(tempfile.mkdtemp(), 'm.jsonl'))]); "
    "loss = MeanMetric(); collector = run.collector(loss, prefix='train').bind('cpu'); "
    "loss.update(torch.tensor([1.0])); collector.schedule_collection(1); run.log(1, {'lr': 0.1}); "
    "torch.save(run.state_dict(), os.path.join(tempfile.mkdtemp(), 'c.pt')); run.close()"
)


def test_importing_the_packages_leaves_torch_distributed_checkpoint_unimported() -> None:
    # A run with a collector and a sink, used until close, with a checkpoint saved by
    # torch.save: the run's check of its sinks' state places walks them as DCP would, itself.
    code = f"import sys; {_IMPORTS}; {_USE}; print('torch.distributed.checkpoint' in sys.modules)"
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert found.stdout.strip() == "False", found.stderr


def test_metrics_are_dcp_stateful() -> None:
    metric = confusion_count_metric().multiclass(3).with_accuracy().build()
    assert isinstance(MeanMetric(), Stateful)
    assert isinstance(metric, Stateful)


def test_the_runs_walk_of_sink_states_finds_the_places_dcp_stores() -> None:
    import torch
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    from sidestream._delivery import _places

    states = [
        {},
        {"run_id": "abc", "last_steps": [["", 3], ["val", 7]]},  # lists of plain values: one
        {"offset": 12, "nested": {"a": 1, "b": {"c": None}}, "empty": {}},
        {"pairs": [{"x": 1}, {"y": 2}], "mixed": [1, {"z": 3}], "deep": [[1, [{"w": 0}]], [2]]},
        {"tensors": [torch.zeros(2), 1], "tuple": ({"k": 1}, 2), 3: "int key"},
    ]
    for state in states:
        found: list[str] = []

        def visit(path: tuple[object, ...], _: object, found: list[str] = found) -> None:
            found.append(".".join(map(str, path)))

        traverse_state_dict(state, visit)  # type: ignore[arg-type]  # the stub's path type
        assert _places(state) == frozenset(found), state


def test_metric_families_are_attributes_imported_on_first_use() -> None:
    code = (
        "import sys, sidestream; before = 'sidestream.metrics.classification' in sys.modules; "
        "print(before, sidestream.metrics.classification.BinaryAUROCMetric.__name__, "
        "sidestream.metrics.regression.R2ScoreMetric.__name__, "
        "sidestream.metrics.language.PerplexityMetric.__name__)"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert found.stdout.split() == [
        "False",
        "BinaryAUROCMetric",
        "R2ScoreMetric",
        "PerplexityMetric",
    ]


def test_the_language_metrics_leave_the_classification_family_unimported() -> None:
    # The classification family is the largest: a job that only measures perplexity need
    # not import it. The language metrics share its tensor check, not the family.
    code = (
        "import sys, torch; from sidestream.metrics.language import PerplexityMetric; "
        "PerplexityMetric().update(torch.randn(2, 5), torch.tensor([1, 2])); "
        "print('sidestream.metrics.classification' in sys.modules)"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert found.stdout.strip() == "False", found.stderr


def test_a_job_that_never_compiles_leaves_torch_dynamo_unimported() -> None:
    # Metric.sync, schedule_collection, collect_results and run.log run eagerly inside a
    # compiled step (host_call); torch.compiler.disable applied at their definition imported
    # torch._dynamo, sympy and mpmath into every process importing sidestream: about 800
    # modules and 2 s, for jobs that never compile.
    # So did the exact ranking metrics' store (torch.compiler.disable at class definition),
    # for every job importing the classification metrics.
    code = (
        f"import sys; {_IMPORTS}; "
        f"{_USE}; m = MeanMetric(); m.update(torch.tensor([1.0])); m.sync(); "
        "from sidestream.metrics.classification import BinaryAUROCMetric; "
        "auroc = BinaryAUROCMetric(exact=True); "
        "auroc.update(torch.tensor([0.2, 0.7]), torch.tensor([0, 1])); auroc.compute(); "
        "print('torch._dynamo' in sys.modules)"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert found.stdout.strip() == "False", found.stderr
