"""Run functions on N local processes joined by a process group; get each rank's result back."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Self, TypeVar

from sidestream.testing._results import DistributedError, RankFailure, dumps_on_host

__all__ = ["DistributedPool", "run_distributed"]

# What the function run on every rank returns: pool.run(f) is a list of it.
Result = TypeVar("Result")

_STOP = "stop"
_START_FAILED = "start failed"  # a rank's message when joining the process group raised
_GROUP_LOST = "group lost"  # a rank's message before its result: the task destroyed the group
_GRACE_S = 5.0  # after one rank fails, how long the others get to report their own view
_DRAIN_S = 0.5  # once every rank still waited for is dead: time for their last messages
_PARENT_CHECK_S = 0.5  # how often a rank looks whether the pool's process is gone


class RankPool(ABC):
    """A process group of ``world_size`` ranks that runs one function at a time on all of them.

    Subclasses say how the ranks are started and how tasks and results travel; the waiting,
    the failure reports and the restart after a failure are the same for all of them.
    """

    def __init__(self, world_size: int, backend: str, collective_timeout_s: float) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size: expected an int >= 1, got {world_size!r}")
        if world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {world_size}")
        if isinstance(collective_timeout_s, bool) or not isinstance(
            collective_timeout_s, int | float
        ):
            raise TypeError(
                f"collective_timeout_s: expected seconds > 0, got {collective_timeout_s!r}"
            )
        if not collective_timeout_s > 0:
            raise ValueError(
                f"collective_timeout_s: expected seconds > 0, got {collective_timeout_s!r}"
            )
        self.world_size = world_size
        self.backend = backend
        self._collective_timeout_s = collective_timeout_s
        self._started = False
        self._next_task = 0
        # One call at a time: each reads the ranks' results of its own task and would drop
        # another thread's, which then waited out its timeout.
        self._calls = threading.Lock()

    @abstractmethod
    def _start(self) -> None:
        """Start the ranks and their process group."""

    @abstractmethod
    def _submit(self, task_id: int, task: bytes) -> None:
        """Hand the pickled ``(function, args, kwargs)`` to every rank."""

    @abstractmethod
    def _poll(self, task_id: int, waiting: set[int], wait_s: float) -> list[tuple[int, bytes]]:
        """Return ``(rank, pickled (ok, payload))`` for ranks of ``waiting`` that finished."""

    @abstractmethod
    def _any_dead(self) -> bool:
        """Whether a rank (or the launcher holding them) has exited."""

    @abstractmethod
    def _rank_alive(self, rank: int) -> bool:
        """Whether ``rank``'s process is still running."""

    @abstractmethod
    def _death_reason(self, rank: int) -> str:
        """How ``rank``'s process (or the launcher holding it) ended."""

    def _group_lost(self) -> bool:
        """Whether the last task destroyed a rank's default process group (by default: no)."""
        return False

    @abstractmethod
    def _stop(self) -> None:
        """Stop every rank (politely, then by force) and release what ``_start`` made."""

    def run(
        self, function: Callable[..., Result], *args: Any, timeout: float = 120.0, **kwargs: Any
    ) -> list[Result]:
        """Run ``function(*args, **kwargs)`` on every rank and return the results by rank.

        ``function`` must be picklable (defined at module level) and so must its arguments and
        results. Tensors in the results come back on the CPU.

        Calls from several threads take turns. A call that is interrupted (Ctrl-C, a test
        framework's timeout) stops the pool, as a failed one does: its task would otherwise go
        on running under the next call.

        Raises:
            DistributedError: If any rank raised, did not finish within ``timeout`` seconds, or
                died. Every rank's traceback or reason is in the message.
            TypeError, ValueError: If ``timeout`` is not a number of seconds > 0 (before the
                task is sent).
        """
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"timeout: expected seconds > 0, got {timeout!r}")
        if not timeout > 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        _refuse_unimportable_main(function)
        task = pickle.dumps((function, args, kwargs))
        with self._calls:
            try:
                return self._run(function, task, timeout)
            except DistributedError:
                raise  # the pool was closed already
            except BaseException:
                self.close()
                raise

    def _run(self, function: Callable[..., Any], task: bytes, timeout: float) -> list[Any]:
        if not self._started:
            self._started = True  # so close() also cleans up after a start that failed halfway
            self._next_task = 0
            atexit.register(self.close)  # the ranks are not daemons: stop them at exit
            self._start()
        task_id = self._next_task
        self._next_task += 1
        self._submit(task_id, task)
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        while len(outcomes) < self.world_size:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            waiting = set(range(self.world_size)) - outcomes.keys()
            finished = self._poll(task_id, waiting, min(0.2, limit - now))
            if not finished:
                if grace_deadline is None and self._any_dead():
                    grace_deadline = time.monotonic() + _GRACE_S
                if grace_deadline is not None and not any(map(self._rank_alive, waiting)):
                    # Nobody left to report: the grace is for living ranks (a rank that died
                    # after every other one answered cost the caller the whole grace).
                    grace_deadline = min(grace_deadline, time.monotonic() + _DRAIN_S)
                continue
            for rank, outcome in finished:
                try:
                    ok, payload = pickle.loads(outcome)
                except Exception as error:  # a result class that cannot be rebuilt here
                    ok, payload = (
                        False,
                        (
                            f"its result could not be unpickled here: {type(error).__name__}: "
                            f"{error}"
                        ),
                    )
                outcomes[rank] = (ok, payload)
                if not ok and grace_deadline is None:
                    grace_deadline = time.monotonic() + _GRACE_S
        name = getattr(function, "__qualname__", repr(function))
        gave_up = grace_deadline is not None and time.monotonic() < deadline
        failures = self._failures(outcomes, timeout, gave_up)
        if failures:
            self.close()
            raise DistributedError(name, self.world_size, failures)
        if self._group_lost():
            # The task destroyed the process group (destroy_process_group()): the next call
            # would fail on every rank for it, so it starts a fresh pool instead.
            self.close()
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _failures(
        self, outcomes: dict[int, tuple[bool, Any]], timeout: float, gave_up: bool
    ) -> list[RankFailure]:
        failures = []
        for rank in range(self.world_size):
            if rank in outcomes:
                ok, payload = outcomes[rank]
                if not ok:
                    failures.append(RankFailure(rank, payload))
                continue
            failures.append(RankFailure(rank, self._missing_reason(rank, timeout, gave_up)))
        return failures

    def _rank_started(self, rank: int) -> bool:
        """Whether ``rank`` joined the process group (by default: assumed)."""
        del rank
        return True

    def _missing_reason(self, rank: int, timeout: float, gave_up: bool) -> str:
        if not self._rank_alive(rank):
            return self._death_reason(rank)
        if gave_up:
            return "no result after another rank failed (likely waiting on it; killed)"
        if not self._rank_started(rank):
            # The timeout counts from the call, a pool's start included.
            return (
                f"no result within {timeout:g} s: it was still joining the process group "
                "(starting the pool counts against the first call's timeout; killed)"
            )
        return f"no result within {timeout:g} s (still running; killed)"

    def close(self) -> None:
        """Stop every rank and forget the process group; the next ``run`` starts a new one."""
        if self._started:
            try:
                self._stop()
            finally:  # a stop that failed half way is not retried by every later call
                self._started = False
                atexit.unregister(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_task(task: bytes) -> bytes:
    """Run one pickled task on this rank; return the pickled ``(ok, result or traceback)``."""
    try:
        function, args, kwargs = pickle.loads(task)
        return dumps_on_host((True, function(*args, **kwargs)))
    except BaseException:  # report everything, the parent decides
        return pickle.dumps((False, traceback.format_exc()))


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    collective_timeout_s: float,
    tasks: Any,
    results: Connection,
    ready: Any,
    parent: int,
) -> None:
    import torch
    import torch.distributed as dist

    # Imported before the group exists: torch.distributed.nn's functions take the default
    # group as a default argument when first imported (DDP and DCP import them), and a group
    # held there outlives destroy_process_group(), so gloo would abort the rank's exit now and
    # then ("terminate called without an active exception").
    import torch.distributed.nn

    # A process group of its own: stopping this rank by force stops what it started too. Out
    # of reach of a kill of the job's group, so a watchdog ends it once the pool's process is
    # gone, busy in a task or not.
    os.setpgrp()
    threading.Thread(
        target=_end_with_parent, args=(parent, store_path, rank), daemon=True, name="pool-watch"
    ).start()
    torch.set_num_threads(1)  # N ranks share this machine's cores
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # gloo ranks are CPU ranks
    # What torchrun sets for its ranks, so code that reads them (LOCAL_RANK, sidestream's check
    # that WORLD_SIZE matches the group) sees this rank, not the environment of the pool's
    # process (itself a rank of some job, say: every rank then read its RANK and WORLD_SIZE).
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
    except BaseException:
        results.send((_START_FAILED, traceback.format_exc().encode()))
        raise
    # Shared memory, written at once: a queued message may be lost when the rank dies.
    ready[rank] = 1
    try:
        while True:
            task = tasks.get()
            if task == _STOP:
                break
            task_id, payload = task
            outcome = run_task(payload)
            if not dist.is_initialized():
                # The task destroyed the group: the pool starts afresh after this call. Said
                # before the result, which ends the call. The rank then waits for the pool's
                # stop: exiting now cut the ranks still working to the grace of a dead rank.
                results.send((_GROUP_LOST, b""))
            results.send((task_id, outcome))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _end_with_parent(parent: int, store_path: str, rank: int) -> None:
    """Kill this rank's process group (itself and what it started) once ``parent`` is gone."""
    end_group_when(lambda: os.getppid() != parent)
    if rank == 0:  # nobody else will remove the pool's temporary directory
        shutil.rmtree(os.path.dirname(store_path), ignore_errors=True)
    os.killpg(0, signal.SIGKILL)


