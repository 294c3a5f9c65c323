"""Runtime: pipelined training equals single-process training, step after step.

Multi-process tests on CPU (gloo, one thread per process). Each launch has a timeout and the
launcher stops every child it started, whatever happens. A whole grid of models and schedules
runs inside one launch, to pay the process start-up once.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.ir import Action
from graphpipe.planning.assemble import assemble
from graphpipe.planning.manual import groups_from_pins
from graphpipe.planning.opgraph import graph_hash, op_graph
from graphpipe.planning.partition import PlanConfig, cost_model, plan
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.runtime.comm import Buffers, outgoing, unpack
from graphpipe.runtime.launch import launch
from graphpipe.runtime.sync import GradSync
from graphpipe.tracing.tracer import trace

M, STEPS, LR = 4, 3, 0.1
PINS = {  # three stages each, chosen so each model shows its hard case
    "two_branch": {"a": 0, "b": 1, "cat": 2, "head": 2},  # fan-out and fan-in
    "skip_across": {"layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 2, "head": 2},
    "late_input": {"layers.0": 0, "layers.1": 1, "layers.2": 1, "head": 2},  # input at S2
    "tied": {"embed": 0, "body": 1, "out": 2},  # embed.weight on S0 and S2
    "multi_output": {"trunk": 0, "left": 1, "right": 2},  # outputs made on S1 and S2
    "masked": {"embed": 0, "mix": 1, "head": 2},  # int64 and bool values cross stages
}
SCHEDULES = ("gpipe", "1f1b", "zb", "zb2")
TIMEOUT = 240  # seconds for a whole launch


def _optimizer(kind: str = "sgd") -> functools.partial[torch.optim.Optimizer]:
    if kind == "adam":
        return functools.partial(torch.optim.Adam, lr=0.01)
    return functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)


def _scheduler(opt: torch.optim.Optimizer, kind: str) -> Any:
    """Adam runs with a StepLR that halves the rate every step; SGD with none."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if kind == "adam" else None


def batch(name: str, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Step `step`'s mini-batch: fresh float inputs and a target shaped for dict_loss."""
    model, inputs = ZOO[name]()
    gen = torch.Generator().manual_seed(1000 + step)
    fresh = tuple(
        torch.randn(x.shape, generator=gen) if x.is_floating_point() else x for x in inputs
    )
    with torch.no_grad():
        out = model(*fresh)
    shape = out.shape if isinstance(out, torch.Tensor) else (fresh[0].shape[0], 1)
    return fresh, torch.randn(shape, generator=gen)


def reference(name: str, steps: int = STEPS, kind: str = "sgd") -> tuple[list[float], nn.Module]:
    """Single-process training with gradient accumulation over the same micro-batches."""
    model, _ = ZOO[name]()
    opt = _optimizer(kind)(model.parameters())
    scheduler = _scheduler(opt, kind)
    losses = []
    for step in range(steps):
        inputs, target = batch(name, step)
        parts = [x.chunk(M) for x in inputs]
        total = 0.0
        for j in range(M):
            loss = dict_loss(model(*[p[j] for p in parts]), target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / M)
    return losses, model


def _train(pm: Any, name: str, kind: str = "sgd") -> dict[str, Any]:
    scheduler = _scheduler(pm.optimizer, kind)
    losses = []
    for s in range(STEPS):
        losses.append(pm.step(*batch(name, s)[0], target=batch(name, s)[1]))
        if scheduler is not None:
            scheduler.step()
    return {"losses": losses, "state": pm.state_dict(), "output": pm(*batch(name, 0)[0])}


def _pipeline(
    name: str,
    schedule: str = "1f1b",
    kind: str = "sgd",
    timeout: float = 60,
    prefetch: bool | None = None,
    m: int = M,
    timer: str | None = None,
) -> Any:
    """`name` compiled over three ranks, cut by its pins."""
    model, inputs = ZOO[name]()
    the_plan = plan(model, inputs, devices=3, micro_batches=m, pins=PINS[name])
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=_optimizer(kind),
        schedule=schedule,
        plan=the_plan,
        runtime=RuntimeConfig(timeout=timeout, prefetch=prefetch, timer=timer),
    )


def _grid_worker(cases: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], Any]:
    return {
        (name, schedule, kind): _train(_pipeline(name, schedule, kind), name, kind)
        for name, schedule, kind in cases
    }


