"""The zoo's training case shared by the runtime tests: three ranks cut by each model's pins,
the mini-batches, the single-process reference with gradient accumulation, and the
comparison (no test module imports another)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.planning.assemble import assemble
from graphpipe.planning.manual import groups_from_pins
from graphpipe.planning.opgraph import graph_hash, op_graph
from graphpipe.planning.partition import PlanConfig, cost_model, plan
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.tracing.tracer import trace

__all__ = [
    "LR",
    "PINS",
    "STEPS",
    "TIMEOUT",
    "M",
    "assert_matches",
    "batch",
    "optimizer_for",
    "reference",
    "replicated_plan",
    "scheduler_for",
    "train",
    "zoo_pipeline",
]


M, STEPS, LR = 4, 3, 0.1


PINS = {  # three stages each, chosen so each model shows its hard case
    "two_branch": {"a": 0, "b": 1, "cat": 2, "head": 2},  # fan-out and fan-in
    "skip_across": {"layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 2, "head": 2},
    "late_input": {"layers.0": 0, "layers.1": 1, "layers.2": 1, "head": 2},  # input at S2
    "tied": {"embed": 0, "body": 1, "out": 2},  # embed.weight on S0 and S2
    "multi_output": {"trunk": 0, "left": 1, "right": 2},  # outputs made on S1 and S2
    "masked": {"embed": 0, "mix": 1, "head": 2},  # int64 and bool values cross stages
}


TIMEOUT = 240  # seconds for a whole launch


def optimizer_for(kind: str = "sgd") -> functools.partial[torch.optim.Optimizer]:
    if kind == "adam":
        return functools.partial(torch.optim.Adam, lr=0.01)
    return functools.partial(torch.optim.SGD, lr=LR, momentum=0.9)


def scheduler_for(opt: torch.optim.Optimizer, kind: str) -> Any:
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
    opt = optimizer_for(kind)(model.parameters())
    scheduler = scheduler_for(opt, kind)
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


def train(pm: Any, name: str, kind: str = "sgd") -> dict[str, Any]:
    scheduler = scheduler_for(pm.optimizer, kind)
    losses = []
    for s in range(STEPS):
        losses.append(pm.step(*batch(name, s)[0], target=batch(name, s)[1]))
        if scheduler is not None:
            scheduler.step()
    return {"losses": losses, "state": pm.state_dict(), "output": pm(*batch(name, 0)[0])}


def zoo_pipeline(
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
        optimizer=optimizer_for(kind),
        schedule=schedule,
        plan=the_plan,
        runtime=RuntimeConfig(timeout=timeout, prefetch=prefetch, timer=timer),
    )


def assert_matches(result: dict[str, Any], name: str, kind: str = "sgd") -> None:
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


def replicated_plan() -> Any:
    """two_branch with stage 0 (both branches) on ranks 0 and 1, the head on rank 2."""
    model, inputs = ZOO["two_branch"]()
    gm = trace(model, inputs)
    g = op_graph(gm, profile(gm, inputs, 2, ProfileConfig(mode="flops")))  # same on every rank
    (branches, _), (head, _) = groups_from_pins(g, {"a": 0, "b": 0, "cat": 1, "head": 1})
    config = PlanConfig(devices=3, micro_batches=M)
    return assemble(
        g, [(branches, 2), (head, 1)], cost_model(config, 2), 3, "manual", graph_hash(gm)
    )
