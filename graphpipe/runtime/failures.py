"""Failures: one protocol for every wait, so that every rank names the rank that failed first.

A rank that fails posts why on a *failure board*, a key-value store every rank reads:

    graphpipe/failure/<rank>   "<time>|<kind>|<text>"   kind: a FailureKind's value; "echo"
                                                      when it stopped because another rank
                                                      failed, else a cause (its own error, a
                                                      death, a timeout's diagnosis)
    graphpipe/waiting/<rank>   "<time>|<ranks>|<what>"  set while a wait lasts over WAITING_AFTER s,
                                                      emptied (not deleted) when it ends

The board is the store torch.distributed rendezvoused with. Under `graphpipe.runtime.launch` and
torchrun that store is served by the launcher or the elastic agent, not by rank 0, so the record
survives the death of any rank (`TORCHELASTIC_USE_AGENT_STORE`); the launcher also posts the
death of a rank that could not post its own. Under env:// without a launcher's store (SLURM's
`srun`), rank 0 serves it (`FailureBoard.host`): a rank that finds the store gone names rank
0 as dead, not the peer that stopped after it; and rank 0, when it fails, waits after its post
until the others have posted theirs (`linger`), so that its post reaches them.

Every wait of a rank (a receive, a send's completion, a collective) goes through `Watch.wait`
(several at once through `Watch.wait_each`): the blocking call runs on a waiter thread while
this thread polls the board (an asynchronous collective's Work, whose future says when it is
done, is waited for on this thread: `Watch.wait_work`), so a failure anywhere stops every other
rank at once with a `PipelineError` of kind ECHO that quotes the first cause (`origin`,
`cause`, `quoted`). `RuntimeConfig.timeout` bounds each wait. A timeout is diagnosed by
following who waits for whom on the board: the ranks at the end of that chain, which wait for
nobody and posted nothing, are the ones named (busy or stalled), so no rank blames a live
neighbour that is itself waiting. Every collective of the runtime runs through `guarded`,
which puts it under the watch. On CUDA, waits are stream dependencies and the process group's
timeout and watchdog bound them.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence, Set
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

from graphpipe._torch import (
    AGENT_STORE_ENV,
    backend_failure,
    default_store,
    set_default_pg_timeout,
    store_connection,
)
from graphpipe.errors import ConfigError, FailureKind, PipelineError

__all__ = [
    "BACKSTOP",
    "FailureBoard",
    "Post",
    "Watch",
    "action_failure",
    "current_watch",
    "failure",
    "first_line",
    "guarded",
    "guarded_work",
    "install_watch",
    "longer_waits",
    "posted",
    "restart_count",
    "set_collective_timeout",
    "unwatched_error",
]

T = TypeVar("T")
POLL = 0.05  # seconds between two looks at the board while a wait lasts
WAITING_AFTER = 0.3  # a wait longer than this is published (who waits for whom)
SETTLE = 5.0  # seconds a rank whose peer closed its connection waits for the cause's post
BACKSTOP = 10.0  # seconds the backend's own timeouts come after the watch's


def restart_count() -> int:
    """How many times torchrun's agent restarted the group before this attempt (0 without
    torchrun): `TORCHELASTIC_RESTART_COUNT`."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


# torchrun's agent keeps its store across restarts: each attempt gets keys of its own
PREFIX = f"graphpipe/{restart_count()}"


class Post(NamedTuple):
    """A rank's failure post on the board."""

    rank: int  # the rank that failed (posted by itself or by the launcher)
    stamp: float  # time.time() of the post
    kind: FailureKind  # what happened; ECHO: it stopped because another rank failed
    text: str  # the message, as the rank's PipelineError says it

    def caused(self) -> bool:
        """Whether the post is a cause, not an echo."""
        return self.kind is not FailureKind.ECHO


