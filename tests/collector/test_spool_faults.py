"""The spool file under OS errors: it recovers once the fault passes, and keeps what it held."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest

import sidestream.sinks._spool as spool_module
from sidestream.sinks._spool import Spool
from sidestream.sinks.base import Report


def _report(step: int) -> Report:
    return Report(step=step, values={"x": float(step)}, time=0.0)


class _FullDisk:
    """The spool's file, whose writes fail as on a full disk."""

    def __init__(self, file: Any) -> None:
        self._real = file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def write(self, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        pass


def test_a_failed_reopen_after_a_failed_write_does_not_break_the_spool_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = Spool(str(tmp_path), "sink", max_bytes=1 << 20)
    spool.append(_report(1))
    spool._file = _FullDisk(spool._file)  # the next write fails: ENOSPC

    def no_descriptors(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    with monkeypatch.context() as patch:
        # The reopen after that failed write fails too (a job short of file descriptors).
        patch.setattr(spool_module, "open", no_descriptors, raising=False)
        with pytest.raises(OSError):
            spool.append(_report(2))
    # The fault passed: the spool works again, and the report it held before is still there.
    spool.append(_report(3))
    assert b'"step":1' in spool.live_bytes()
    assert [spool.pop_oldest().step for _ in range(2)] == [1, 3]
    spool.discard()
