"""Every workflow of the repository: ``nox -l`` lists them.

The torch requirement comes from one place, ``SIDESTREAM_TORCH`` (default ``torch==2.13.0``):
set it to ``torch`` for the latest release or pin the build your machines use.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests", "docs"]  # as `nox -t ci`
nox.options.reuse_existing_virtualenvs = False
# Every session needs Python 3.11. Without it nox would only skip the session and exit 0
# outside CI (where the CI variable is unset): `nox -s demo` or `nox -t ci` on a machine with
# another Python would report success having run nothing.
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
TORCH = os.environ.get("SIDESTREAM_TORCH", "torch==2.13.0")
CORE = "packages/sidestream"
INTEGRATIONS = [
    "integrations/sidestream-wandb",
    "integrations/sidestream-mlflow",
    "integrations/sidestream-tensorboard",
    "integrations/sidestream-torchmetrics",
]
DISTRIBUTIONS = [CORE, *INTEGRATIONS]
TEST_REQUIREMENTS = [
    "pytest>=8",
    "pytest-timeout",
    "pytest-xdist",  # the tests session's two workers
    "numpy",
    "scikit-learn",
    "scipy",
    "hypothesis",
    "matplotlib",  # the demo draws its curves, and its test checks the image
]


def _install_project(session: nox.Session, *extra: str, integrations: bool = True) -> None:
    # Torch first and on its own, so the requirement above is the one that decides the build.
    session.install(TORCH)
    editables = [CORE, *(INTEGRATIONS if integrations else [])]
    session.install(*[arg for path in editables for arg in ("-e", path)], *extra)


@nox.session(python=PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """Mypy (strict) over the packages and the documented usage in tests/typed_usage."""
    _install_project(session, "mypy>=1.11")
    session.run("mypy")


@nox.session(python=PYTHON, tags=["ci"])
def tests(session: nox.Session) -> None:
    """All that runs on a CPU machine: unit, distributed (2 and 4 gloo ranks), integrations.

    On two pytest-xdist workers: most tests wait on other processes (ranks, tracker servers,
    child sinks), so two workers take a third less time even on two cores. More would load a
    small machine enough to slow the timing-sensitive ones. Arguments replace the defaults:
    ``nox -s tests -- tests/core`` runs one folder in this process.
    """
    _install_project(session, *TEST_REQUIREMENTS)
    session.run("pytest", *(session.posargs or ["-n", "2", "tests"]))


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """Opt-in: CUDA tests under sync-debug mode, then the distributed tests over NCCL.

    With two or more GPUs the distributed tests run on ranks torchrun starts, one per GPU,
    joined by NCCL: with 2 and 4 ranks (as on CPU) and once over every visible GPU.
    """
    _install_project(session, *TEST_REQUIREMENTS)
    session.run("pytest", "-m", "gpu", "tests", *session.posargs)
    count = "import torch; print(torch.cuda.device_count())"
    output = session.run("python", "-c", count, silent=True)
    gpus = int(str(output).split()[-1])
    if gpus < 2:
        session.log(f"{gpus} GPU visible: the NCCL run of the distributed tests needs 2; skipped")
        return
    session.run(
        "pytest",
        "-m",
        "distributed and not integration",
        "tests",
        *session.posargs,
        env={"SIDESTREAM_TEST_LAUNCHER": "torchrun", "SIDESTREAM_TEST_BACKEND": "nccl"},
    )


@nox.session(python=PYTHON, name="compile")
def compile_inductor(session: nox.Session) -> None:
    """Opt-in (slow): every built-in metric's update compiled with inductor, against eager.

    CI compiles the same catalogue with the fast ``aot_eager`` backend.
    """
    _install_project(session, *TEST_REQUIREMENTS)
    session.run(
        "pytest",
        "-m",
        "compile",
        "tests/metrics/test_compiled_updates.py",
        *session.posargs,
        env={"SIDESTREAM_COMPILE_INDUCTOR": "1"},
    )


@nox.session(python=PYTHON)
def lowest(session: nox.Session) -> None:
    """Opt-in: the tracker and torchmetrics tests on the lowest release each integration declares.

    Each integration's ``client>=X`` requirement is installed as ``client==X`` (torch stays
    ``SIDESTREAM_TORCH``), so a floor that stopped working fails here, not on a user's machine.
    """
    _install_project(session, *TEST_REQUIREMENTS, *lowest_releases())
    session.run("pytest", *(session.posargs or ["-n", "2", "-m", "integration", "tests"]))


def lowest_releases() -> list[str]:
    """``name==X`` for each integration requirement ``name>=X`` (the sibling pins excluded)."""
    import re
    import tomllib

    pins = []
    for path in INTEGRATIONS:
        project = tomllib.loads(Path(path, "pyproject.toml").read_text())["project"]
        for requirement in project["dependencies"]:
            floor = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][0-9A-Za-z.]*)", requirement)
            if floor is not None:
                pins.append(f"{floor[1]}=={floor[2]}")
    return pins


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Wheels and sdists of all five distributions (one version) into dist/, then a smoke test.

    The smoke test installs the wheels the way a user would, into this session's fresh
    virtual environment: torch first, then ``pip install --find-links dist "sidestream[all]"``,
    and builds every sink through ``sinks_from_config``.
    """
    import shutil
    import tomllib

    versions = {
        path: tomllib.loads(Path(path, "pyproject.toml").read_text())["project"]["version"]
        for path in DISTRIBUTIONS
    }
    if len(set(versions.values())) != 1:
        session.error(f"distributions must share one version, got {versions}")
    session.install("build")
    shutil.rmtree("dist", ignore_errors=True)
    for path in DISTRIBUTIONS:
        session.run("python", "-m", "build", "--outdir", "dist", path)
    session.install(TORCH)
    session.install("--find-links", "dist", "sidestream[all]")
    with session.chdir(session.create_tmp()):
        session.run("python", "-c", _SMOKE)