STORE_ERRORS = (dist.DistError,)  # what a store raises when its server is gone


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
        host: The rank whose process serves the store (env:// without a launcher's store:
            rank 0), whose death takes the board with it; None: a launcher or torchrun's
            agent serves it.
    """

    def __init__(self, rank: int, world: int, store: Any, host: int | None = None) -> None:
        self.rank, self.world, self.store, self.host = rank, world, store, host
        self.lost = False  # a call on the store failed: its server is gone
        self._seen: dict[int, Post] = {}  # the posts of the last read

    @classmethod
    def of_process_group(cls) -> FailureBoard:
        """The board on the store the default process group rendezvoused with."""
        # down to the store the launcher also sees, on a connection of its own: a TCPStore
        # client serves one call at a time, and the process group's own blocking calls on it
        # must not hold the board up
        store = store_connection(default_store())
        # env:// without a launcher's store: rank 0 serves the TCPStore (torch's rendezvous)
        agent = os.environ.get(AGENT_STORE_ENV) == "True"
        host = 0 if isinstance(store, dist.TCPStore) and not agent else None
        return cls(dist.get_rank(), dist.get_world_size(), store, host)

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        """A call on the store; when its server is gone, nothing (and the board is lost)."""
        try:
            yield
        except STORE_ERRORS:
            self.lost = True

    def host_gone(self) -> int | None:
        """The rank that served the store, when it is gone with it (None: the store is
        there, or no rank served it)."""
        if self.host is None or self.host == self.rank:
            return None
        if not self.lost:
            self.posts()  # a call, to find out
        return self.host if self.lost else None

    # -- failures -----------------------------------------------------------------------------

    def post(self, text: str, kind: FailureKind, rank: int | None = None) -> None:
        """Record why `rank` (default this one) fails; a rank's first post is kept.

        Best effort: a store whose server is gone (the launcher ended) records nothing.
        """
        if self.store is None:
            return
        rank = self.rank if rank is None else rank
        with self._reaching():
            self.store.compare_set(
                f"{PREFIX}/failure/{rank}", "", f"{time.time():.6f}|{kind.value}|{text}"
            )

    def posts(self) -> dict[int, Post]:
        """Every rank's post, by rank. When the store's server is gone: the posts read
        last (a post is never withdrawn), none if there were none."""
        if self.store is None:
            return {}
        keys = [f"{PREFIX}/failure/{r}" for r in range(self.world)]
        found: dict[int, Post] = {}
        with self._reaching():
            for r, key in enumerate(keys):
                if self.store.check([key]):
                    stamp, kind, text = self.store.get(key).decode().split("|", 2)
                    found[r] = Post(r, float(stamp), FailureKind(kind), text)
            self._seen = found
        return dict(self._seen)

    def linger(self) -> None:
        """On the rank that serves the store, after its own post: wait until every other
        rank that is in a wait has posted (read the board), or SETTLE s passed, so that the
        board outlives the post it must carry. A rank in no wait for 2 x WAITING_AFTER
        (stopped, dead, or busy past the timeout) reads no board now and is not waited for:
        one that comes back after the store is gone names this rank as dead."""
        if self.host != self.rank:
            return
        start = time.monotonic()
        while time.monotonic() < start + SETTLE and not self.lost:
            posted = set(self.posts())
            others = [r for r in range(self.world) if r != self.rank and r not in posted]
            settled = time.monotonic() > start + 2 * WAITING_AFTER
            if not [r for r in others if not settled or self.waiting(r) is not None]:
                return
            time.sleep(POLL)

    def first(self) -> Post | None:
        """The first failure another rank posted: the earliest cause, else the earliest echo."""
        posts = [p for r, p in self.posts().items() if r != self.rank]
        return min(posts, key=lambda p: (not p.caused(), p.stamp)) if posts else None

    # -- who waits for whom -------------------------------------------------------------------

    def set_waiting(self, ranks: Sequence[int], what: str) -> None:
        """Publish that this rank waits for `ranks` (in action or collective `what`)."""
        if self.store is not None:
            with self._reaching():
                peers = ",".join(str(r) for r in ranks)
                self.store.set(f"{PREFIX}/waiting/{self.rank}", f"{time.time():.6f}|{peers}|{what}")

    def clear_waiting(self) -> None:
        """This rank waits for nobody any more: its state is emptied, never deleted (a
        reader between its `check` and its `get` reads a deleted key back empty)."""
        if self.store is not None:
            with self._reaching():
                self.store.set(f"{PREFIX}/waiting/{self.rank}", "")

    def waiting(self, rank: int) -> tuple[list[int], str] | None:
        """The ranks `rank` waits for and why, or None when it waits for nobody."""
        if self.store is None:
            return None
        key = f"{PREFIX}/waiting/{rank}"
        with self._reaching():
            if self.store.check([key]):  # once set, the key stays: `get` cannot block
                state = self.store.get(key).decode()
                if state:
                    _, peers, what = state.split("|", 2)
                    return [int(p) for p in peers.split(",") if p], what
        return None

    def idle(self) -> set[int]:
        """The other ranks that wait for nobody now (read once, for `blocking`)."""
        return {r for r in range(self.world) if r != self.rank and self.waiting(r) is None}

    def blocking(
        self, peers: Sequence[int], idle_before: Set[int] = frozenset()
    ) -> tuple[list[int], list[str]]:
        """Follow who waits for whom from `peers` to the ranks that wait for nobody.

        A rank found waiting for nobody is read again after 2 x WAITING_AFTER (it may have
        started a wait just now, not yet published), unless it was in `idle_before`: found
        waiting for nobody that long before already (`idle`, read by the watch ahead of its
        deadline), so that a timeout is diagnosed at the deadline, not a sleep after it.

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
            if state is None and r not in idle_before:
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


