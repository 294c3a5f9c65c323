"""RunSpec: everything `graphpipe.compile` was asked for, checked once and frozen.

compile's options are defined once, in groups (`graphpipe.planning.options`, and the
runtime's group `RuntimeConfig` here), and `RunSpec.build` routes compile's keywords into
them, checks every option at once (every problem in one ConfigError, naming the values) and
resolves what they leave open (M, the schedule, dp and tp, the planner's options).
Everything downstream (the planning step, `PipelinedModel` and the runtime's parts) reads
the spec, never loose arguments:

    >>> spec = RunSpec.build(torch.randn(8, 4), loss_fn=F.mse_loss,
    ...                      optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    >>> spec.schedule, spec.micro_batches, spec.micro_batch_size, spec.numerics.precision
    (None, 4, 2, None)

It lives in the runtime, not in `graphpipe.compile`, because the runtime consumes it and
must not import the layer above it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from graphpipe.errors import ConfigError
from graphpipe.ir import ParallelDims, Plan
from graphpipe.ir.registry import schedule_for, schedule_spec
from graphpipe.planning.options import (
    GROUPS,
    Init,
    Memory,
    Numerics,
    OptionGroup,
    Parallelism,
    Planning,
    default,
    joined,
    option,
    split,
)
from graphpipe.planning.partition import PlanConfig, micro_batch_size, plan_options
from graphpipe.runtime.clip import check_clipping
from graphpipe.runtime.emulate import Emulate
from graphpipe.runtime.mesh import ParallelLayout, dims_of
from graphpipe.runtime.nancheck import check_nan_check
from graphpipe.runtime.precision import check_precision
from graphpipe.runtime.refusals import refusal
from graphpipe.runtime.weights import CLASSES
from graphpipe.tracing.bind import batch_of, normalise, split_of
from graphpipe.tracing.split import InputSplit

__all__ = [
    "RUN_GROUPS",
    "OptimizerFactory",
    "RunSpec",
    "RuntimeConfig",
    "check_mesh",
    "check_reshard",
    "mesh_refusals",
    "plan_schedule",
    "tp_refusals",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]
DEFAULT_MICRO_BATCHES = 4


class OutputLoss:
    """A loss_fn of the output alone (`lambda out: out.loss`, a model given its labels as an
    input), called as every loss_fn is, (output, target): the target, which step() then
    does not need, is ignored."""

    def __init__(self, fn: Callable[[Any], torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, out: Any, target: Any) -> torch.Tensor:
        return self.fn(out)

    def __repr__(self) -> str:
        return f"OutputLoss({getattr(self.fn, '__qualname__', self.fn)!r})"


def needs_target(loss_fn: LossFn) -> bool:
    """Whether step() must be given a target for `loss_fn` (not an `OutputLoss`)."""
    return not isinstance(loss_fn, OutputLoss)


def _of_output(loss_fn: Any) -> bool:
    """Whether `loss_fn` takes one argument, the output: one positional parameter without
    a default, and no *args."""
    try:
        params = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: (output, target)
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len([p for p in params if p.kind in positional and p.default is p.empty]) == 1


@dataclass(frozen=True)
class RuntimeConfig(OptionGroup):
    """How the pipeline runs: the runtime's group of options (`graphpipe.planning.options`
    holds the others)."""

    name = "runtime"
    timeout: float = option(
        60.0, "seconds any receive or collective may wait before failing", "--timeout"
    )
    backend: str | None = option(None, "None: nccl when CUDA is available, else gloo")
    device: str | None = option(None, "None: cuda:LOCAL_RANK with nccl, else cpu")
    record: bool = option(False, "time every action (PipelinedModel.timeline)")
    timer: str | None = option(None, "host ranges or profiler; None: profiler on CUDA only")
    plan_timeout: float = option(
        1800.0,
        "seconds ranks wait for rank 0's plan (profiling too), and with compile_stages in a "
        "step at new shapes (the stages compile)",
    )
    prefetch: bool | None = option(None, "post every receive of a call first; None: on gloo")
    emulate: Emulate | None = option(None, "stages wait the plan's times instead of computing")
    quiet: bool = option(False, "rank 0 prints no line of what compile chose")
    compile_stages: bool = option(
        False, "torch.compile each stage module in place (not with zero bubble)", "--compile-stages"
    )
    host_cache: bool = option(
        True,
        "on CPU: glibc keeps freed memory for reuse, as a device's allocator does",
        "--host-cache",
    )

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        """Every problem with the values, each naming its value."""
        out = []
        if not (_positive(self.timeout) and _positive(self.plan_timeout)):
            out.append(
                f"timeouts must be positive, got timeout={self.timeout}, "
                f"plan_timeout={self.plan_timeout}"
            )
        if self.timer not in (None, "host", "profiler"):
            out.append(f"timer must be 'host' or 'profiler', got {self.timer!r}")
        for name in ("compile_stages", "host_cache"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name}={getattr(self, name)!r}: it must be True or False")
        return out


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


RUN_GROUPS: tuple[type[OptionGroup], ...] = (*GROUPS, RuntimeConfig)  # compile's groups


@dataclass(frozen=True)
class RunSpec:
    """One compiled run, as asked for (its option groups, `graphpipe.planning.options`) and
    resolved: the values the groups leave open (M, the schedule, dp and tp, the plan's
    options) decided once, consistent with each other.

    Build it with `RunSpec.build`, which checks every option at once.
    """

    loss_fn: LossFn  # (model output, target) -> scalar, mean-reduced over the batch; an
    # OutputLoss where the user's takes the output alone
    optimizer: OptimizerFactory  # builds one rank's optimizer from its parameter list
    planning: Planning
    parallelism: Parallelism
    numerics: Numerics
    memory: Memory
    init: Init
    runtime: RuntimeConfig
    # -- resolved
    micro_batches: int  # M: the asked one, the given plan's, or 4
    micro_batch_size: int  # rows per micro-batch on each rank: the example batch / (M x dp)
    schedule: str | None  # the asked one, or the policy's; None: none named, the plan's
    # (the planner's choice with its layout) runs (`graphpipe.ir.registry.schedule_for`)
    plan: Plan | None = None  # a given plan (loaded from its JSON); None: plan on rank 0
    plan_options: Mapping[str, Any] = field(default_factory=dict)  # PlanConfig fields
    # the layout: the given mesh's, or dp=, tp= and dp_shard= (pp open until the world is
    # joined; compile builds the mesh from it then, `graphpipe.runtime.mesh.build_mesh`)
    dims: ParallelDims = field(default_factory=lambda: ParallelDims(pp=None))
    mesh: DeviceMesh | None = None  # the mesh given, or built by compile from `dims`
    reshard_after_forward: bool = True  # FSDP2 frees gathered parameters after each forward
    tp_plan: Mapping[str, str] | None = None  # module path -> style; None: the model's own
    # input name -> the largest whole-batch shape a step brings; None: the example's
    max_shapes: Mapping[str, tuple[int, ...]] | None = None
    # how each input splits into micro-batches, resolved against the example (its inferred
    # rules included): compile's trace, the planner and every step split by it
    input_split: InputSplit = field(default_factory=InputSplit)
    layout: ParallelLayout | None = None  # this rank's view of `dims`, set once joined

    @property
    def schedule_given(self) -> bool:
        """The user named the schedule (else a folded plan may change it)."""
        return self.planning.schedule is not None

    @property
    def auto_mesh(self) -> bool:
        """mesh="auto": rank 0 chooses the mesh and M once the world is joined."""
        return self.parallelism.mesh == "auto"

    @property
    def meshed(self) -> bool:
        """Stages run over a mesh (`ParallelDims.meshed`)."""
        return self.dims.meshed

    @property
    def clip(self) -> tuple[float, float] | None:
        """(max norm, p) when clipping, else None."""
        n = self.numerics
        return None if n.max_grad_norm is None else (n.max_grad_norm, n.grad_norm_type)

    @classmethod
    def build(
        cls,
        example_inputs: Any,
        *,
        loss_fn: Callable[..., torch.Tensor],
        optimizer: OptimizerFactory,
        plan: Plan | str | Path | None = None,
        groups: Mapping[str, OptionGroup | None] | None = None,
        **options: Any,
    ) -> RunSpec:
        """Check compile's arguments and resolve them (the same names and meanings).

        Args:
            example_inputs: One mini-batch.
            loss_fn: The loss.
            optimizer: The optimizer's factory.
            plan: A given plan, or its JSON file.
            groups: Group keyword ("planning", ...) -> the group given, or None.
            **options: Any option by name (`graphpipe.planning.options`), routed to its group.

        Raises:
            ConfigError: every problem found, at once, naming the values.
        """
        problems: list[str] = []
        _check(problems, _check_loss_fn, loss_fn)
        _check(problems, _check_optimizer, optimizer)
        got, found = split(groups or {}, options, RUN_GROUPS)
        problems.extend(found)
        g = _Groups(**got)  # type: ignore[arg-type]
        resolved = _check(problems, schedule_for, g.numerics.weights, g.planning.schedule)
        problems.extend(_run_problems(g, resolved))
        bad = g.parallelism.bad_fields()  # said by the group's type rules
        dims = None if bad else _check(problems, check_mesh, g.parallelism)
        bounds = _check(problems, _max_shapes, g.memory.max_shapes)
        reshard = _check(problems, check_reshard, g.parallelism.reshard_after_forward, resolved)
        if dims is not None:
            problems.extend(tp_refusals(dims, g.parallelism.tp_plan))
            if dims.meshed or g.parallelism.mesh == "auto":  # auto may choose one
                problems.extend(mesh_refusals(g, dims.tp))
        problems.extend(_plan_option_problems(g))
        if g.planning.micro_batches == "auto" and g.parallelism.mesh != "auto":
            problems.append("micro_batches='auto' is chosen with the mesh: pass mesh='auto'")
        given = None if plan is None else _load_plan(plan)
        asked_m = g.planning.micro_batches if g.planning.micro_batches != "auto" else None
        m = _check(problems, _micro_batches, asked_m, given)
        input_split = _check(problems, _input_split, example_inputs, g.planning.input_split)
        if input_split and bounds is not None:
            problems.append(
                f"input_split ({input_split.describe()}) with max_shapes: the largest batch "
                "is planned by tiling every input along dim 0; give batches of the example's "
                "shapes, or no rule"
            )
        b = (
            None
            if m is None or dims is None or input_split is None
            else _check(problems, _micro_batch_size, example_inputs, m, dims.dp, input_split)
        )
        if problems:
            raise ConfigError(joined(problems))
        assert m is not None and b is not None  # resolved: None where none is named
        assert dims is not None and reshard is not None  # a bad field is a problem
        tp_plan = g.parallelism.tp_plan
        return cls(
            loss_fn=OutputLoss(loss_fn) if _of_output(loss_fn) else loss_fn,
            optimizer=optimizer,
            **got,  # type: ignore[arg-type]
            micro_batches=m,
            micro_batch_size=b,
            schedule=resolved,
            plan=given,
            plan_options=MappingProxyType(planner_options(g, resolved, dims.meshed)),
            dims=dims,
            mesh=g.parallelism.mesh,
            reshard_after_forward=reshard,
            tp_plan=None if tp_plan is None else MappingProxyType(dict(tp_plan)),
            max_shapes=bounds,
            input_split=input_split,
        )


@dataclass(frozen=True)
class _Groups:
    """A run's option groups, by name (what `split` returns)."""

    planning: Planning
    parallelism: Parallelism
    numerics: Numerics
    memory: Memory
    init: Init
    runtime: RuntimeConfig


