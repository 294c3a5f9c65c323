"""Several stages per rank: interleaved 1F1B, ZB-V and graph interleaving, trained on two
ranks, equal to one process with gradient accumulation; their literal programs on a 2-rank
chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint
from plans import placed_plan
from training import TIMEOUT, M, assert_matches, batch, optimizer_for, train
from zoo import ZOO, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ScheduleError
from graphpipe.planning.interleave import place_graph
from graphpipe.planning.partition import plan
from graphpipe.runtime.launch import launch
from graphpipe.scheduling.generators import make_schedule
from graphpipe.scheduling.program import lower
from graphpipe.scheduling.simulate import simulate

CHAINS = {  # four chain stages each, so two ranks hold two stages
    # under "v" embed (stage 0) and out (stage 3) share rank 0: a tied weight on one rank
    "tied": {"embed": 0, "body.0": 1, "body.1": 2, "body.2": 3, "out": 3},
    # under "loop" the late input is read by stage 2, on rank 0 with stage 0
    "late_input": {"layers.0": 0, "layers.1": 1, "layers.2": 2, "head": 3},
    # a skip edge from stage 0 to stage 3: across the ranks under "loop", on rank 0 under "v"
    "skip_across": {"layers.0": 0, "layers.1": 1, "layers.2": 2, "layers.3": 3},
}
FOLDED = {  # three stages on two ranks: a later stage joins an earlier one's rank
    # the join (cat, head) on rank 0 with branch a, while branch b runs on rank 1
    "two_branch": ({"a": 0, "b": 1, "cat": 2, "head": 2}, [0, 1, 0]),
    # the skip from layers.0 to the sum after layers.3 stays on rank 0
    "skip_across": ({"layers.0": 0, "layers.1": 1, "layers.2": 1, "layers.3": 2}, [0, 1, 0]),
    # embed.weight read by stages 0 and 2, both on rank 0: one tensor there
    "tied": ({"embed": 0, "body": 1, "out": 2}, [0, 1, 0]),
}
CASES = [
    (name, s)
    for name in sorted(CHAINS)
    for s in ("interleaved", "interleaved_zb", "zbv", "dualpipev")
]
CASES += [(name, "graph_interleaved") for name in sorted(FOLDED)]
PLACEMENT = {"interleaved": "loop", "interleaved_zb": "loop", "zbv": "v", "dualpipev": "v"}


def _folded(name: str) -> Any:
    model, inputs = ZOO[name]()
    pins, assignment = FOLDED[name]
    unfolded = plan(model, inputs, devices=3, micro_batches=M, pins=pins)
    return place_graph(unfolded, 2, assignment)


def _pipeline(name: str, schedule: str) -> Any:
    model, inputs = ZOO[name]()
    if schedule == "graph_interleaved":
        return gp_compile(
            model, inputs, loss_fn=dict_loss, optimizer=optimizer_for(), plan=_folded(name)
        )
    the_plan = plan(
        model,
        inputs,
        devices=2,
        micro_batches=M,
        pins=CHAINS[name],
        virtual_stages=2,
        placement=PLACEMENT[schedule],
    )
    return gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=optimizer_for(),
        schedule=schedule,
        plan=the_plan,
        runtime=RuntimeConfig(timeout=60),
    )


def _worker(cases: list[tuple[str, str]]) -> dict[tuple[str, str], Any]:
    out = {}
    for name, schedule in cases:
        pm = _pipeline(name, schedule)
        out[(name, schedule)] = {
            **train(pm, name),
            "held": len(pm._stage_indices),
            "schedule": pm.schedule.name,
        }
    return out


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], Any]:
    return launch(_worker, 2, args=(CASES,), timeout=TIMEOUT)[0]


@pytest.mark.parametrize(("name", "schedule"), CASES)
def test_several_stages_per_rank_train_like_one_process(
    results: dict[tuple[str, str], Any], name: str, schedule: str
) -> None:
    assert results[(name, schedule)]["held"] == 2 or schedule == "graph_interleaved"
    assert_matches(results[(name, schedule)], name)
    assert results[(name, schedule)]["schedule"] == schedule  # the default for a folded plan


@pytest.mark.parametrize("name", ["1f1b", "async", "2bw"])
def test_one_stage_schedules_refuse_several_stages_per_rank(name: str) -> None:
    """Only interleaved and zbv place several stages per rank, both flushed: the weight
    policies for asynchronous schedules never meet such a plan."""
    p = placed_plan(2, 2, 4, "loop")
    with pytest.raises(ScheduleError, match=r"devices \[0, 1\] hold several"):
        make_schedule(p, name)


INTERLEAVED_2x4 = [
    "0F0 [0SF0>1] 0F1 [0SF1>1] 2F0 [2SF0>3] 2F1 [2SF1>3] 0F2 [0SF2>1] 2B0 [2SB0>1] 0F3 [0SF3>1] "
    "2B1 [2SB1>1] 2F2 [2SF2>3] 0B0 2F3 [2SF3>3] 0B1 2B2 [2SB2>1] 2B3 [2SB3>1] 0B2 0B3 0U",
    "1F0 [1SF0>2] 1F1 [1SF1>2] 3F0 3B0 [3SB0>2] 3F1 3B1 [3SB1>2] 1F2 [1SF2>2] 1B0 [1SB0>0] "
    "1F3 [1SF3>2] 1B1 [1SB1>0] 3F2 3B2 [3SB2>2] 3F3 3B3 [3SB3>2] 1B2 [1SB2>0] 1B3 [1SB3>0] 1U",
]


def _text(program: Any, rank: int) -> str:
    """A rank's program without its receives (the literal shape: compute and sends)."""
    parts = []
    for op in program.ranks[rank]:
        text = str(op)
        if text.startswith("["):
            sends = [t for t in text.strip("[]").split() if "S" in t[1:3]]
            if sends:
                parts.append("[" + " ".join(sends) + "]")
        else:
            parts.append(text)
    return " ".join(parts)