class _Call:
    """A call handed to the waiter thread, and its outcome: `done` is held until it returns
    or raises (a bare lock, lighter than a Future's condition)."""

    __slots__ = ("done", "dropped", "error", "fn", "over", "result")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Lock()
        self.done.acquire()
        self.over = False  # the caller has seen `done` released
        self.result: Any = None
        self.error: BaseException | None = None
        self.dropped = False  # the caller gave up on it before it ran: not run

    def ready(self, timeout: float) -> bool:
        """Whether the call returned or raised, waiting up to `timeout` seconds for it."""
        if not self.over:
            self.over = self.done.acquire(timeout=timeout)
        return self.over

    def outcome(self) -> Any:
        """What the call returned; what it raised is raised."""
        if self.error is not None:
            raise self.error
        return self.result


class _Work:
    """A backend's Work whose completion its future reports (a gloo collective, run on
    gloo's own threads): waited for on this thread, with the `_Call` interface."""

    __slots__ = ("done", "work")

    def __init__(self, work: dist.Work) -> None:
        self.work = work
        self.done = threading.Event()
        work.get_future().add_done_callback(lambda _: self.done.set())

    def ready(self, timeout: float) -> bool:
        """Whether the work completed (or failed), waiting up to `timeout` seconds."""
        return self.done.wait(timeout)

    def outcome(self) -> Any:
        """The completed work's result; its error is raised."""
        return self.work.wait()


