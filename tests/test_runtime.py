"""Runtime: pipelined training equals single-process training, step after step.

Multi-process tests on CPU (gloo, one thread per process). Each launch has a timeout and the
launcher stops every child it started, whatever happens. A whole grid of models and schedules
runs inside one launch, to pay the process start-up once.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from training import (
    PINS,
    STEPS,
    TIMEOUT,
    M,
    assert_matches,
    batch,
    optimizer_for,
    replicated_plan,
    train,
    zoo_pipeline,
)
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.ir import Action
from graphpipe.runtime.comm import Buffers, outgoing, unpack
from graphpipe.runtime.launch import launch
from graphpipe.runtime.sync import GradSync

SCHEDULES = ("gpipe", "1f1b", "zb", "zb2")


def _grid_worker(cases: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], Any]:
    return {
        (name, schedule, kind): train(zoo_pipeline(name, schedule, kind), name, kind)
        for name, schedule, kind in cases
    }


@pytest.fixture(scope="module")
def grid() -> dict[tuple[str, str, str], Any]:
    cases = [(name, s, "sgd") for name in PINS for s in SCHEDULES]
    cases.append(("tied", "1f1b", "adam"))  # another optimizer, with an LR scheduler
    return launch(_grid_worker, 3, args=(cases,), timeout=TIMEOUT)[0]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", sorted(PINS))
def test_pipelined_training_matches_single_process(
    grid: dict[tuple[str, str, str], Any], name: str, schedule: str
) -> None:
    assert_matches(grid[(name, schedule, "sgd")], name)


def test_any_optimizer_with_an_lr_scheduler_on_pm_optimizer(
    grid: dict[tuple[str, str, str], Any],
) -> None:
    assert_matches(grid[("tied", "1f1b", "adam")], "tied", "adam")


def _nccl_form_worker(cases: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    return {
        (name, schedule): train(zoo_pipeline(name, schedule, prefetch=False), name)
        for name, schedule in cases
    }


def test_the_program_made_for_nccl_trains_the_same_on_gloo() -> None:
    """Receives posted where NCCL's lowering puts them, not all first as gloo allows."""
    cases = [
        ("two_branch", "1f1b"),
        ("skip_across", "zb"),
        ("tied", "gpipe"),
        ("late_input", "zb2"),
    ]
    results = launch(_nccl_form_worker, 3, args=(cases,), timeout=TIMEOUT)[0]
    for (name, _), result in results.items():
        assert_matches(result, name)


SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _count_host_syncs(pm: Any, name: str) -> int:
    """Device-to-host reads (`Tensor.item` and friends) during one step()."""
    count = 0
    originals = {m: getattr(torch.Tensor, m) for m in SYNCS}

    def counting(method: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            count += 1
            return method(*args, **kwargs)

        return wrapper

    inputs, target = batch(name, 0)
    try:
        for m, method in originals.items():
            setattr(torch.Tensor, m, counting(method))
        pm.step(*inputs, target=target)
    finally:
        for m, method in originals.items():
            setattr(torch.Tensor, m, method)
    return count


def _sync_worker() -> dict[int, tuple[int, int, int]]:
    counts = {}
    for m in (2, 8):
        # masked: S0 sends S1 three tensors in one message, S1 sends back two gradients
        pm = zoo_pipeline("masked", "zb", m=m)
        buffers = pm._executor.transport.buffers
        pm.step(*batch("masked", 1)[0], target=batch("masked", 1)[1])  # warm up
        first = buffers.made
        counts[m] = (_count_host_syncs(pm, "masked"), first, buffers.made - first)
    return counts


def test_a_warm_step_syncs_once_whatever_m_and_makes_no_message_buffer() -> None:
    """The loss is read once per step, whatever M: nothing in the micro-batch loop syncs; and
    every packing buffer of a step after the first is one a finished message handed back."""
    results = launch(_sync_worker, 3, timeout=TIMEOUT)
    for counts in results:
        assert counts[2][0] == counts[8][0] <= 2, counts
        assert counts[2][2] == counts[8][2] == 0, counts
    # the ranks of the 3-tensor edge pack (S0 its forwards, S1 its gradients); S2 never does
    assert [counts[8][1] > 0 for counts in results] == [True, True, False], results


def test_cpu_message_buffers_are_reused_once_handed_back_and_device_ones_never() -> None:
    pool = Buffers(torch.device("cpu"))
    a = pool.take(1000)
    assert pool.take(1000) is not a  # a is in use
    pool.give(a)
    assert pool.pooled_bytes == 1000
    assert pool.take(1000) is a
    assert pool.take(24).numel() == 24 and pool.made == 3
    meta = Buffers(torch.device("meta"))  # the caching allocator's job on an accelerator
    meta.give(meta.take(8))
    assert meta.pooled_bytes == 0 and meta.take(8).numel() == 8 and meta.made == 2


def test_one_tensor_goes_on_the_wire_as_its_own_bytes_and_several_are_packed() -> None:
    pool = Buffers(torch.device("cpu"))
    x = torch.randn(4, 8)
    wire, pooled = outgoing([x], pool)
    assert not pooled and wire.data_ptr() == x.data_ptr() and wire.numel() == x.nbytes
    ids = torch.arange(4)
    packed, pooled = outgoing([x, ids], pool)
    assert pooled and pool.made == 1 and packed.numel() == x.nbytes + ids.nbytes
    back = unpack(packed, [((4, 8), torch.float32), ((4,), torch.int64)])
    assert torch.equal(back[0], x) and torch.equal(back[1], ids)
    strided = x.t()  # not contiguous: its bytes in order, copied once
    wire, _ = outgoing([strided], pool)
    assert torch.equal(wire.view(torch.float32).reshape(8, 4), strided)


def _profiled_worker() -> dict[str, Any]:
    pm = zoo_pipeline("two_branch", "zb", timer="profiler")
    pm.recording = True
    inputs, target = batch("two_branch", 0)
    before = time.time()
    pm.step(*inputs, target=target)
    after = time.time()
    program = [str(op) for op in pm.program.ranks[pm.rank] if isinstance(op, Action)]
    spans = [s for s in pm.timeline().spans if s.rank == pm.rank]
    pm.recording = False
    with torch.profiler.profile() as prof:  # the user's own profiler sees the actions too
        pm.step(*inputs, target=target)
    labels = sorted(e.name for e in prof.events() if e.name.startswith("graphpipe::"))
    return {"program": program, "spans": spans, "before": before, "after": after, "labels": labels}


def test_the_profiler_timer_records_every_action_of_the_program() -> None:
    """With timer="profiler" (CUDA's default) the timeline comes from torch.profiler ranges:
    one span per compute and update action, in program order, on the Unix-epoch clock. A
    user's own profiler around step() sees one `graphpipe::` range per action as well (the
    executor labels actions only while a profiler records)."""
    for result in launch(_profiled_worker, 3, timeout=TIMEOUT):
        spans = result["spans"]
        assert [s.action for s in spans] == result["program"]
        assert all(result["before"] <= s.start <= s.end <= result["after"] for s in spans)
        assert all(a.end <= b.start + 1e-6 for a, b in itertools.pairwise(spans))
        assert result["labels"] == sorted(f"graphpipe::{a}" for a in result["program"])


def _replicated_worker() -> dict[str, Any]:
    model, inputs = ZOO["two_branch"]()
    the_plan = replicated_plan()
    pm = gp_compile(model, inputs, loss_fn=dict_loss, optimizer=optimizer_for(), plan=the_plan)
    early: list[int] = []  # buckets already in flight when each update began
    finish = GradSync.__call__

    def recording(sync: GradSync) -> None:
        early.append(sync.launched())
        finish(sync)

    GradSync.__call__ = recording  # type: ignore[method-assign]
    return {**train(pm, "two_branch"), "early": early}


def test_data_parallel_stage_reduces_gradients_within_its_group() -> None:
    """The replicas' sums equal one process, and they start during the last backward."""
    for rank, result in enumerate(launch(_replicated_worker, 3, timeout=TIMEOUT)):
        assert_matches(result, "two_branch")
        if rank < 2:  # the replicas: every bucket was launched before the update
            assert len(result["early"]) == STEPS and min(result["early"]) > 0, result["early"]


def _auto_plan_worker() -> dict[str, Any]:
    model, inputs = ZOO["two_branch"]()
    pm = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=optimizer_for(),
        micro_batches=M,
        schedule="1f1b",
        replication=False,
    )
    return {**train(pm, "two_branch"), "stages": len(pm.plan.stages)}


def test_two_ranks_with_the_plan_made_on_rank_0() -> None:
    results = launch(_auto_plan_worker, 2, timeout=TIMEOUT)
    assert results[0]["stages"] == 2
    assert_matches(results[1], "two_branch")


def _slow_plan_worker(delay: float) -> int:
    """Rank 0 plans for longer than the step timeout; the others must wait for it."""
    gp = sys.modules["graphpipe.compile.steps"]  # where rank 0 calls the partitioner
    if dist.get_rank() == 0:
        plan_it = gp.partition

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay)
            return plan_it(*args, **kwargs)

        gp.partition = slow  # type: ignore[assignment]
    model, inputs = ZOO["two_branch"]()
    pm = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=optimizer_for(),
        micro_batches=M,
        replication=False,
        runtime=RuntimeConfig(timeout=2, plan_timeout=60),
    )
    return len(pm.plan.stages)


def test_the_plan_broadcast_waits_as_long_as_planning_takes() -> None:
    stages = launch(_slow_plan_worker, 2, args=(6.0,), timeout=TIMEOUT, comm_timeout=2)
    assert stages[0] == stages[1] >= 2  # both ranks hold rank 0's plan, whatever its layout