def end_group_when(gone: Callable[[], bool]) -> None:
    """Return once ``gone()`` says the pool's process has ended (looked at every half second).

    The rank's watchdog thread then kills its own process group: busy in a task, it would
    never hear from the pool again.
    """
    while not gone():
        time.sleep(_PARENT_CHECK_S)


def _read_results(rank: int, results: Connection, inbox: queue.SimpleQueue[Any]) -> None:
    """Move ``rank``'s messages into ``inbox`` until its end of the pipe closes.

    A thread of its own, so a message cut short by the rank's death blocks this thread only
    until the pipe reports its end (the rank holds the only write end), never the pool's wait.
    The thread owns ``results`` and closes it: closed by another thread while this one reads,
    its descriptor could be reused under the read.
    """
    with results:
        while True:
            try:
                message = results.recv()
            except (EOFError, OSError):  # the rank is gone (or its message was cut short)
                return
            inbox.put((rank, message))


class DistributedPool(RankPool):
    """A gloo process group of ``world_size`` local processes that runs one function at a time.

    Starting processes and a process group costs seconds, so the pool keeps them between calls.
    When a call fails on any rank, times out, or a process dies, the pool is torn down (so a
    half-finished collective cannot poison the next call) and restarted on the next ``run``.

    Args:
        world_size: Number of ranks.
        backend: The torch.distributed backend (``"gloo"`` for CPU processes).
        collective_timeout_s: Timeout of each collective inside the ranks, so a rank waiting for
            a peer that never comes raises instead of hanging.

    Example:
        >>> with DistributedPool(2) as pool:
        ...     ranks = pool.run(torch.distributed.get_rank)
        >>> ranks
        [0, 1]
    """

    def __init__(
        self, world_size: int, backend: str = "gloo", collective_timeout_s: float = 30.0
    ) -> None:
        import torch.distributed as dist

        if not isinstance(backend, str):
            # backend.lower() below raised AttributeError, naming no argument.
            raise TypeError(f"backend: expected a str such as 'gloo', got {backend!r}")
        if backend.lower() == "nccl":
            raise ValueError(
                "backend: DistributedPool's ranks are CPU processes (CUDA hidden from them); "
                "for NCCL ranks, one per GPU, use TorchrunPool(world_size, backend='nccl')"
            )
        if not dist.is_backend_available(backend):
            raise ValueError(
                f"backend: {backend!r} is not a torch.distributed backend this torch has "
                "(DistributedPool's ranks are CPU processes: 'gloo')"
            )
        super().__init__(world_size, backend, collective_timeout_s)
        self._context = mp.get_context("spawn")
        self._processes: list[BaseProcess] = []
        self._tasks: list[Any] = []
        self._results: queue.SimpleQueue[Any] | None = None
        self._store_dir: tempfile.TemporaryDirectory[str] | None = None
        self._ready: Any = None
        self._start_errors: dict[int, str] = {}
        self._lost = False

    def _start(self) -> None:
        self._lost = False
        self._ready = self._context.Array("b", self.world_size, lock=False)
        self._start_errors = {}
        self._store_dir = tempfile.TemporaryDirectory(prefix="sidestream-pg-")
        store_path = os.path.join(self._store_dir.name, "store")
        self._results = queue.SimpleQueue()
        self._tasks = [self._context.Queue() for _ in range(self.world_size)]
        # One pipe per rank, its write end in that rank only: a rank that dies mid-message ends
        # its pipe, where a shared queue (whose write end this process holds too) waits forever.
        pipes = [self._context.Pipe(duplex=False) for _ in range(self.world_size)]
        self._processes = [
            self._context.Process(
                target=_worker,
                args=(
                    rank,
                    self.world_size,
                    store_path,
                    self.backend,
                    self._collective_timeout_s,
                    self._tasks[rank],
                    pipes[rank][1],
                    self._ready,
                    os.getpid(),
                ),
                # Not a daemon: a rank may start processes of its own (a ProcessSink), as
                # torchrun's ranks can.
                daemon=False,
                name=f"sidestream-rank-{rank}",
            )
            for rank in range(self.world_size)
        ]
        try:
            for process in self._processes:
                process.start()
        finally:
            for rank, (reader, writer) in enumerate(pipes):
                writer.close()  # each started rank has its own copy (a rank never started: EOF)
                threading.Thread(
                    target=_read_results,
                    args=(rank, reader, self._results),
                    daemon=True,
                    name=f"sidestream-results-{rank}",
                ).start()

    def _submit(self, task_id: int, task: bytes) -> None:
        for task_queue in self._tasks:
            task_queue.put((task_id, task))

    def _poll(self, task_id: int, waiting: set[int], wait_s: float) -> list[tuple[int, bytes]]:
        assert self._results is not None
        try:
            rank, (got_id, outcome) = self._results.get(timeout=wait_s)
        except queue.Empty:
            return []
        if got_id == _START_FAILED:
            self._start_errors[rank] = outcome.decode(errors="replace")
            return []
        if got_id == _GROUP_LOST:
            self._lost = True
            return []
        return [(rank, outcome)] if got_id == task_id and rank in waiting else []

    def _rank_started(self, rank: int) -> bool:
        return self._ready is not None and bool(self._ready[rank])

    def _group_lost(self) -> bool:
        return self._lost

    def _read_start_errors(self) -> None:
        """Take the start failures still queued (the rank died before they were polled)."""
        while self._results is not None:
            try:
                rank, (got_id, outcome) = self._results.get(timeout=0.5)
            except queue.Empty:
                return
            if got_id == _START_FAILED:
                self._start_errors[rank] = outcome.decode(errors="replace")

    def _any_dead(self) -> bool:
        return any(not process.is_alive() for process in self._processes)

    def _rank_alive(self, rank: int) -> bool:
        return self._processes[rank].is_alive()

    def _death_reason(self, rank: int) -> str:
        code = self._processes[rank].exitcode
        reason = f"process died with exit code {code}"
        if code is not None and code < 0:  # multiprocessing's way of saying "killed by -code"
            with contextlib.suppress(ValueError):
                reason += f" (killed by {signal.Signals(-code).name})"
        if self._rank_started(rank):
            return reason
        if rank not in self._start_errors:
            self._read_start_errors()
        if rank in self._start_errors:
            return f"{reason} while joining the process group:\n{self._start_errors[rank]}"
        # Spawned ranks import the main script again; unguarded code there runs in every rank.
        return (
            f"{reason} while starting, before its process group was up (its traceback is on "
            'stderr; a script that makes the pool outside `if __name__ == "__main__":` '
            "fails this way)"
        )

    def _stop(self) -> None:
        for task_queue in self._tasks:
            with contextlib.suppress(Exception):
                task_queue.put(_STOP)
        deadline = time.monotonic() + 5.0
        # A start that failed halfway leaves processes that never ran (join would assert).
        started = [process for process in self._processes if process.pid is not None]
        for process in started:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in started:
            if process.is_alive():
                _kill_group(process)
                process.join(timeout=5.0)
        for task_queue in self._tasks:
            task_queue.close()
            task_queue.cancel_join_thread()
        self._processes, self._tasks, self._results = [], [], None
        if self._store_dir is not None:
            self._store_dir.cleanup()
            self._store_dir = None