class Watch:
    """Runs this rank's waits on a waiter thread and stops them when another rank fails.

    A wait for a Work that reports its completion (an asynchronous collective, `wait_work`)
    is not handed over: this thread waits for its future. Gloo's point-to-point Works do
    not (their `is_completed` stays False until `wait` and they have no future), so their
    waits run on the waiter thread.

    Args:
        board: The failure board.
        timeout: Seconds any wait may take.
    """

    def __init__(self, board: FailureBoard, timeout: float) -> None:
        self.board, self.timeout = board, timeout
        self._calls: queue.SimpleQueue[list[_Call]] = queue.SimpleQueue()
        # a daemon thread: a wait abandoned after a failure never holds the process's exit
        threading.Thread(target=self._waiter, daemon=True, name="graphpipe-wait").start()

    def _waiter(self) -> None:
        while True:
            for call in self._calls.get():
                try:
                    if not call.dropped:
                        call.result = call.fn()
                except BaseException as exc:
                    call.error = exc
                call.done.release()

    def _submit(self, fns: Sequence[Callable[[], Any]]) -> list[_Call]:
        """Hand `fns` to the waiter thread as one item (one wake-up), to run in order."""
        calls = [_Call(fn) for fn in fns]
        self._calls.put(calls)
        return calls

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
        return self._outcome(self._submit([call])[0], peers, what, timeout)

    def wait_work(
        self, work: dist.Work, peers: Sequence[int], what: str, timeout: float | None = None
    ) -> Any:
        """`work.wait()` for an asynchronous collective's `work`, on this thread: its
        future wakes it, and the board is read as `wait` reads it.

        Raises:
            PipelineError: as `wait`.
        """
        return self._outcome(_Work(work), peers, what, timeout)

    def wait_each(self, waits: Sequence[tuple[Callable[[], T], Sequence[int], str]]) -> list[T]:
        """Several waits `(call, peers, what)`, one after the other, each as `wait` runs it
        (its own timeout, its own error); handed to the waiter thread at once, as one item, so
        that it runs them back to back: one wake-up for all, and no thread switch for those
        complete when the caller comes to them.

        Raises:
            PipelineError: as `wait`, for the first that fails; the waits after it are
                dropped (those the waiter thread has not begun are not run).
        """
        calls = self._submit([call for call, _, _ in waits])
        done = []
        try:
            for call, (_, peers, what) in zip(calls, waits, strict=True):
                done.append(self._outcome(call, peers, what, None))
        finally:
            for call in calls[len(done) + 1 :]:
                call.dropped = True
        return done

    def _outcome(
        self, call: _Call | _Work, peers: Sequence[int], what: str, timeout: float | None
    ) -> Any:
        """The outcome of the submitted `call`, waited for as `wait` says."""
        limit = self.timeout if timeout is None else timeout
        try:
            if call.ready(WAITING_AFTER):
                return call.outcome()
        except Exception as exc:
            raise self.failed(peers, what, exc) from exc
        self.board.set_waiting(peers, what)
        try:
            return self._poll(call, peers, what, limit)
        finally:
            self.board.clear_waiting()

    def _poll(self, call: _Call | _Work, peers: Sequence[int], what: str, limit: float) -> Any:
        deadline = time.monotonic() + limit - WAITING_AFTER
        early = deadline - 2 * WAITING_AFTER  # when the board's idle ranks are read first
        idle: set[int] | None = None
        while True:
            try:
                if call.ready(POLL):
                    return call.outcome()
            except Exception as exc:
                raise self.failed(peers, what, exc) from exc
            other = self.board.first()
            if other is not None:
                raise self._echo(f"rank {self.rank}, {what}: ", other)
            if self.board.lost and self.board.host_gone() is not None:
                raise self._host_died(f"rank {self.rank}, {what}: ")
            now = time.monotonic()
            if idle is None and now > early:
                idle = self.board.idle()
            if now > deadline:
                text, ends = self._diagnose(peers, what, limit, idle or set())
                other = self.board.first()  # a peer that timed out first has the same story
                if other is not None:
                    raise self._echo(f"rank {self.rank}, {what}: ", other)
                raise self.raised(text, FailureKind.TIMED_OUT, peers=ends)

    def _echo(self, head: str, other: Post, peers: Sequence[int] = ()) -> PipelineError:
        """Stop (the wait that `head` names) because of another rank's post `other`."""
        return self.raised(
            f"{head}stopped, another rank failed: {other.text}",
            FailureKind.ECHO,
            peers=peers,
            origin=other.rank,
            cause=other.kind,
            quoted=other.text,
        )

    def failed(self, peers: Sequence[int], what: str, exc: Exception) -> PipelineError:
        """The posted error for a call that raised: when a peer closed its connection (it
        died), the cause another rank or the launcher posts, else the call's own error."""
        with_peers = f", peer rank {_ranks(peers)}" if peers else ""  # none: not known here
        head = f"rank {self.rank}, {what}{with_peers}: "
        seen = backend_failure(exc)
        if seen is None:
            return self.raised(head + first_line(exc), FailureKind.RAISED, peers=peers)
        # a closed connection: a death, whose post the launcher makes within moments
        cause = self.board.first() if seen == "timeout" else self._settled_cause()
        if cause is not None:
            return self._echo(head, cause, peers)
        if self.board.host_gone() is not None:
            return self._host_died(head)
        if seen == "timeout":
            text, ends = self._diagnose(peers, what, self.timeout)
            return self.raised(text, FailureKind.TIMED_OUT, peers=ends)
        return self.raised(
            f"{head}{f'rank {_ranks(peers)}' if peers else 'a peer'} closed its connection: "
            "it has probably died",
            FailureKind.DIED,
            peers=peers,
        )

    def _host_died(self, head: str) -> PipelineError:
        """The error for a store gone with the rank that served it: that rank died, and
        took the board (and any cause posted on it) along; the peer whose connection
        closed may only have been stopping after it."""
        host = self.board.host
        assert host is not None
        return self.raised(
            f"{head}rank {host}, which served the store, is gone with it: rank {host} has "
            "probably died (the failure board went with it)",
            FailureKind.DIED,
            peers=[host],
            origin=host,
        )

    def _settled_cause(self) -> Post | None:
        """The first cause another rank or the launcher posts within SETTLE s, or None
        (at once when the store is gone with the rank that served it)."""
        end = time.monotonic() + SETTLE
        while True:
            posts = [p for r, p in self.board.posts().items() if r != self.rank]
            if self.board.host_gone() is not None:
                return None
            causes = [p for p in posts if p.caused()]
            if causes:
                return min(causes, key=lambda p: p.stamp)
            if time.monotonic() > end:
                return min(posts, key=lambda p: p.stamp) if posts else None
            time.sleep(POLL)

    def _diagnose(
        self, peers: Sequence[int], what: str, limit: float, idle: Set[int] = frozenset()
    ) -> tuple[str, list[int]]:
        """Why a wait for `peers` ran out of time, naming the ranks at the end of the chain;
        and those ranks (none when every rank waits). `idle`: the ranks found waiting for
        nobody 2 x WAITING_AFTER before (`FailureBoard.blocking`)."""
        ends, chain = self.board.blocking(peers, idle)
        text = f"rank {self.rank}, {what}, peer rank {_ranks(peers)}: no answer within {limit:g} s"
        via = f"; {'; '.join(chain)}" if chain else ""
        if not ends:
            text = f"{text}{via}; every rank waits for another: mismatched calls on the ranks"
        else:
            text = (
                f"{text}{via}; rank {_ranks(ends)} waits for no rank and posted no failure: "
                "it is alive but has not reached the matching call (a stage or user code "
                "slower than the timeout, or mismatched calls)"
            )
        return text, ends

    def raised(self, text: str, kind: FailureKind, **fields: Any) -> PipelineError:
        """Post `text` and return the PipelineError of `kind` to raise.

        Args:
            text: The message.
            kind: What happened.
            **fields: The error's other fields (`peers`, `stage`, ...); `rank` is this one.
        """
        self.board.post(text, kind)
        self.board.linger()
        return PipelineError(text, kind=kind, rank=self.rank, **fields)

    def post_error(self, where: str, exc: BaseException) -> None:
        """Post a rank's own error (raised in `where`) unless it already posted one."""
        if isinstance(exc, PipelineError) and exc.rank == self.rank:
            return  # the watch posted it
        kind = FailureKind.BAD_INPUT if isinstance(exc, ConfigError) else FailureKind.RAISED
        self.board.post(f"rank {self.rank}, {where}: {first_line(exc)}", kind)
        self.board.linger()


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
    *,
    here: bool = False,
) -> T:
    """Run the collective `fn` (over `peers`, default every rank) under the process's watch.

    On NCCL, or with `here`, the call runs on this thread (a CUDA wait makes this thread's
    stream wait; the process group's timeout and watchdog bound it); its error is posted all
    the same.

    Args:
        what: The collective, as the error names it ("the all-reduce of the loss").
        fn: The call: a collective, or the wait of one launched asynchronously.
        peers: The ranks of the collective (default: every rank).
        timeout: Seconds it may take (default: the watch's).
        here: Run `fn` on this thread even under gloo.

    Raises:
        PipelineError: the collective failed, ran out of time, or another rank failed.
    """
    watch = current_watch()
    rank = dist.get_rank()
    others = [r for r in (range(dist.get_world_size()) if peers is None else peers) if r != rank]
    if watch is not None and not here and dist.get_backend() != "nccl":
        return watch.wait(fn, others, what, timeout)
    try:
        return fn()
    except RuntimeError as exc:
        if watch is not None:
            raise watch.failed(others, what, exc) from exc
        head = f"rank {rank}, {what}, peer rank {_ranks(others)}: "
        raise unwatched_error(head, rank, others, exc) from exc