@pytest.fixture(scope="module")
def grid() -> dict[tuple[str, str, str], Any]:
    cases = [(name, s, "sgd") for name in PINS for s in SCHEDULES]
    cases.append(("tied", "1f1b", "adam"))  # another optimizer, with an LR scheduler
    return launch(_grid_worker, 3, args=(cases,), timeout=TIMEOUT)[0]


def _assert_matches(result: dict[str, Any], name: str, kind: str = "sgd") -> None:
    ref_losses, ref_model = reference(name, kind=kind)
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    ref_state = ref_model.state_dict()
    assert list(result["state"]) == list(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6)
    fresh, _ = ZOO[name]()
    fresh.load_state_dict(result["state"])  # strict: every original name is there
    with torch.no_grad():
        torch.testing.assert_close(
            result["output"], ref_model(*batch(name, 0)[0]), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", sorted(PINS))
def test_pipelined_training_matches_single_process(
    grid: dict[tuple[str, str, str], Any], name: str, schedule: str
) -> None:
    _assert_matches(grid[(name, schedule, "sgd")], name)


def test_any_optimizer_with_an_lr_scheduler_on_pm_optimizer(
    grid: dict[tuple[str, str, str], Any],
) -> None:
    _assert_matches(grid[("tied", "1f1b", "adam")], "tied", "adam")


def _nccl_form_worker(cases: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    return {
        (name, schedule): _train(_pipeline(name, schedule, prefetch=False), name)
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
        _assert_matches(result, name)


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
        pm = _pipeline("masked", "zb", m=m)
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
    pm = _pipeline("two_branch", "zb", timer="profiler")
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


def _replicated_plan() -> Any:
    """two_branch with stage 0 (both branches) on ranks 0 and 1, the head on rank 2."""
    model, inputs = ZOO["two_branch"]()
    gm = trace(model, inputs)
    g = op_graph(gm, profile(gm, inputs, 2, ProfileConfig(mode="flops")))  # same on every rank
    (branches, _), (head, _) = groups_from_pins(g, {"a": 0, "b": 0, "cat": 1, "head": 1})
    config = PlanConfig(devices=3, micro_batches=M)
    return assemble(
        g, [(branches, 2), (head, 1)], cost_model(config, 2), 3, "manual", graph_hash(gm)
    )


def _replicated_worker() -> dict[str, Any]:
    model, inputs = ZOO["two_branch"]()
    the_plan = _replicated_plan()
    pm = gp_compile(model, inputs, loss_fn=dict_loss, optimizer=_optimizer(), plan=the_plan)
    early: list[int] = []  # buckets already in flight when each update began
    finish = GradSync.__call__

    def recording(sync: GradSync) -> None:
        early.append(sync.launched())
        finish(sync)

    GradSync.__call__ = recording  # type: ignore[method-assign]
    return {**_train(pm, "two_branch"), "early": early}


def test_data_parallel_stage_reduces_gradients_within_its_group() -> None:
    """The replicas' sums equal one process, and they start during the last backward."""
    for rank, result in enumerate(launch(_replicated_worker, 3, timeout=TIMEOUT)):
        _assert_matches(result, "two_branch")
        if rank < 2:  # the replicas: every bucket was launched before the update
            assert len(result["early"]) == STEPS and min(result["early"]) > 0, result["early"]


def _auto_plan_worker() -> dict[str, Any]:
    model, inputs = ZOO["two_branch"]()
    pm = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=_optimizer(),
        micro_batches=M,
        schedule="1f1b",
        replication=False,
    )
    return {**_train(pm, "two_branch"), "stages": len(pm.plan.stages)}


def test_two_ranks_with_the_plan_made_on_rank_0() -> None:
    results = launch(_auto_plan_worker, 2, timeout=TIMEOUT)
    assert results[0]["stages"] == 2
    _assert_matches(results[1], "two_branch")


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
        optimizer=_optimizer(),
        micro_batches=M,
        replication=False,
        runtime=RuntimeConfig(timeout=2, plan_timeout=60),
    )
    return len(pm.plan.stages)


def test_the_plan_broadcast_waits_as_long_as_planning_takes() -> None:
    stages = launch(_slow_plan_worker, 2, args=(6.0,), timeout=TIMEOUT, comm_timeout=2)
    assert stages[0] == stages[1] >= 2  # both ranks hold rank 0's plan, whatever its layout
