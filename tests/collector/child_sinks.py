"""Sinks that misbehave inside a ProcessSink's child; importable there by module."""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sidestream.sinks import JsonlSink, Report, RunInfo, Sink


class TroubleJsonlSink(JsonlSink):
    """A JSONL sink (buffered, resumable) that dies, hangs or raises once at a given step.

    Each trouble happens once per marker file, so the child started after it behaves.
    """

    def __init__(
        self,
        path: Path,
        *,
        die_at: int | None = None,
        hang_at: int | None = None,
        raise_at: int | None = None,
        raises: int = 1,
    ) -> None:
        super().__init__(path, flush_every=1)  # one report per write: troubles hit one step
        self._marker = Path(f"{path}.trouble")
        self._die_at, self._hang_at, self._raise_at = die_at, hang_at, raise_at
        self._raises = raises

    def send(self, reports: Sequence[Report]) -> None:
        for report in reports:
            if report.step == self._die_at and not self._marker.exists():
                self._marker.touch()
                os._exit(9)
            if report.step == self._hang_at and not self._marker.exists():
                self._marker.touch()
                time.sleep(600)
            if report.step == self._raise_at and self._raises > 0:
                self._raises -= 1
                raise ConnectionError("tracker refused the connection")
        super().send(reports)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pid": os.getpid()}

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "pid"})


class FailingOpenSink(Sink):
    name = "failing_open"

    def open(self, run: RunInfo) -> None:
        raise PermissionError("no write access to the tracker")

    def write(self, report: Report) -> None:  # pragma: no cover - never opened
        raise AssertionError("write without open")


class BatchSizesSink(Sink):
    """Takes up to 4 reports per call and reports the sizes it got in its state."""

    name = "batch_sizes"
    max_batch = 4

    def __init__(self) -> None:
        self._sizes: list[int] = []

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        self._sizes.append(1)

    def write_batch(self, reports: Sequence[Report]) -> None:
        self._sizes.append(len(reports))

    def state_dict(self) -> dict[str, Any]:
        return {"sizes": list(self._sizes), "pid": os.getpid()}


class DurableCountSink(JsonlSink):
    """A JSONL sink that counts its ``make_durable`` calls in its state."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, flush_every=1000)  # nothing reaches the file before a flush
        self._durable_calls = 0

    def make_durable(self, timeout: float | None = None) -> bool:
        self._durable_calls += 1
        return super().make_durable(timeout)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "durable_calls": self._durable_calls}

    def load_state_dict(self, state_dict: Any) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "durable_calls"})


class SlowDurableSink(JsonlSink):
    """A JSONL sink whose ``make_durable`` takes ``seconds`` (a slow backend), within its
    timeout."""

    def __init__(self, path: Path, seconds: float) -> None:
        super().__init__(path)
        self._seconds = seconds

    def make_durable(self, timeout: float | None = None) -> bool:
        time.sleep(self._seconds)
        return super().make_durable(timeout)


class SlowOpenSink(JsonlSink):
    """A JSONL sink whose ``open`` takes ``seconds``; each open writes its pid to a file."""

    def __init__(self, path: Path, seconds: float) -> None:
        super().__init__(path)
        self._seconds = seconds

    def open(self, run: RunInfo) -> None:
        with open(f"{self.path}.opens", "a", encoding="utf-8") as opens:
            opens.write(f"{os.getpid()}\n")
        time.sleep(self._seconds)
        super().open(run)


class SlowReopenSink(SlowOpenSink):
    """A ``SlowOpenSink`` whose first ``open`` is quick: only a restarted child's is slow."""

    def open(self, run: RunInfo) -> None:
        opens = Path(f"{self.path}.opens")
        if not opens.exists():
            opens.write_text(f"{os.getpid()}\n", encoding="utf-8")
            JsonlSink.open(self, run)
            return
        super().open(run)


class BuggySink(Sink):
    """A sink whose ``write`` has a bug: retrying it cannot help."""

    name = "buggy"

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        raise AttributeError("'NoneType' object has no attribute 'log'")


class CloseMarkerSink(Sink):
    """Appends ``open <pid>`` and ``close <pid>`` lines to ``path``, like a run opened and
    finished on a backend."""

    name = "close_marker"

    def __init__(self, path: Path) -> None:
        self._path = path

    def _mark(self, what: str) -> None:
        with open(self._path, "a") as file:
            file.write(f"{what} {os.getpid()}\n")

    def open(self, run: RunInfo) -> None:
        self._mark("open")

    def write(self, report: Report) -> None:
        pass

    def close(self, timeout: float | None = None) -> bool:
        self._mark("close")
        return True


