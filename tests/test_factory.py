"""Stage factories (`graphpipe.runtime.factory`): emulation chosen once, from
`RuntimeConfig.emulate`, as the stages a run builds and what ends each action; the executor
knows nothing of it. And the runtime's pieces (`graphpipe.runtime.pieces`) as a consumer
reads them (`Programs` from a `Run` alone).
"""

from __future__ import annotations

import ast
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from graphpipe.ir import Plan
from graphpipe.planning.partition import plan
from graphpipe.runtime import executor
from graphpipe.runtime.emulate import Emulate, EmulatedStage, emulated_specs
from graphpipe.runtime.executor import host_only
from graphpipe.runtime.factory import EmulatedStages, RealStages, stage_factory
from graphpipe.runtime.pieces import Run
from graphpipe.runtime.refusals import refusal
from graphpipe.runtime.stage import Specs, build_stage, micro_shapes
from graphpipe.runtime.stepping import Programs
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.program import lower
from graphpipe.tracing.tracer import trace

M = 4  # micro-batches of 4 rows: the example's 16 rows
CPU = torch.device("cpu")


def _carved() -> tuple[Any, Plan, dict[int, Any], Callable[[], Specs], list[int]]:
    """A two-stage chain's trace, plan, carved stages, its shapes' computation, and how
    many times that ran."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
    x = torch.randn(16, 32)
    the_plan = plan(model, x, devices=2, micro_batches=M, pins={"0": 0, "1": 0, "2": 1})
    assert len(the_plan.stages) == 2
    gm = trace(model, x, micro_batch_size=16 // M)
    carved = {s.index: build_stage(gm, the_plan, s.index) for s in the_plan.stages}
    calls: list[int] = []

    def shapes() -> Specs:
        calls.append(1)
        return micro_shapes(gm, (x,), 16 // M)

    return gm, the_plan, carved, shapes, calls


def test_without_emulate_the_stages_are_the_carved_ones_and_actions_end_with_the_host() -> None:
    gm, the_plan, carved, shapes, calls = _carved()
    factory = stage_factory(None)
    assert isinstance(factory, RealStages)
    assert factory.fixed_shapes is None and factory.action_end is host_only
    modules, specs = factory.build(gm, the_plan, carved, (1,), CPU, shapes, False)
    assert modules is carved and specs == shapes()
    idle, none = factory.build(gm, the_plan, carved, (), CPU, shapes, False)
    assert idle is carved and none == {} and len(calls) == 2  # an idle rank needs no shapes


def test_emulate_builds_every_stages_stand_in_other_ranks_on_meta_with_scaled_specs() -> None:
    gm, the_plan, carved, shapes, _ = _carved()
    emulate = Emulate(byte_scale=4)
    factory = stage_factory(emulate)
    assert isinstance(factory, EmulatedStages)
    assert factory.fixed_shapes == refusal("emulated-shapes", "emulate=")
    assert factory.action_end is host_only  # "serial": each wait is in the stage
    modules, specs = factory.build(gm, the_plan, carved, (1,), CPU, shapes, True)
    assert sorted(modules) == [0, 1]
    assert all(isinstance(m, EmulatedStage) for m, _ in modules.values())
    assert [modules[i][1] for i in (0, 1)] == [carved[i][1] for i in (0, 1)]  # same StageIO
    assert modules[0][0].device.type == "meta" and modules[1][0].device == CPU
    # what crosses stages is flat and scaled; the rest (the model output: the loss reads
    # it) keeps its shape
    crossing = {n for _, io in carved.values() for n in io.sent}
    real = shapes()
    assert crossing and "output" in real and "output" not in crossing
    assert specs == {
        n: emulated_specs({n: s}, emulate)[n] if n in crossing else s for n, s in real.items()
    }
    assert factory.materialize(nn.Linear(2, 2), modules[1][0], CPU, None, None) == []
    idle, _ = factory.build(gm, the_plan, carved, (), CPU, shapes, False)
    assert all(isinstance(m, EmulatedStage) for m, _ in idle.values())  # every rank's too


def test_overlapped_emulation_ends_an_action_once_its_device_time_has_passed() -> None:
    gm, the_plan, carved, shapes, _ = _carved()
    factory = stage_factory(Emulate(host="overlapped"))
    assert isinstance(factory, EmulatedStages) and factory.clock is not None
    modules, _ = factory.build(gm, the_plan, carved, (0, 1), CPU, shapes, False)
    assert all(m.clock is factory.clock for m, _ in modules.values())  # one per rank
    factory.clock.owe(0.02)
    start = time.perf_counter()
    factory.action_end(start)
    assert time.perf_counter() >= start + 0.02  # a lower bound: a loaded host only adds
    assert factory.clock.owed == 0.0  # the next action starts at 0


def test_the_executor_imports_nothing_of_emulation() -> None:
    source = inspect.getsource(executor)
    imported = {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert "graphpipe.runtime.emulate" not in imported
    assert "graphpipe.runtime.factory" not in imported
    assert "emulat" not in source.lower()  # no flag, no type, not even a mention


def test_programs_read_a_run_alone() -> None:
    _, the_plan, _, _, _ = _carved()
    flushed = make_schedule(the_plan, "1f1b", M)
    program = lower(the_plan, flushed, prefetch=False)
    run = Run(the_plan, flushed, M, program, False, None)
    assert not run.asynchronous
    assert Programs(run, 1).for_call(3) is program.ranks[1]  # every call the same program
    first = make_schedule(the_plan, "async", M)
    run = Run(the_plan, first, M, lower(the_plan, first, prefetch=False), False, None)
    assert run.asynchronous
    second = Programs(run, 0).for_call(1)  # call 1: micro-batches M..2M-1
    expected = lower(the_plan, make_schedule(the_plan, "async", M, first_call=1)).ranks[0]
    assert [str(op) for op in second] == [str(op) for op in expected]
