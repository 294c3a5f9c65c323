"""Weight policies: each matches its own update rule, written again here as a plain loop.

The references below do not use the runtime: they replay the policy's recurrence in one
process, micro-batch by micro-batch, with the weight versions the schedule implies (stage i
of an asynchronous 1F1B has warm-up w_i: its forward of micro-batch j runs after max(0, j - w_i)
of its updates, its backward after j). Pipelined runs on 3 processes must end with the same
parameters, to rounding, after 4 step() calls of 4 micro-batches each (16 updates).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call
from zoo import ZOO, dict_loss

from graphpipe.compile import compile as gp_compile
from graphpipe.ir import Plan
from graphpipe.ir.cost import weight_copies
from graphpipe.planning.partition import plan
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch
from graphpipe.runtime.resume import saved_plan
from graphpipe.runtime.stage import OUTPUT, build_stage, model_output
from graphpipe.runtime.sync import GradSync
from graphpipe.runtime.weights import PolicyOptions, make_policy
from graphpipe.scheduling.generators import make_schedule, warmups
from graphpipe.scheduling.simulate import simulate
from graphpipe.tracing.tracer import trace

M, CALLS = 4, 4
PINS = {  # a case's name: its zoo model, then "/devices" where not 3
    "skip_across": {"layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 2, "head": 2},
    "two_branch": {"a": 0, "b": 1, "cat": 2, "head": 2},
    "skip_across/2": {"layers.0": 0, "layers.1": 0, "layers.2": 1, "layers.3": 1, "head": 1},
}
NO_FIXES = PolicyOptions(lr_reschedule=False, correction=False)
FIXES = PolicyOptions(lr_reschedule=True, correction=True, warmup_updates=8, ema=0.8)
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "adam": functools.partial(torch.optim.Adam, lr=0.01),
}
CASES = [  # (model, policy, optimizer, PipeMare options)
    ("skip_across", "stash", "sgd", None),
    ("two_branch", "stash", "adam", None),
    ("skip_across", "2bw", "adam", None),
    ("two_branch", "2bw", "sgd", None),
    ("skip_across", "pipemare", "sgd", FIXES),
    ("two_branch", "pipemare", "sgd", NO_FIXES),
]


def zoo_model(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Case `name`'s zoo model and example inputs."""
    return ZOO[name.split("/")[0]]()


