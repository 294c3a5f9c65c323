"""A weight tied across two stages of one pp rank, on a mesh with a "dp" dimension (FSDP2).

The tiny Llama with `tie_word_embeddings=True` (tests/test_mesh_models.py's `llama(tied=True)`,
traced by torch.export) under zbv: four stages folded as a V onto two pp ranks, so stage 0
(the embedding) and stage 3 (lm_head, reading the embedding's table) both run on pp rank 0,
each an FSDP2 root of its own. Stage 3 gets a copy of the table before it is wrapped
(`graphpipe.runtime.groups.own_copies`), and the GradSync adds the two copies' gradients on
the rank after FSDP2's reduce-scatter, so both step identically.

Four gloo processes on pp 2 x dp 2 (and eight on pp 2 x dp 2 x tp 2): every step's loss and
every parameter equal one process's at rtol 1e-5, both copies of the table equal after every
step, Adam's state of each copy equals one process's (duplicated, identical), a checkpoint
saved after two steps and loaded after the third runs the third again to the same loss and
weights (both copies and both optimizer states restored, not aliased), and
`load_state_dict` fills both copies. On four ranks tests/test_mesh.py's fx-traced tied net
(an nn.Embedding's weight read again by an output Linear), folded alike, equals its one
process too (SGD with momentum, its gradients clipped as torch's clip_grad_norm_ does).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_mesh import STEPS as FX_STEPS
from test_mesh import M as FX_M
from test_mesh import _optimizer as fx_optimizer
from test_mesh import _tied_batch
from test_mesh_models import (
    PINS_FOLDED,
    STEPS,
    TIMEOUT,
    M,
    _adam_state,
    _named,
    _optimizer,
    batch,
    llama,
    lm_loss,
    reference,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from zoo import ZOO, D, dict_loss

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.planning.api import plan
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.launch import launch
from graphpipe.runtime.mesh import whole

ATOL = 2e-6  # tests/test_tp.py's: tp's all-reduces sum in another order than one process
TIED = ("model.embed_tokens.weight", "lm_head.weight")  # the table's two names
MAX_NORM = 0.05  # the fx net's clipping: below every step's norm
TIMEOUT_8 = 400  # tests/test_tp.py's: 8 processes on 2 cores
SHAPES = {4: ((2, 2), ("pp", "dp")), 8: ((2, 2, 2), ("pp", "dp", "tp"))}


def _compile(world: int) -> Any:
    """The tied Llama under zbv, folded as a V over this launch's mesh."""
    shape, names = SHAPES[world]
    ids, _ = batch(0)
    return gp_compile(
        llama(tied=True),
        {"input_ids": ids, "use_cache": False},
        loss_fn=lm_loss,
        optimizer=_optimizer(),
        micro_batches=M,
        schedule="zbv",
        pins=PINS_FOLDED,
        mesh=init_device_mesh("cpu", shape, mesh_dim_names=names),
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120, quiet=True),
    )


def _copies(pm: Any) -> dict[str, torch.Tensor]:
    """This rank's copies of the table by its module's name, each gathered whole (a
    collective over the stage's dp and tp ranks, which walk the same names)."""
    return {
        n: whole(p.detach()).clone() for n, p in pm.module.named_parameters() if n.endswith(TIED)
    }


class ThreeReaders(nn.Module):
    """zoo's Tied with a third reader of its table in the middle of the chain: embed.weight
    is mid.weight (D -> vocab) and out.weight too."""

    def __init__(self, vocab: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.body = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.mid = nn.Linear(D, vocab, bias=False)
        self.up = nn.Linear(vocab, D)
        self.out = nn.Linear(D, vocab, bias=False)
        self.mid.weight = self.embed.weight
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(tokens))  # (B, L, D)
        h = self.up(torch.tanh(self.mid(h)))  # (B, L, D)
        return self.out(h.mean(dim=1))  # (B, vocab)


def _three_readers() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ThreeReaders()
    return model, (_tied_batch(0)[0],)