def _run_problems(g: _Groups, schedule: str | None) -> list[str]:
    """What the run's options refuse together: clipping, precision and the NaN check under
    the weight policy, and the combinations that exclude each other."""
    problems: list[str] = []
    n, weights = g.numerics, g.numerics.weights
    _check(problems, check_clipping, n.max_grad_norm, n.grad_norm_type, weights)
    _check(problems, check_precision, n.precision, weights)
    _check(problems, check_nan_check, n.nan_check, weights)
    _check(
        problems,
        _check_combinations,
        n.nan_check,
        n.precision,
        g.runtime.compile_stages,
        schedule,
    )
    return problems


def _check(problems: list[str], check: Callable[..., Any], *args: Any) -> Any:
    """`check(*args)`, or None with its ConfigError's message added to `problems`."""
    try:
        return check(*args)
    except ConfigError as exc:
        problems.append(str(exc))
        return None


def _max_shapes(value: Any) -> Mapping[str, tuple[int, ...]] | None:
    """max_shapes as a read-only dict of int tuples (checked against the inputs after the
    trace: `graphpipe.runtime.shapes.check_max_shapes`).

    Raises:
        ConfigError: not a dict of input name -> sequence of positive ints.
    """
    if value is None:
        return None
    shapes = dict(value) if isinstance(value, Mapping) else None
    if shapes is None or not all(
        isinstance(k, str)
        and isinstance(v, Sequence)
        and all(isinstance(d, int) and d > 0 for d in v)
        for k, v in shapes.items()
    ):
        raise ConfigError(
            f"max_shapes must be a dict of input name -> shape (positive ints), got {value!r}"
        )
    return MappingProxyType({k: tuple(v) for k, v in shapes.items()})


