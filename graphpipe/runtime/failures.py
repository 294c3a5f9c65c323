"""Failures: one protocol for every wait, so that every rank names the rank that failed first.

A rank that fails posts why on a *failure board*, a key-value store every rank reads:

    graphpipe/failure/<rank>   "<time>|<kind>|<text>"   kind: "cause" (its own error, a death,
                                                      a timeout's diagnosis) or "echo" (it
                                                      stopped because another rank failed)
    graphpipe/waiting/<rank>   "<time>|<ranks>|<what>"  set while a wait lasts over WAITING_AFTER s

The board is the store torch.distributed rendezvoused with. Under `graphpipe.runtime.launch` and
torchrun that store is served by the launcher or the elastic agent, not by rank 0, so the record
survives the death of any rank (`TORCHELASTIC_USE_AGENT_STORE`); the launcher also posts the
death of a rank that could not post its own.

Every wait of a rank (a receive, a send's completion, a collective) goes through `Watch.wait`:
the blocking call runs on a waiter thread while this thread polls the board, so a failure
anywhere stops every other rank at once with a `PipelineError` that quotes the first cause.
`RuntimeConfig.timeout` bounds each wait. A timeout is diagnosed by following who waits for
whom on the board: the ranks at the end of that chain, which wait for nobody and posted nothing,
are the ones named (busy or stalled), so no rank blames a live neighbour that is itself waiting.
On CUDA, waits are stream dependencies and the process group's timeout and watchdog bound them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from graphpipe.errors import ConfigError, PipelineError

__all__ = [
    "BACKSTOP",
    "FailureBoard",
    "Watch",
    "current_watch",
    "first_line",
    "guarded",
    "install_watch",
    "posted",
    "set_collective_timeout",
]

T = TypeVar("T")
POLL = 0.05  # seconds between two looks at the board while a wait lasts
WAITING_AFTER = 0.3  # a wait longer than this is published (who waits for whom)
SETTLE = 5.0  # seconds a rank whose peer closed its connection waits for the cause's post
BACKSTOP = 10.0  # seconds the backend's own timeouts come after the watch's
# torchrun's agent keeps its store across restarts: each attempt gets keys of its own
PREFIX = f"graphpipe/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, the form every post uses."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no message'}"


class FailureBoard:
    """Failure posts and wait states on a store shared by every rank.

    Args:
        rank: This rank (-1 for the launcher).
        world: Number of ranks.
        store: The store; None gives a board that records nothing (a single process).
    """

    def __init__(self, rank: int, world: int, store: Any) -> None:
        self.rank, self.world, self.store = rank, world, store

    @classmethod
    def of_process_group(cls) -> FailureBoard:
        """The board on the store the default process group rendezvoused with."""
        store = None
        with contextlib.suppress(AttributeError, RuntimeError, ValueError):
            store = dist.distributed_c10d._get_default_store()
            while isinstance(store, dist.PrefixStore):  # down to what the launcher also sees
                store = store.underlying_store
            # a connection of its own: a TCPStore client serves one call at a time, and the
            # process group's own blocking calls on it must not hold the board up
            store = store.clone()  # type: ignore[attr-defined]
        return cls(dist.get_rank(), dist.get_world_size(), store)

    # -- failures -----------------------------------------------------------------------------

    def post(self, text: str, kind: str = "cause", rank: int | None = None) -> None:
        """Record why `rank` (default this one) fails; a rank's first post is kept."""
        if self.store is None:
            return
        rank = self.rank if rank is None else rank
        with contextlib.suppress(Exception):  # best effort: the store may be gone
            self.store.compare_set(
                f"{PREFIX}/failure/{rank}", "", f"{time.time():.6f}|{kind}|{text}"
            )

    def posts(self) -> dict[int, tuple[float, str, str]]:
        """Every rank's post: rank -> (time, kind, text)."""
        found: dict[int, tuple[float, str, str]] = {}
        if self.store is None:
            return found
        keys = [f"{PREFIX}/failure/{r}" for r in range(self.world)]
        with contextlib.suppress(Exception):
            for r, key in enumerate(keys):
                if self.store.check([key]):
                    stamp, kind, text = self.store.get(key).decode().split("|", 2)
                    found[r] = (float(stamp), kind, text)
        return found

    def first(self) -> str | None:
        """The first failure another rank posted: the earliest cause, else the earliest echo."""
        posts = {r: p for r, p in self.posts().items() if r != self.rank}
        if not posts:
            return None
        return min(posts.values(), key=lambda p: (p[1] != "cause", p[0]))[2]

    # -- who waits for whom -------------------------------------------------------------------

    def set_waiting(self, ranks: Sequence[int], what: str) -> None:
        """Publish that this rank waits for `ranks` (in action or collective `what`)."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                peers = ",".join(str(r) for r in ranks)
                self.store.set(f"{PREFIX}/waiting/{self.rank}", f"{time.time():.6f}|{peers}|{what}")

    def clear_waiting(self) -> None:
        """This rank waits for nobody any more."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.delete_key(f"{PREFIX}/waiting/{self.rank}")

    def waiting(self, rank: int) -> tuple[list[int], str] | None:
        """The ranks `rank` waits for and why, or None when it waits for nobody."""
        if self.store is None:
            return None
        key = f"{PREFIX}/waiting/{rank}"
        with contextlib.suppress(Exception):
            if self.store.check([key]):
                _, peers, what = self.store.get(key).decode().split("|", 2)
                return [int(p) for p in peers.split(",") if p], what
        return None

    def blocking(self, peers: Sequence[int]) -> tuple[list[int], list[str]]:
        """Follow who waits for whom from `peers` to the ranks that wait for nobody.

        Returns:
            Those ranks, less any that posted a failure (a rank whose own wait timed out
            stops waiting to post it); empty when every rank reached waits (mismatched
            calls). And the waits passed on the way, as text.
        """
        seen, chain, ends = set(), [], []
        todo = [p for p in peers if p != self.rank]
        while todo:
            r = todo.pop(0)
            if r in seen:
                continue
            seen.add(r)
            state = self.waiting(r)
            if state is None:
                time.sleep(WAITING_AFTER * 2)  # it may have started waiting just now
                state = self.waiting(r)
            if state is None:  # an end, unless it stopped waiting to post a failure
                ends.append(r)
                continue
            ranks, what = state
            chain.append(f"rank {r} waits for rank {','.join(map(str, ranks))} ({what})")
            todo.extend(p for p in ranks if p != r)
        posted = self.posts()
        return sorted(r for r in ends if r not in posted), chain


