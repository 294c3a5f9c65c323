"""Mixed precision: bf16 trains like one process under autocast, values cross stages in 2
bytes, and fp16's loss scale is agreed by every rank (an overflow anywhere skips the step
everywhere and halves the scale)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from training import PINS, batch
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError
from graphpipe.ir.registry import POLICIES
from graphpipe.planning.partition import plan
from graphpipe.runtime.launch import launch
from graphpipe.runtime.precision import LossScaler, check_precision, saturating_cast

M, STEPS, LR = 4, 3, 0.05
NAME = "two_branch"  # ranks 0 and 1 the branches, rank 2 the head and the loss


def _pipeline(precision: str) -> Any:
    model, inputs = ZOO[NAME]()
    the_plan = plan(model, inputs, devices=3, micro_batches=M, pins=PINS[NAME])
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=LR),
        plan=the_plan,
        precision=precision,
        runtime=RuntimeConfig(timeout=60),
    )


def _received_dtypes(pm: Any) -> list[torch.dtype]:
    """Record the dtype of every floating tensor this rank receives."""
    seen: list[torch.dtype] = []
    wait_all = pm._executor.transport.wait_all  # the executor's one way to take receives

    def recording(pendings: Any) -> list[list[torch.Tensor]]:
        arrived = wait_all(pendings)
        seen.extend(v.dtype for values in arrived for v in values if v.is_floating_point())
        return arrived

    pm._executor.transport.wait_all = recording
    return seen


def _bf16_worker() -> dict[str, Any]:
    pm = _pipeline("bf16")
    seen = _received_dtypes(pm)
    losses = [pm.step(*batch(NAME, s)[0], target=batch(NAME, s)[1]) for s in range(STEPS)]
    params = {n: p.dtype for n, p in pm.module.named_parameters()}
    inputs, target = batch(NAME, 0)
    evaluated = {"eval": pm.eval_step(*inputs, target=target), "outputs": pm(*inputs)}
    out = {"losses": losses, "state": pm.state_dict(), "received": seen, "params": params}
    return {**out, **evaluated}


def _reference_bf16() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, autocast bf16, gradient accumulation over the same micro-batches."""
    model, _ = ZOO[NAME]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, target = batch(NAME, step)
        total = 0.0
        for j in range(M):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = dict_loss(model(*[x.chunk(M)[j] for x in inputs]), target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return losses, model.state_dict()


def test_bf16_trains_like_one_process_under_autocast_with_half_width_messages() -> None:
    results = launch(_bf16_worker, 3, timeout=240)
    ref_losses, ref_state = _reference_bf16()
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-2)
        assert set(r["params"].values()) == {torch.float32}  # master weights stay float32
        assert r["received"] and set(r["received"]) == {torch.bfloat16}
    for key, value in ref_state.items():
        torch.testing.assert_close(results[0]["state"][key], value, rtol=2e-2, atol=2e-3)
    model, _ = ZOO[NAME]()  # eval and pm(...) in bf16 too: the trained model under autocast
    model.load_state_dict(ref_state)
    inputs, target = batch(NAME, 0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        parts = [model(*[x.chunk(M)[j] for x in inputs]) for j in range(M)]
        evaluated = sum(float(dict_loss(o, t)) for o, t in zip(parts, target.chunk(M), strict=True))
        evaluated /= M
    for r in results:
        assert r["eval"] == pytest.approx(evaluated, rel=2e-2)
        torch.testing.assert_close(r["outputs"], torch.cat(parts), rtol=5e-2, atol=5e-2)


def _fp16_worker() -> dict[str, Any]:
    pm = _pipeline("fp16")
    out: dict[str, Any] = {"scales": [], "skipped": [], "changed": []}
    for step in range(STEPS):
        before = {n: p.detach().clone() for n, p in pm.module.named_parameters()}
        hooks = []
        if step == 1 and pm.rank == 0:  # an overflow on a rank that does not hold the loss
            first = next(iter(pm.module.parameters()))
            hooks.append(first.register_hook(lambda g: g * float("inf")))
        pm.step(*batch(NAME, step)[0], target=batch(NAME, step)[1])
        for h in hooks:
            h.remove()
        out["changed"].append(
            any(not torch.equal(p, before[n]) for n, p in pm.module.named_parameters())
        )
        out["scales"].append(pm.loss_scale)
        out["skipped"].append(pm.skipped_steps)
    return out


def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale() -> None:
    for r in launch(_fp16_worker, 3, timeout=240):
        assert r["changed"] == [True, False, True]  # step 1 skipped everywhere
        assert r["skipped"] == [0, 1, 1]
        assert r["scales"] == [2.0**16, 2.0**15, 2.0**15]


def test_a_plan_for_bf16_counts_two_bytes_per_value_between_stages() -> None:
    model, inputs = ZOO[NAME]()
    fp32 = plan(model, inputs, devices=3, micro_batches=M, pins=PINS[NAME])
    bf16 = plan(model, inputs, devices=3, micro_batches=M, pins=PINS[NAME], precision="bf16")
    assert [e.bytes for e in bf16.edges] == [e.bytes // 2 for e in fp32.edges]
    assert all(e.bytes > 0 for e in bf16.edges)
    assert [s.activation_bytes for s in bf16.stages] < [s.activation_bytes for s in fp32.stages]


def test_bad_precisions_are_refused_naming_the_value() -> None:
    model, inputs = ZOO[NAME]()
    opt = functools.partial(torch.optim.SGD, lr=LR)
    with pytest.raises(ConfigError, match="'fp8'"):
        gp_compile(model, inputs, loss_fn=dict_loss, optimizer=opt, precision="fp8")
    with pytest.raises(ConfigError, match="weights='stash'"):
        gp_compile(
            model, inputs, loss_fn=dict_loss, optimizer=opt, precision="fp16", weights="stash"
        )


def test_the_cast_between_stages_saturates_an_additive_mask() -> None:
    scores = torch.zeros(2, 3)
    mask = torch.tensor([[0.0, 0.0, torch.finfo(torch.float32).min]] * 2)
    cast = saturating_cast(mask, torch.float16)
    assert cast[0, 2].item() == torch.finfo(torch.float16).min  # not -inf
    probs = F.softmax(scores.half().float() + cast.float(), dim=-1)
    assert torch.isfinite(probs).all() and probs[0, 2] == 0
    assert saturating_cast(mask, torch.bfloat16).dtype == torch.bfloat16


def test_the_loss_scaler_skips_on_an_overflow_anywhere_and_grows_after_good_steps() -> None:
    reduced: list[float] = []
    remote = {"overflow": 0.0}  # what the other ranks contribute to the MAX

    def all_reduce_max(flag: torch.Tensor) -> None:
        flag.clamp_(min=remote["overflow"])
        reduced.append(float(flag))

    scaler = LossScaler(all_reduce_max, scale=8.0, interval=2)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 8.0)
    assert scaler.unscale([p], torch.device("cpu")) and p.grad.tolist() == [1.0, 1.0]
    remote["overflow"] = 1.0  # this rank's gradients are finite, another's are not
    assert not scaler.unscale([p], torch.device("cpu"))
    scaler.update(False)
    assert (scaler.scale, scaler.skipped) == (4.0, 1)
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 8.0 and reduced == [0.0, 1.0]


def test_the_loss_scaler_unscales_every_dtype_and_flags_a_local_nan() -> None:
    reduced: list[float] = []

    def all_reduce_max(flag: torch.Tensor) -> None:  # one rank: the MAX is its own flag
        reduced.append(float(flag))

    scaler = LossScaler(all_reduce_max, scale=4.0)
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1).half())
    a.grad, b.grad = torch.tensor([4.0, 8.0]), torch.tensor([2.0]).half()
    assert scaler.unscale([a, b], torch.device("cpu"))
    assert a.grad.tolist() == [1.0, 2.0] and b.grad.tolist() == [0.5]
    b.grad = torch.tensor([float("nan")]).half()
    assert not scaler.unscale([a, b], torch.device("cpu"))
    assert reduced == [0.0, 1.0]


@pytest.mark.parametrize("weights", sorted(POLICIES))
def test_fp16_is_refused_exactly_for_policies_without_a_whole_step(weights: str) -> None:
    check_precision("bf16", weights)
    if POLICIES[weights].whole_step:
        check_precision("fp16", weights)
    else:
        with pytest.raises(ConfigError, match=f"weights={weights!r}"):
            check_precision("fp16", weights)
