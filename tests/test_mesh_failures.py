"""Failures under a ("pp", "dp") mesh: a rank that dies inside FSDP2's all-gather is named.

Four gloo processes on a (2, 2) mesh (tests/test_mesh.py's chain, pp ranks [[0, 1], [2, 3]]).
Global rank 3 (stage 1, dp index 1) exits hard the moment it enters FSDP2's all-gather of
its stage's parameters in step 2. Its dp peer, rank 2, is then inside the same all-gather
(a collective FSDP2 runs, not graphpipe's `guarded`), ranks 0 and 1 wait for stage 1 in a
receive. Every survivor must raise a PipelineError that names rank 3, long before the
runtime timeout, and `launch` must report rank 3's death first.
"""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
from test_mesh import _compile, batch
from torch.distributed import TCPStore

from graphpipe.errors import FailureKind, PipelineError
from graphpipe.runtime import failures
from graphpipe.runtime.failures import FailureBoard, Watch
from graphpipe.runtime.launch import launch

VICTIM = 3  # global rank: stage 1, dp index 1
SLOW = 60  # RuntimeConfig.timeout of test_mesh's _compile: the survivors must not wait for it
LIMIT = 120  # seconds for the whole launch


def _dies_in_all_gather() -> None:
    """Two steps of the chain on the mesh; rank VICTIM exits inside step 2's first
    all-gather (FSDP2 gathers each unit's parameters with `dist.all_gather_single`)."""
    pm = _compile("chain", "1f1b", "mesh")
    inputs, target = batch("chain", 0)
    pm.step(*inputs, target=target)
    if dist.get_rank() == VICTIM:
        dist.all_gather_single = lambda *args, **kwargs: os._exit(9)  # type: ignore[assignment]
    pm.step(*inputs, target=target)


def test_a_rank_dying_in_an_fsdp_all_gather_is_named_by_every_survivor() -> None:
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        launch(_dies_in_all_gather, 4, timeout=LIMIT, grace=SLOW)
    took = time.monotonic() - start
    e = err.value
    assert took < SLOW / 2, (took, e.problems)  # at once, not after the timeout
    assert (e.kind, e.origin) == (FailureKind.DIED, VICTIM), e.problems
    assert e.problems[0].startswith(f"rank {VICTIM}: exited with code 9"), e.problems
    survivors = [line for line in e.problems if line.startswith(("rank 0:", "rank 1:", "rank 2:"))]
    assert len(survivors) == 3, e.problems
    for line in survivors:
        assert f"rank {VICTIM}: exited with code 9" in line, e.problems


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
