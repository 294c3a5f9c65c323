"""Autoplan: the planner's mesh choice (`mesh="auto"`) against the brute-force grid.

    python -m benchmarks.autoplan                           # every table (long: the grid)
    python -m benchmarks.autoplan --devices 8 32 --no-grid  # the choice only, at 8 and 32
    python -m benchmarks.autoplan --torchtitan 8b           # beside torchtitan's 8B mesh
    python -m benchmarks.autoplan --models mmt --devices 64 128 256 512 --no-grid
    python -m benchmarks.autoplan --models llama-0.9b --devices 512 --no-grid --workers 2

Everything is simulated, on the same costs: op times from the H100 roofline
(`ProfileConfig(mode="roofline", preset="h100")`), bf16 values between ops and stages
(`precision="bf16"`; parameters and optimizer state float32, AdamW's 2 slots), 80 GiB per
device, `h100x8` nodes (`graphpipe.planning.devices.NODES`: 8 GPUs on 450 GB/s NVLink, 50
GB/s per GPU across nodes). Models, on the meta device:

    llama-0.9b  a Llama-like Hugging Face model (hidden 2048, 16 layers, 16 heads, FFN 5504,
                vocab 32000: 0.94 B parameters), 64 x 1024 tokens, its base_model_tp_plan
    mmt         models.mmt's paper preset (4 towers x 8 layers, hidden 1024), batch 64; no
                tp plan, so tp = 1

Per device count N: the auto choice (`automesh.choose`: branch and bound, on `--workers`
forked processes, every core by default) and its plan time, the grid's best (`automesh.grid`:
every mesh of the same space planned, none pruned, on one process) and its time, their
ratio, and the step against the compute-bound ideal (one device's best step / N). The grid
plans each mesh as the search does (each its own cut: a candidate's plan depends on nothing
else), so the ratio measures what pruning loses: nothing, where the bounds hold.

`--torchtitan`: Llama 3.1 8B, 70B and 405B (Hugging Face configs on the meta device, 8192
tokens per sequence) at torchtitan's published meshes (docs/performance.md, "Grand Teton"
runs: 8B on 8 GPUs FSDP 8, global batch 16; 70B on 256 GPUs FSDP 32 x TP 8, global batch
512; 405B on 512 GPUs FSDP 8 x TP 8 x PP 8, global batch 256), each simulated at its best
M, beside graphpipe's choice on the same simulated cluster.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tabulate import tabulate
from torch import fx, nn

from benchmarks._common import log, machine
from graphpipe.planning.automesh import Candidate, MeshSearch, Scored, choose, grid
from graphpipe.planning.partition import PlanConfig
from graphpipe.planning.profile import Profile, ProfileConfig, profile
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import flat_inputs, trace

GIB = 1 << 30
ROOFLINE = ProfileConfig(mode="roofline", preset="h100")
NODE = "h100x8"
BUDGET = 80 * GIB
DEVICES = (8, 16, 32, 64, 128, 256, 512)
# torchtitan's published meshes: model -> (devices, pp, dp, tp, global batch)
TORCHTITAN = {"8b": (8, 1, 8, 1, 16), "70b": (256, 1, 32, 8, 512), "405b": (512, 8, 8, 8, 256)}
LLAMA3 = {  # Llama 3.1's configs (hidden, layers, heads, kv heads, FFN), vocab 128256
    "8b": (4096, 32, 32, 8, 14336),
    "70b": (8192, 80, 64, 8, 28672),
    "405b": (16384, 126, 128, 8, 53248),
}


@dataclass(frozen=True)
class Traced:
    """A model traced and profiled at its whole mini-batch, with its plan options."""

    name: str
    gm: fx.GraphModule
    prof: Profile
    tp_plan: dict[str, str] | None


def _llama(hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=ffn,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv,
                max_position_embeddings=8192,
            )
        )


def _traced_llama(name: str, model: nn.Module, batch: int, seq: int) -> Traced:
    from graphpipe.runtime.tp import model_tp_plan

    ids = torch.randint(0, 1000, (batch, seq))
    gm = trace(model, {"input_ids": ids, "use_cache": False}, micro_batch_size=batch)
    return Traced(name, gm, profile(gm, (), batch, ROOFLINE), model_tp_plan(model))


def llama_09b() -> Traced:
    """The issue's ~0.9 B Llama-like model at 64 x 1024 tokens."""
    return _traced_llama("llama-0.9b", _llama(2048, 16, 16, 16, 5504, 32000), 64, 1024)


def mmt() -> Traced:
    """models.mmt's paper preset."""
    w = load_workload("models.mmt", "paper")
    b = w.batch_size
    gm = trace(w.model, w.example_inputs, leaf_modules=w.leaf_modules, micro_batch_size=b)
    prof = profile(gm, flat_inputs(gm, *w.example_inputs), b, ROOFLINE)
    return Traced("mmt", gm, prof, None)


def _config(t: Traced, devices: int) -> PlanConfig:
    return PlanConfig(
        devices=devices,
        micro_batches=1,
        memory_budget=BUDGET,
        profile=ROOFLINE,
        precision="bf16",
        tp_plan=t.tp_plan,
    )


def _auto(t: Traced, devices: int, workers: int = 1) -> tuple[Any, float, float]:
    """(plan, simulated step, plan seconds) of the auto choice, planned on `workers`
    processes (`MeshSearch.workers`)."""
    start = time.perf_counter()
    plan = choose(t.gm, t.prof, _config(t, devices), MeshSearch(node=NODE, workers=workers))
    return plan, simulate(plan).iteration_time, time.perf_counter() - start