def kill_own_group(pid: int) -> bool:
    """Kill process ``pid`` and what it started, if it leads a process group; whether it did.

    A rank of either pool leads one (``os.setpgrp`` here, torchrun's session per rank).
    """
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            return True
    except (ProcessLookupError, PermissionError):
        pass
    return False


def _kill_group(process: BaseProcess) -> None:
    """Kill a rank and the processes it started (its own process group: see ``_worker``)."""
    assert process.pid is not None
    if not kill_own_group(process.pid):
        process.kill()  # not yet in a group of its own (still starting)


def run_distributed(
    function: Callable[..., Result],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Result]:
    """Run ``function`` once on ``world_size`` fresh gloo processes; results by rank.

    Raises:
        DistributedError: If any rank raised, timed out or died (see ``DistributedPool.run``).
    """
    with DistributedPool(world_size, backend=backend) as pool:
        return pool.run(function, *args, timeout=timeout, **kwargs)


def _refuse_unimportable_main(function: Any) -> None:
    """Refuse, before anything is sent, a function that no rank can import.

    Pickle sends a function by name: ``__main__.rank_sum``. A spawned rank finds ``__main__``'s
    functions by running the caller's script file again, so a ``__main__`` with no file (a
    Jupyter notebook, an IPython or Python REPL, ``python -c``) leaves every rank with
    ``AttributeError: Can't get attribute ...`` after the pool's start (seconds), with no word
    of what to do.
    """
    if getattr(function, "__module__", None) != "__main__":
        return
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if main_file is not None and os.path.isfile(main_file):
        return
    name = getattr(function, "__qualname__", repr(function))
    raise ValueError(
        f"function: {name} is defined in __main__ of a process that has no script file (a "
        "notebook, a REPL, python -c), which the ranks cannot import it from; define it in a "
        "module (a .py file beside the notebook) and import it from there"
    )