# name -> (the net, its pins, the table's names, its copies on pp rank 0 and on pp rank 1)
FX_NETS: dict[str, tuple[Callable[[], Any], dict[str, int], tuple[str, ...], tuple[int, int]]]
FX_NETS = {
    # stages 0 and 3 on pp rank 0: two copies there, no group
    "two readers": (
        ZOO["tied"],
        {"embed": 0, "body.0": 1, "body.1": 2, "body.2": 3, "out": 3},
        ("embed.weight", "out.weight"),
        (2, 0),
    ),
    # and stage 2 on pp rank 1: pp rank 0's sum summed with pp rank 1's over the tie's group
    "three readers": (
        _three_readers,
        {"embed": 0, "body": 1, "mid": 2, "up": 2, "out": 3},
        ("embed.weight", "mid.weight", "out.weight"),
        (2, 1),
    ),
}


def _fx_reference(net: str) -> tuple[list[float], list[float], torch.Tensor]:
    """One process, gradient accumulation over M micro-batches, then torch's clip_grad_norm_:
    the losses, the norms before clipping and the tied weight after the last step."""
    model, _ = FX_NETS[net][0]()
    opt = fx_optimizer()(model.parameters())
    losses, norms = [], []
    for step in range(FX_STEPS):
        tokens, target = _tied_batch(step)
        total = 0.0
        for j in range(FX_M):
            loss = dict_loss(model(tokens.chunk(FX_M)[j]), target.chunk(FX_M)[j])
            (loss / FX_M).backward()
            total += loss.item()
        losses.append(total / FX_M)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
    return losses, norms, model.embed.weight.detach().clone()


def _fx_tied(net: str) -> dict[str, Any]:
    """An fx-traced tied net of `FX_NETS` folded as a V on pp 2 x dp 2 under zbv: embed on
    stage 0, out on stage 3, both on pp rank 0; clipped (the table's norm counted once, not
    once per copy). Its losses, norms, state and every step's copies of the table here."""
    make, pins, names, _ = FX_NETS[net]
    model, inputs = make()
    folded = plan(model, inputs, devices=4, dp=2, micro_batches=FX_M, pins=pins,
                  virtual_stages=2, placement="v")  # fmt: skip
    pm = gp_compile(
        model,
        inputs,
        loss_fn=dict_loss,
        optimizer=fx_optimizer(),
        micro_batches=FX_M,
        schedule="zbv",
        plan=folded,
        dp=2,
        max_grad_norm=MAX_NORM,
        runtime=RuntimeConfig(timeout=120, quiet=True),
    )
    losses, norms, held = [], [], []
    for s in range(FX_STEPS):
        tokens, target = _tied_batch(s)
        losses.append(float(pm.step(tokens, target=target)))
        norms.append(pm.last_grad_norm)
        params = pm.module.named_parameters()
        held.append([whole(p.detach()).clone() for n, p in params if n.endswith(names)])
    return {"losses": losses, "norms": norms, "state": pm.state_dict(), "held": held}


def _step(pm: Any, s: int) -> float:
    return float(pm.step(input_ids=batch(s)[0], target=batch(s)[1]))


def _worker(world: int, where: str) -> dict[str, Any]:
    pm = _compile(world)
    losses, held = [], []
    for s in range(STEPS):
        if s == STEPS - 1:
            pm.save(where)  # after STEPS - 1 steps
        losses.append(_step(pm, s))
        held.append(_copies(pm))
    state, adam = pm.state_dict(), _adam_state(pm)
    pm.load(where)
    again = _step(pm, STEPS - 1)  # the last step again, from the checkpoint
    resumed = {"loss": again, "state": pm.state_dict(), "held": _copies(pm)}
    fresh = llama(tied=True)  # its state dict lacks the non-persistent rotary inv_freq,
    pm.load_state_dict(fresh.state_dict())  # which the stage keeps as it is
    return {
        "fx": {net: _fx_tied(net) for net in FX_NETS} if world == 4 else {},
        "stages": [s.index for s in pm.plan.stages_on(pm.rank)],
        "losses": losses,
        "held": held,
        "state": state,
        "adam": adam,
        "resumed": resumed,
        "start": _copies(pm),
    }


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    return reference(tied=True)


