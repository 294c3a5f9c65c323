"""Gathered parameters of an exported Llama's stages on a pp2 x dp2 mesh, by FSDP2 units.

    python -m benchmarks.fsdp_units                 # 8 decoder layers, 4 per stage
    python -m benchmarks.fsdp_units --layers 12     # 6 per stage

A Llama-like model (Hugging Face LlamaForCausalLM, random weights: width 256, MLP 512,
vocabulary 512, `--layers` decoder layers), traced by torch.export (a flat aten graph), is
compiled on 4 local gloo processes over a ("pp", "dp") = (2, 2) mesh, half of the layers
pinned to each pp device, 1f1b, M = 2 micro-batches, reshard_after_forward (the default).
Each rank steps twice and measures the second step, in three layouts of its stage:

- `one unit`: the stage as one FSDP2 unit, as before issue 36's item 3 (run by patching
  `graphpipe.runtime.mesh.outline_blocks` to outline nothing);
- `blocks, kept`: one unit per decoder layer, each kept gathered after a backward that is
  not the step's last (the stage's `RESHARDING` entry removed after compile);
- `blocks`: one unit per decoder layer, as graphpipe wraps it now.

What is counted: a parameter is gathered from the moment its unit's all-gather output buffer
is allocated until the unit reshards. Two public traces of FSDP2 give that: the all-gather
each unit runs through a custom all-gather (`FSDPModule.set_custom_all_gather`: graphpipe's
own guarded one, whose `allocate` adds each output buffer's bytes until the buffer is freed,
seen by a `weakref.finalize` on it), and the unit's registered parameters, which are sharded
DTensors while it is resharded and plain tensors while it is gathered. The sum of both is
read after every all-gather and at every unit's forward (after FSDP2's pre-forward hook), the
points where it can grow; its largest value over the step is the peak. A buffer's copy into
the parameters (both alive for the length of one copy) is not counted twice.

Expected: the stage root's own parameters (the embedding, or the final norm and head) and
two layers (the one running and the one prefetched), not the stage. About a minute on 2
CPUs. Not part of the test suite (tests/test_mesh_models.py checks the units and the
training).
"""

from __future__ import annotations

import argparse
import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from benchmarks._common import log, machine
from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.planning.profile import ProfileConfig
from graphpipe.runtime.fsdp_comms import GuardedAllGather
from graphpipe.runtime.launch import launch
from graphpipe.runtime.mesh import RESHARDING
from graphpipe.runtime.outline import block_prefixes

MIB = 2**20
B, L, M, V = 8, 16, 2, 512  # mini-batch rows, sequence length, micro-batches, vocabulary
LAYOUTS = ("one unit", "blocks, kept", "blocks")


def llama(layers: int) -> nn.Module:
    """A seeded Llama: width 256, MLP 512, 4 heads, vocabulary 512, `layers` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg)


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(3, V, (B, L), generator=gen), torch.randint(3, V, (B, L), generator=gen)


@dataclass
class _Unit:
    """One FSDP2 unit of a stage: its own parameters (not a nested unit's), by name, and the
    bytes of its all-gather output not yet copied into them."""

    names: list[str]
    pending: int = 0
    buffer: int = 0  # which of its all-gather outputs `pending` counts (a serial number)


class _Gathered:
    """The bytes of one stage's parameters gathered now, and the peaks since `reset`.

    A unit counts from its all-gather output's allocation (`pending`, until its copy-out:
    its parameters seen gathered, or the output freed) until it reshards: while its
    parameters are registered as plain tensors, not sharded DTensors. `with_buffers` also
    counts every all-gather output still alive after its copy-out (in forward FSDP2 keeps a
    synchronous all-gather's output until the next unit's copy-out, for overlap)."""

    def __init__(self, stage: nn.Module, units: list[_Unit]) -> None:
        self.stage, self.units = stage, units
        self.buffers = 0  # bytes of all-gather outputs alive
        self.peak = self.with_buffers = 0

    def reset(self) -> None:
        self.peak = self.with_buffers = 0
        self.read()

    def read(self) -> None:
        held = pending = 0
        for unit in self.units:
            params = [self.stage.get_parameter(n) for n in unit.names]
            whole = [p for p in params if not isinstance(p, DTensor)]
            if whole:
                unit.pending = 0  # copied out: counted as its parameters now
            held += sum(p.numel() * p.element_size() for p in whole)
            pending += unit.pending
        self.peak = max(self.peak, held + pending)
        self.with_buffers = max(self.with_buffers, held + self.buffers)

    def freed(self, unit: _Unit, serial: int, nbytes: int) -> None:
        """An all-gather output of `unit` is gone: copied out (it is not pending any more)."""
        self.buffers -= nbytes
        if unit.buffer == serial:
            unit.pending = 0


class _CountedAllGather(GuardedAllGather):
    """graphpipe's guarded all-gather for one unit, counting its output buffers."""

    def __init__(self, what: str, gathered: _Gathered, unit: _Unit) -> None:
        super().__init__(what)
        self.gathered, self.unit = gathered, unit

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        buffer = super().allocate(size, dtype=dtype, device=device)
        nbytes = buffer.numel() * buffer.element_size()
        self.unit.pending, self.unit.buffer = nbytes, self.unit.buffer + 1
        self.gathered.buffers += nbytes
        weakref.finalize(buffer, self.gathered.freed, self.unit, self.unit.buffer, nbytes)
        return buffer

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        super().__call__(output_tensor, input_tensor, group, async_op)
        self.gathered.read()