def guarded_work(
    what: str,
    start: Callable[[], dist.Work],
    peers: Sequence[int] | None = None,
    timeout: float | None = None,
) -> None:
    """Start the asynchronous collective `start` (`async_op=True`) on this thread and wait
    for its Work under the process's watch (`Watch.wait_work`: no thread handed the wait),
    as `guarded` runs a blocking one. On NCCL: `work.wait()`, a stream dependency.

    Raises:
        PipelineError: the collective failed, ran out of time, or another rank failed.
    """
    work = guarded(what, start, peers, here=True)
    watch = current_watch()
    if watch is None or dist.get_backend() == "nccl":
        guarded(what, work.wait, peers, here=True)
        return
    rank = dist.get_rank()
    others = [r for r in (range(dist.get_world_size()) if peers is None else peers) if r != rank]
    watch.wait_work(work, others, what, timeout)


def failure(text: str, kind: FailureKind, **fields: Any) -> PipelineError:
    """The PipelineError of `kind` to raise, posted on the board when a watch is installed,
    so no other rank waits for this one (`fields`: the error's own, `rank` aside)."""
    watch = current_watch()
    if watch is not None:
        return watch.raised(text, kind, **fields)
    rank = dist.get_rank() if dist.is_initialized() else None
    return PipelineError(text, kind=kind, rank=rank, **fields)