def _check_loss_fn(loss_fn: Any) -> None:
    """Raises: ConfigError: a loss_fn that is not callable."""
    if not callable(loss_fn):
        raise ConfigError(
            f"loss_fn={loss_fn!r} is not callable; it must map (output, target), or the "
            "output alone (lambda out: out.loss), to a scalar"
        )


def _check_optimizer(optimizer: Any) -> None:
    """Raises: ConfigError: an optimizer instead of a factory of one."""
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer={optimizer!r} must build an optimizer from a parameter list, e.g. "
            "functools.partial(torch.optim.Adam, lr=1e-3); each rank owns "
            "only its stage's parameters"
        )


def _check_combinations(
    nan_check: bool, precision: str | None, compile_stages: bool, schedule: str | None
) -> None:
    """Raises: ConfigError: two settings that exclude each other."""
    if nan_check and precision == "fp16":
        raise ConfigError(
            "nan_check=True with precision='fp16': fp16's loss scaler already skips a step "
            "whose gradients overflow (pm.skipped_steps); use one or the other"
        )
    if compile_stages and schedule is not None and schedule_spec(schedule).split_backward:
        raise ConfigError(
            f"compile_stages=True cannot run schedule={schedule!r}: it splits each backward "
            "into input and weight halves, which a compiled backward does not; use 1f1b, "
            "gpipe, interleaved or graph_interleaved"
        )


