"""Models too big for one device: built on the meta device, each rank materialises its stage.

- About 1 GB of fp32 parameters, built on meta and compiled on 2 ranks: each rank's resident
  memory grows by its stage's bytes plus a fixed overhead (`OVERHEAD`: the fx graphs, the
  process groups and allocator slack), far from the whole model, and two steps from an init
  callback give the losses of the same model built for real with the same init.
- GPT-2 (a Hugging Face model with a tied embedding and head) saved as a state_dict file, a
  safetensors file and a DCP directory, rebuilt on meta and compiled from each, and Llama
  (whose rotary table is in no checkpoint) from a file with its own init_weights: the
  pipelined losses equal the plain model's.
- What cannot be materialised is refused, naming it.
"""

from __future__ import annotations

import functools
import resource
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from real_models import HF_CASES, M, optimizer, reference, step_data
from torch import nn

from benchmarks.mesh_memory import init_by_name
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError
from graphpipe.runtime.launch import launch
from graphpipe.runtime.materialize import is_meta, materialize

WIDTH, LAYERS = 4096, 16  # 16 x 64 MiB: 1 GiB of fp32 parameters
OVERHEAD = 200 * 2**20  # bytes a rank may grow by beyond its stage during compile
TIMEOUT = 400


def _big() -> nn.Module:
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]
    )


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen)


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _big_worker() -> dict[str, Any]:
    before = _rss()
    with torch.device("meta"):
        model = _big()
    pm = gp_compile(
        model,
        _data(0)[0],
        loss_fn=F.mse_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        micro_batches=M,
        replication=False,
        init_weights=init_by_name,
    )
    grown = _rss() - before
    assert pm.module is not None
    stage = sum(p.numel() * p.element_size() for p in pm.module.parameters())
    losses = [pm.step(_data(s)[0], target=_data(s)[1]) for s in range(2)]
    meta_left = sum(t.is_meta for t in model.parameters())
    return {"grown": grown, "stage": stage, "losses": losses, "meta_left": meta_left}


def test_a_meta_model_materialises_only_each_ranks_stage() -> None:
    results = launch(_big_worker, 2, timeout=TIMEOUT)
    total = WIDTH * (WIDTH + 1) * 4 * LAYERS
    for r in results:
        assert r["stage"] < total
        assert r["grown"] <= r["stage"] + OVERHEAD, (r["grown"], r["stage"])
        assert r["grown"] < 0.75 * total
        assert r["meta_left"] > 0  # the other stage's parameters were never allocated
    assert sum(r["stage"] for r in results) == total
    model = _big()
    init_by_name(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    for step in range(2):
        x, y = _data(step)
        total_loss = 0.0
        for xj, yj in zip(x.chunk(M), y.chunk(M), strict=True):
            loss = F.mse_loss(model(xj), yj)
            (loss / M).backward()
            total_loss += loss.item()
        opt.step()
        opt.zero_grad()
        expected.append(total_loss / M)
    torch.testing.assert_close(results[0]["losses"], expected, rtol=1e-5, atol=0)


def _saved(kind: str, model: nn.Module, root: Path) -> Path:
    """`model`'s state in a file or directory of format `kind`."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if kind == "torch":
        torch.save(state, root / "model.pt")
        return root / "model.pt"
    state.pop("lm_head.weight")  # a tied alias: stored once, as Hugging Face does
    if kind == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(root / "model.safetensors"))
        return root / "model.safetensors"
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process, on purpose: torch says so anyway
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    return root / "dcp"


def _hf_init(model: nn.Module) -> None:
    model.init_weights()  # type: ignore[operator]  # Hugging Face's: recomputes rotary tables


def _load_worker(runs: list[tuple[str, str]]) -> list[list[float]]:
    """Each (model, checkpoint): rebuilt on meta, compiled from the checkpoint, two steps.

    Llama's rotary table is a non-persistent buffer, in no checkpoint: its `init_weights`
    (Hugging Face's own) computes it, and the checkpoint then overrides the parameters.
    """
    losses = []
    for name, checkpoint in runs:
        case = HF_CASES[name]
        example, _ = step_data(case, 0)
        with torch.device("meta"):
            model = case.build()
        pm = gp_compile(
            model,
            {**example, **case.constants},
            loss_fn=case.loss,
            optimizer=optimizer,
            micro_batches=M,
            replication=False,
            checkpoint=checkpoint,
            init_weights=_hf_init if name == "llama" else None,
        )
        losses.append(
            [pm.step(**step_data(case, s)[0], target=step_data(case, s)[1]) for s in range(2)]
        )
    return losses


def test_a_meta_model_loads_its_stage_from_a_checkpoint(tmp_path: Path) -> None:
    gpt2, llama = HF_CASES["gpt2"], HF_CASES["llama"]
    kinds = ["torch", "safetensors", "dcp"]
    runs = [("gpt2", str(_saved(kind, gpt2.build(), tmp_path))) for kind in kinds]
    (tmp_path / "llama").mkdir()
    runs.append(("llama", str(_saved("torch", llama.build(), tmp_path / "llama"))))
    results = launch(_load_worker, 2, args=(runs,), timeout=TIMEOUT)[0]
    expected = {"gpt2": reference(gpt2, 2)[0], "llama": reference(llama, 2)[0]}
    for (name, path), losses in zip(runs, results, strict=True):
        torch.testing.assert_close(losses, expected[name], rtol=1e-5, atol=0, msg=path)


class NoReset(nn.Module):
    """A module with a parameter and no reset_parameters(): nothing can initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_meta_model_with_no_way_to_initialise_is_refused_naming_the_module() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), NoReset())
    assert is_meta(model)
    with pytest.raises(ConfigError, match=r"no reset_parameters\(\)") as err:
        materialize(model, model, torch.device("cpu"))
    assert "1: ['1.scale']" in str(err.value)


def test_a_checkpoint_missing_a_stage_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    state = plain.state_dict()
    del state["1.bias"]
    torch.save(state, tmp_path / "partial.pt")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="lacks") as err:
        materialize(model, model, torch.device("cpu"), checkpoint=tmp_path / "partial.pt")
    assert "1.bias" in str(err.value)


def test_materialised_tensors_take_the_checkpoint_values_under_every_alias(
    tmp_path: Path,
) -> None:
    plain = HF_CASES["gpt2"].build()
    path = _saved("safetensors", plain, tmp_path)  # holds only transformer.wte.weight
    with torch.device("meta"):
        model = HF_CASES["gpt2"].build()
    materialize(model, model, torch.device("cpu"), checkpoint=path)
    assert not is_meta(model)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
