"""JsonlSink under the faults a long job meets: a pipe's reader going, log rotation, resume.

Each test compares the lines actually in the file (or read from the pipe) with the steps
logged: nothing lost, nothing twice, every line whole JSON.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sidestream import Run
from sidestream.sinks import JsonlSink, Report, RunInfo
from sidestream.sinks.runner import SinkRunner

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX files and pipes")


def _report(step: int, stream: str = "") -> Report:
    return Report(step=step, values={"x": float(step)}, time=1000.0 + step, stream=stream)


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines() if path.exists() else []


def _steps(lines: list[bytes]) -> list[tuple[str, int]]:
    """(stream, step) of each line; a line that is no JSON object fails the test."""
    records = [json.loads(line) for line in lines]
    return [(record["stream"], record["step"]) for record in records]


def _wait_for(condition: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)
    assert condition(), "timed out"  # type: ignore[operator]


def _read_lines(fifo: Path, into: list[bytes], count: int | None = None) -> None:
    """Read whole lines from ``fifo`` unbuffered (no line read ahead), ``count`` at most."""
    with fifo.open("rb", buffering=0) as pipe:
        line = b""
        while count is None or len(into) < count:
            byte = pipe.read(1)
            if not byte:
                return
            line += byte
            if byte == b"\n":
                into.append(line)
                line = b""


@pytest.mark.parametrize("made_anew", [False, True], ids=["same-fifo", "fifo-made-anew"])
def test_a_fifo_whose_reader_exits_delivers_to_the_next_reader(
    tmp_path: Path, made_anew: bool
) -> None:
    """The write got BrokenPipeError and was retried on the same descriptor: a FIFO made anew
    by the next reader (rm, mkfifo, cat) never got a line (close False), and the same FIFO got
    a blank line first (a newline closing a line that was never cut)."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    first: list[bytes] = []
    reader = threading.Thread(target=_read_lines, args=(fifo, first, 3))
    reader.start()
    runner = SinkRunner(JsonlSink(fifo), retry_initial_s=0.02, retry_max_s=0.1)
    runner.start()
    for step in (1, 2, 3):
        runner.submit(_report(step))
    reader.join(30.0)
    assert not reader.is_alive()
    if made_anew:
        fifo.unlink()
        os.mkfifo(fifo)
    for step in range(4, 11):
        runner.submit(_report(step))
    _wait_for(lambda: "no reader attached" in str(runner.status.last_error))
    assert runner.status.state == "retrying"
    assert str(fifo) in str(runner.status.last_error)
    second: list[bytes] = []
    reader = threading.Thread(target=_read_lines, args=(fifo, second))
    reader.start()
    assert runner.close(30.0)
    reader.join(30.0)
    assert _steps(first) == [("", step) for step in (1, 2, 3)]
    assert second and second[0].strip(), second[:1]  # no blank line
    assert _steps(second) == [("", step) for step in range(4, 11)]


def _read_all(fifo: Path, into: list[bytes], attached: threading.Event | None = None) -> None:
    """Every byte a reader of ``fifo`` gets until its writers close it; ``attached`` is set
    once it has the FIFO open (a writer holds it then)."""
    with fifo.open("rb") as pipe:
        if attached is not None:
            attached.set()
        into.append(pipe.read())


def _hold_the_pipe_full_then_exit(fifo: Path) -> None:
    """A reader that attaches, reads nothing, and exits once the writer filled the pipe."""
    import fcntl
    import termios

    descriptor = os.open(fifo, os.O_RDONLY)
    try:
        size = fcntl.fcntl(descriptor, fcntl.F_GETPIPE_SZ)
        queued = bytearray(4)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            fcntl.ioctl(descriptor, termios.FIONREAD, queued)
            if int.from_bytes(queued, sys.byteorder) >= size:
                return  # the writer waits for room: part of its batch is in the pipe
            time.sleep(0.01)
    finally:
        os.close(descriptor)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_GETPIPE_SZ")
