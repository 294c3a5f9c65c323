"""Failures: every rank names the rank that failed first, at once, whatever failed where.

Each test injects one fault into a 3-rank pipeline (two_branch: rank 0 and 1 the branches,
rank 2 the head and the loss) and checks what every rank reports through `launch`: the
survivors stop well before the timeout and quote the failing rank, never a live neighbour.
The timeouts are generous: only the stall tests wait for one, and they state its length.
"""

from __future__ import annotations

import os
import time

import pytest
from test_runtime import _optimizer, _pipeline, batch
from zoo import ZOO, dict_loss

from graphpipe.compile import compile as gp_compile
from graphpipe.errors import PipelineError
from graphpipe.launch import launch
from graphpipe.runtime.pipeline import PipelinedModel

LIMIT = 120  # seconds for a whole launch
SLOW = 60  # RuntimeConfig.timeout where the survivors must not wait for it


def _failure(fault: str, victim: int, timeout: float = SLOW) -> None:
    """Train two steps of two_branch with `fault` injected on rank `victim`."""
    if fault == "dies_in_plan_broadcast" and int(os.environ["RANK"]) == victim:
        os._exit(3)  # before compile: the others wait in the plan broadcast
    if fault == "dies_in_plan_broadcast":
        model, inputs = ZOO["two_branch"]()
        gp_compile(model, inputs, loss_fn=dict_loss, optimizer=_optimizer(), micro_batches=4)
        return
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
    elif fault == "dies_in_loss_all_reduce":
        pm._all_reduce = lambda t, what: os._exit(5)  # type: ignore[method-assign]
    elif fault == "dies_in_state_dict_gather":
        pm._gather = lambda mine, what: os._exit(6)  # type: ignore[method-assign]
    elif fault == "stalls_before_loss_all_reduce":  # alive, never joins the all-reduce
        pm._all_reduce = lambda t, what: time.sleep(600)  # type: ignore[method-assign]


def _survivors(err: pytest.ExceptionInfo[PipelineError], victim: int) -> list[str]:
    lines = [line for line in err.value.problems if not line.startswith(f"rank {victim}:")]
    return [line for line in lines if line.startswith("rank ") and ": " in line][:2]


@pytest.mark.parametrize(
    ("fault", "victim", "cause"),
    [
        ("raises_in_stage", 0, "rank 0, action 0F0: RuntimeError: boom in the stage"),
        ("dies_between_steps", 0, "rank 0: exited with code 7"),
        ("dies_in_loss_all_reduce", 2, "rank 2: exited with code 5"),
        ("dies_in_plan_broadcast", 0, "rank 0: exited with code 3"),
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