_SMOKE = """
from sidestream.sinks import available_sinks, sinks_from_config
names = available_sinks()
assert names == ["console", "jsonl", "mlflow", "tensorboard", "wandb"], names
sinks = sinks_from_config({"jsonl": {"path": "a.jsonl"}, "console": None,
    "tensorboard": {"log_dir": "tb"}, "mlflow": {"tracking_uri": "sqlite:///m.db"},
    "wandb": {"mode": "offline"}})
print("built:", [type(sink).__name__ for sink in sinks])
from sidestream_torchmetrics import wrap  # the fifth distribution, through the extra
"""

DOCS_REQUIREMENTS = ["mkdocs-material", "mkdocstrings[python]"]


@nox.session(python=PYTHON, tags=["ci"])
def docs(session: nox.Session) -> None:
    """Build the documentation site strictly, then check every nav page was built and linked."""
    session.install(*DOCS_REQUIREMENTS, "pytest", "pytest-timeout")
    session.run(
        "mkdocs", "build", "--strict", "--site-dir", "site", env={"NO_MKDOCS_2_WARNING": "1"}
    )
    # --noconftest: the nav checks read files only; the tests' conftest would import torch.
    session.run(
        "pytest",
        "--noconftest",
        "tests/test_docs.py",
        "-k",
        "nav",
        env={"SIDESTREAM_SITE_DIR": "site"},
    )


@nox.session(name="docs-serve", python=PYTHON)
def docs_serve(session: nox.Session) -> None:
    """Preview the site at http://127.0.0.1:8000, rebuilt on every change (``mkdocs serve``)."""
    session.install(*DOCS_REQUIREMENTS)
    session.run("mkdocs", "serve", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks against peers; writes docs/benchmarks.md and its plots (docs/figures/)."""
    # The integrations come along: tracker_overhead measures each tracker's own client too.
    _install_project(session, "torchmetrics", "numpy", "matplotlib")
    session.run("python", "-m", "benchmarks.run", *session.posargs)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """A real 2-process training run: train, validation and lr streams, then a PNG of the curves.

    Writes runs/demo/metrics.jsonl, runs/demo/tensorboard/ and runs/demo/curves.png (its path
    is printed last). ``nox -s demo -- --plot docs/figures/demo.png`` redraws the README's image.
    """
    # numpy: torch warns without it; matplotlib: the plot; TensorBoard: the demo writes there too.
    _install_project(session, "numpy", "matplotlib", integrations=False)
    session.install("-e", "integrations/sidestream-tensorboard")
    session.run("python", "examples/train_distributed.py", *session.posargs)


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """100,000 windows of 200 names on 2 ranks (``-- --windows N`` for another count).

    Writes ``build/soak.json``, which ``nox -s reliability`` quotes in docs/reliability.md.
    """
    _install_project(session, *TEST_REQUIREMENTS)
    session.run("python", "-m", "tests.reliability.soak", *session.posargs)


@nox.session(python=PYTHON)
def reliability(session: nox.Session) -> None:
    """Every fault and bad input of the suite, full size; regenerates docs/reliability.md."""
    _install_project(session, *TEST_REQUIREMENTS)
    session.run("python", "-m", "tests.reliability.report", *session.posargs)
