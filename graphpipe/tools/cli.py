"""The `graphpipe` command line.

    graphpipe plan models.mmt --devices 8                     graph and sequential plans, tables
    graphpipe plan models.mmt --preset paper --devices 32 --render plans.svg
    graphpipe plan path/to/model.py:make --devices 4 --json plan.json
    graphpipe plan models.nbranch --devices 8 --schedule zb --timeline zb.svg --trace zb.json
    graphpipe plan models.mmt --devices 16 --dp 2             pp 8 x dp 2 (FSDP over dp)
    graphpipe plan models.mmt --devices 16 --dp auto          the planner chooses pp x dp
    graphpipe plan models.mmt --devices 8 --tp 2 --tp-plan '{"*.fc1": "colwise", ...}'
    graphpipe run models.mmt --devices 2                      train it on 2 local processes
    graphpipe run models.mmt --devices 4 --dp 2               pp 2 x dp 2 on 4 local processes
    graphpipe run models.mmt --devices 2 --checkpoint-every 10 --resume auto
                                                              go on from the last checkpoint

MODEL follows the factory protocol of `graphpipe.tools.workload`: a module path such as
`models.mmt`, or `file.py:function`. Progress goes to stderr, tables to stdout. Errors print one
message naming the bad value and exit with status 2.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from graphpipe.errors import ConfigError, GraphPipeError
from graphpipe.ir import ANY_PLACEMENT, DEFAULT_SCHEDULE, Plan, schedule_names, schedule_spec
from graphpipe.ir.cost import LinkModel
from graphpipe.ir.plan import layout_lines
from graphpipe.planning.layouts import LAYOUTS
from graphpipe.planning.partition import micro_batch_size, partition, planner_config
from graphpipe.planning.profile import ProfileConfig, profile
from graphpipe.runtime.checkpoint import export_checkpoint
from graphpipe.runtime.tp import resolve_tp_plan
from graphpipe.scheduling.simulate import SimResult, simulate
from graphpipe.tools.flags import add_flags, given
from graphpipe.tools.render import render, side_by_side
from graphpipe.tools.report import (
    compare_plans,
    modules_of,
    plan_summary,
    plan_table,
    schedule_summary,
    schedule_table,
)
from graphpipe.tools.timeline import chrome_trace, timeline_svg
from graphpipe.tools.train import TrainConfig, train
from graphpipe.tools.workload import Workload, find_workload, load_workload
from graphpipe.tracing.split import InputSplit
from graphpipe.tracing.tracer import trace

__all__ = ["main"]

GIB = 1 << 30
TRAINING = schedule_names(training=True)
FLUSHED = schedule_names(training=True, asynchronous=False, placement=None)  # "best" tries them


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except GraphPipeError as exc:
        print(f"graphpipe: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphpipe", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    _plan_parser(commands)
    _run_parser(commands)
    _export_parser(commands)
    return parser


# compile's options each subcommand takes as flags (`graphpipe.tools.flags`: one definition)
PLAN_OPTIONS = (
    "micro_batches", "memory_budget", "replication", "dp", "tp", "tp_plan", "interleave",
    "precision", "weights", "input_split",
)  # fmt: skip
RUN_OPTIONS = (
    "micro_batches", "schedule", "weights", "dp", "tp", "tp_plan", "replication",
    "max_grad_norm", "recompute", "compile_stages", "precision", "memory_budget", "timeout",
    "host_cache", "input_split",
)  # fmt: skip


def _plan_parser(commands: Any) -> None:
    """`graphpipe plan`: its arguments."""
    plan = commands.add_parser(
        "plan",
        help="plan a model and print its stages",
        description="Trace, profile and partition MODEL.",
    )
    _model_arguments(plan)
    plan.add_argument(
        "--partitioner",
        choices=("graph", "sequential", "both"),
        default="both",
        help="which plan(s) to make (default: both, side by side)",
    )
    add_flags(plan, PLAN_OPTIONS, help_extra={"dp": "'auto' tries every K, keeps the fastest"})
    plan.add_argument(
        "--profile",
        choices=("auto", "flops", "measure"),
        default="auto",
        help="op times measured on --device, or from FLOPs (fast, the same every run); "
        "auto (default): measured, from FLOPs for a model on the meta device (--preset paper)",
    )
    plan.add_argument(
        "--device", default=None, help="device to measure on (default: the model's own)"
    )
    plan.add_argument(
        "--bandwidth",
        type=float,
        default=12.5,
        metavar="GB/s",
        help="link bandwidth per device (default: 12.5)",
    )
    plan.add_argument(
        "--schedule",
        default=None,
        choices=(*sorted(TRAINING), "best"),
        help="schedule to run; the graph plan considers only the layouts it runs (default: "
        f"the planner's, with the layout it chose: {DEFAULT_SCHEDULE} on one stage per "
        "device; best: the fastest flushed one on one stage per device)",
    )
    _plan_outputs(plan)
    plan.set_defaults(func=_plan_command)


def _plan_outputs(plan: argparse.ArgumentParser) -> None:
    """`graphpipe plan`'s files: the plan's JSON, its pictures and simulated timelines."""
    plan.add_argument("--json", type=Path, metavar="FILE", help="write the (graph) plan as JSON")
    plan.add_argument(
        "--render",
        type=Path,
        metavar="FILE.svg",
        help="draw the stage graph(s); the suffix picks the format",
    )
    plan.add_argument(
        "--render-ops", type=Path, metavar="FILE.svg", help="draw the op graph coloured by stage"
    )
    plan.add_argument(
        "--timeline",
        type=Path,
        metavar="FILE.svg",
        help="draw the (graph) plan's simulated timeline; comparing both partitioners, the "
        "sequential plan's goes beside it, FILE-sequential.svg",
    )
    plan.add_argument(
        "--trace",
        type=Path,
        metavar="FILE.json",
        help="write the simulated timeline as a Chrome/Perfetto trace (the sequential "
        "plan's beside it, FILE-sequential.json, comparing both)",
    )


def _run_parser(commands: Any) -> None:
    """`graphpipe run`: its arguments."""
    run = commands.add_parser(
        "run",
        help="train a model pipelined across local processes",
        description=(
            "Train MODEL on synthetic data, one process per device (see graphpipe.tools.train)."
        ),
    )
    _model_arguments(run, devices_default=2)
    run.add_argument("--steps", type=int, default=40, help="training steps (default: 40)")
    run.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate (default: 3e-3)")
    run.add_argument(
        "--profile",
        choices=("measure", "flops"),
        default="measure",
        help="op times for planning (default: measured on this machine)",
    )
    run.add_argument("--out", help="folder for the pictures (default: runs/<model>)")
    add_flags(run, RUN_OPTIONS, help_extra={"micro_batches": "None here: the preset's"})
    _checkpoint_arguments(run)
    run.set_defaults(func=_run_command)


def _export_parser(commands: Any) -> None:
    """`graphpipe export`: its arguments."""
    export = commands.add_parser(
        "export",
        help="a checkpoint directory (pm.save) as a plain state_dict file",
        description="Write the model of a checkpoint directory saved by pm.save as a "
        "torch.save state dict that loads into the unpipelined model (strict).",
    )
    export.add_argument("checkpoint", type=Path, help="the directory pm.save wrote")
    export.add_argument("out", type=Path, help="the state dict file to write")
    export.set_defaults(func=_export_command)


def _checkpoint_arguments(run: argparse.ArgumentParser) -> None:
    """`graphpipe run`'s checkpoint and resume flags."""
    run.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        metavar="N",
        help="keep a checkpoint every N steps and after the last one (default: 0, none)",
    )
    run.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="where the checkpoints go, one step-N folder each (default: OUT/checkpoints)",
    )
    run.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="K",
        help="how many of the newest checkpoints to keep (default: 3)",
    )
    run.add_argument(
        "--resume",
        choices=("never", "auto"),
        default="never",
        help="auto: go on from the latest complete checkpoint in DIR, if any (under "
        "torchrun --max-restarts, a restarted group resumes by itself)",
    )


