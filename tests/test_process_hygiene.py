"""Importing sidestream changes nothing process-wide; a sink's changes to the environment are
documented."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, logging, os, signal, sys, threading, warnings
import torch, torch.distributed
before = dict(
    env=dict(os.environ), handlers=list(logging.getLogger().handlers),
    level=logging.getLogger().level, threads=threading.active_count(),
    sigint=signal.getsignal(signal.SIGINT), sigterm=signal.getsignal(signal.SIGTERM),
    filters=list(warnings.filters), excepthook=sys.excepthook, thread_hook=threading.excepthook,
)
import sidestream, sidestream.collector, sidestream.sinks, sidestream.run, sidestream.metrics
import sidestream.metrics.regression, sidestream.metrics.language, sidestream.metrics.classification
import sidestream_mlflow, sidestream_tensorboard, sidestream_wandb
changed = [
    name for name, now in (
        ("handlers", list(logging.getLogger().handlers)), ("level", logging.getLogger().level),
        ("threads", threading.active_count()), ("sigint", signal.getsignal(signal.SIGINT)),
        ("sigterm", signal.getsignal(signal.SIGTERM)), ("filters", list(warnings.filters)),
        ("excepthook", sys.excepthook), ("thread_hook", threading.excepthook),
    ) if now != before[name]
]
old = before["env"]
env = sorted(k for k in set(os.environ) | set(old) if os.environ.get(k) != old.get(k))
print(json.dumps({"changed": changed, "env": env}))
"""


def test_importing_the_packages_changes_no_process_wide_setting() -> None:
    found = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    *printed, last = found.stdout.strip().splitlines() or [""]
    assert not printed, f"printed at import: {printed}"
    assert json.loads(last) == {"changed": [], "env": []}, found.stderr


def test_every_environment_variable_a_sink_sets_is_documented() -> None:
    # MlflowSink sets MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT for a URI with a password, for the
    # whole process, while its page said that no environment variable is changed.
    setting = re.compile(
        r"os\.environ(?:\.setdefault\(|\[)\s*[\"']([A-Z0-9_]+)[\"']\s*(?:,|\]\s*=)"
    )
    for package in ("mlflow", "tensorboard", "wandb"):
        source = _ROOT / "integrations" / f"sidestream-{package}" / "src"
        page = (_ROOT / "docs" / "integrations" / f"{package}.md").read_text()
        for path in source.rglob("*.py"):
            for name in setting.findall(path.read_text()):
                assert name in page, f"{path.name} sets {name}; docs/integrations/{package}.md"


_HELD_GROUP_PROBE = """
import os, torch, torch.distributed as dist
import sidestream  # at the top of a training script, before its init_process_group
dist.init_process_group("gloo", init_method=os.environ["PROBE_STORE"], rank=0, world_size=1)
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch.distributed.nn
import torch.distributed.nn.functional as functional
held = [d for d in functional.broadcast.__defaults__ if isinstance(d, dist.ProcessGroup)]
dist.destroy_process_group()
print(len(held))
"""


def test_a_script_importing_sidestream_first_keeps_no_group_past_destroy_process_group(
    tmp_path: Path,
) -> None:
    # The quickstart under torchrun aborted at exit in about one run of ten ("terminate called
    # without an active exception"): its optimizer imported torch.distributed.nn after
    # init_process_group, whose functions then held the group as a default argument past
    # destroy_process_group(), and gloo's destructor ran during the interpreter's teardown.
    result = subprocess.run(
        [sys.executable, "-c", _HELD_GROUP_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PROBE_STORE": f"file://{tmp_path / 'store'}"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "0", "torch.distributed.nn holds the default group"
