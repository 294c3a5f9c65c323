"""Failures: every rank names the rank that failed first, at once, whatever failed where.

The fault matrix: two_branch on 2 ranks (branch a | branch b and the head) and on 3 (a | b |
the head and the loss); every rank position is killed with SIGKILL (kill -9) during compile
(the plan broadcast), P2P (its first stage forward of a step), the loss all-reduce and a
checkpoint save (DCP's collectives), and stopped with SIGSTOP at each position during P2P and
at some positions in the other moments. Every survivor must raise a PipelineError naming the
victim: at once for a death (the timeout is 60 s), within RuntimeConfig.timeout + 2 s for a
stop. No process may remain. The other tests: a stage that raises on a live rank, a death in a
state-dict gather, a stalled all-reduce under launch's longer process-group timeout.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint
from test_bad_inputs import _runtime_loss_worker
from torch.distributed import TCPStore
from training import batch, optimizer_for, zoo_pipeline
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError, FailureKind, PipelineError
from graphpipe.runtime import failures
from graphpipe.runtime.failures import FailureBoard, Watch
from graphpipe.runtime.launch import launch
from graphpipe.runtime.pipeline import PipelinedModel

LIMIT = 120  # seconds for a whole launch
SLOW = 60  # RuntimeConfig.timeout where the survivors must not wait for it


def _failure(fault: str, victim: int, timeout: float = SLOW) -> None:
    """Train two steps of two_branch with `fault` injected on rank `victim`."""
    pm = zoo_pipeline("two_branch", timeout=timeout)
    inputs, target = batch("two_branch", 0)
    pm.step(*inputs, target=target)
    if pm.rank == victim:
        _inject(pm, fault)
    pm.step(*inputs, target=target)
    pm.state_dict()


def _inject(pm: PipelinedModel, fault: str) -> None:
    if fault == "raises_in_stage":  # the rank stays alive; its stage raises

        def boom(*args: object, **kwargs: object) -> None:
            raise RuntimeError("boom in the stage")

        for stage in pm._executor.stages.values():  # type: ignore[union-attr]
            stage.module.forward = boom  # type: ignore[method-assign]
    elif fault == "dies_between_steps":  # rank 0: the one that would host a default store
        os._exit(7)
    elif fault == "dies_in_state_dict_gather":
        pm._collectives.gather = lambda mine, what: os._exit(6)  # type: ignore[method-assign]
    elif fault == "stalls_before_loss_all_reduce":  # alive, never joins the all-reduce
        pm._collectives.all_reduce = lambda t, what: time.sleep(600)  # type: ignore[method-assign]


def _survivors(err: pytest.ExceptionInfo[PipelineError], victim: int) -> list[str]:
    lines = [line for line in err.value.problems if not line.startswith(f"rank {victim}:")]
    return [line for line in lines if line.startswith("rank ") and ": " in line][:2]


@pytest.mark.parametrize(
    ("fault", "victim", "cause", "kind"),
    [
        (
            "raises_in_stage",
            0,
            "rank 0, action 0F0: RuntimeError: boom in the stage",
            FailureKind.RAISED,
        ),
        ("dies_between_steps", 0, "rank 0: exited with code 7", FailureKind.DIED),
        ("dies_in_state_dict_gather", 1, "rank 1: exited with code 6", FailureKind.DIED),
    ],
)
def test_every_survivor_quotes_the_first_failure_at_once(
    fault: str, victim: int, cause: str, kind: FailureKind
) -> None:
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        launch(_failure, 3, args=(fault, victim), timeout=LIMIT, grace=SLOW)
    assert time.monotonic() - start < SLOW / 2  # not after the timeout
    assert (err.value.kind, err.value.origin) == (kind, victim), err.value.problems
    assert set(err.value.peers) == {0, 1, 2}  # the victim, and the survivors that echoed it
    survivors = _survivors(err, victim)
    assert len(survivors) == 2, err.value.problems
    for line in survivors:
        assert cause in line, err.value.problems
        assert "stopped, another rank failed" in line


def test_a_stalled_collective_fails_after_the_runtime_timeout_naming_the_stalled_rank() -> None:
    """launch's process group timeout is 60 s; RuntimeConfig.timeout=3 governs the all-reduce."""
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        launch(
            _failure,
            3,
            args=("stalls_before_loss_all_reduce", 1, 3.0),
            timeout=LIMIT,
            # the stalled rank is stopped after it; the other survivor names it within its
            # own 3 s wait, which a loaded machine may begin seconds after rank 0's (a
            # fresh-clone CI beside another test file's ranks: not within 5 s)
            grace=15,
            comm_timeout=60,
        )
    assert time.monotonic() - start < 40
    assert err.value.kind is FailureKind.TIMED_OUT, err.value.problems
    survivors = _survivors(err, 1)
    assert len(survivors) == 2, err.value.problems
    for line in survivors:
        assert "the all-reduce of the loss" in line, err.value.problems
        assert "rank 1 waits for no rank and posted no failure" in line, err.value.problems