def action_failure(where: str, exc: Exception, **fields: Any) -> PipelineError:
    """The posted PipelineError for an action of this rank that raised `exc` (`where`: "rank
    r, action 1F0"; `fields`: its stage and micro-batch).

    A backend's closed connection or timeout inside an action comes from a collective that
    runs within the stage's own code, outside `guarded`: FSDP2's all-gathers and
    reduce-scatters over the dp ranks of a mesh, in the stage's forward and backward. Its
    peer died (or stalled): the cause the launcher or that peer posts is quoted, as for a
    guarded wait (`Watch.failed`), instead of gloo's text. Any other error is the action's
    own: BAD_INPUT for a ConfigError, else RAISED.
    """
    watch = current_watch()
    if watch is not None and backend_failure(exc) is not None:
        return watch.failed((), where.removeprefix(f"rank {watch.rank}, "), exc)
    kind = FailureKind.BAD_INPUT if isinstance(exc, ConfigError) else FailureKind.RAISED
    return failure(f"{where}: {first_line(exc)}", kind, **fields)


def unwatched_error(head: str, rank: int, peers: Sequence[int], exc: Exception) -> PipelineError:
    """The PipelineError for a backend's error `exc` outside a watch (nothing is posted).

    Args:
        head: The message's start, naming the rank, the call and the peers.
        rank: This rank.
        peers: The ranks of the call.
        exc: The backend's error: a closed connection is DIED, a timeout TIMED_OUT.
    """
    seen = backend_failure(exc)
    kind = {"closed": FailureKind.DIED, "timeout": FailureKind.TIMED_OUT}.get(
        seen or "", FailureKind.RAISED
    )
    return PipelineError(head + first_line(exc), kind=kind, rank=rank, peers=peers)


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


@contextlib.contextmanager
def longer_waits(seconds: float) -> Iterator[None]:
    """Every wait of this rank (the watch's limit, and the default process group's own
    timeout behind it) may take `seconds` inside the block; the limits are put back after.
    For a step whose stages compile (torch.compile's inductor on a new shape), where a
    peer's wait includes this rank's compile."""
    watch = current_watch()
    if watch is None:
        yield
        return
    saved = watch.timeout
    watch.timeout = seconds
    set_collective_timeout(seconds)
    try:
        yield
    finally:
        watch.timeout = saved
        set_collective_timeout(saved)


def set_collective_timeout(seconds: float, groups: Sequence[dist.ProcessGroup] = ()) -> None:
    """Make `seconds` the limit of the collectives of the default process group and of
    `groups` (a mesh's dp groups, whose collectives FSDP2 runs inside the stage's actions,
    outside the watch: a peer stalled in one fails them at this limit, `action_failure`).

    On NCCL the process group's own timeout (and watchdog) is the limit. Elsewhere the watch
    enforces `seconds` and diagnoses who stalls; the process group's timeout comes
    `BACKSTOP` s later, so that its bare "timed out" never races the diagnosis.
    """
    backstop = 0.0 if dist.get_backend() == "nccl" else BACKSTOP
    for group in (None, *groups):
        set_default_pg_timeout(seconds + backstop, group)