def plan_schedule(spec: RunSpec, plan: Plan) -> str:
    """The schedule `plan` was made for (`Plan.schedule`), for a run that names none: checked
    against the run as a named one is (`RunSpec.build`): its weight policy runs it
    (`schedule_for`), and compile_stages meets no split backward.

    Raises:
        ConfigError: naming the plan's schedule and every problem with it.
    """
    problems: list[str] = []
    _check(problems, schedule_for, spec.numerics.weights, None, plan.schedule)
    _check(problems, _check_combinations, False, None, spec.runtime.compile_stages, plan.schedule)
    if problems:
        raise ConfigError(
            f"the plan was made for schedule {plan.schedule!r}, which this run cannot run "
            "(name another with schedule=, or plan again):",
            problems,
        )
    return plan.schedule


def _plan_option_problems(g: _Groups) -> list[str]:
    """The planner's options' problems, found on every rank before any work (rank 0 would
    otherwise meet them only after profiling): `PlanConfig.problems_of`, at the given
    devices or 1 (the world is not joined yet; its size is checked against the plan later),
    without what is said elsewhere once: the mesh's degrees (`check_mesh`), the precision
    (`check_precision`) and a value of the wrong type (its group's `problems`)."""
    said = {"dp", "tp", "tp_plan", "precision", "micro_batches"}  # check_mesh, ..., the M rule
    said |= {name for group in vars(g).values() for name in group.bad_fields()}
    options = {k: v for k, v in plan_options(vars(g)).items() if k not in said}
    return PlanConfig.problems_of(g.parallelism.devices or 1, **options)