class FlushHangSink(JsonlSink):
    """A JSONL sink whose ``flush`` (and so ``close``) hangs while ``<path>.hang`` exists."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._flag = Path(f"{path}.hang")

    def flush(self, timeout: float | None = None) -> bool:
        while self._flag.exists():
            time.sleep(0.05)
        return super().flush(timeout)


class ChildlessSink(JsonlSink):
    """A sink that the parent can rebuild from its pickle but a child process cannot."""

    def __setstate__(self, state: dict[str, object]) -> None:
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise RuntimeError("cannot construct in child")
        self.__dict__.update(state)


class TemporaryFolderSink(Sink):
    """Holds a ``tempfile.TemporaryDirectory`` for the life of its process, as wandb does for
    its media files, and names it in its state."""

    name = "temporary_folder"

    def __init__(self) -> None:
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    def open(self, run: RunInfo) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="sidestream-child-")

    def write(self, report: Report) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"folder": None if self._folder is None else self._folder.name}


class FlushFailsOnceSink(Sink):
    """Keeps the steps written in its state; its first flush raises (the backend down)."""

    name = "flush_fails_once"

    def __init__(self) -> None:
        self._steps: list[int] = []
        self._flush_failed = False

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        self._steps.append(report.step)

    def flush(self, timeout: float | None = None) -> bool:
        if not self._flush_failed:
            self._flush_failed = True
            raise ConnectionError("flush: tracker unreachable")
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self._steps), "pid": os.getpid()}


class GatedMarkerSink(Sink):
    """Appends ``<what> <pid>`` lines to ``path`` (``close`` with the exit code it was told);
    its ``open`` or ``write`` (``gate``) waits until ``<path>.go`` exists."""

    name = "gated_marker"

    def __init__(self, path: Path, gate: str) -> None:
        self._path = path
        self._gate = gate

    def _mark(self, what: str) -> None:
        with open(self._path, "a") as file:
            file.write(f"{what} {os.getpid()}\n")
        if what == self._gate:
            while not Path(f"{self._path}.go").exists():
                time.sleep(0.05)

    def open(self, run: RunInfo) -> None:
        self._mark("open")

    def write(self, report: Report) -> None:
        self._mark("write")

    def make_durable(self, timeout: float | None = None) -> bool:
        self._mark("durable")
        return True

    def close(self, timeout: float | None = None) -> bool:
        from sidestream._exit import failed_exit_code

        self._mark(f"close:{failed_exit_code()}")
        return True


class StalledFlushSink(Sink):
    """Keeps the steps written in its state; its flush does not finish while ``flag`` exists
    (a backend that confirms nothing)."""

    name = "stalled_flush"

    def __init__(self, flag: Path) -> None:
        self._flag = flag
        self._steps: list[int] = []

    def open(self, run: RunInfo) -> None:
        pass

    def write(self, report: Report) -> None:
        self._steps.append(report.step)

    def flush(self, timeout: float | None = None) -> bool:
        return not self._flag.exists()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self._steps)}


class DiesAtFirstOpenSink(JsonlSink):
    """A JSONL sink whose first child dies while opening (once per marker file).

    With ``then_fail`` every later open raises instead (a tracker down).
    """

    def __init__(self, path: Path, *, then_fail: bool = False) -> None:
        super().__init__(path)
        self._then_fail = then_fail

    def open(self, run: RunInfo) -> None:
        marker = Path(f"{self.path}.died")
        if not marker.exists():
            marker.touch()
            os._exit(9)
        if self._then_fail:
            raise ConnectionError("tracker down")
        super().open(run)


class EioOnSecondSyncJsonlSink(JsonlSink):
    """Its second ``fsync`` (a second checkpoint's) fails as a disk's write-back error does."""

    def _sync_file(self) -> None:
        self._syncs = getattr(self, "_syncs", 0) + 1
        if self._syncs >= 2:
            import errno

            raise OSError(errno.EIO, "Input/output error")
        super()._sync_file()


class SlowExitSink(Sink):
    """Closes within its timeout (at 60 % of it), then its child is slow to exit.

    A finalizer made at open sleeps ``exit_s`` when the child ends (as removing a temporary
    folder on a hung disk would), after close has answered.
    """

    name = "slow_exit"

    def __init__(self, exit_s: float = 60.0) -> None:
        self._exit_s = exit_s

    def open(self, run: RunInfo) -> None:
        self._anchor = _Anchor()
        weakref.finalize(self._anchor, time.sleep, self._exit_s)

    def write(self, report: Report) -> None:
        pass

    def close(self, timeout: float | None = None) -> bool:
        time.sleep(0.6 * (timeout or 0.0))
        return True


class _Anchor:
    """An object a finalizer can hang on (a plain ``object()`` takes no weak reference)."""


class SlowDurableRefusingSink(JsonlSink):
    """A JSONL sink whose ``make_durable`` takes ``seconds`` and whose child refuses the write
    of step ``refuse_at`` once (a transient backend error)."""

    def __init__(self, path: Path, seconds: float, refuse_at: int) -> None:
        super().__init__(path, flush_every=1)
        self._seconds, self._refuse_at, self._refused = seconds, refuse_at, False

    def send(self, reports: Sequence[Report]) -> None:
        if not self._refused and any(report.step == self._refuse_at for report in reports):
            self._refused = True
            raise ConnectionError("tracker refused the connection")
        super().send(reports)

    def make_durable(self, timeout: float | None = None) -> bool:
        time.sleep(self._seconds)
        return super().make_durable(timeout)