@pytest.mark.parametrize("made_anew", [False, True], ids=["same-fifo", "fifo-made-anew"])
@pytest.mark.parametrize("lines", ["many-lines", "one-huge-line"])
def test_a_fifo_whose_reader_exits_mid_batch_gives_the_next_reader_each_line_once(
    tmp_path: Path, made_anew: bool, lines: str
) -> None:
    """The pipe took the first 64 KiB of a batch, then its reader exited: the retry sent the
    whole batch again after a newline, so the next reader of the same FIFO got the lines in
    those 64 KiB twice and a line of no JSON (a line larger than the pipe: the same)."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    if lines == "many-lines":
        reports = [_report(step) for step in range(1, 2001)]  # about 140 kB
    else:  # one line of about 450 kB, between two small ones
        big = Report(
            step=2,
            values={"x": 2.0},
            time=1002.0,
            histograms={"h": torch.arange(30000, dtype=torch.float64) / 7},
        )
        reports = [_report(1), big, _report(3)]
    first = threading.Thread(target=_hold_the_pipe_full_then_exit, args=(fifo,))
    first.start()
    runner = SinkRunner(
        JsonlSink(fifo, flush_every=4096), capacity=4096, retry_initial_s=0.02, retry_max_s=0.1
    )
    for report in reports:  # one batch
        runner.submit(report)
    runner.start()
    first.join(60.0)
    assert not first.is_alive()
    if made_anew:  # rm, mkfifo: what the old pipe held is gone with it
        fifo.unlink()
        os.mkfifo(fifo)
    _wait_for(lambda: "no reader attached" in str(runner.status.last_error))
    got: list[bytes] = []
    second = threading.Thread(target=_read_all, args=(fifo, got))
    second.start()
    assert runner.close(60.0)
    second.join(60.0)
    assert not second.is_alive()
    data = got[0]
    assert data.endswith(b"\n")
    # Every line the next reader got is one JSON object, each step once, in order.
    assert _steps(data.splitlines()) == [("", report.step) for report in reports]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_GETPIPE_SZ")
def test_a_close_that_gives_up_a_cut_batch_leaves_the_next_reader_no_torn_line(
    tmp_path: Path,
) -> None:
    """The next reader attached to the same FIFO while the runner waited to retry, and close
    gave up the batch: the sink let the pipe go with a line cut in it, so the reader got a
    line of no JSON, then the end."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    first = threading.Thread(target=_hold_the_pipe_full_then_exit, args=(fifo,))
    first.start()
    runner = SinkRunner(
        JsonlSink(fifo, flush_every=4096),
        capacity=4096,
        spool_dir=str(tmp_path / "spool"),
        retry_initial_s=3.0,
        retry_max_s=3.0,
    )
    for step in range(1, 2001):  # one batch, larger than the pipe
        runner.submit(_report(step))
    runner.start()
    first.join(60.0)
    _wait_for(lambda: "reader" in str(runner.status.last_error))
    got: list[bytes] = []
    attached = threading.Event()
    second = threading.Thread(target=_read_all, args=(fifo, got, attached))
    second.start()  # attaches at once: the sink still holds the pipe
    assert attached.wait(30.0)  # before close lets the pipe go (an open then waits for good)
    assert runner.close(0.2) is False  # given up; the batch is kept in the spool
    second.join(30.0)
    assert not second.is_alive()
    data = got[0]
    assert data.endswith(b"\n")
    steps = _steps(data.splitlines())  # each line one JSON object
    assert steps == [("", step) for step in range(1, len(steps) + 1)]