def _instrument(stage: nn.Module) -> _Gathered:
    """Count `stage`'s gathered bytes at every all-gather and every unit's forward."""
    paths = [path for path, m in stage.named_modules() if isinstance(m, FSDPModule)]
    deepest = {
        name: max((p for p in paths if p == "" or name.startswith(p + ".")), key=len)
        for name, _ in stage.named_parameters()
    }
    units = {path: _Unit([n for n, p in deepest.items() if p == path]) for path in paths}
    gathered = _Gathered(stage, list(units.values()))
    for path, unit in units.items():
        module = cast(FSDPModule, stage.get_submodule(path))
        what = f"FSDP2's all-gather of {path or 'the stage root'} (counted)"
        module.set_custom_all_gather(_CountedAllGather(what, gathered, unit))  # type: ignore[arg-type]
        cast(nn.Module, module).register_forward_pre_hook(lambda m, a: gathered.read())
    return gathered


def _sizes(stage: nn.Module, model: nn.Module) -> dict[str, int]:
    """The stage's parameter bytes: whole, its root's own (under no layer), its largest
    layer's."""
    prefixes = block_prefixes(model)
    by_block: dict[str, int] = {}
    for name, p in stage.named_parameters():
        block = next((b for b in prefixes if name.startswith(b + ".")), "")
        by_block[block] = by_block.get(block, 0) + p.numel() * p.element_size()
    root = by_block.pop("", 0)
    return {"stage": root + sum(by_block.values()), "root": root, "block": max(by_block.values())}


def _compile(model: nn.Module) -> Any:
    ids, _ = _batch(0)
    half = len(model.model.layers) // 2
    pins = {"model.embed_tokens": 0, "lm_head": 1}
    pins.update({f"model.layers.{i}": int(i >= half) for i in range(2 * half)})
    return gp_compile(
        model,
        {"input_ids": ids, "use_cache": False},
        loss_fn=_lm_loss,
        optimizer=functools.partial(torch.optim.SGD, lr=0.01),
        micro_batches=M,
        schedule="1f1b",
        pins=pins,
        dp=2,
        profile=ProfileConfig(mode="flops"),
        runtime=RuntimeConfig(timeout=120, quiet=True),
    )


def _measure(layers: int, layout: str) -> dict[str, Any]:
    """One layout's pipeline: two steps, the second's peak of gathered bytes."""
    model = llama(layers)
    if layout == "one unit":
        with mock.patch("graphpipe.runtime.mesh.outline_blocks", lambda stage, model: []):
            pm = _compile(model)
    else:
        pm = _compile(model)
    if layout == "blocks, kept":
        pm.module.meta.pop(RESHARDING)
    gathered = _instrument(pm.module)
    pm.step(input_ids=_batch(1)[0], target=_batch(1)[1])
    gathered.reset()
    pm.step(input_ids=_batch(2)[0], target=_batch(2)[1])
    units = sum(isinstance(m, FSDPModule) for m in pm.module.modules())
    return {
        "index": pm.rank,
        "units": units,
        "peak": gathered.peak,
        "with_buffers": gathered.with_buffers,
        **_sizes(pm.module, model),
    }


def _worker(layers: int) -> dict[str, dict[str, Any]]:
    return {layout: _measure(layers, layout) for layout in LAYOUTS}


def report(layers: int = 8) -> str:
    """Run the 4 processes and return the figures as a markdown section."""
    log(f"fsdp units: an exported {layers}-layer Llama on pp2 x dp2, three layouts")
    results = launch(_worker, 4, args=(layers,), timeout=900)
    rows = []
    for layout in LAYOUTS:
        for rank in (0, 2):  # dp index 0 of each pp coordinate (dp ranks hold equal shards)
            r = results[rank][layout]
            twin = results[rank + 1][layout]
            assert (twin["peak"], twin["stage"]) == (r["peak"], r["stage"]), (r, twin)
            rows.append(
                [
                    layout,
                    r["index"],
                    r["units"],
                    f"{r['stage'] / MIB:.2f}",
                    f"{r['block'] / MIB:.2f}",
                    f"{r['root'] / MIB:.2f}",
                    f"{r['peak'] / MIB:.2f}",
                    f"{r['peak'] / r['stage']:.2f}",
                    f"{(r['peak'] - r['root']) / r['block']:.2f}",
                    f"{r['with_buffers'] / MIB:.2f}",
                ]
            )
    headers = [
        "layout", "stage", "FSDP units", "stage MiB", "largest layer MiB", "root MiB",
        "peak gathered MiB", "peak / stage", "(peak - root) / layer",
        "peak with FSDP2's kept buffers MiB",
    ]  # fmt: skip
    return (
        "\n".join(
            [
                "## Issue 36: FSDP2 units of an exported stage, gathered parameters (measured)",
                "",
                f"{machine()}; `python -m benchmarks.fsdp_units"
                f"{'' if layers == 8 else f' --layers {layers}'}`",
                "",
                f"Hugging Face Llama (random weights, width 256, MLP 512, vocabulary {V}, {layers} "
                f"decoder layers, {layers // 2} per stage) traced by torch.export, pp2 x dp2 on 4 "
                f"gloo processes, 1f1b, M = {M}, reshard_after_forward; float32. Peak of the "
                "parameter bytes gathered at once during the second step, on each stage's dp "
                "rank 0 (its dp peer measured the same).",
                "",
                tabulate(rows, headers, tablefmt="github"),
            ]
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (even)")
    args = parser.parse_args()
    print(report(args.layers))


if __name__ == "__main__":
    main()