class Watch:
    """Runs this rank's waits on a waiter thread and stops them when another rank fails.

    Args:
        board: The failure board.
        timeout: Seconds any wait may take.
    """

    def __init__(self, board: FailureBoard, timeout: float) -> None:
        self.board, self.timeout = board, timeout
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._calls = queue.SimpleQueue()
        # a daemon thread: a wait abandoned after a failure never holds the process's exit
        threading.Thread(target=self._waiter, daemon=True, name="graphpipe-wait").start()

    def _waiter(self) -> None:
        while True:
            call, future = self._calls.get()
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)

    def _submit(self, call: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((call, future))
        return future

    @property
    def rank(self) -> int:
        """This rank."""
        return self.board.rank

    def wait(
        self, call: Callable[[], T], peers: Sequence[int], what: str, timeout: float | None = None
    ) -> T:
        """`call()` (a blocking wait for `peers`), stopped early when another rank fails.

        Raises:
            PipelineError: another rank posted a failure (quoted), `timeout` passed (the ranks
                that block the wait are named), or `call` failed (a peer closed its
                connection: it died). The error is posted before it is raised.
        """
        limit = self.timeout if timeout is None else timeout
        future = self._submit(call)
        try:
            return future.result(timeout=WAITING_AFTER)
        except concurrent.futures.TimeoutError:
            pass
        except Exception as exc:
            raise self.failed(peers, what, exc) from exc
        self.board.set_waiting(peers, what)
        try:
            return self._poll(future, peers, what, limit)
        finally:
            self.board.clear_waiting()

    def _poll(
        self, future: concurrent.futures.Future[T], peers: Sequence[int], what: str, limit: float
    ) -> T:
        deadline = time.monotonic() + limit - WAITING_AFTER
        while True:
            try:
                return future.result(timeout=POLL)
            except concurrent.futures.TimeoutError:
                pass
            except Exception as exc:
                raise self.failed(peers, what, exc) from exc
            other = self.board.first()
            if other is not None:
                raise self._echo(what, other)
            if time.monotonic() > deadline:
                diagnosis = self._diagnose(peers, what, limit)
                other = self.board.first()  # a peer that timed out first has the same story
                if other is not None:
                    raise self._echo(what, other)
                raise self.raised(diagnosis, "cause")

    def _echo(self, what: str, other: str) -> PipelineError:
        """Stop `what` because of another rank's post `other`."""
        return self.raised(
            f"rank {self.rank}, {what}: stopped, another rank failed: {other}", "echo"
        )

    def failed(self, peers: Sequence[int], what: str, exc: Exception) -> PipelineError:
        """The posted error for a call that raised: when a peer closed its connection (it
        died), the cause another rank or the launcher posts, else the call's own error."""
        text = str(exc).lower()
        head = f"rank {self.rank}, {what}, peer rank {_ranks(peers)}: "
        if not any(w in text for w in ("closed", "reset", "broken pipe", "timed out", "timeout")):
            return self.raised(head + first_line(exc), "cause")
        timed_out = "timed out" in text or "timeout" in text
        # a closed connection: a death, whose post the launcher makes within moments
        cause = self.board.first() if timed_out else self._settled_cause()
        if cause is not None:
            return self.raised(f"{head}stopped, another rank failed: {cause}", "echo")
        if timed_out:
            return self.raised(self._diagnose(peers, what, self.timeout), "cause")
        return self.raised(
            f"{head}rank {_ranks(peers)} closed its connection: it has probably died", "cause"
        )

    def _settled_cause(self) -> str | None:
        """The first cause another rank or the launcher posts within SETTLE s, or None."""
        end = time.monotonic() + SETTLE
        while True:
            posts = {r: p for r, p in self.board.posts().items() if r != self.rank}
            causes = [p for p in posts.values() if p[1] == "cause"]
            if causes:
                return min(causes)[2]
            if time.monotonic() > end:
                return min(posts.values())[2] if posts else None
            time.sleep(POLL)

    def _diagnose(self, peers: Sequence[int], what: str, limit: float) -> str:
        """Why a wait for `peers` ran out of time, naming the ranks at the end of the chain."""
        ends, chain = self.board.blocking(peers)
        text = f"rank {self.rank}, {what}, peer rank {_ranks(peers)}: no answer within {limit:g} s"
        via = f"; {'; '.join(chain)}" if chain else ""
        if not ends:
            return f"{text}{via}; every rank waits for another: mismatched calls on the ranks"
        return (
            f"{text}{via}; rank {_ranks(ends)} waits for no rank and posted no failure: "
            "it is alive but has not reached the matching call (a stage or user code slower "
            "than the timeout, or mismatched calls)"
        )

    def raised(self, text: str, kind: str) -> PipelineError:
        """Post `text` and return the PipelineError to raise."""
        self.board.post(text, kind)
        return PipelineError(text)

    def post_error(self, where: str, exc: BaseException) -> None:
        """Post a rank's own error (raised in `where`) unless it already posted one."""
        if isinstance(exc, PipelineError) and str(exc).startswith(f"rank {self.rank},"):
            return  # the watch posted it
        self.board.post(f"rank {self.rank}, {where}: {first_line(exc)}", "cause")


def _ranks(ranks: Sequence[int] | int) -> str:
    if isinstance(ranks, int):
        return str(ranks)
    return ",".join(str(r) for r in ranks) if len(ranks) < 6 else "every other rank"


_WATCH: Watch | None = None


def install_watch(timeout: float) -> Watch:
    """The process's watch on the default process group (made once, timeout updated)."""
    global _WATCH
    if _WATCH is None or _WATCH.board.rank != dist.get_rank():
        _WATCH = Watch(FailureBoard.of_process_group(), timeout)
    _WATCH.timeout = timeout
    return _WATCH


def current_watch() -> Watch | None:
    """The watch `install_watch` made, or None."""
    return _WATCH if dist.is_initialized() else None


def guarded(
    what: str,
    fn: Callable[[], T],
    peers: Sequence[int] | None = None,
    timeout: float | None = None,
) -> T:
    """Run the collective `fn` (over `peers`, default every rank) under the process's watch.

    On NCCL the call runs on this thread (the process group's watchdog bounds it); its
    error is posted all the same.

    Raises:
        PipelineError: the collective failed, ran out of time, or another rank failed.
    """
    watch = current_watch()
    rank = dist.get_rank()
    others = [r for r in (range(dist.get_world_size()) if peers is None else peers) if r != rank]
    if watch is not None and dist.get_backend() != "nccl":
        return watch.wait(fn, others, what, timeout)
    try:
        return fn()
    except RuntimeError as exc:
        if watch is not None:
            raise watch.failed(others, what, exc) from exc
        text = f"rank {rank}, {what}, peer rank {_ranks(others)}: {first_line(exc)}"
        raise PipelineError(text) from exc


@contextlib.contextmanager
def posted(where: str) -> Iterator[None]:
    """Post any error the block raises on the board, so no other rank waits for this one.

    A ConfigError is not posted: it refuses an input, on every rank alike, before any
    communication, and the pipeline stays usable.
    """
    try:
        yield
    except (ConfigError, PipelineError):
        raise  # a PipelineError was posted where it was raised
    except Exception as exc:
        watch = current_watch()
        if watch is not None:
            watch.post_error(where, exc)
        raise


def set_collective_timeout(seconds: float) -> None:
    """Make `seconds` the limit of the default process group's collectives.

    On NCCL the process group's own timeout (and watchdog) is the limit. Elsewhere the watch
    enforces `seconds` and diagnoses who stalls; the process group's timeout comes
    `BACKSTOP` s later, so that its bare "timed out" never races the diagnosis.
    """
    backstop = 0.0 if dist.get_backend() == "nccl" else BACKSTOP
    with contextlib.suppress(AttributeError, RuntimeError, ValueError):
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds + backstop))