def _check(results: list[dict[str, Any]], expected: dict[str, Any], world: int) -> None:
    """Every rank equals one process; pp rank 0 holds two copies of the table, equal."""
    per_pp = world // 2
    start = llama(tied=True).state_dict()[TIED[0]]
    for rank, got in enumerate(results):
        on_v = rank < per_pp  # pp rank 0: stages 0 and 3
        assert got["stages"] == ([0, 3] if on_v else [1, 2]), f"rank {rank}"
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), f"rank {rank}"
        assert list(got["state"]) == list(expected["state"]), f"rank {rank}"
        for key, value in expected["state"].items():
            torch.testing.assert_close(
                got["state"][key], value, rtol=1e-5, atol=ATOL, msg=_named(key)
            )
        for step, copies in enumerate(got["held"]):
            assert len(copies) == (2 if on_v else 0), f"rank {rank} step {step}"
            values = list(copies.values())
            for other in values[1:]:  # the same tensor, bit for bit
                torch.testing.assert_close(other, values[0], rtol=0, atol=0)
        _check_adam(got["adam"], expected["adam"], rank)
        _check_resumed(got, rank)
        for copy in got["start"].values():  # load_state_dict filled every copy
            torch.testing.assert_close(copy, start, rtol=0, atol=0)


def _check_adam(
    adam: dict[str, dict[str, torch.Tensor]], want: dict[str, dict[str, Any]], rank: int
) -> None:
    """Each copy's Adam state is one process's state of the table (duplicated, identical)."""
    for name, moments in adam.items():
        if not name.endswith(TIED):
            continue
        for k, v in moments.items():
            torch.testing.assert_close(
                v, want[TIED[0]][k], rtol=1e-5, atol=1e-7, msg=_named(f"rank {rank} {name} {k}")
            )


def _check_resumed(got: dict[str, Any], rank: int) -> None:
    """The last step run again from the checkpoint: the same loss and weights, so both
    copies and their optimizer states (each its own tensor) were restored."""
    resumed = got["resumed"]
    assert resumed["loss"] == pytest.approx(got["losses"][-1], rel=1e-6), f"rank {rank}"
    for key, value in got["state"].items():
        torch.testing.assert_close(
            resumed["state"][key], value, rtol=1e-6, atol=1e-7, msg=_named(key)
        )
    for name, value in resumed["held"].items():
        torch.testing.assert_close(value, got["held"][-1][name], rtol=1e-6, atol=1e-7)


def test_a_weight_tied_across_two_stages_of_one_pp_rank_trains_as_one_process_under_dp(
    expected: dict[str, Any], tmp_path: Path
) -> None:
    """pp 2 x dp 2, zbv: each of pp rank 0's stages shards a copy of the table of its own,
    their gradients added on the rank; equal to one process and to each other."""
    results = launch(_worker, 4, args=(4, str(tmp_path / "ckpt")), timeout=TIMEOUT)
    _check(results, expected, 4)
    for net in FX_NETS:
        _check_fx(results, net)


def _check_fx(results: list[dict[str, Any]], net: str) -> None:
    """Every rank of the fx net equals one process; every copy of the table, on either pp
    rank, is the same tensor after every step."""
    ref_losses, ref_norms, ref_weight = _fx_reference(net)
    assert min(ref_norms) > 2 * MAX_NORM  # every step is clipped
    held = FX_NETS[net][3]
    for rank, result in enumerate(results):
        got = result["fx"][net]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), f"{net} rank {rank}"
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), f"{net} rank {rank}"
        torch.testing.assert_close(got["state"]["embed.weight"], ref_weight, rtol=1e-5, atol=1e-6)
        for step, copies in enumerate(got["held"]):
            assert len(copies) == held[rank // 2], f"{net} rank {rank}"
            first = results[0]["fx"][net]["held"][step][0]
            for copy in copies:  # bit for bit
                torch.testing.assert_close(copy, first, rtol=0, atol=0)


def test_a_weight_tied_across_two_stages_of_one_pp_rank_trains_as_one_process_under_dp_tp(
    expected: dict[str, Any], tmp_path: Path
) -> None:
    """pp 2 x dp 2 x tp 2, zbv: the copies are the tp plan's DTensors (lm_head column-wise
    reads the table replicated over tp), each sharded over dp by its stage's FSDP2 root."""
    results = launch(_worker, 8, args=(8, str(tmp_path / "ckpt")), timeout=TIMEOUT_8)
    _check(results, expected, 8)