def micro_batches(name: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """CALLS * M micro-batches, in order (what the step() calls feed)."""
    model, inputs = zoo_model(name)
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(CALLS * M):
        x = tuple(torch.randn((2, *t.shape[1:]), generator=gen) for t in inputs)
        with torch.no_grad():
            y = torch.randn(model(*x).shape, generator=gen)
        out.append((x, y))
    return out


def mini_batches(name: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    mbs = micro_batches(name)
    return [
        (
            tuple(
                torch.cat([mb[0][i] for mb in mbs[c * M : (c + 1) * M]])
                for i in range(len(mbs[0][0]))
            ),
            torch.cat([mb[1] for mb in mbs[c * M : (c + 1) * M]]),
        )
        for c in range(CALLS)
    ]


def _plan(name: str) -> Plan:
    model, _ = zoo_model(name)
    x, _ = mini_batches(name)[0]
    flops = ProfileConfig(mode="flops")  # the same plan every time: a resume checks it
    devices = len(set(PINS[name].values()))
    return plan(
        model, x, devices=devices, micro_batches=M, pins=PINS[name], replication=False,
        profile=flops,
    )  # fmt: skip


def _stage_of(name: str) -> tuple[nn.Module, dict[str, int], dict[int, int]]:
    """A fresh model, its parameters' stages, and each stage's warm-up."""
    model, _ = zoo_model(name)
    the_plan = _plan(name)
    gm = trace(model, mini_batches(name)[0][0])
    where = {
        n: s.index
        for s in the_plan.stages
        for n, _ in build_stage(gm, the_plan, s.index)[0].named_parameters()
    }
    return model, where, warmups(the_plan)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    x: Any,
    y: Any,
    scale: float,
    losses: list[float] | None = None,
) -> dict[str, torch.Tensor]:
    """The gradients of the loss on (x, y) times `scale` at `weights`; the loss appended to
    `losses`."""
    leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
    loss = dict_loss(functional_call(model, leaves, x), y)
    if losses is not None:
        losses.append(loss.item())
    grads = torch.autograd.grad(loss * scale, list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def _step(
    model: nn.Module,
    opts: dict[int, torch.optim.Optimizer],
    where: dict[str, int],
    grads: dict[str, torch.Tensor],
    stages: list[int],
) -> None:
    for n, p in model.named_parameters():
        if where[n] in stages:
            p.grad = grads[n]
    for s in stages:
        opts[s].step()
        opts[s].zero_grad()


def stash_reference(
    name: str, optimizer: str, losses: list[float] | None = None
) -> dict[str, torch.Tensor]:
    """w_i(j+1) = w_i(j) - step(grad f(w_1(j - w_1), ..., w_n(j - w_n))); each micro-batch's
    loss appended to `losses`."""
    model, where, warm = _stage_of(name)
    opts = _optimizers(model, where, optimizer)
    history = {s: [_snapshot(model)] for s in warm}  # stage -> weights after k updates
    for j, (x, y) in enumerate(micro_batches(name)):
        weights = {n: history[where[n]][max(0, j - warm[where[n]])][n] for n in where}
        _step(model, opts, where, _grads(model, weights, x, y, 1.0, losses), list(warm))
        for s in warm:
            history[s].append(_snapshot(model))
    return _snapshot(model)


def twobw_reference(
    name: str, optimizer: str, losses: list[float] | None = None
) -> dict[str, torch.Tensor]:
    """V_0 = V_1 = W0, V_(t+2) = step(V_(t+1), grad f(V_t)); each micro-batch's loss
    appended to `losses`.

    That is W(t+1) = W(t) - step(grad f(W(t-1))) with W(t) = V_(t+1).
    """
    model, where, warm = _stage_of(name)
    opts = _optimizers(model, where, optimizer)
    versions = {0: _snapshot(model), 1: _snapshot(model)}
    mbs = micro_batches(name)
    for t in range(CALLS):
        total: dict[str, torch.Tensor] = {}
        for x, y in mbs[t * M : (t + 1) * M]:
            for n, g in _grads(model, versions[t], x, y, 1.0 / M, losses).items():
                total[n] = total[n] + g if n in total else g
        _step(model, opts, where, total, list(warm))
        versions[t + 2] = _snapshot(model)
    return _snapshot(model)


def pipemare_reference(
    name: str, optimizer: str, options: PolicyOptions
) -> dict[str, torch.Tensor]:
    """Forward with the weights of max(0, j - w_i) updates, no stash; backward recomputes each
    stage on its saved input with w - w_i * delta (or w), lr scaled by 1/tau^(1 - min(k/K, 1))."""
    model, where, warm = _stage_of(name)
    the_plan = _plan(name)
    gm = trace(model, mini_batches(name)[0][0])
    stages = {s.index: build_stage(gm, the_plan, s.index) for s in the_plan.stages}
    opts = _optimizers(model, where, optimizer)
    history = {s: [_snapshot(model)] for s in warm}
    delta = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for j, (x, y) in enumerate(micro_batches(name)):
        values = dict(zip(names, x, strict=False))
        saved: dict[int, list[torch.Tensor]] = {}
        for s, (module, io) in stages.items():  # forward, stage by stage, old weights
            saved[s] = [values[n] for n in io.inputs]
            w = {n: history[s][max(0, j - warm[s])][n] for n, _ in module.named_parameters()}
            with torch.no_grad():
                values.update(functional_call(module, w, tuple(saved[s])))
        grads_in: dict[str, torch.Tensor] = {}
        for s in sorted(stages, reverse=True):  # backward, recomputing with live weights
            module, io = stages[s]
            live = dict(module.named_parameters())
            correct = options.correction and warm[s] > 0
            w = {
                n: (p.detach() - warm[s] * delta[n] if correct else p.detach()).requires_grad_()
                for n, p in live.items()
            }
            args = [
                v.detach().requires_grad_() if n in io.received and v.is_floating_point() else v
                for n, v in zip(io.inputs, saved[s], strict=True)
            ]
            out = functional_call(module, w, tuple(args))
            roots = [out[n] for n in io.sent if n in grads_in]
            seeds = [grads_in[n] for n in io.sent if n in grads_in]
            if io.has_output:
                roots.append(dict_loss(model_output(gm, out[OUTPUT]), y))
                seeds.append(torch.ones(()))
            torch.autograd.backward(roots, seeds)
            for n, a in zip(io.inputs, args, strict=True):
                if a.grad is not None:
                    grads_in[n] = grads_in[n] + a.grad if n in grads_in else a.grad
            before = {n: p.detach().clone() for n, p in live.items()}
            factor = 1.0
            if options.lr_reschedule:
                progress = min(j / options.warmup_updates, 1.0)
                factor = 1.0 / max(warm[s], 1) ** (1.0 - progress)
            for g in opts[s].param_groups:
                g["lr"] *= factor
            _step(model, opts, where, {n: w[n].grad for n in live}, [s])
            for g in opts[s].param_groups:
                g["lr"] /= factor
            for n, p in live.items():
                delta[n] = options.ema * delta[n] + (1 - options.ema) * (p.detach() - before[n])
            history[s].append(_snapshot(model))
    return _snapshot(model)


def _optimizers(
    model: nn.Module, where: dict[str, int], optimizer: str
) -> dict[int, torch.optim.Optimizer]:
    stages = sorted(set(where.values()))
    return {
        s: OPTIMIZERS[optimizer]([p for n, p in model.named_parameters() if where[n] == s])
        for s in stages
    }


def _policy_worker(cases: list[tuple[str, str, str, PolicyOptions | None]]) -> list[Any]:
    results = []
    for name, policy, optimizer, options in cases:
        model, _ = zoo_model(name)
        pm = gp_compile(
            model,
            mini_batches(name)[0][0],
            loss_fn=dict_loss,
            optimizer=OPTIMIZERS[optimizer],
            weights=policy,
            weight_options=options,
            plan=_plan(name),
        )
        losses = [pm.step(*x, target=y) for x, y in mini_batches(name)]
        state = pm.state_dict()  # drains the pipeline: every update applied
        results.append(
            {
                "state": state,
                "versions": pm.versions(),
                "losses": losses,
                "stage": pm.plan.stage_on(pm.rank).index,
            }
        )
    return results


@pytest.fixture(scope="module")
def runs() -> list[list[Any]]:
    return launch(_policy_worker, 3, args=(CASES,), timeout=300)


def _reference(name: str, policy: str, optimizer: str, options: Any) -> dict[str, torch.Tensor]:
    if policy == "stash":
        return stash_reference(name, optimizer)
    if policy == "2bw":
        return twobw_reference(name, optimizer)
    return pipemare_reference(name, optimizer, options)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pipelined_policy_follows_its_update_rule(runs: list[list[Any]], case: int) -> None:
    name, policy, optimizer, options = CASES[case]
    expected = _reference(name, policy, optimizer, options)
    state = runs[0][case]["state"]
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    initial = dict(zoo_model(name)[0].named_parameters())
    assert any(not torch.equal(state[k], initial[k]) for k in expected)  # it did train


@pytest.mark.parametrize("case", range(len(CASES)))
def test_versions_are_consistent_and_copies_stay_within_the_bound(
    runs: list[list[Any]], case: int
) -> None:
    name, policy, _, options = CASES[case]
    warm = warmups(_plan(name))
    for rank_result in (r[case] for r in runs):
        v, stage = rank_result["versions"], rank_result["stage"]
        w = warm[stage]
        if policy == "stash":  # backward on the forward's version, j - w updates old
            assert v["backward"] == v["forward"]
            assert v["forward"] == {j: max(0, j - w) for j in range(CALLS * M)}
        elif policy == "2bw":
            assert v["backward"] == v["forward"]
            assert v["forward"] == {j: max(0, j // M - 1) for j in range(CALLS * M)}
        else:  # pipemare: forward delay is the schedule's tau = w, backward has none
            assert v["forward"] == {j: max(0, j - w) for j in range(CALLS * M)}
            assert v["backward"] == {j: j for j in range(CALLS * M)}
        correction = options.correction if options else True
        assert v["peak_copies"] == weight_copies(policy, w, correction), (stage, v)


def test_the_simulator_counts_the_same_weight_copies() -> None:
    the_plan = _plan("skip_across")
    sched = make_schedule(the_plan, "async", calls=2)
    warm = warmups(the_plan)
    flush = simulate(the_plan, sched, weights="flush")
    stash = simulate(the_plan, sched, weights="stash")
    for s in the_plan.stages:
        rank = s.devices[0]
        extra = stash.peak_memory[rank] - flush.peak_memory[rank]
        assert extra == s.param_bytes * (weight_copies("stash", warm[s.index]) - 1)


def _resume_worker(
    policy: str, options: PolicyOptions | None, path: str
) -> list[dict[str, torch.Tensor]]:
    """Two calls, a checkpoint, two more; and a fresh pipeline resumed from the checkpoint,
    compiled with the plan the checkpoint was saved under (`graphpipe.saved_plan`), as a
    restarted run whose plan would be measured anew does."""
    name = "skip_across"
    mbs = mini_batches(name)

    def build(the_plan: Plan) -> Any:
        model, _ = zoo_model(name)
        return gp_compile(
            model,
            mbs[0][0],
            loss_fn=dict_loss,
            optimizer=OPTIMIZERS["adam"],
            weights=policy,
            weight_options=options,
            plan=the_plan,
        )

    first = build(_plan(name))
    for x, y in mbs[:2]:
        first.step(*x, target=y)
    first.save(path)
    for x, y in mbs[2:4]:
        first.step(*x, target=y)
    second = build(saved_plan(Path(path)))
    second.load(path)
    for x, y in mbs[2:4]:
        second.step(*x, target=y)
    return [first.state_dict(), second.state_dict()]


@pytest.mark.parametrize(("policy", "options"), [("stash", None), ("pipemare", FIXES)])
def test_a_checkpoint_resumes_exactly(
    policy: str, options: PolicyOptions | None, tmp_path: Path
) -> None:
    args = (policy, options, str(tmp_path / "ckpt"))
    uninterrupted, resumed = launch(_resume_worker, 3, args=args, timeout=300)[0]
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)


def test_update_hooks_run_in_order_and_a_refusal_skips_the_step() -> None:
    """make_policy's hooks run after the sums, in order, until one refuses; a refusal skips
    the optimizer step and drops the gradients."""
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    ran: list[str] = []

    def hook(name: str, verdict: bool) -> Callable[[], bool]:
        def run() -> bool:
            ran.append(name)
            return verdict

        return run

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    hooks = [hook("unscale", True), hook("agree", False), hook("clip", True)]
    policy = make_policy("flush", model, optimizer, GradSync([]), 1, hooks=hooks)
    model(torch.ones(1, 2)).sum().backward()
    policy.update(None)
    assert ran == ["unscale", "agree"]
    assert model.weight.grad is None and torch.equal(model.weight, before)
    assert policy.version == 0