def _export_command(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.checkpoint, args.out)
    _log(f"wrote {out}")
    return 0


def _run_command(args: argparse.Namespace) -> int:
    find_workload(args.model)  # a bad MODEL is one line here, not one per rank
    train(
        TrainConfig(
            model=args.model,
            preset=args.preset,
            options=parse_options(args.option),
            devices=args.devices,
            compile_options=given(args, RUN_OPTIONS),
            steps=args.steps,
            lr=args.lr,
            profile=args.profile,
            out=args.out,
            checkpoint_every=args.checkpoint_every,
            checkpoint_dir=args.checkpoint_dir,
            keep_checkpoints=args.keep_checkpoints,
            resume=args.resume,
        )
    )
    return 0


def _model_arguments(parser: argparse.ArgumentParser, devices_default: int | None = None) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="models.NAME or path/file.py:function (see graphpipe.tools.workload)",
    )
    parser.add_argument(
        "--devices",
        "-n",
        type=int,
        required=devices_default is None,
        default=devices_default,
        help="number of devices (processes)",
    )
    parser.add_argument("--preset", default="cpu", help="model preset: tiny, cpu or paper")
    parser.add_argument(
        "--option",
        "-o",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model option, e.g. -o branches=4 (repeatable)",
    )


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """`["branches=4", "name=x"]` -> `{"branches": 4, "name": "x"}`."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"model options are KEY=VALUE, got {pair!r}")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    return options


def _log(message: str) -> None:
    print(f"[graphpipe] {message}", file=sys.stderr, flush=True)


def _timed(what: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    result = fn()
    _log(f"{what} in {time.perf_counter() - start:.2f} s")
    return result


def load(args: argparse.Namespace) -> Workload:
    """The workload named on the command line."""
    _log(f"building {args.model} (preset {args.preset})")
    return load_workload(args.model, args.preset, **parse_options(args.option))


def _traced(w: Workload, rows: int, rules: Any) -> Any:
    """The workload traced at the micro-batch size it is profiled at (an exported graph
    runs at its traced size only), its inputs split by `rules` (input_split)."""
    split = InputSplit(rules)
    return trace(
        w.model, w.example_inputs, w.leaf_modules, micro_batch_size=rows, input_split=split
    )


def _plan_command(args: argparse.Namespace) -> int:
    w = load(args)
    options = given(args, PLAN_OPTIONS)
    m = options.pop("micro_batches", None) or w.micro_batches
    b = micro_batch_size(w.batch_size, m)
    gm = _timed("traced", lambda: _traced(w, b, options.get("input_split")))
    prof_cfg = ProfileConfig(mode=args.profile, device=args.device)
    prof = _timed(
        f"profiled ({args.profile})", lambda: profile(gm, w.example_inputs, b, prof_cfg, log=_log)
    )
    if (options.get("tp") or 1) > 1:
        options["tp_plan"] = resolve_tp_plan(w.model, options.get("tp_plan"))
    named = None if args.schedule in (None, "best") else args.schedule
    kinds = ("graph", "sequential") if args.partitioner == "both" else (args.partitioner,)
    plans: dict[str, Plan] = {}
    for kind in kinds:
        config = planner_config(
            args.devices,
            {},
            options
            | {
                "micro_batches": m,
                "partitioner": kind,
                "link": LinkModel(bandwidth=args.bandwidth * 1e9),
                "interleave": bool(options.get("interleave")) and kind == "graph",
                "schedule": named,
                "layouts": ("one",) if args.schedule == "best" else LAYOUTS,
            },
        )
        plans[kind] = _timed(
            f"{kind} plan searched", functools.partial(partition, gm, prof, config)
        )
    modules = modules_of(gm.graph.nodes)
    runs = {}
    for kind, plan in plans.items():
        name, run = best_schedule(plan, args.schedule)
        runs[kind] = run
        layouts = "".join(f"\n{line}" for line in layout_lines(plan.info.get("layouts")))
        print(f"\n{plan_summary(plan)}\nop costs: {plan.costs}{layouts}")
        print(plan_table(plan, modules))
        print(f"\n{schedule_summary(name, run)}\n{schedule_table(plan, run)}")
        _write_timeline(args, run, None if kind == kinds[0] else kind)
    if len(plans) == 2:
        print("\n" + compare_plans(plans["graph"], plans["sequential"]))
        ratio = runs["graph"].throughput / runs["sequential"].throughput
        print(f"simulated with their schedules: graph {ratio:.2f}x the sequential throughput")
    main_plan = plans[kinds[0]]
    if args.json:
        args.json.write_text(main_plan.to_json())
        _log(f"wrote {args.json}")
    if args.render:
        picture = side_by_side(list(plans.values())) if len(plans) > 1 else render(main_plan)
        _write_picture(picture, args.render)
    if args.render_ops:
        _write_picture(render(gm, main_plan), args.render_ops)
    return 0


def best_schedule(plan: Plan, name: str | None) -> tuple[str, SimResult]:
    """Simulate `name` on `plan`; "best" tries every flushed schedule and keeps the fastest;
    None: the plan's (`Plan.schedule`: the planner's choice with its layout). A plan whose
    devices hold several stages runs graph_interleaved unless `name` (or the planner's
    choice) is one of the placed schedules."""
    name = name or plan.schedule  # the planner's choice with its layout
    names = FLUSHED if name == "best" else [name]
    if plan.shared_devices() and (name == "best" or not schedule_spec(name).folds_chain):
        names = [ANY_PLACEMENT]
    runs = {n: simulate(plan, n) for n in names}
    best = max(runs, key=lambda n: runs[n].throughput)
    return best, runs[best]


def _write_timeline(args: argparse.Namespace, run: SimResult, other: str | None) -> None:
    """The simulated timeline at the paths asked for: the main plan's there, `other`'s (the
    second plan compared) beside them, `zb-sequential.svg`."""
    outputs = [
        (args.timeline, lambda: timeline_svg(run.timeline)),
        (args.trace, lambda: json.dumps(chrome_trace(run.timeline))),
    ]
    for path, text in outputs:
        if path:
            target = path.with_name(f"{path.stem}-{other}{path.suffix}") if other else path
            target.write_text(text())
            _log(f"wrote {target}")


def _write_picture(picture: Any, path: Path) -> None:
    fmt = path.suffix.lstrip(".") or "svg"
    path.write_bytes(picture.pipe(format=fmt))
    _log(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
