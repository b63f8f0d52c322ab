from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidestream.testing import RankPool
from tests._ports import quiet_port
from tests.conftest import Pools
from tests.integrations._workload import WORLD_SIZE

# Nothing outside this machine is reachable from the tests: no MLflow usage telemetry.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
            if "pool2" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.distributed)


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 with a SQLite store; tests may kill and restart it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = quiet_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self._log = root / "server.log"

    def start(self, timeout: float = 120.0) -> None:
        executable = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or "mlflow"
        command = [
            executable,
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--workers",
            "1",
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self._log, "ab") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"mlflow server exited:\n{self._log.read_text()[-3000:]}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.uri}/health", timeout=1.0) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(
            f"mlflow server not healthy in {timeout} s:\n{self._log.read_text()[-3000:]}"
        )

    @property
    def running(self) -> bool:
        """Whether the server process was started and has not exited."""
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        # The server runs in its own session: end its workers with it.
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _ram_dir(prefix: str) -> Path:
    # SQLite commits on a RAM disk where there is one: an MLflow write's cost is mostly fsync.
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=shm if shm.is_dir() else None))


@pytest.fixture(scope="session")
def _empty_mlflow_store() -> Iterator[Path | None]:
    """One empty SQLite MLflow store with its tables made, or ``None`` without mlflow.

    MLflow makes a fresh store's tables by running every schema migration, about 2.5 s: once
    here instead of once per test. A few tests (entry points, sink options, the examples) still
    start from no file at all, as a new user does.
    """
    try:
        from mlflow import MlflowClient
    except ImportError:
        yield None
        return
    root = _ram_dir("sidestream-mlflow-template-")
    MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").search_experiments()
    yield root / "mlflow.db"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shm_path(_empty_mlflow_store: Path | None) -> Iterator[Path]:
    """A temporary directory on a RAM disk where there is one, for SQLite MLflow stores.

    It holds ``mlflow.db``, a copy of an empty store with its tables made (when mlflow is
    installed).
    """
    root = _ram_dir("sidestream-test-")
    if _empty_mlflow_store is not None:
        shutil.copyfile(_empty_mlflow_store, root / "mlflow.db")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server() -> Iterator[MlflowServer]:
    pytest.importorskip("mlflow")
    root = _ram_dir("sidestream-mlflow-")
    server = MlflowServer(root)
    server.start()
    yield server
    server.kill()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pool2(pools: Pools) -> RankPool:
    return pools.get(WORLD_SIZE)