def planner_options(g: _Groups, schedule: str | None, meshed: bool) -> dict[str, Any]:
    """The PlanConfig fields rank 0 plans with (`plan_options`), with what a run adds: the
    schedule named (or the weight policy's) limits the layouts; no zero-bubble schedule with
    compile_stages; a placed schedule (interleaved, zbv) folds a chain of 2 stages per
    device; one stage per device under a mesh (a weight tied across two stages of one rank
    is refused there). M, devices and the mesh's degrees are set by compile when it plans
    (`graphpipe.compile.steps`)."""
    out = plan_options(vars(g))
    for name in ("micro_batches", "dp", "tp", "tp_plan", "dp_shard", "reshard_after_forward"):
        out.pop(name, None)
    out.pop("devices", None)
    if g.planning.schedule is None and schedule is not None:
        out["schedule"] = schedule  # the weight policy's
    if g.runtime.compile_stages:
        out["split_backward"] = False
    placement = None if schedule is None else schedule_spec(schedule).placement
    if placement in ("loop", "v") and g.planning.virtual_stages == 1:
        out["virtual_stages"] = 2  # a chain of 2 stages per device, folded as it names
        out["placement"] = placement
    if meshed and g.planning.layouts == default("layouts"):
        out["layouts"] = ("one",)
    return out


def _load_plan(plan: Plan | str | Path) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.from_json(Path(plan).read_text())


def _micro_batches(micro_batches: int | None, plan: Plan | None) -> int:
    """M: the one asked for, the given plan's, or 4.

    Raises:
        ConfigError: M differs from the given plan's.
    """
    if plan is None:
        return micro_batches or DEFAULT_MICRO_BATCHES
    if micro_batches is not None and micro_batches != plan.micro_batches:
        raise ConfigError(
            f"micro_batches={micro_batches}, but the plan was made for "
            f"{plan.micro_batches} micro-batches; plan again or leave micro_batches out"
        )
    return plan.micro_batches


def _input_split(example_inputs: Any, rules: Mapping[Any, Any] | None) -> InputSplit:
    """The input_split rules, resolved against the example (`InputSplit.resolved`).

    Raises:
        ConfigError: a rule of another kind, or an input whose batch dimension cannot be
            told, naming it.
    """
    return split_of(*normalise(example_inputs), rules)


def _micro_batch_size(example_inputs: Any, m: int, dp: int, split: InputSplit) -> int:
    """The example batch / (M * dp): the rows each process runs per micro-batch.

    Raises:
        ConfigError: inputs that are not a batch, or a batch M * dp does not divide.
    """
    args, kwargs = normalise(example_inputs)
    batch = batch_of(args, kwargs, split)
    if dp > 1 and batch % (m * dp):
        raise ConfigError(
            f"a batch of {batch} does not split into {m} micro-batches of {dp} equal "
            f"data-parallel slices (M * dp = {m * dp} must divide it)"
        )
    return micro_batch_size(batch, m * dp)


