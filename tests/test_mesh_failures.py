"""Failures under a ("pp", "dp") mesh: a rank that dies inside FSDP2's all-gather is named.

Four gloo processes on a (2, 2) mesh (tests/test_mesh.py's chain, pp ranks [[0, 1], [2, 3]]).
Global rank 3 (stage 1, dp index 1) exits hard the moment it enters FSDP2's all-gather of
its stage's parameters in step 2. Its dp peer, rank 2, is then inside the same all-gather
(a collective FSDP2 runs, not graphpipe's `guarded`), ranks 0 and 1 wait for stage 1 in a
receive. Every survivor must raise a PipelineError that names rank 3, long before the
runtime timeout, and `launch` must report rank 3's death first.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_mesh import PINS, _compile, batch, chain
from torch.distributed import TCPStore
from zoo import dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import FailureKind, PipelineError
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime import failures
from graphpipe.runtime.failures import FailureBoard, Watch
from graphpipe.runtime.launch import launch

VICTIM = 3  # global rank: stage 1, dp index 1
SLOW = 60  # RuntimeConfig.timeout of test_mesh's _compile: the survivors must not wait for it
LIMIT = 120  # seconds for the whole launch


def _dies_in_all_gather(clock: str) -> None:
    """Two steps of the chain on the mesh; rank VICTIM exits inside step 2's first
    all-gather (FSDP2 gathers each unit's parameters with `dist.all_gather_single`). The
    victim writes the time it dies, each survivor the time its step raised, under `clock`."""
    pm = _compile("chain", "1f1b", "mesh")
    inputs, target = batch("chain", 0)
    pm.step(*inputs, target=target)
    stamp = Path(clock) / str(dist.get_rank())
    if dist.get_rank() == VICTIM:

        def die(*args: object, **kwargs: object) -> None:
            stamp.write_text(str(time.time()))
            os._exit(9)

        dist.all_gather_single = die  # type: ignore[assignment]
    try:
        pm.step(*inputs, target=target)
    finally:
        stamp.write_text(str(time.time()))


def test_a_rank_dying_in_an_fsdp_all_gather_is_named_by_every_survivor(tmp_path: Path) -> None:
    with pytest.raises(PipelineError) as err:
        launch(_dies_in_all_gather, 4, args=(str(tmp_path),), timeout=LIMIT, grace=SLOW)
    e = err.value
    assert (e.kind, e.origin) == (FailureKind.DIED, VICTIM), e.problems
    assert e.problems[0].startswith(f"rank {VICTIM}: exited with code 9"), e.problems
    survivors = [line for line in e.problems if line.startswith(("rank 0:", "rank 1:", "rank 2:"))]
    assert len(survivors) == 3, e.problems
    for line in survivors:
        assert f"rank {VICTIM}: exited with code 9" in line, e.problems
    died = float((tmp_path / str(VICTIM)).read_text())
    for rank in (0, 1, 2):  # told, not left to time out
        took = float((tmp_path / str(rank)).read_text()) - died
        # after the death (an ordering), and before the SLOW s a survivor left waiting in the
        # all-gather would take; told by the failure watch, it takes under a second idle and
        # a few seconds on a loaded machine, so half of SLOW is room, not a tight margin
        assert 0 <= took < SLOW / 2, (rank, took)


STALL = 15.0  # RuntimeConfig.timeout of the stall: above compile's slowest wait here


def _stalls_in_all_gather() -> None:
    """Two steps of the chain on the mesh; rank VICTIM stops (SIGSTOP) the moment it enters
    step 2's first all-gather: alive, and silent."""
    model, inputs = chain()
    pm = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        micro_batches=2,
        pins=PINS["chain"],
        dp=2,
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=STALL),
    )
    inputs, target = batch("chain", 0)
    pm.step(*inputs, target=target)
    if dist.get_rank() == VICTIM:
        stop = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGSTOP)  # noqa: E731
        dist.all_gather_single = stop  # type: ignore[assignment]
    pm.step(*inputs, target=target)


def test_a_rank_stalled_in_an_fsdp_all_gather_is_named_after_the_timeout() -> None:
    """Its dp peer waits in the same all-gather under the watch (FSDP2's collectives are
    guarded), so it publishes whom it waits for: every survivor, rank 0 too (which waits
    for rank 2, not for the victim), names rank 3 at the timeout, and rank 2 says where it
    waited. Before, rank 2 sat in gloo's all-gather past the launcher's grace, and rank 0,
    timing out first, named rank 2 (which waited for nobody on the board)."""
    with pytest.raises(PipelineError) as err:
        launch(_stalls_in_all_gather, 4, timeout=LIMIT, grace=STALL)
    e = err.value
    assert e.kind is FailureKind.TIMED_OUT, e.problems
    survivors = [line for line in e.problems if line.startswith(("rank 0:", "rank 1:", "rank 2:"))]
    assert len(survivors) == 3, e.problems
    for line in survivors:
        assert f"rank {VICTIM} waits for no rank and posted no failure" in line, e.problems
    dp_peer = next(line for line in survivors if line.startswith("rank 2:"))
    assert "rank 2, FSDP2's all-gather of stage 1's parameters" in dp_peer, e.problems
    stopped = [line for line in e.problems if line.startswith(f"rank {VICTIM}: stopped")]
    assert stopped, e.problems  # by the launcher


def test_an_action_s_closed_connection_quotes_the_posted_death(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In one process (a board on a store of its own): gloo's closed connection inside an
    action is the death the launcher posted, not the action's own error."""
    store = TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    watch = Watch(FailureBoard(2, 4, store), timeout=5)
    monkeypatch.setattr(failures, "current_watch", lambda: watch)
    FailureBoard(-1, 4, store).post("rank 3: exited with code 9", FailureKind.DIED, rank=3)
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:29888")
    e = failures.action_failure("rank 2, action 1F0", closed, stage=1, micro_batch=0)
    assert (e.kind, e.rank, e.origin, e.cause) == (FailureKind.ECHO, 2, 3, FailureKind.DIED)
    assert str(e) == "rank 2, action 1F0: stopped, another rank failed: rank 3: exited with code 9"
    own = failures.action_failure("rank 2, action 1F0", RuntimeError("shapes"), stage=1)
    assert (own.kind, own.stage, str(own)) == (
        FailureKind.RAISED,
        1,
        "rank 2, action 1F0: RuntimeError: shapes",
    )
