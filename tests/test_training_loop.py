"""What a training loop expects: global gradient clipping equal to `clip_grad_norm_` on one
process, with tied weights across ranks and a replicated stage in the pipeline; evaluation
that leaves the training state alone under every weight policy."""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from training import PINS, STEPS, M, batch, optimizer_for, replicated_plan
from zoo import ZOO, dict_loss

from graphpipe.compile import _scheduled
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError, ScheduleError
from graphpipe.ir.cost import MemoryModel
from graphpipe.planning.partition import plan
from graphpipe.planning.recompute import choose_recompute
from graphpipe.runtime import stepping
from graphpipe.runtime.clip import check_clipping
from graphpipe.runtime.executor import Batch
from graphpipe.runtime.launch import launch
from graphpipe.runtime.spec import RunSpec
from graphpipe.scheduling.simulate import simulate

TIMEOUT = 240
CLIP_CASES = {  # name -> (model, max norm, norm type, plan)
    "tied": ("tied", 0.05, 2.0, "pins"),  # embed.weight on stages 0 and 2 (ranks 0 and 2)
    "replicated": ("two_branch", 0.05, 2.0, "replicated"),  # stage 0 on ranks 0 and 1
    "inf": ("skip_across", 0.01, math.inf, "pins"),
}


def _clipped_reference(name: str, max_norm: float, norm_type: float) -> dict[str, Any]:
    model, _ = ZOO[name]()
    opt = optimizer_for()(model.parameters())
    norms, losses = [], []
    for step in range(STEPS):
        inputs, target = batch(name, step)
        parts = [x.chunk(M) for x in inputs]
        total = 0.0
        for j in range(M):
            loss = dict_loss(model(*[p[j] for p in parts]), target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def _clip_worker() -> dict[str, Any]:
    out = {}
    for case, (name, max_norm, norm_type, how) in CLIP_CASES.items():
        model, inputs = ZOO[name]()
        the_plan = (
            replicated_plan()
            if how == "replicated"
            else plan(model, inputs, devices=3, micro_batches=M, pins=PINS[name])
        )
        pm = gp_compile(
            model,
            inputs,
            loss_fn=dict_loss,
            optimizer=optimizer_for(),
            plan=the_plan,
            max_grad_norm=max_norm,
            grad_norm_type=norm_type,
        )
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(pm.step(*batch(name, step)[0], target=batch(name, step)[1]))
            norms.append(pm.last_grad_norm)
        out[case] = {"losses": losses, "norms": norms, "state": pm.state_dict()}
    return out


@pytest.fixture(scope="module")
def clipped() -> list[dict[str, Any]]:
    return launch(_clip_worker, 3, timeout=TIMEOUT)


@pytest.mark.parametrize("case", sorted(CLIP_CASES))
def test_clipping_equals_clip_grad_norm_on_one_process(
    clipped: list[dict[str, Any]], case: str
) -> None:
    name, max_norm, norm_type, _ = CLIP_CASES[case]
    ref = _clipped_reference(name, max_norm, norm_type)
    assert all(n > max_norm for n in ref["norms"])  # the clipping is active in every step
    for rank_result in clipped:
        result = rank_result[case]
        assert result["norms"] == pytest.approx(ref["norms"], rel=1e-5)  # the same on every rank
        assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        for key, value in ref["state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("max_norm", "norm_type", "weights", "match"),
    [
        (0.0, 2.0, "flush", "max_grad_norm must be positive, got 0.0"),
        (-1.0, 2.0, "flush", "got -1.0"),
        (1.0, 0.0, "flush", "grad_norm_type must be positive"),
        (1.0, 2.0, "stash", "weights='stash'"),
        (1.0, 2.0, "pipemare", "weights='pipemare'"),
    ],
)
def test_bad_clipping_is_refused_naming_the_value(
    max_norm: float, norm_type: float, weights: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        check_clipping(max_norm, norm_type, weights)


# -- evaluation --------------------------------------------------------------------------------


class Noisy(nn.Module):
    """BatchNorm and dropout: a model whose eval mode differs from its training mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(self.a(x)))


NOISY_PINS = {"a": 0, "drop": 1, "b": 1}
POLICIES = ("flush", "stash", "2bw", "pipemare")


def _noisy_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


def _snapshot(pm: Any) -> dict[str, Any]:
    return {
        "module": {k: v.clone() for k, v in pm.module.state_dict().items()},
        "grads": [None if p.grad is None else p.grad.clone() for p in pm.module.parameters()],
        "optimizer": copy.deepcopy(pm.optimizer.state_dict()),
        "versions": copy.deepcopy(pm.versions()),
        "training": [m.training for m in pm.module.modules()],
    }


def _eval_worker() -> dict[str, Any]:
    out = {}
    for weights in POLICIES:
        model = Noisy()
        x, _ = _noisy_batch(0)
        pm = gp_compile(
            model,
            x,
            loss_fn=F.mse_loss,
            optimizer=optimizer_for(),
            micro_batches=2,
            weights=weights,
            pins=NOISY_PINS,
        )
        torch.manual_seed(1)  # dropout masks
        for step in range(2):
            pm.step(_noisy_batch(step)[0], target=_noisy_batch(step)[1])
        before = _snapshot(pm)
        x, y = _noisy_batch(9)
        loss, output = pm.eval_step(x, target=y), pm(x)
        again = pm.eval_step(x, target=y)  # no dropout: the same value twice
        out[weights] = {"before": before, "after": _snapshot(pm), "loss": loss}
        out[weights] |= {"again": again, "output": output}
        if weights == "flush":
            out[weights]["state"] = pm.state_dict()
    return out


@pytest.fixture(scope="module")
def evaluated() -> list[dict[str, Any]]:
    return launch(_eval_worker, 2, timeout=TIMEOUT)


@pytest.mark.parametrize("weights", POLICIES)
def test_eval_leaves_weights_gradients_optimizer_and_versions_alone(
    evaluated: list[dict[str, Any]], weights: str
) -> None:
    for rank in evaluated:
        result = rank[weights]
        before, after = result["before"], result["after"]
        assert before["training"] == after["training"] and all(after["training"])
        for k, v in before["module"].items():  # parameters and BatchNorm's running stats
            assert torch.equal(v, after["module"][k]), k
        for g0, g1 in zip(before["grads"], after["grads"], strict=True):
            assert (g0 is None and g1 is None) or torch.equal(g0, g1)
        assert repr(before["optimizer"]) == repr(after["optimizer"])
        assert before["versions"] == after["versions"]
        assert result["loss"] == result["again"]


def test_eval_step_and_call_equal_the_model_in_eval_mode(evaluated: list[dict[str, Any]]) -> None:
    result = evaluated[0]["flush"]
    model = Noisy()
    model.load_state_dict(result["state"])  # the trained weights and running statistics
    model.eval()
    x, y = _noisy_batch(9)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(result["output"], expected, rtol=1e-5, atol=1e-6)
    # the mean of the micro-batch losses: the batch's mean loss for an equal split
    assert result["loss"] == pytest.approx(F.mse_loss(expected, y).item(), rel=1e-5)


# -- torch.compile per stage -------------------------------------------------------------------


def _compiled_worker() -> dict[str, Any]:
    torch._dynamo.reset()
    out = {}
    for compiled in (False, True):
        model, inputs = ZOO["two_branch"]()
        pm = gp_compile(
            model,
            inputs,
            loss_fn=dict_loss,
            optimizer=optimizer_for(),
            micro_batches=M,
            pins={"a": 0, "b": 0, "cat": 1, "head": 1},
            compile_stages=compiled,
        )
        losses = [
            pm.step(*batch("two_branch", s)[0], target=batch("two_branch", s)[1]) for s in range(2)
        ]
        out[compiled] = {"losses": losses, "state": pm.state_dict()}
        out[compiled]["compiled"] = getattr(pm.module, "_compiled_call_impl", None) is not None
        out[compiled]["graphs"] = counters["stats"]["unique_graphs"]  # dynamo's, so far
    return out


def test_compiled_stages_train_like_uncompiled_ones() -> None:
    """torch.compile (inductor, on the CPU) on each stage: the same losses and parameters, the
    same state dict keys."""
    for result in launch(_compiled_worker, 2, timeout=600):
        plain, compiled = result[False], result[True]
        assert compiled["compiled"] and not plain["compiled"]
        assert plain["graphs"] == 0 < compiled["graphs"]  # the stage really ran compiled
        assert compiled["losses"] == pytest.approx(plain["losses"], rel=1e-5)
        assert list(compiled["state"]) == list(plain["state"])
        for key, value in plain["state"].items():
            torch.testing.assert_close(compiled["state"][key], value, rtol=1e-5, atol=1e-6)


def test_a_step_at_new_shapes_with_compiled_stages_waits_up_to_the_plan_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """inductor compiles a stage on its first step at new shapes, and a peer's receive waits
    for it: that step's waits get the plan's limit (a loaded machine compiled for over the
    60 s receive timeout), later steps the runtime's."""
    asked: list[float] = []

    def longer(seconds: float) -> contextlib.AbstractContextManager[None]:
        asked.append(seconds)
        return contextlib.nullcontext()

    monkeypatch.setattr(stepping, "longer_waits", longer)
    stepper = stepping.Stepper.__new__(stepping.Stepper)
    stepper.compile_wait, stepper._stepped = 1800.0, set()
    for _ in range(3):
        with stepper._compiling(Batch(0, {}, None)):
            pass
    assert asked == [1800.0]
    stepper.compile_wait = None  # not compiled: every step waits the runtime's timeout
    stepper._stepped.clear()
    with stepper._compiling(Batch(0, {}, None)):
        pass
    assert asked == [1800.0]


def test_compiled_stages_refuse_a_split_backward() -> None:
    model, inputs = ZOO["two_branch"]()
    with pytest.raises(ConfigError, match="schedule='zb'"):
        gp_compile(
            model,
            inputs,
            loss_fn=dict_loss,
            optimizer=optimizer_for(),
            schedule="zb",
            compile_stages=True,
        )


# -- recomputation -----------------------------------------------------------------------------


def _saved_bytes(pm: Any, name: str) -> int:
    """Bytes autograd saves for the backward during one step, outside checkpointed regions
    (a checkpointed forward saves through its own hooks, inside ours)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.step(*batch(name, 5)[0], target=batch(name, 5)[1])
    return total


def _recompute_worker() -> dict[Any, Any]:
    out = {}
    for schedule in ("1f1b", "zb"):
        for recompute in (False, True):
            model, inputs = ZOO["two_branch"]()
            pm = gp_compile(
                model,
                inputs,
                loss_fn=dict_loss,
                optimizer=optimizer_for(),
                schedule=schedule,
                plan=plan(model, inputs, devices=3, micro_batches=M, pins=PINS["two_branch"]),
                recompute=recompute,
            )
            losses = [
                pm.step(*batch("two_branch", s)[0], target=batch("two_branch", s)[1])
                for s in range(STEPS)
            ]
            saved = _saved_bytes(pm, "two_branch")
            stage = pm.plan.stages[pm.rank]
            out[(schedule, recompute)] = {
                "losses": losses,
                "state": pm.state_dict(),
                "saved": saved,
                "predicted": stage.activation_bytes,
                "flag": stage.recompute,
            }
    return out


@pytest.fixture(scope="module")
def recomputed() -> list[dict[Any, Any]]:
    return launch(_recompute_worker, 3, timeout=TIMEOUT)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_recompute_trains_exactly_like_no_recompute(
    recomputed: list[dict[Any, Any]], schedule: str
) -> None:
    for rank in recomputed:
        plain, again = rank[(schedule, False)], rank[(schedule, True)]
        assert again["flag"] and not plain["flag"]
        assert again["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        for key, value in plain["state"].items():
            torch.testing.assert_close(again["state"][key], value, rtol=1e-6, atol=1e-7)


def test_recompute_saves_the_memory_the_model_predicts(recomputed: list[dict[Any, Any]]) -> None:
    """Measured: the bytes autograd saves during a step; predicted: the stage's activation
    bytes per micro-batch. Both drop, and to at most the stage's inputs."""
    for rank in recomputed:
        plain, again = rank[("1f1b", False)], rank[("1f1b", True)]
        assert again["predicted"] < plain["predicted"]
        assert again["saved"] < plain["saved"]
        saved_share = again["saved"] / plain["saved"]
        predicted_share = again["predicted"] / plain["predicted"]
        assert saved_share <= predicted_share + 0.25, (saved_share, predicted_share)


def test_recompute_names_a_stage_that_does_not_exist() -> None:
    model, inputs = ZOO["two_branch"]()
    p = plan(model, inputs, devices=3, micro_batches=M, pins=PINS["two_branch"])
    with pytest.raises(ConfigError, match=r"stages \[7\], but the plan has stages 0..2"):
        choose_recompute(p, [1, 7])
    with pytest.raises(ConfigError, match="'sometimes'"):
        choose_recompute(p, "sometimes")


def test_auto_recompute_fits_a_device_over_its_budget() -> None:
    model, inputs = ZOO["two_branch"]()
    p = plan(model, inputs, devices=3, micro_batches=M, pins=PINS["two_branch"])
    heaviest = max(p.stages, key=lambda s: s.memory_bytes)
    budget = heaviest.memory_bytes - 1  # the heaviest stage just misses it
    tight = replace(p, cost_model=replace(p.cost_model, memory=MemoryModel(budget)))
    chosen = choose_recompute(tight, "auto")
    over = [s.index for s in tight.stages if s.memory_bytes > budget]  # the two branches
    assert [s.index for s in chosen.stages if s.recompute] == over != []
    assert max(s.memory_bytes for s in chosen.stages) <= budget
    assert chosen.stages[heaviest.index].backward_time == pytest.approx(
        heaviest.backward_time + heaviest.forward_time
    )
    assert simulate(chosen, "1f1b").iteration_time > simulate(tight, "1f1b").iteration_time


def test_auto_recompute_is_chosen_at_the_counts_of_the_schedules_order() -> None:
    """At a budget that graph 1F1B's counts (2, 2, 1) just fit, zb2 holds 3 micro-batches on
    every stage: compile chooses recompute="auto" at those counts (both branches recompute
    and fit); without recomputation the dry run refuses zb2's peak; under 1f1b nothing
    recomputes."""
    model, inputs = ZOO["two_branch"]()
    p = plan(model, inputs, devices=3, micro_batches=8, pins=PINS["two_branch"])
    assert [s.in_flight for s in p.stages] == [2, 2, 1]
    budget = max(s.memory_bytes for s in p.stages)
    tight = replace(p, cost_model=replace(p.cost_model, memory=MemoryModel(budget)))

    def scheduled(schedule: str, recompute: Any) -> Any:
        spec = RunSpec.build(
            inputs,
            loss_fn=dict_loss,
            optimizer=optimizer_for(),
            micro_batches=8,
            schedule=schedule,
            plan=tight,
            recompute=recompute,
        )
        return _scheduled(tight, spec)[0]

    chosen = scheduled("zb2", "auto")
    assert [(s.in_flight, s.recompute) for s in chosen.stages] == [
        (3, True),
        (3, True),
        (3, False),
    ]
    assert max(s.memory_bytes for s in chosen.stages) <= budget
    with pytest.raises(ScheduleError, match=f"rank 0 peaks at .* over the budget of {budget}"):
        scheduled("zb2", False)
    assert not any(s.recompute for s in scheduled("1f1b", "auto").stages)