def test_a_failure_board_post_is_kept_and_causes_come_before_echoes() -> None:
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    mine, launcher = FailureBoard(0, 3, store), FailureBoard(-1, 3, store)
    assert mine.first() is None
    FailureBoard(1, 3, store).post("rank 1: stopped, another rank failed", FailureKind.ECHO)
    echo = mine.first()
    assert echo is not None
    assert (echo.rank, echo.kind, echo.text) == (
        1,
        FailureKind.ECHO,
        "rank 1: stopped, another rank failed",
    )
    launcher.post("rank 2: exited with code 9", FailureKind.DIED, rank=2)
    launcher.post("rank 2: a later post", FailureKind.RAISED, rank=2)  # the first is kept
    cause = mine.first()
    assert cause is not None
    assert (cause.rank, cause.kind, cause.text) == (
        2,
        FailureKind.DIED,
        "rank 2: exited with code 9",
    )
    FailureBoard(2, 3, store).set_waiting([0], "action 2RF0<0")
    assert FailureBoard(1, 3, store).blocking([2]) == (
        [0],
        ["rank 2 waits for rank 0 (action 2RF0<0)"],
    )


def test_a_wait_state_read_while_it_ends_is_either_the_state_or_none() -> None:
    """A reader checks a rank's key, then gets it; the rank's wait may end in between. Its
    end empties the key (a deleted one read back empty, which no reader could parse: seen
    as a survivor's `ValueError` in the fault matrix), so every read is whole."""
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    waiter, reader = FailureBoard(0, 2, store.clone()), FailureBoard(1, 2, store.clone())
    done = threading.Event()

    def flip() -> None:
        while not done.is_set():
            waiter.set_waiting([1], "action 0RF0<1")
            waiter.clear_waiting()

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    try:
        seen = [reader.waiting(0) for _ in range(5000)]
    finally:
        done.set()
        flipper.join(timeout=10)
    assert {None if s is None else repr(s) for s in seen} == {None, repr(([1], "action 0RF0<1"))}
    assert not reader.lost


def test_a_board_whose_store_is_gone_records_and_reads_nothing() -> None:
    """The launcher ended: posting is best effort, and no read raises."""
    server = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 1, is_master=False, timeout=timedelta(seconds=2))
    board = FailureBoard(0, 2, client)
    del server
    gc.collect()
    board.post("rank 0: lost", FailureKind.RAISED)
    board.set_waiting([1], "action 0RF0<1")
    assert board.posts() == {} and board.waiting(1) is None


# -- kinds: what a watch raises, in one process (the board on a store of its own) --------------


def _watch(rank: int, store: TCPStore, world: int = 3) -> Watch:
    return Watch(FailureBoard(rank, world, store), timeout=0.6)


def _board() -> TCPStore:
    return TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)