def test_interleaved_program_on_a_two_rank_chain() -> None:
    p = placed_plan(2, 2, 4, "loop")
    program = lower(p, make_schedule(p, "interleaved"))
    assert [_text(program, r) for r in range(2)] == INTERLEAVED_2x4


ZBV_2x4 = [  # the paper's order (arXiv 2405.15362, figure 4): Fa x3, Fb Ib Wb x2, steady, cool-down
    "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 "
    "0I3 0W3 0U",
    "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 "
    "2W3 1W3 1U",
]


def test_zbv_order_on_a_two_rank_chain() -> None:
    """Device 0 holds the first and the last stage; equal stages tie every candidate, so
    the order is the paper's."""
    p = placed_plan(2, 2, 4, "v")
    assert [" ".join(r) for r in make_schedule(p, "zbv").compute_only()] == ZBV_2x4


DUALPIPEV_2x4 = [  # DualPipeV's phases on device 0 (stages 0, 3) and device 1 (stages 1, 2)
    # Fa x2, Fa Fb, Ib W Fb | (Fa Bb)(Fb Ba), Bb (Fb Ba) | B, I, W Ia, W
    "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3 0U",
    # (Fa Fb) x2 | ((Fa Bb)(Fb Ba)) x2 | B B, I I, W W
    "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3 1U",
]


def test_dualpipev_order_on_a_two_rank_chain() -> None:
    """DeepSeek's DualPipeV (torch's ScheduleDualPipeV computes the same order): full
    backwards paired with forwards in the steady state, split ones in the warm-up and the
    cool-down."""
    p = placed_plan(2, 2, 4, "v")
    assert [" ".join(r) for r in make_schedule(p, "dualpipev").compute_only()] == DUALPIPEV_2x4


