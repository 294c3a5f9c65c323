"""VLM at scale: what the graph buys a vision-language model, frozen encoder and trained.

    python -m benchmarks.vlm                          # the table in BENCHMARKS.md
    python -m benchmarks.vlm --devices 16 --cases one-image

Everything is simulated on the same costs: `models.vlm`'s paper preset (LLaVA-1.5-7B's
sizes: a 0.3 B ViT-L/14 at 576 patches, a 7 B-class decoder, 512 text tokens, batch 64) on
the meta device, op times from the H100 roofline, bf16 values, float32 weights and AdamW's
2 slots, 80 GiB per device, h100x8 nodes (450 GB/s NVLink inside, 50 GB/s per GPU across).
Its layers are torch.nn's, with no tp plan: meshes are pp x dp (FSDP2 over dp).

Cases: one image per sample (the encoder a few % of the step's FLOPs), and many images
pooled into few tokens each (`merge` patches per image token, as Qwen2-VL's merger and
video models pool) so that the encoder is at least 20% of the step's FLOPs; each with the
encoder trained and frozen (LLaVA's recipe: forward only, `Stage.backward` False).

Per case and N, three plans, each at its best mesh and M:
- graphpipe: `mesh="auto"` (the graph partitioner, every layout, pp x dp and M chosen);
- torchtitan: its VLM layout, the whole encoder (with the projector and the embedding) on
  pipeline stage 0 and the decoder's layers split evenly over the pp stages, one stage per
  rank or two folded loop or v (its interleaved and ZBV schedules), every pp x dp at every M
  the search tries, the best kept;
- sequential: graphpipe's own best sequential pipeline (PipeDream's DP cut, `mesh="auto"`).
Columns: the encoder's share of the step's FLOPs, each plan's mesh / layout / schedule and
simulated step, and the ratios torchtitan / graphpipe and sequential / graphpipe (above 1:
graphpipe is faster).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tabulate import tabulate
from torch import fx

from benchmarks._common import log, machine
from graphpipe.errors import PlanError, ScheduleError
from graphpipe.planning.automesh import Candidate, MeshSearch, choose
from graphpipe.planning.opgraph import graph_hash
from graphpipe.planning.partition import PlanConfig, partition_op_graph
from graphpipe.planning.profile import Profile, ProfileConfig, profile
from graphpipe.scheduling.simulate import simulate
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import flat_inputs, trace

GIB = 1 << 30
ROOFLINE = ProfileConfig(mode="roofline", preset="h100")
NODE = "h100x8"
BUDGET = 80 * GIB
DEVICES = (16, 32, 64)
# torchtitan's pipeline layouts: one stage per rank (1F1B, GPipe, ZB), or two stages per rank
# folded loop (Interleaved1F1B) or v (ZBV); each simulated under the schedules that run it
TORCHTITAN_LAYOUTS = (("one", 1), ("loop", 2), ("v", 2))
TORCHTITAN_SCHEDULES = {
    "one": ("gpipe", "1f1b", "zb"),
    "loop": ("interleaved", "interleaved_zb"),
    "v": ("zbv", "dualpipev"),
}
# case -> models.vlm options: one image; many images pooled (the encoder >= 20% of FLOPs)
CASES: dict[str, dict[str, Any]] = {
    "one-image": {"images": 1, "merge": 1},
    "one-image-frozen": {"images": 1, "merge": 1, "frozen": True},
    "8-images": {"images": 8, "merge": 16},
    "32-images-frozen": {"images": 32, "merge": 64, "frozen": True},
}


@dataclass(frozen=True)
class Traced:
    """A case traced and profiled at its whole mini-batch."""

    name: str
    gm: fx.GraphModule
    prof: Profile
    layers: int  # decoder layers
    batch: int


def traced(name: str) -> Traced:
    """The case's paper preset, traced on meta and profiled on the H100 roofline."""
    w = load_workload("models.vlm", "paper", **CASES[name])
    b = w.batch_size
    gm = trace(w.model, w.example_inputs, micro_batch_size=b)
    prof = profile(gm, flat_inputs(gm, *w.example_inputs), b, ROOFLINE)
    return Traced(name, gm, prof, int(w.options["layers"]), b)


def encoder_share(t: Traced) -> float:
    """The encoder's share of the step's FLOPs: forward and backward (2x the forward)
    where a gradient runs through an op, forward alone where none does (frozen)."""
    total = encoder = 0.0
    for node in t.gm.graph.nodes:
        flops = node.meta.get("gp_flops", 0)
        work = flops * (3 if node.meta.get("gp_grad", True) else 1)
        total += work
        if str(node.meta.get("gp_module", "")).startswith("vision"):
            encoder += work
    return encoder / total if total else 0.0


def _config(devices: int, **options: Any) -> PlanConfig:
    return PlanConfig(
        devices=devices,
        micro_batches=1,
        memory_budget=BUDGET,
        profile=ROOFLINE,
        precision="bf16",
        **options,
    )