def test_a_wait_stopped_by_another_ranks_failure_is_an_echo_of_it() -> None:
    store = _board()
    FailureBoard(-1, 3, store).post("rank 2: was killed by signal 9", FailureKind.DIED, rank=2)
    with pytest.raises(PipelineError) as err:
        _watch(0, store).wait(lambda: time.sleep(5), [1], "action 0RF0<1")
    e = err.value
    assert (e.kind, e.rank, e.origin, e.cause) == (FailureKind.ECHO, 0, 2, FailureKind.DIED)
    assert e.quoted == "rank 2: was killed by signal 9"
    assert str(e) == "rank 0, action 0RF0<1: stopped, another rank failed: " + e.quoted
    posted = FailureBoard(1, 3, store).posts()[0]  # the echo is posted for the others
    assert (posted.kind, posted.text) == (FailureKind.ECHO, str(e))


def test_a_wait_past_the_timeout_names_the_rank_that_waits_for_nobody() -> None:
    store = _board()
    FailureBoard(1, 3, store).set_waiting([2], "action 1RF0<2")  # 1 waits for 2, 2 for nobody
    with pytest.raises(PipelineError) as err:
        _watch(0, store).wait(lambda: time.sleep(5), [1], "action 0RF0<1")
    e = err.value
    assert (e.kind, e.rank, e.peers) == (FailureKind.TIMED_OUT, 0, (2,)), str(e)
    assert "rank 2 waits for no rank and posted no failure" in str(e)


def test_a_peer_that_closed_its_connection_died(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failures, "SETTLE", 0.2)  # nobody will post the cause
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:29888")
    e = _watch(0, _board()).failed([1], "action 0RF0<1", closed)
    assert (e.kind, e.rank, e.peers) == (FailureKind.DIED, 0, (1,)), str(e)
    assert str(e).endswith("rank 1 closed its connection: it has probably died")


def test_a_collectives_own_error_is_raised_with_its_peers() -> None:
    e = _watch(0, _board()).failed([1, 2], "the all-reduce of the loss", RuntimeError("shapes"))
    assert (e.kind, e.peers) == (FailureKind.RAISED, (1, 2))
    assert str(e) == "rank 0, the all-reduce of the loss, peer rank 1,2: RuntimeError: shapes"


def test_waits_handed_over_together_return_in_order_and_each_fails_as_itself() -> None:
    watch = _watch(0, _board())
    waits = [(lambda k=k: k, [1], f"action {k}") for k in range(5)]
    assert watch.wait_each(waits) == [0, 1, 2, 3, 4]

    def refused() -> None:
        raise RuntimeError("shapes")

    waits = [(lambda: None, [1], "action 0SF0>1"), (refused, [2], "action 0SF1>2")]
    with pytest.raises(PipelineError) as err:
        watch.wait_each(waits)
    assert (err.value.kind, err.value.peers) == (FailureKind.RAISED, (2,))
    assert str(err.value) == "rank 0, action 0SF1>2, peer rank 2: RuntimeError: shapes"


class _FakeWork:
    """A Work whose future a timer completes `after` seconds on (never for None)."""

    def __init__(self, after: float | None) -> None:
        self.future: torch.futures.Future[None] = torch.futures.Future()
        self.waited_on: list[str] = []
        if after is not None:
            threading.Timer(after, lambda: self.future.set_result(None)).start()

    def get_future(self) -> torch.futures.Future[None]:
        return self.future

    def wait(self) -> bool:
        self.waited_on.append(threading.current_thread().name)
        return True


def test_a_works_wait_runs_on_this_thread_woken_by_its_future() -> None:
    watch = _watch(0, _board())
    work = _FakeWork(after=0.4)  # past WAITING_AFTER: the watch also reads the board
    assert watch.wait_work(work, [1], "the all-reduce of the loss") is True  # type: ignore[arg-type]
    assert work.waited_on == [threading.current_thread().name]