@pytest.mark.parametrize(("devices", "m"), [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_zbv_beats_interleaved_1f1b_on_equal_stages(devices: int, m: int) -> None:
    """ZB-V's point: on the same chain (equal F, I and W) its bubble is smaller than
    interleaved 1F1B's. A device's shallow forwards run at most 2(N-d)-1 ahead of its deep
    ones; bounding them by its unfinished input halves instead (as before) left the turning
    device idle while each micro-batch went round, and took up to twice as long."""
    zbv = simulate(placed_plan(devices, 2, m, "v"), "zbv").iteration_time
    loop = simulate(placed_plan(devices, 2, m, "loop"), "interleaved").iteration_time
    assert zbv < loop


def test_dualpipev_refuses_plans_other_than_a_v_of_two_stages_per_device_and_m_below_2n() -> None:
    with pytest.raises(ScheduleError, match="'dualpipev' needs a chain of stages placed 'v'"):
        make_schedule(placed_plan(2, 2, 4, "loop"), "dualpipev")
    with pytest.raises(ScheduleError, match="dualpipev needs 2 stages per device, got 4 on 4"):
        make_schedule(placed_plan(4, 1, 8, "loop"), "dualpipev")
    with pytest.raises(ScheduleError, match=r"micro_batches >= 2 x 4 devices = 8 .*, got 6"):
        make_schedule(placed_plan(4, 2, 6, "v"), "dualpipev")


def test_interleaved_needs_m_a_multiple_of_the_devices() -> None:
    p = placed_plan(2, 2, 3, "loop")
    with pytest.raises(Exception, match="multiple of 2 devices"):
        make_schedule(p, "interleaved")


torch.set_num_threads(1)


def _resume_worker(where: str) -> dict[str, Any]:
    """Two steps under zbv (two stages per rank), saved; loaded by a 1f1b pipeline on two
    stages (one per rank), which takes the third step. Also the uninterrupted zbv run."""
    name = "tied"
    model, inputs = ZOO[name]()
    zbv = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=optimizer_for(),
        schedule="zbv",
        plan=plan(
            model,
            inputs,
            devices=2,
            micro_batches=M,
            pins=CHAINS[name],
            virtual_stages=2,
            placement="v",
        ),
    )
    for s in range(2):
        zbv.step(*batch(name, s)[0], target=batch(name, s)[1])
    zbv.save(where)
    model, inputs = ZOO[name]()
    pins = {"embed": 0, "body.0": 0, "body.1": 1, "body.2": 1, "out": 1}
    one = gp_compile(
        model, inputs, loss_fn=dict_loss, optimizer=optimizer_for(), micro_batches=M, pins=pins
    )
    one.load(where)
    loaded = one.state_dict()
    for pm in (zbv, one):
        pm.step(*batch(name, 2)[0], target=batch(name, 2)[1])
    return {"saved": zbv.state_dict(), "loaded": loaded, "after": one.state_dict()}


def test_a_checkpoint_of_several_stages_per_rank_is_keyed_by_the_models_names(
    tmp_path: Path,
) -> None:
    """A rank's stages are a ModuleList, whose keys put each stage's position first; the
    checkpoint is keyed by the model's names, so another plan loads it (and the tied weight,
    held by stages 0 and 3 on rank 0, once)."""
    (result, _) = launch(_resume_worker, 2, args=(str(tmp_path / "ckpt"),), timeout=TIMEOUT)
    saved = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "ckpt"))
    keys = saved.read_metadata().state_dict_metadata
    model_keys = sorted(k[len("model/") :] for k in keys if k.startswith("model/"))
    names = [n for n in ZOO["tied"]()[0].state_dict() if n != "out.weight"]  # embed's alias
    assert model_keys == sorted(names)  # no "0." / "1." prefix
    assert list(result["after"]) == list(result["saved"])
    for n, value in result["after"].items():  # the same third step from the same state
        torch.testing.assert_close(value, result["saved"][n], rtol=1e-5, atol=1e-6, msg=n)


def _chain8() -> tuple[torch.nn.Module, torch.Tensor]:
    """Eight small layers, one stage each: a "v" over four ranks."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(8)]
    return torch.nn.Sequential(*layers), torch.randn(16, 6)


def _chain8_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 6, generator=g)


def _chain8_reference(m: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: each step accumulates loss / M over the same M micro-batches."""
    model, _ = _chain8()
    opt = optimizer_for()(model.parameters())
    losses = []
    for step in range(steps):
        x, y = _chain8_batch(step)
        losses.append(0.0)
        for xj, yj in zip(x.chunk(m), y.chunk(m), strict=True):
            loss = torch.nn.functional.mse_loss(model(xj), yj)
            (loss / m).backward()
            losses[-1] += loss.item() / m
        opt.step()
        opt.zero_grad()
    return losses, model.state_dict()


def _chain8_worker(the_plan: Any, steps: int) -> dict[str, Any]:
    model, x = _chain8()
    pm = gp_compile(
        model,
        (x,),
        loss_fn=torch.nn.functional.mse_loss,
        optimizer=optimizer_for(),
        schedule="dualpipev",
        plan=the_plan,
        runtime=RuntimeConfig(timeout=60),
    )
    losses = [pm.step(x, target=y) for x, y in map(_chain8_batch, range(steps))]
    return {"losses": losses, "state": pm.state_dict(), "held": len(pm._stage_indices)}


def test_dualpipev_on_four_ranks_trains_like_one_process() -> None:
    """Eight stages on four ranks, M = 2N = 8: DualPipeV's whole order, overlapped pairs
    on every device and full and split backwards on the same stages."""
    m, steps = 8, 2
    model, x = _chain8()
    pins = {str(i): i for i in range(8)}
    the_plan = plan(
        model, (x,), devices=4, micro_batches=m, pins=pins, virtual_stages=2, placement="v"
    )
    (result, *_) = launch(_chain8_worker, 4, args=(the_plan, steps), timeout=TIMEOUT)
    ref_losses, ref_state = _chain8_reference(m, steps)
    assert result["held"] == 2
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert list(result["state"]) == list(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6)