def test_other_lines_after_a_cut_batch_complete_the_cut_line_first(tmp_path: Path) -> None:
    """Not the runner's retry of the same batch: the cut line is completed, then the lines."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    first = threading.Thread(target=_hold_the_pipe_full_then_exit, args=(fifo,))
    first.start()
    sink = JsonlSink(fifo, flush_every=4096)
    _wait_for(lambda: _opened(sink))
    with pytest.raises(BrokenPipeError):
        sink.write_batch([_report(step) for step in range(1, 2001)])
    first.join(30.0)
    got: list[bytes] = []
    second = threading.Thread(target=_read_all, args=(fifo, got))
    second.start()
    other = [_report(step, "val") for step in range(1, 4)]
    _wait_for(lambda: _sent(sink, other))
    sink.close()
    second.join(30.0)
    steps = _steps(got[0].splitlines())  # every line whole JSON
    cut = len(steps) - len(other)
    assert 0 < cut < 2000
    assert steps == [("", step) for step in range(1, cut + 1)] + [
        ("val", 1),
        ("val", 2),
        ("val", 3),
    ]


def _opened(sink: JsonlSink) -> bool:
    try:
        sink.open(RunInfo())
    except OSError:  # ENXIO until the reader attached
        return False
    return True


def _sent(sink: JsonlSink, reports: list[Report]) -> bool:
    try:
        sink.write_batch(reports)
    except OSError:  # ENXIO until the next reader attached
        return False
    return True


def _writer_holds(fifo: Path) -> bool:
    """Whether any process holds ``fifo`` open for writing (a reader would not see its end)."""
    descriptor = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.read(descriptor, 1)  # b"": no writer; nothing to read with a writer: EAGAIN
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False


def test_a_fifo_sink_given_up_while_retrying_lets_the_pipe_go(tmp_path: Path) -> None:
    """A runner whose close gave up on a write being retried (its reader gone) never closed
    the sink: the process held the FIFO's write end for good, so a reader that attached
    later never saw the end of it."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    first: list[bytes] = []
    reader = threading.Thread(target=_read_lines, args=(fifo, first, 2))
    reader.start()
    spool = tmp_path / "spool"
    runner = SinkRunner(JsonlSink(fifo), spool_dir=str(spool), retry_initial_s=0.02)
    runner.start()
    for step in (1, 2):
        runner.submit(_report(step))
    reader.join(30.0)
    assert not reader.is_alive()
    runner.submit(_report(3))  # the reader is gone: retried until close gives up
    _wait_for(lambda: "no reader attached" in str(runner.status.last_error))
    assert not runner.close(0.5)
    _wait_for(lambda: not _writer_holds(fifo), timeout=10.0)
    assert _steps(first) == [("", 1), ("", 2)]
    kept = [
        json.loads(line)["step"]
        for file in spool.glob("*.spool.jsonl")
        for line in file.read_text().splitlines()
    ]
    assert kept == [3]  # the step the pipe never got, kept for a replay


