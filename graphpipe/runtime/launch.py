"""launch: run a function on N local processes, one per device, with a process group each.

    def main(steps):                        # runs on every rank, process group ready
        pm = graphpipe.compile(...)
        ...
        return pm.rank, losses

    results = graphpipe.launch(main, nprocs=2, args=(10,))   # [rank 0's return, rank 1's]

Built on torch.multiprocessing's spawn context. Each worker gets the torchrun variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port), one CPU thread unless
told otherwise, and a process group (gloo on CPU, NCCL on CUDA). For several machines use
torchrun instead: `torchrun --nnodes 2 --nproc-per-node 8 ... train.py`, with graphpipe.compile
in train.py.

The launcher serves the rendezvous store itself (as torchrun's agent does,
`TORCHELASTIC_USE_AGENT_STORE`), so the failure board on it (`graphpipe.runtime.failures`)
outlives any rank, rank 0 included.

Failures: when a worker raises or dies, the launcher posts it on the board (unless the worker
posted its own), so the others stop waiting at once and name it; they get `grace` seconds to
finish or fail, then the rest are stopped. `launch` raises `PipelineError` listing what
happened on every rank, the first failure first. A worker whose parent dies stops itself, so
no process outlives the launcher.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphpipe.errors import ConfigError, PipelineError
from graphpipe.runtime.failures import FailureBoard

__all__ = ["free_port", "launch"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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

    Returns:
        What `fn` returned on each rank.

    Raises:
        ConfigError: nprocs < 1.
        PipelineError: a rank raised, died or ran out of time; the message says which and how.
    """
    if nprocs < 1:
        raise ConfigError(f"nprocs must be >= 1, got {nprocs}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    store = dist.TCPStore(
        "127.0.0.1",
        0,  # a free port, held from now on
        nprocs,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(nprocs),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank is a client of this store
    }
    workers = [
        ctx.Process(
            target=_worker,
            daemon=True,
            name=f"graphpipe-rank{rank}",
            args=(rank, env, fn, tuple(args), results, backend, threads, comm_timeout, os.getpid()),
        )
        for rank in range(nprocs)
    ]
    for w in workers:
        w.start()
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
    parent: int,
) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=int(env["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=comm_timeout),
        )
        # plain pickle bytes: torch's queue pickler would share tensors through file
        # descriptors that vanish with this process
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException as exc:  # report everything, then exit non-zero at once: a wait
        # abandoned after a failure must not hold the exit (no process group teardown)
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _orphan_watch(parent: int) -> None:
    """Stop this worker when the launcher is gone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _supervise(
    workers: list[Any], results: Any, timeout: float, grace: float, board: FailureBoard
) -> list[Any]:
    outcomes: dict[int, tuple[str, Any]] = {}
    posted: set[int] = set()
    deadline, failed_at = time.monotonic() + timeout, None
    while any(w.is_alive() for w in workers) or len(outcomes) < len(workers):
        _collect(results, outcomes)
        for rank, w in enumerate(workers):
            if not w.is_alive() and rank not in outcomes and w.exitcode not in (None, 0):
                _collect(results, outcomes, wait=0.5)
                outcomes.setdefault(rank, ("died", _death(w.exitcode)))
        _post_failures(board, outcomes, posted)
        if failed_at is None and any(kind != "ok" for kind, _ in outcomes.values()):
            failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or (failed_at is not None and now > failed_at + grace):
            _stop(workers, outcomes, "stopped: it was still running when the launcher gave up")
            break
        if not any(w.is_alive() for w in workers) and len(outcomes) < len(workers):
            _collect(results, outcomes, wait=1.0)
            for rank in range(len(workers)):
                outcomes.setdefault(rank, ("died", "exited without reporting"))
    for w in workers:
        w.join(timeout=5)
    return _results_or_raise(outcomes, len(workers), timeout)


def _post_failures(
    board: FailureBoard, outcomes: dict[int, tuple[str, Any]], posted: set[int]
) -> None:
    """Post each failed rank on the board once; a rank's own earlier post is kept."""
    for rank, (kind, value) in outcomes.items():
        if kind in ("died", "error") and rank not in posted:
            posted.add(rank)
            board.post(f"rank {rank}: {str(value).strip().splitlines()[0]}", "cause", rank)


def _collect(results: Any, outcomes: dict[int, tuple[str, Any]], wait: float = 0.05) -> None:
    try:
        while True:
            rank, kind, value = results.get(timeout=wait)
            outcomes[rank] = (kind, value)
            wait = 0.0
    except queue.Empty:
        return


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code} without reporting an error"


def _stop(workers: list[Any], outcomes: dict[int, tuple[str, Any]], why: str) -> None:
    for rank, w in enumerate(workers):
        if w.is_alive():
            w.terminate()
            with contextlib.suppress(OSError):  # a stopped process takes its SIGTERM now
                os.kill(w.pid, signal.SIGCONT)
            w.join(timeout=3)
            if w.is_alive():
                w.kill()
            outcomes.setdefault(rank, ("stopped", why))


def _rank_of_failure(outcome: tuple[str, Any] | None) -> int:
    """Root causes first: deaths, then errors of a rank's own, then errors caused by a peer."""
    kind, value = outcome or ("stopped", "")
    if kind == "error" and ("closed its connection" in value or "did not answer" in value):
        return 2
    return {"died": 0, "error": 1, "stopped": 3, "ok": 4}.get(kind, 3)


def _results_or_raise(outcomes: dict[int, tuple[str, Any]], n: int, timeout: float) -> list[Any]:
    if all(outcomes.get(r, ("", None))[0] == "ok" for r in range(n)):
        return [pickle.loads(outcomes[r][1]) for r in range(n)]
    order = sorted(range(n), key=lambda r: _rank_of_failure(outcomes.get(r)))
    lines = []
    for r in order:
        kind, value = outcomes.get(r, ("stopped", f"no report within {timeout:g} s"))
        text = "finished" if kind == "ok" else str(value).strip().splitlines()[0]
        lines.append(f"rank {r}: {text}")
    first = order[0]
    detail = outcomes.get(first, ("", ""))[1]
    if isinstance(detail, str) and "\n" in detail:
        lines.append(f"rank {first} said:\n{detail}")
    raise PipelineError(f"the pipeline failed; rank {first} first", lines)
