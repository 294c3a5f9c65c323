"""launch: run a function on N local processes, one per device, with a process group each.

    def main(steps):                        # runs on every rank, process group ready
        pm = graphpipe.compile(...)
        ...
        return pm.rank, losses

    results = graphpipe.launch(main, nprocs=2, args=(10,))   # [rank 0's return, rank 1's]

Each worker gets the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), one CPU thread unless told otherwise, and a process group (gloo on CPU, NCCL on
CUDA). For several machines use torchrun instead: `torchrun --nnodes 2 --nproc-per-node 8 ...
train.py`, with graphpipe.compile in train.py.

The launcher serves the rendezvous store itself (as torchrun's agent does,
`TORCHELASTIC_USE_AGENT_STORE`), so the failure board on it (`graphpipe.runtime.failures`)
outlives any rank, rank 0 included.

Failures: when a worker raises or dies, the launcher posts it on the board (unless the worker
posted its own), so the others stop waiting at once and name it; they get `grace` seconds to
finish or fail, then the rest are stopped. `launch` raises `PipelineError` listing what
happened on every rank, the first failure first; its `kind` is the first failure's. A worker
whose parent dies stops itself, so no process outlives the launcher.

What is torch's and what is graphpipe's own, and why:
- spawning: `torch.multiprocessing.start_processes`. By default with the "forkserver" start
  method: a server process imports torch and graphpipe once (`PRELOAD`), and every worker
  of every later launch forks from it, so a launch starts in a fraction of a second where
  "spawn" spends one to two seconds per process importing torch (measured: 2.3 s for 2
  processes, 4.5 to 5 s for 4 on 2 cores). A worker's environment is then the launcher's at
  the call (passed along and set before `fn` runs); settings a C library reads when a
  process starts (glibc's `MALLOC_*`) come from the server's, so who needs them passes
  `start_method="spawn"` (`benchmarks/emulated.py`).
- the rendezvous store and its free port: `torch.distributed.TCPStore` on port 0, served by
  the launcher; every rank connects to it as a client (torch's own agent-store convention,
  `graphpipe._torch.AGENT_STORE_ENV`). No port is picked by hand.
- reaping and stopping children: graphpipe's own. torch's `ProcessContext.join` and
  torch.distributed.elastic's `start_processes` / `PContext` stop every other child at the
  first failure and report that one failure; graphpipe's protocol needs the opposite: the
  launcher posts the death on the failure board at once, the survivors get `grace` seconds to
  name it and exit with their own error, and every rank's outcome is reported.
- a child's result and exception: a queue of graphpipe's own. torch's spawn returns no values
  and passes only a traceback text; elastic's error files carry no return values either.
  graphpipe needs each rank's return value, and for a failure its `FailureKind` and first line.
- orphans: a thread in each worker exits when the launcher is gone. torch's parent-death
  signal (SIGINT) is delivered as KeyboardInterrupt only when the main thread returns to
  Python, which a rank blocked in a collective never does.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphpipe._torch import AGENT_STORE_ENV
from graphpipe.errors import ConfigError, FailureKind, PipelineError
from graphpipe.runtime.failures import FailureBoard

__all__ = ["DEFAULT_START_METHOD", "PRELOAD", "START_METHODS", "launch"]

START_METHODS = ("forkserver", "spawn")
# where the platform has no fork server (Windows), a fresh interpreter per worker
DEFAULT_START_METHOD = (
    "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
)
# imported once by the fork server: the launcher's main module (as "spawn" imports it in
# every worker: a function defined there unpickles) and the heavy imports every worker
# needs, none that reads the environment of a particular launch (graphpipe reads only
# TORCHELASTIC_RESTART_COUNT at import, which launched workers never have)
PRELOAD = ("__main__", "torch", "torch.distributed", "networkx", "graphpipe", "graphpipe.compile")


@dataclass(frozen=True)
class _Outcome:
    """What became of one rank."""

    kind: FailureKind | None  # None: it finished
    text: str  # the failure's first line and traceback, or "" when it finished
    value: bytes = b""  # the pickled return value, when it finished
    reported: bool = True  # False: the launcher saw it (a death, a stop), the rank said nothing

    def first_line(self) -> str:
        return self.text.strip().splitlines()[0] if self.text.strip() else "finished"


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 600.0,
    grace: float | None = None,
    backend: str | None = None,
    threads: int = 1,
    comm_timeout: float = 60.0,
    start_method: str = DEFAULT_START_METHOD,
) -> list[Any]:
    """Run `fn(*args)` on `nprocs` processes and return their results, by rank.

    Args:
        fn: A picklable (module-level) function.
        nprocs: Number of processes (ranks).
        args: Arguments for every rank.
        timeout: Seconds the whole run may take; then every worker is stopped.
        grace: Seconds the others get after a first failure (default comm_timeout + 10).
        backend: "gloo" or "nccl" (default: nccl when CUDA is available).
        threads: torch intra-op threads per process.
        comm_timeout: The process group's timeout for collectives.
        start_method: "forkserver" (the default where the platform has it: workers fork
            from a server that imported torch once; see the module docstring) or "spawn" (a
            fresh interpreter each).

    Returns:
        What `fn` returned on each rank.

    Raises:
        ConfigError: nprocs < 1, or an unknown start method.
        PipelineError: a rank raised, died or ran out of time; the message says which and how.
            Its `kind` is the first failure's (TIMED_OUT when nothing failed before
            `timeout`), `origin` that rank, `peers` every rank that failed or was stopped.
    """
    if nprocs < 1:
        raise ConfigError(f"nprocs must be >= 1, got {nprocs}")
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(list(PRELOAD))  # used when the server first starts
    results: Any = context.Queue()
    store = dist.TCPStore(
        "127.0.0.1",
        0,  # a free port, held from now on
        nprocs,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    env = {
        **os.environ,  # a forked worker's own is the fork server's, from when it started
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(nprocs),
        AGENT_STORE_ENV: "True",  # every rank is a client of this store
    }
    started = mp.start_processes(
        _worker,
        args=(env, fn, tuple(args), results, backend, threads, comm_timeout, _Launcher()),
        nprocs=nprocs,
        join=False,  # reaped by _supervise: torch's join stops the others at a first failure
        daemon=True,
        start_method=start_method,
    )
    assert started is not None
    workers = list(started.processes)
    board = FailureBoard(-1, nprocs, store)
    try:
        return _supervise(
            workers, results, timeout, comm_timeout + 10 if grace is None else grace, board
        )
    finally:
        del store


def _worker(
    rank: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    backend: str,
    threads: int,
    comm_timeout: float,
    launcher: _Inherited,
) -> None:
    os.environ.clear()  # the launcher's environment, not the fork server's
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    launcher.install()
    threading.Thread(target=_orphan_watch, args=(launcher.pid,), daemon=True).start()
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=int(env["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=comm_timeout),
        )
        # every rank connected before any runs `fn`: gloo's full mesh is made pair by pair,
        # and a rank whose `fn` returns at once could close its pairs (exit) while a peer
        # still reads its handshake ("Connection closed by peer" in that peer's
        # init_process_group, seen with two test files launching at once)
        dist.barrier()
        # plain pickle bytes: torch's queue pickler would share tensors through file
        # descriptors that vanish with this process
        results.put((rank, None, pickle.dumps(fn(*args))))
    except BaseException as exc:  # report everything, then exit non-zero at once: a wait
        # abandoned after a failure must not hold the exit (no process group teardown)
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        results.put((rank, _kind_of(exc).value, text))
        results.close()
        results.join_thread()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


class _Launcher:
    """The launcher as a worker needs it: its pid (to stop when it is gone) and its stdout
    and stderr, which a worker forked from the fork server does not inherit (it would
    write where the server's went). Pickled as the process starts, the streams travel as
    file descriptors handed to the child (multiprocessing's `DupFd`, for either start
    method); a closed stream stays the worker's own."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        streams = [reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2)]
        return (_Inherited, (os.getpid(), *streams))


@dataclass
class _Inherited:
    """`_Launcher` in the worker: the launcher's pid and its streams' descriptors here."""

    pid: int
    stdout: Any
    stderr: Any

    def install(self) -> None:
        """Point this process's fds 1 and 2 at the launcher's stdout and stderr.

        Under "spawn" a handed descriptor keeps its number in the child: it may be 1 or 2
        itself (closing it closed the stream it is), or the other stream's target (installing
        one first overwrote the other). Each is copied to a number of its own before either
        is installed, and only descriptors other than 1 and 2 are closed.
        """
        own = {}
        for target, handed in ((1, self.stdout), (2, self.stderr)):
            if handed is not None:
                fd = handed.detach()
                own[target] = os.dup(fd)
                if fd not in (1, 2):
                    os.close(fd)
        for target, fd in own.items():
            os.dup2(fd, target)
            os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _kind_of(exc: BaseException) -> FailureKind:
    """The kind of a worker's own error: a PipelineError's, BAD_INPUT for a refusal."""
    if isinstance(exc, PipelineError):
        return exc.kind
    return FailureKind.BAD_INPUT if isinstance(exc, ConfigError) else FailureKind.RAISED


def _orphan_watch(parent: int) -> None:
    """Stop this worker when the launcher (pid `parent`; under "forkserver" not this
    process's parent, which is the fork server) is gone."""
    while _alive(parent):
        time.sleep(1.0)
    os._exit(1)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (exists and, where /proc says, is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:  # "pid (name) state ..."
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _supervise(
    workers: list[Any], results: Any, timeout: float, grace: float, board: FailureBoard
) -> list[Any]:
    outcomes: dict[int, _Outcome] = {}
    posted: set[int] = set()
    deadline, failed_at = time.monotonic() + timeout, None
    while any(w.is_alive() for w in workers) or len(outcomes) < len(workers):
        _collect(results, outcomes)
        for rank, w in enumerate(workers):
            if not w.is_alive() and rank not in outcomes and w.exitcode not in (None, 0):
                _collect(results, outcomes, wait=0.5)
                outcomes.setdefault(
                    rank, _Outcome(FailureKind.DIED, _death(w.exitcode), reported=False)
                )
        _post_failures(board, outcomes, posted)
        if failed_at is None and any(o.kind is not None for o in outcomes.values()):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            _stop(workers, outcomes, "stopped: it was still running when the launcher gave up")
            break
        if not any(w.is_alive() for w in workers) and len(outcomes) < len(workers):
            _collect(results, outcomes, wait=1.0)
            for rank in range(len(workers)):
                outcomes.setdefault(
                    rank, _Outcome(FailureKind.DIED, "exited without reporting", reported=False)
                )
    for w in workers:
        w.join(timeout=5)
    return _results_or_raise(outcomes, len(workers), timeout)


def _post_failures(board: FailureBoard, outcomes: dict[int, _Outcome], posted: set[int]) -> None:
    """Post each failed rank on the board once; a rank's own earlier post is kept."""
    for rank, outcome in outcomes.items():
        if outcome.kind is not None and rank not in posted:
            posted.add(rank)
            board.post(f"rank {rank}: {outcome.first_line()}", outcome.kind, rank)


def _collect(results: Any, outcomes: dict[int, _Outcome], wait: float = 0.05) -> None:
    """Move the workers' reports from the queue into `outcomes`, waiting `wait` s for one."""
    try:
        while True:
            rank, kind, value = results.get(timeout=wait)
            if kind is None:
                outcomes[rank] = _Outcome(None, "", value)
            else:
                outcomes[rank] = _Outcome(FailureKind(kind), value)
            wait = 0.0
    except queue.Empty:
        return


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code} without reporting an error"


def _stop(workers: list[Any], outcomes: dict[int, _Outcome], why: str) -> None:
    for rank, w in enumerate(workers):
        if w.is_alive():
            w.terminate()
            with contextlib.suppress(OSError):  # a stopped process takes its SIGTERM now
                os.kill(w.pid, signal.SIGCONT)
            w.join(timeout=3)
            if w.is_alive():
                w.kill()
            outcomes.setdefault(rank, _Outcome(FailureKind.STOPPED, why, reported=False))


# the launcher's view of each rank, root causes first: a death it saw, then a rank's own
# error, then a rank that failed because of a peer (a dead peer it saw, an echo), then a
# rank the launcher stopped, then one that finished
_ORDER = {
    FailureKind.RAISED: 1,
    FailureKind.BAD_INPUT: 1,
    FailureKind.NONFINITE: 1,
    FailureKind.TIMED_OUT: 1,
    FailureKind.BROKEN: 1,
    FailureKind.ECHO: 2,
    FailureKind.STOPPED: 3,
}


def _rank_of_failure(outcome: _Outcome) -> int:
    """Where a rank's outcome sorts: root causes first."""
    if outcome.kind is None:
        return 4
    if outcome.kind is FailureKind.DIED:  # its own death, or a peer's that it reported
        return 2 if outcome.reported else 0
    return _ORDER[outcome.kind]


def _results_or_raise(outcomes: dict[int, _Outcome], n: int, timeout: float) -> list[Any]:
    """Every rank's return value, or a PipelineError whose kind is the first failure's."""
    if all(r in outcomes and outcomes[r].kind is None for r in range(n)):
        return [pickle.loads(outcomes[r].value) for r in range(n)]
    missing = _Outcome(FailureKind.STOPPED, f"no report within {timeout:g} s", reported=False)
    seen = {r: outcomes.get(r, missing) for r in range(n)}
    order = sorted(range(n), key=lambda r: _rank_of_failure(seen[r]))
    lines = [f"rank {r}: {seen[r].first_line()}" for r in order]
    first = order[0]
    if "\n" in seen[first].text.strip():
        lines.append(f"rank {first} said:\n{seen[first].text}")
    kind = seen[first].kind
    late = kind is FailureKind.STOPPED  # nothing failed before the launcher stopped them
    raise PipelineError(
        f"the pipeline failed; rank {first} first"
        + (
            f": the run passed launch's timeout of {timeout:g} s (the whole run's limit; "
            "graphpipe.launch(..., timeout=seconds) for a longer one)"
            if late
            else ""
        ),
        lines,
        kind=FailureKind.TIMED_OUT if late else kind or FailureKind.RAISED,
        peers=[r for r in order if seen[r].kind is not None],
        origin=first,
    )
