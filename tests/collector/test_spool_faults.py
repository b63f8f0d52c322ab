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


def test_a_failed_write_after_the_spool_folder_was_deleted_keeps_the_spool(
    tmp_path: Path,
) -> None:
    # The spool's folder deleted under the open file (a temp-dir cleaner, an rm -rf), then one
    # failed write (a full disk): the file was reopened by its path, which failed, so the
    # spooled reports were lost with the closed file and every later spill failed for good.
    import shutil

    folder = tmp_path / "spool"
    spool = Spool(str(folder), "sink", max_bytes=1 << 20)
    spool.append(_report(1))
    spool.append(_report(2))
    shutil.rmtree(folder)
    spool._file = _FullDisk(spool._file)  # the next write fails: ENOSPC
    with pytest.raises(OSError):
        spool.append(_report(3))
    # The disk has room again: the spool still holds what it held, and takes more.
    spool.append(_report(4))
    assert [spool.pop_oldest().step for _ in range(3)] == [1, 2, 4]
    assert spool.dropped == 0
    spool.discard()


def test_one_unreadable_spooled_report_costs_only_itself(tmp_path: Path) -> None:
    # A read of one spooled line that fails (EIO on a bad sector) dropped the whole spool:
    # steps 6..12 lost, although the lines after it were readable at their own offsets.
    from sidestream.sinks import SinkRunner
    from sidestream.sinks.base import Sink

    class Recording(Sink):
        name = "rec"

        def __init__(self) -> None:
            self.steps: list[int] = []

        def open(self, run: object) -> None:
            pass

        def write(self, report: Report) -> None:
            self.steps.append(report.step)

    sink = Recording()
    runner = SinkRunner(sink, capacity=4, spool_dir=str(tmp_path))
    for step in range(1, 13):  # before start: 1..4 queued, 5..12 spooled
        runner.submit(_report(step))
    assert runner.spooled == 8
    spool = runner._spool
    real_open = spool._open
    reads: list[int] = []

    class OneBadRead:
        def __init__(self, file: Any) -> None:
            self._file = file

        def __getattr__(self, name: str) -> Any:
            return getattr(self._file, name)

        def read(self, size: int = -1) -> bytes:
            reads.append(size)
            if len(reads) == 2:  # the line of step 6
                raise OSError(errno.EIO, "Input/output error")
            return self._file.read(size)

    spool._open = lambda: OneBadRead(real_open())  # type: ignore[method-assign]
    runner.start()
    assert runner.close(timeout=30) is False  # one report lost: said so
    assert sink.steps == [1, 2, 3, 4, 5, *range(7, 13)]
    assert runner.dropped == 1


def test_a_spool_line_of_a_newer_format_is_refused_not_read_in_part(tmp_path: Path) -> None:
    # Lines carried no format: a newer writer's line, with a field this version does not
    # know (one that changes what the values mean), was read without it, silently.
    import json

    from sidestream.sinks import JsonlSink, read_spool, replay_spool
    from sidestream.sinks._spool_format import (
        SPOOL_FORMAT,
        SpoolFormatError,
        decode_report,
        encode_report,
    )

    line = json.loads(encode_report(_report(1)))
    assert line["format"] == SPOOL_FORMAT
    path = tmp_path / "x.spool.jsonl"
    newer = {**line, "format": SPOOL_FORMAT + 1, "value_scale": 0.001}
    path.write_text(json.dumps(newer) + "\n")
    with pytest.raises(SpoolFormatError, match=r"line 1: spool format 2.*upgrade sidestream"):
        list(read_spool(path))
    with pytest.raises(SpoolFormatError):  # no damage: never skipped as a damaged line is
        list(read_spool(path, damaged=[]))
    out = tmp_path / "out.jsonl"
    with pytest.raises(SpoolFormatError):  # before the sink opens: no file made
        replay_spool(path, JsonlSink(out), skip_damaged=True)
    assert not out.exists()
    # A field this format does not have is damage; a line of before the format is read.
    with pytest.raises(ValueError, match="unknown field 'value_scale'"):
        decode_report(json.dumps({**line, "value_scale": 0.001}))
    old = {key: value for key, value in line.items() if key != "format"}
    assert decode_report(json.dumps({**old, "extra": 1})) == _report(1)


def test_a_report_the_full_disk_kept_out_of_the_spool_names_the_spool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # "could not spool step 5: OSError: [Errno 28] No space left on device" named neither the
    # spool file nor its folder (the temp dir by default, often not the logs' disk).
    import logging

    from sidestream.sinks import SinkRunner
    from sidestream.sinks.base import Sink

    class Idle(Sink):
        name = "idle"

        def open(self, run: object) -> None:
            pass

        def write(self, report: Report) -> None:
            pass

    runner = SinkRunner(Idle(), capacity=2, spool_dir=str(tmp_path / "spool"))
    with caplog.at_level(logging.WARNING, logger="sidestream.sinks"):
        for step in range(1, 4):  # not started: 1, 2 queued, 3 spooled
            runner.submit(_report(step))
        runner._spool._file = _FullDisk(runner._spool._file)
        runner.submit(_report(4))
        runner.start()
        assert runner.close(timeout=30) is False
    (message,) = [r.getMessage() for r in caplog.records if "could not spool" in r.getMessage()]
    assert "No space left on device" in message
    assert str(runner._spool.path or tmp_path / "spool") in message
    assert "spool_dir" in message