def torchtitan_pins(layers: int, pp: int) -> dict[str, int]:
    """torchtitan's VLM layout: the encoder, projector and embedding on stage 0 with the
    first of the decoder's layers split evenly, the head on the last stage."""
    pins = {"vision": 0, "projector": 0, "embed": 0, "norm": pp - 1, "head": pp - 1}
    for i in range(layers):
        pins[f"decoder.{i}"] = i * pp // layers
    return pins


def _auto(t: Traced, devices: int, **options: Any) -> tuple[Any, float]:
    plan = choose(t.gm, t.prof, _config(devices, **options), MeshSearch(node=NODE))
    return plan, simulate(plan).iteration_time


def _torchtitan(t: Traced, devices: int) -> tuple[str, float]:
    """The best pp x dp, M and schedule of torchtitan's layout (one stage per rank, or two
    folded loop or v), planned by pins on the search's rank graph and costs."""
    from graphpipe.planning.automesh import _micro_batches, _state

    best: tuple[float, str] = (float("inf"), "no plan fits")
    search = MeshSearch(node=NODE)
    state = _state(t.gm, t.prof, _config(devices), search, t.batch)
    for pp in (p for p in range(2, devices + 1) if devices % p == 0 and 2 * p <= t.layers):
        dp = devices // pp
        for m in _micro_batches(t.batch // dp, "auto"):
            c = Candidate(pp, dp, 1, m)
            g = state.ranks(state.rows(c), 1).g
            for reshard in search.reshard:
                cost = state.cost(c, reshard)
                for layout, v in TORCHTITAN_LAYOUTS:
                    step, name = _pinned(t, g, cost, c, layout, v)
                    if step < best[0]:
                        best = step, f"pp {pp} x dp {dp}, M {m}, {layout}/{name}"
    return best[1], best[0]


def _pinned(t: Traced, g: Any, cost: Any, c: Candidate, layout: str, v: int) -> tuple[float, str]:
    """torchtitan's cut of `c` on layout `layout` (v stages a rank) under the fastest
    schedule that runs it within the budget: (step, schedule), or (inf, why)."""
    config = replace(
        _config(c.pp, pins=torchtitan_pins(t.layers, c.pp * v), partitioner="manual"),
        micro_batches=c.micro_batches, layouts=(layout,), virtual_stages=v,
        placement="loop" if layout == "one" else layout,
    )  # fmt: skip
    try:
        plan = partition_op_graph(g, cost, config, graph_hash(t.gm))
    except PlanError as exc:
        return float("inf"), str(exc).splitlines()[0]
    best = float("inf"), "none fits"
    for name in TORCHTITAN_SCHEDULES[layout]:
        try:
            run = simulate(plan, name)
        except ScheduleError:
            continue
        if max(run.peak_memory, default=0) <= BUDGET and run.iteration_time < best[0]:
            best = run.iteration_time, name
    return best


def _said(plan: Any, step: float) -> str:
    return (
        f"{plan.dims}, M {plan.micro_batches}, {plan.layout}/{plan.schedule}: {step * 1e3:.0f} ms"
    )


def rows(cases: Sequence[str], devices: Sequence[int]) -> list[list[Any]]:
    """One row per case and device count."""
    table = []
    for name in cases:
        start = time.perf_counter()
        t = traced(name)
        share = encoder_share(t)
        log(f"{name}: traced in {time.perf_counter() - start:.0f} s, encoder {share:.0%}")
        for n in devices:
            start = time.perf_counter()
            ours, ours_step = _auto(t, n)
            seq, seq_step = _auto(t, n, partitioner="sequential")
            titan, titan_step = _torchtitan(t, n)
            log(f"{name} N={n}: {_said(ours, ours_step)}; torchtitan {titan} "
                f"{titan_step * 1e3:.0f} ms; sequential {_said(seq, seq_step)} "
                f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
            table.append(
                [name, f"{share:.0%}", n, _said(ours, ours_step),
                 f"{titan}: {titan_step * 1e3:.0f} ms", _said(seq, seq_step),
                 f"{titan_step / ours_step:.2f}", f"{seq_step / ours_step:.2f}"]
            )  # fmt: skip
    return table


HEADERS = [
    "case", "encoder FLOPs", "N", "graphpipe (auto)", "torchtitan's layout", "sequential",
    "torchtitan / graphpipe", "sequential / graphpipe",
]  # fmt: skip


def report(cases: Sequence[str] = tuple(CASES), devices: Sequence[int] = DEVICES) -> str:
    """The markdown section."""
    table = rows(cases, devices)
    return (
        "## Issue 49: a VLM at scale, the graph against torchtitan's layout\n\n"
        f"`python -m benchmarks.vlm` on {machine()}; simulated: models.vlm paper (LLaVA-1.5-7B "
        f"sizes), H100 roofline op times, bf16 values, 80 GiB per device, {NODE} nodes.\n\n"
        + tabulate(table, headers=HEADERS, tablefmt="github")
        + "\n"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
    args = parser.parse_args(argv)
    print(report(args.cases, args.devices))


if __name__ == "__main__":
    main()