def test_stdout_piped_into_head_fails_at_once_and_keeps_the_reports(tmp_path: Path) -> None:
    """`train.py | head -n 5`: every write got BrokenPipeError, retried until close, so the
    job's exit waited its whole exit_timeout (30 s) with the sink 'retrying'."""
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, time\n"
        "from sidestream import Run\n"
        "from sidestream.sinks import JsonlSink\n"
        "run = Run([JsonlSink('/dev/stdout')], spool_dir=sys.argv[1], exit_timeout=20.0)\n"
        # 150 kB of lines, more than a pipe holds: some are written after head exits.
        "for step in range(1, 2001):\n"
        "    run.log(step, {'x': float(step)})\n"
        "    if step % 500 == 0:\n"
        "        time.sleep(0.3)\n"
        "start = time.monotonic()\n"
        "ok = run.close(timeout=20.0)\n"
        "print(f'closed {ok} in {time.monotonic() - start:.1f}', file=sys.stderr)\n"
        "print(run.sink_status['jsonl'].state, file=sys.stderr)\n"
    )
    spool = tmp_path / "spool"
    job = subprocess.Popen(
        [sys.executable, str(script), str(spool)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert job.stdout is not None
    head = [job.stdout.readline() for _ in range(5)]
    job.stdout.close()  # head exits
    _, err = job.communicate(timeout=120)
    assert job.returncode == 0, err.decode()
    assert _steps(head) == [("", step) for step in range(1, 6)]
    closed = err.decode().splitlines()
    state, took = closed[-1], closed[-2]
    assert took.startswith("closed False in "), err.decode()
    assert float(took.rsplit(" ", 1)[1]) < 10.0, err.decode()
    assert state == "failed"
    assert "the reader of /dev/stdout exited" in err.decode()
    # What the pipe did not take is in the spool: nothing lost in silence.
    spooled = [
        json.loads(line)["step"]
        for file in spool.glob("*.spool.jsonl")
        for line in file.read_text().splitlines()
    ]
    assert spooled and max(spooled) == 2000


def _run(path: Path, tmp_path: Path) -> Run:
    return Run(
        [JsonlSink(path)],
        spool_dir=str(tmp_path / "spool"),
        sink_retry_initial_s=0.02,
        sink_retry_max_s=0.1,
    )


def _log(run: Run, steps: range) -> None:
    for step in steps:
        run.log(step, {"x": float(step)})


def _delivered(run: Run) -> bool:
    """Whether every logged step reached the file: a runner knows only what the log thread
    handed it, so that thread's queue is waited for first."""
    pipe = run._log_pipe
    return (pipe is None or pipe.wait_idle(30)) and run.sink_runners[0].wait_delivered(30)


def _rotate(how: str, path: Path) -> Path | None:
    """What logrotate (or a user) does to the file; where its lines so far went."""
    rotated = path.with_name(path.name + ".1")
    if how == "move":  # logrotate's default: rename, then `create` a new empty file
        path.rename(rotated)
        path.touch()
        return rotated
    if how == "move-no-create":
        path.rename(rotated)
        return rotated
    if how == "copytruncate":
        shutil.copyfile(path, rotated)
        os.truncate(path, 0)
        return rotated
    assert how == "delete"
    path.unlink()
    return None


@pytest.mark.parametrize("how", ["move", "move-no-create", "copytruncate", "delete"])
def test_a_rotated_file_goes_on_in_a_new_one_and_a_resume_repeats_nothing(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The sink failed for good at the first write after a rotation: every later step of the
    job stayed out of the file (kept only in the spool, close False)."""
    path = tmp_path / "run.jsonl"
    run = _run(path, tmp_path)
    _log(run, range(1, 6))
    assert _delivered(run)
    before = copy.deepcopy(run.state_dict(timeout=10))  # offset into the old file
    with caplog.at_level("WARNING", logger="sidestream.sinks"):
        rotated = _rotate(how, path)
        _log(run, range(6, 11))
        assert _delivered(run)
        after = copy.deepcopy(run.state_dict(timeout=10))
        _log(run, range(11, 13))
        assert run.close(timeout=30)
    assert run.sink_status["jsonl"].state == "healthy"
    assert str(path) in caplog.text
    if rotated is not None:
        assert _steps(_lines(rotated)) == [("", step) for step in range(1, 6)]
    if how == "move":
        assert f"its lines so far are in {rotated}" in caplog.text
    assert _steps(_lines(path)) == [("", step) for step in range(6, 13)]
    written = path.read_bytes()
    # A job resumed from either checkpoint (crashed after step 12) writes no step twice.
    for checkpoint in (before, after):
        path.write_bytes(written)
        resumed = _run(path, tmp_path)
        resumed.load_state_dict(checkpoint)
        _log(resumed, range(6, 16))
        assert resumed.close(timeout=30)
        assert _steps(_lines(path)) == [("", step) for step in range(6, 16)]


def test_a_resume_reads_every_line_of_a_file_rotated_since_the_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint's offset was used in whatever file stood at the path: shorter, only its
    last line was read (one stream's step), longer, the lines from that offset on; a stream
    whose lines were all before it was written again."""
    path = tmp_path / "run.jsonl"
    first = JsonlSink(path)
    first.open(RunInfo())
    for step in range(1, 6):
        first.write_batch([_report(step, "train"), _report(step, "val")])
    checkpoint = first.state_dict()
    first.close()
    os.truncate(path, 0)  # copytruncate; the job went on into the cut file, then crashed
    going_on = JsonlSink(path)
    going_on.open(RunInfo())
    going_on.write(_report(6, "val"))
    for step in range(6, 31):
        going_on.write(_report(step, "train"))
    going_on.close()
    assert os.path.getsize(path) > checkpoint["offset"]  # the old offset points mid-file
    written = _steps(_lines(path))
    for cut in (len(written), 3):  # the whole file, or only its first lines (shorter)
        path.write_bytes(b"".join(line + b"\n" for line in path.read_bytes().splitlines()[:cut]))
        expected = written[:cut]
        resumed = JsonlSink(path)
        resumed.load_state_dict(checkpoint)
        with caplog.at_level("WARNING", logger="sidestream.sinks"):
            resumed.open(RunInfo())
        for step in range(6, 33):  # the resumed job logs from its checkpoint on
            resumed.write_batch([_report(step, "train"), _report(step, "val")])
        resumed.close()
        lines = _steps(_lines(path))
        assert lines[: len(expected)] == expected
        for stream in ("train", "val"):
            steps = [step for name, step in lines if name == stream]
            assert len(steps) == len(set(steps)), (stream, steps)  # none twice
            assert steps[-1] == 32
        assert "every line in it is read" in caplog.text
        caplog.clear()


@pytest.mark.parametrize(
    ("cut", "kept"), [(10, [1, 2, 4]), (1, [1, 2, 3, 4])], ids=["mid-line", "before-newline"]
)
def test_a_file_cut_mid_line_while_written_keeps_every_new_line_whole(
    tmp_path: Path, cut: int, kept: list[int]
) -> None:
    """A newline was appended after the cut line's fragment: a line of no JSON in the file.
    The fragment is cut off now; a line cut just before its newline is whole JSON, kept."""
    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path)
    sink.open(RunInfo())
    for step in range(1, 4):
        sink.write(_report(step))
    os.truncate(path, os.path.getsize(path) - cut)  # someone cut it mid-line
    sink.write(_report(4))
    sink.write(_report(5))
    sink.close()
    # Every line of the file is one JSON object (_steps fails the test on one that is not).
    assert _steps(_lines(path)) == [("", step) for step in [*kept, 5]]
    assert path.read_bytes().endswith(b"\n")


def test_a_file_replaced_by_another_with_lines_still_fails(tmp_path: Path) -> None:
    """Not rotation: another file with content stands at the path; it is not appended to."""
    path = tmp_path / "run.jsonl"
    run = _run(path, tmp_path)
    _log(run, range(1, 4))
    assert _delivered(run)
    other = tmp_path / "other.jsonl"
    other.write_text('{"step": 100, "stream": "", "time": 0.0, "values": {}}\n')
    os.replace(other, path)
    _log(run, range(4, 6))
    assert not run.close(timeout=30)
    assert "was replaced while this run wrote it" in str(run.sink_status["jsonl"].last_error)
    assert _steps(_lines(path)) == [("", 100)]


class _FullDiskFile:
    """The sink's open file, whose writes fail as on a full disk (the error names no file)."""

    def __init__(self, file: object) -> None:
        self._real = file

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def write(self, data: object) -> int:
        import errno

        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["file", "/dev/full"])
def test_a_full_disk_error_names_the_file(tmp_path: Path, where: str) -> None:
    # A write's ENOSPC names no file: the pipeline's warning said "OSError: [Errno 28] No
    # space left on device" and nothing of which of the job's disks was full.
    import errno

    if where == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    path = tmp_path / "m.jsonl" if where == "file" else Path(where)
    sink = JsonlSink(path)
    sink.open(RunInfo())
    if where == "file":
        sink._file = _FullDiskFile(sink._file)  # type: ignore[assignment]
    with pytest.raises(OSError) as raised:
        sink.write(_report(1))
    assert raised.value.errno == errno.ENOSPC
    assert str(path) in str(raised.value)
    sink.close()