def test_a_work_never_done_is_stopped_by_another_ranks_failure() -> None:
    store = _board()
    FailureBoard(-1, 3, store).post("rank 2: was killed by signal 9", FailureKind.DIED, rank=2)
    with pytest.raises(PipelineError) as err:
        _watch(0, store).wait_work(_FakeWork(None), [1, 2], "the all-reduce of the loss")  # type: ignore[arg-type]
    assert (err.value.kind, err.value.origin) == (FailureKind.ECHO, 2)


def test_a_refused_input_is_posted_as_bad_input_and_echoed_as_such() -> None:
    store = _board()
    _watch(1, store).post_error("step", ConfigError("loss_fn returned a [2, 4] tensor"))
    with pytest.raises(PipelineError) as err:
        _watch(0, store).wait(lambda: time.sleep(5), [1], "action 0RB0<1")
    assert (err.value.kind, err.value.cause) == (FailureKind.ECHO, FailureKind.BAD_INPUT)
    assert err.value.quoted == "rank 1, step: ConfigError: loss_fn returned a [2, 4] tensor"


def test_a_stage_refusing_its_input_is_a_bad_input_first() -> None:
    """Only rank 1's stage can check the loss: launch names it first, as a bad input."""
    with pytest.raises(PipelineError) as err:
        launch(_runtime_loss_worker, 2, timeout=LIMIT, comm_timeout=20)
    assert (err.value.kind, err.value.origin) == (FailureKind.BAD_INPUT, 1), err.value.problems
    assert err.value.problems[0].startswith("rank 1: ConfigError: loss_fn returned")


def test_a_pipeline_error_keeps_its_fields_through_pickle() -> None:
    e = PipelineError("m", ["p"], kind=FailureKind.ECHO, rank=0, origin=2, quoted="q")
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.problems, back.fields()) == (str(e), e.problems, e.fields())


# -- the fault matrix: kill -9 and SIGSTOP at every rank position and moment -------------------

MATRIX_PINS = {  # two_branch on 2 ranks (branch a | branch b and the head) and on 3
    2: {"a": 0, "b": 1, "cat": 1, "head": 1},
    3: {"a": 0, "b": 1, "cat": 2, "head": 2},
}
STALL = 3.0  # RuntimeConfig.timeout in the SIGSTOP cases
KILLS = [(w, v, m) for w in (2, 3) for v in range(w) for m in ("compile", "p2p", "loss", "save")]
STOPS = [(w, v, m) for w in (2, 3) for v in range(w) for m in ("p2p",)] + [
    (3, 0, "save"),
    (2, 1, "loss"),
    (3, 1, "compile"),
    (2, 0, "compile"),
]