def check_mesh(parallelism: Parallelism) -> ParallelDims:
    """The run's layout, pp left open: the given mesh's (`dims_of`), or dp= and tp='s
    (compile builds the mesh from it), or none (also for mesh="auto", until rank 0
    chooses).

    Raises:
        ConfigError: a mesh with dp= or tp= too, a mesh that is not a DeviceMesh with dims
            `MESH_SHAPES`, or dp="auto" (the planner's: plan with it, then compile with the
            degree it chose).
    """
    mesh, dp, tp = parallelism.mesh, parallelism.dp, parallelism.tp
    shard = parallelism.dp_shard
    if mesh == "auto":  # rank 0 chooses the mesh once the world is joined (compile)
        given = [f"{k}={v!r}" for k, v in (("dp", dp), ("tp", tp)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} with mesh='auto', which chooses it")
        return ParallelDims(pp=None, dp_shard=shard)
    if mesh is not None and (dp is not None or tp is not None):
        raise ConfigError(
            f"mesh= and dp={dp!r}, tp={tp!r} given; dp= and tp= are the shorthand for a "
            "(world // (dp x tp), dp, tp) mesh: pass one or the other"
        )
    if mesh is not None:
        return dims_of(mesh, shard)
    if dp == "auto":
        raise ConfigError(
            "dp='auto' is the planner's: choose the degree with graphpipe.plan(..., "
            "dp='auto') (or `graphpipe plan --dp auto`), then compile with dp=k and that plan; "
            "or mesh='auto' chooses pp x dp x tp"
        )
    return ParallelDims(pp=None, dp=int(dp or 1), tp=int(tp or 1), dp_shard=shard)


def tp_refusals(dims: ParallelDims, tp_plan: Any) -> list[str]:
    """What tensor parallelism (a "tp" mesh dimension) refuses, each named."""
    if dims.tp == 1:
        return [] if tp_plan is None else [
            f"tp_plan= given ({len(tp_plan)} entries) but the mesh has no 'tp' dimension: "
            "pass a mesh with dims ('pp', 'tp') or ('pp', 'dp', 'tp')"
        ]  # fmt: skip
    out = []
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        out.append(f"tp_plan={tp_plan!r}: it must be a mapping of module path to style")
    if not dims.dp_shard:
        out.append(refusal("tp-hsdp", "dp_shard=False"))
    return out


def check_reshard(reshard_after_forward: bool | None, schedule: str | None) -> bool:
    """FSDP2's reshard_after_forward for `schedule`: as given, or by default True, but False
    under a split backward (zero bubble), whose weight halves run after later forwards and
    may read a parameter their forward saved: a reshard in between would free its storage.

    Raises:
        ConfigError: not a bool or None, or True under a split backward.
    """
    split = schedule is not None and schedule_spec(schedule).split_backward
    if reshard_after_forward is None:
        return not split
    if not isinstance(reshard_after_forward, bool):
        raise ConfigError(
            f"reshard_after_forward={reshard_after_forward!r}: it must be True, False or None "
            "(None: True, but False for a zero-bubble schedule)"
        )
    if reshard_after_forward and split:
        raise ConfigError(
            f"reshard_after_forward=True with schedule={schedule!r}: a zero-bubble schedule "
            "keeps each stage's parameters gathered from its forwards to its last weight "
            "gradient (a weight half may read a parameter its forward saved); pass False or "
            "leave it None"
        )
    return reshard_after_forward


def mesh_refusals(g: _Groups, tp: int) -> list[str]:
    """What a mesh of `tp` tensor-parallel ranks refuses (`graphpipe.runtime.refusals`),
    each named; empty if all is well. A versioned weight policy (stash, 2bw) runs over dp,
    each dp rank's stages whole (`graphpipe.runtime.wiring`)."""
    out = []
    weights = g.numerics.weights
    if weights in CLASSES and weights != "flush" and not CLASSES[weights].versioned:
        out.append(refusal("mesh-weights", f"weights={weights!r}"))
    if weights in CLASSES and CLASSES[weights].versioned:
        if tp > 1:
            out.append(refusal("mesh-versions-tp", f"weights={weights!r} with tp={tp}"))
        if g.parallelism.mesh == "auto":
            out.append(refusal("mesh-versions-tp", f"weights={weights!r} with mesh='auto'"))
    if g.numerics.nan_check:
        out.append(refusal("mesh-nan-check", "nan_check=True"))
    if g.runtime.compile_stages:
        out.append(refusal("mesh-compile-stages", "compile_stages=True"))
    if g.parallelism.replication:
        out.append(refusal("mesh-replication", "replication=True"))
    return out