def _grid_best(t: Traced, devices: int) -> tuple[Scored, float]:
    start = time.perf_counter()
    every = [s for s in grid(t.gm, t.prof, _config(t, devices), MeshSearch(node=NODE)) if s.plan]
    return min(every, key=lambda s: s.step), time.perf_counter() - start


def rows(t: Traced, devices: tuple[int, ...], with_grid: bool, workers: int) -> list[list[Any]]:
    """One row per device count."""
    _, one, _ = _auto(t, 1)
    log(f"{t.name}: one device {one * 1e3:.1f} ms")
    table = []
    for n in devices:
        plan, step, seconds = _auto(t, n, workers)
        mesh = f"{plan.dims}, M {plan.micro_batches}"
        said = f"{mesh} {plan.schedule} {step * 1e3:.1f} ms in {seconds:.1f} s"
        log(f"{t.name} N={n}: {said}")
        row = [t.name, n, f"{mesh}, {plan.layout}/{plan.schedule}"]
        row += [f"{step * 1e3:.1f}", f"{seconds:.1f}"]
        if with_grid:
            best, grid_s = _grid_best(t, n)
            row += [str(best.candidate), f"{best.step * 1e3:.1f}", f"{step / best.step:.3f}"]
            log(f"{t.name} N={n}: the grid's best {row[-3]} {row[-2]} ms in {grid_s:.0f} s")
            row.append(f"{grid_s:.0f}")
        else:
            row += ["", "", "", ""]
        row += [f"{one / n * 1e3:.1f}", f"{step / (one / n):.2f}"]
        table.append(row)
    return table


HEADERS = [
    "model", "N", "auto mesh, layout/schedule", "auto ms", "plan s", "grid best", "grid ms",
    "auto/grid", "grid s", "ideal ms", "auto/ideal",
]  # fmt: skip


def torchtitan_rows(names: list[str], workers: int) -> list[list[Any]]:
    """graphpipe's choice beside torchtitan's published mesh, both simulated."""
    table = []
    for name in names:
        n, pp, dp, tp, batch = TORCHTITAN[name]
        hidden, layers, heads, kv, ffn = LLAMA3[name]
        start = time.perf_counter()
        t = _traced_llama(
            f"llama3.1-{name}", _llama(hidden, layers, heads, kv, ffn, 128256), batch, 8192
        )
        log(f"{t.name}: traced in {time.perf_counter() - start:.0f} s")
        config = _config(t, n)
        plan, step, seconds = _auto(t, n, workers)
        theirs = _best_at(t, config, Candidate(pp, dp, tp, 1), batch)
        table.append(
            [t.name, n, batch, f"pp {pp} x dp {dp} x tp {tp}", _ms(theirs),
             f"{plan.dims}, M {plan.micro_batches}",
             plan.schedule, f"{step * 1e3:.0f}", f"{seconds:.0f}"]
        )  # fmt: skip
    return table


def _best_at(t: Traced, config: PlanConfig, mesh: Candidate, batch: int) -> Scored | None:
    """The mesh at its best M (every M the search would try), planned as the search plans."""
    from graphpipe.planning.automesh import _micro_batches, _state

    search = MeshSearch(node=NODE)
    state = _state(t.gm, t.prof, config, search, batch)
    found = [
        state.evaluate(Candidate(mesh.pp, mesh.dp, mesh.tp, m), search.reshard)
        for m in _micro_batches(batch // mesh.dp, "auto")
    ]
    planned = [s for s in found if s.plan is not None]
    return min(planned, key=lambda s: s.step) if planned else None


def _ms(s: Scored | None) -> str:
    return "no plan fits" if s is None else f"{s.step * 1e3:.0f} (M {s.candidate.micro_batches})"


MODELS: dict[str, Callable[[], Traced]] = {"llama-0.9b": llama_09b, "mmt": mmt}


def report(
    devices: tuple[int, ...],
    with_grid: bool,
    titan: list[str],
    models: list[str] | None = None,
    workers: int = 1,
) -> str:
    """The markdown section (`models`: names of `MODELS`, all by default; the auto choice
    planned on `workers` processes, the grid on one)."""
    chosen = [MODELS[name] for name in models or MODELS]
    table = [r for build in chosen for r in rows(build(), devices, with_grid, workers)]
    text = (
        "## Issue 38: the whole mesh planned\n\n"
        f"`python -m benchmarks.autoplan --workers {workers}` on {machine()}; simulated: H100 "
        f"roofline op times, bf16 values, 80 GiB per device, {NODE} nodes. The auto choice "
        f"planned on {workers} worker process(es), the grid on one.\n\n"
        + tabulate(table, headers=HEADERS, tablefmt="github")
        + "\n"
    )
    if titan:
        headers = ["model", "N", "batch", "torchtitan", "its step ms", "graphpipe", "schedule",
                   "step ms", "plan s"]  # fmt: skip
        made = torchtitan_rows(titan, workers)
        text += "\n" + tabulate(made, headers=headers, tablefmt="github") + "\n"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
    parser.add_argument("--no-grid", action="store_true", help="the auto choice only")
    parser.add_argument("--torchtitan", nargs="*", default=None, choices=sorted(TORCHTITAN))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="processes the auto choice plans on (default: every core)",
    )
    args = parser.parse_args()
    titan = sorted(TORCHTITAN) if args.torchtitan == [] else (args.torchtitan or [])
    print(report(tuple(args.devices), not args.no_grid, titan, args.models, args.workers))


if __name__ == "__main__":
    main()