def _halt(how: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def _arm(pm: PipelinedModel, moment: str, how: str) -> None:
    """Make this rank halt at `moment` of the next step (or of the save after it)."""
    if moment == "p2p":  # its first stage forward: the others wait in P2P for it

        def halt(*args: object, **kwargs: object) -> None:
            _halt(how)

        for stage in pm._executor.stages.values():  # type: ignore[union-attr]
            stage.module.forward = halt  # type: ignore[method-assign]
    elif moment == "loss":
        pm._collectives.all_reduce = lambda t, what: _halt(how)  # type: ignore[method-assign]
    elif moment == "save":  # the others wait in DCP's collectives
        torch.distributed.checkpoint.save = lambda *a, **k: _halt(how)


def _clock_waits() -> list[float]:
    """From now on in this process, when each wait under the watch begins (each one's
    timeout counts from there): `time.monotonic()`, in order."""
    starts: list[float] = []
    outcome = Watch._outcome

    def timed(self: Watch, *args: Any, **kwargs: Any) -> Any:
        starts.append(time.monotonic())
        return outcome(self, *args, **kwargs)

    Watch._outcome = timed  # type: ignore[method-assign]
    return starts


def _matrix_worker(world: int, victim: int, moment: str, how: str, out: str) -> None:
    """Two steps and a save of two_branch on `world` ranks; `victim` halts at `moment`.

    A survivor writes the seconds between the halt's step (or compile) and its error, the
    seconds its last wait lasted (its clock starts there, after the survivor's own work:
    tracing in compile, its stage's actions in a step), and the error, to out/rank<r>
    before raising it."""
    rank = int(os.environ["RANK"])
    waits = _clock_waits()
    if moment == "compile" and rank == victim:
        _halt(how)  # the others wait in the plan broadcast's rendezvous
    timeout = STALL if how == "stop" else SLOW
    model, inputs = ZOO["two_branch"]()
    start = time.monotonic()
    try:
        pm = gp_compile(
            model,
            inputs,
            loss_fn=dict_loss,
            optimizer=optimizer_for(),
            micro_batches=4,
            pins=MATRIX_PINS[world],
            runtime=RuntimeConfig(timeout=timeout),
        )
        inputs, target = batch("two_branch", 0)
        pm.step(*inputs, target=target)
        if rank == victim:
            _arm(pm, moment, how)
        start = time.monotonic()
        pm.step(*inputs, target=target)
        pm.save(os.path.join(out, "ckpt"))
    except PipelineError as exc:
        with open(os.path.join(out, f"rank{rank}"), "w") as f:
            fields = f"{exc.kind.value}|{exc.origin}|{exc.cause and exc.cause.value}|{exc.peers}"
            end = time.monotonic()
            f.write(f"{end - start} {end - waits[-1]}\n{fields}\n{exc}")
        raise


def _run_matrix(
    world: int, victim: int, moment: str, how: str, out: Path
) -> dict[int, tuple[float, float, str]]:
    """Each survivor's seconds to its error (from the halt's step or compile, and from the
    start of its last wait), and the error."""
    with pytest.raises(PipelineError) as err:
        args = (world, victim, moment, how, str(out))
        # survivors of a death raise within SETTLE s; of a stop, at their own timeout
        launch(_matrix_worker, world, args=args, timeout=LIMIT, grace=10 if how == "kill" else 2)
    assert multiprocessing.active_children() == []  # no process remains
    victim_line = next(p for p in err.value.problems if p.startswith(f"rank {victim}:"))
    if how == "kill":
        assert victim_line == f"rank {victim}: was killed by signal 9", err.value.problems
    reports = {r: (out / f"rank{r}").read_text() for r in range(world) if r != victim}
    times = {r: text.split("\n", 1)[0].split() for r, text in reports.items()}
    return {r: (float(times[r][0]), float(times[r][1]), text) for r, text in reports.items()}


@pytest.mark.parametrize(("world", "victim", "moment"), KILLS)
def test_a_rank_killed_anywhere_is_named_by_every_survivor_at_once(
    world: int, victim: int, moment: str, tmp_path: Path
) -> None:
    for rank, (seconds, _, report) in _run_matrix(world, victim, moment, "kill", tmp_path).items():
        assert seconds < 15, (rank, report)  # the timeout is 60 s
        assert f"another rank failed: rank {victim}: was killed by signal 9" in report
        assert report.split("\n")[1].startswith(f"echo|{victim}|died|"), (rank, report)


@pytest.mark.parametrize(("world", "victim", "moment"), STOPS)
def test_a_stopped_rank_is_named_by_every_survivor_within_the_timeout(
    world: int, victim: int, moment: str, tmp_path: Path
) -> None:
    for rank, (seconds, waited, report) in _run_matrix(
        world, victim, moment, "stop", tmp_path
    ).items():
        # no survivor names a stop before a whole timeout has passed since it
        assert seconds >= STALL, (rank, report)
        # its wait ends at the timeout (its own diagnosis, or the echo of another's), plus
        # the board's reads that name the stopped rank: 2 s is ample for those on a loaded
        # machine and below a second timeout (2 x STALL). Its own work before the wait
        # (tracing in compile: seconds under load) is not the naming's
        assert waited < STALL + 2 < 2 * STALL, (rank, report)
        assert f"rank {victim} waits for no rank and posted no failure" in report
        kind = report.split("\n")[1]  # its own diagnosis, or the first survivor's echoed
        assert kind == f"timed_out|None|None|({victim},)" or kind.startswith("echo|"), report
