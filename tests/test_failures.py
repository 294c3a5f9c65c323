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

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from test_runtime import _optimizer, _pipeline, batch
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import PipelineError
from graphpipe.runtime.launch import launch
from graphpipe.runtime.pipeline import PipelinedModel

LIMIT = 120  # seconds for a whole launch
SLOW = 60  # RuntimeConfig.timeout where the survivors must not wait for it


def _failure(fault: str, victim: int, timeout: float = SLOW) -> None:
    """Train two steps of two_branch with `fault` injected on rank `victim`."""
    pm = _pipeline("two_branch", timeout=timeout)
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
    ("fault", "victim", "cause"),
    [
        ("raises_in_stage", 0, "rank 0, action 0F0: RuntimeError: boom in the stage"),
        ("dies_between_steps", 0, "rank 0: exited with code 7"),
        ("dies_in_state_dict_gather", 1, "rank 1: exited with code 6"),
    ],
)
def test_every_survivor_quotes_the_first_failure_at_once(
    fault: str, victim: int, cause: str
) -> None:
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        launch(_failure, 3, args=(fault, victim), timeout=LIMIT, grace=SLOW)
    assert time.monotonic() - start < SLOW / 2  # not after the timeout
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
            grace=5,
            comm_timeout=60,
        )
    assert time.monotonic() - start < 40
    survivors = _survivors(err, 1)
    assert len(survivors) == 2, err.value.problems
    for line in survivors:
        assert "the all-reduce of the loss" in line, err.value.problems
        assert "rank 1 waits for no rank and posted no failure" in line, err.value.problems


def test_a_failure_board_post_is_kept_and_causes_come_before_echoes() -> None:
    from torch.distributed import TCPStore

    from graphpipe.runtime.failures import FailureBoard

    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    mine, launcher = FailureBoard(0, 3, store), FailureBoard(-1, 3, store)
    assert mine.first() is None
    FailureBoard(1, 3, store).post("rank 1: stopped, another rank failed", "echo")
    assert mine.first() == "rank 1: stopped, another rank failed"
    launcher.post("rank 2: exited with code 9", "cause", rank=2)
    launcher.post("rank 2: a later post", "cause", rank=2)  # the first post is kept
    assert mine.first() == "rank 2: exited with code 9"
    FailureBoard(2, 3, store).set_waiting([0], "action 2RF0<0")
    assert FailureBoard(1, 3, store).blocking([2]) == (
        [0],
        ["rank 2 waits for rank 0 (action 2RF0<0)"],
    )


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


def _matrix_worker(world: int, victim: int, moment: str, how: str, out: str) -> None:
    """Two steps and a save of two_branch on `world` ranks; `victim` halts at `moment`.

    A survivor writes the seconds between the halt's step (or compile) and its error, and the
    error, to out/rank<r> before raising it."""
    rank = int(os.environ["RANK"])
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
            optimizer=_optimizer(),
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
            f.write(f"{time.monotonic() - start}\n{exc}")
        raise


def _run_matrix(
    world: int, victim: int, moment: str, how: str, out: Path
) -> dict[int, tuple[float, str]]:
    """Each survivor's seconds to its error, and the error."""
    with pytest.raises(PipelineError) as err:
        args = (world, victim, moment, how, str(out))
        # survivors of a death raise within SETTLE s; of a stop, at their own timeout
        launch(_matrix_worker, world, args=args, timeout=LIMIT, grace=10 if how == "kill" else 2)
    assert multiprocessing.active_children() == []  # no process remains
    victim_line = next(p for p in err.value.problems if p.startswith(f"rank {victim}:"))
    if how == "kill":
        assert victim_line == f"rank {victim}: was killed by signal 9", err.value.problems
    reports = {r: (out / f"rank{r}").read_text() for r in range(world) if r != victim}
    return {r: (float(text.split("\n", 1)[0]), text) for r, text in reports.items()}


@pytest.mark.parametrize(("world", "victim", "moment"), KILLS)
def test_a_rank_killed_anywhere_is_named_by_every_survivor_at_once(
    world: int, victim: int, moment: str, tmp_path: Path
) -> None:
    for rank, (seconds, report) in _run_matrix(world, victim, moment, "kill", tmp_path).items():
        assert seconds < 15, (rank, report)  # the timeout is 60 s
        assert f"another rank failed: rank {victim}: was killed by signal 9" in report


@pytest.mark.parametrize(("world", "victim", "moment"), STOPS)
def test_a_stopped_rank_is_named_by_every_survivor_within_the_timeout(
    world: int, victim: int, moment: str, tmp_path: Path
) -> None:
    for rank, (seconds, report) in _run_matrix(world, victim, moment, "stop", tmp_path).items():
        assert STALL <= seconds < STALL + 2, (rank, report)
        assert f"rank {victim} waits for no rank and posted no failure" in report
