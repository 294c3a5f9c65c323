"""Render the gallery: for every model in `models/`, three SVG pictures.

    python -m viz                          # the paper presets on 8 devices -> viz/gallery/
    python -m viz --out /tmp/g --devices 4 --models mmt dlrm

    <model>-ops.svg       the op graph, one coloured box per stage of the graph plan
    <model>-stages.svg    the graph plan's stage graph beside the sequential plan's
    <model>-timeline.svg  the graph plan's best flushed schedule, simulated

Planning the paper presets needs no memory: they are built on the meta device.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from graphpipe.planning.partition import PlanConfig, micro_batch_size, partition
from graphpipe.planning.profile import profile
from graphpipe.tools.cli import best_schedule
from graphpipe.tools.render import render, side_by_side
from graphpipe.tools.timeline import timeline_svg
from graphpipe.tools.workload import load_workload
from graphpipe.tracing.tracer import trace

MODELS = ("mmt", "dlrm", "candle_uno", "nbranch", "inception", "vlm")
KINDS = ("ops", "stages", "timeline")


def render_gallery(
    out: Path, models: Sequence[str] = MODELS, preset: str = "paper", devices: int = 8
) -> list[Path]:
    """Write the three pictures of every model into `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in models:
        w = load_workload(f"models.{name}", preset)
        gm = trace(w.model, w.example_inputs, w.leaf_modules)
        prof = profile(gm, w.example_inputs, micro_batch_size(w.batch_size, w.micro_batches))
        plans = {
            kind: partition(gm, prof, PlanConfig(devices, w.micro_batches, kind))
            for kind in ("graph", "sequential")
        }
        schedule, run = best_schedule(plans["graph"], "best")
        pictures = {
            "ops": render(gm, plans["graph"]).pipe(format="svg"),
            "stages": side_by_side([plans["graph"], plans["sequential"]]).pipe(format="svg"),
            "timeline": timeline_svg(run.timeline).encode(),
        }
        for kind, svg in pictures.items():
            path = out / f"{name}-{kind}.svg"
            path.write_bytes(svg)
            written.append(path)
        print(
            f"{name}: {len(plans['graph'].stages)} stages, depth {plans['graph'].depth} "
            f"(sequential: depth {plans['sequential'].depth}), schedule {schedule}",
            flush=True,
        )
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line."""
    parser = argparse.ArgumentParser(prog="python -m viz", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "gallery")
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(argv)
    files = render_gallery(args.out, args.models, args.preset, args.devices)
    print(f"wrote {len(files)} pictures to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
