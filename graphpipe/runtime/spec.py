"""RunSpec: everything `graphpipe.compile` was asked for, checked once and frozen.

`compile()` keeps its keyword arguments for users; it turns them into one `RunSpec` with
`RunSpec.build`, which checks every argument at once and reports every problem in one
ConfigError, naming the values. Everything downstream (the planning step, `PipelinedModel`
and the runtime's parts) reads the spec, never loose arguments:

    >>> spec = RunSpec.build(torch.randn(8, 4), loss_fn=F.mse_loss,
    ...                      optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    >>> spec.schedule, spec.micro_batches, spec.micro_batch_size
    ('1f1b', 4, 2)

It lives in the runtime, not in `graphpipe.compile`, because the runtime consumes it and
must not import the layer above it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.ir.registry import DEFAULT_SCHEDULE, policy_spec, schedule_spec
from graphpipe.planning.partition import PlanConfig, micro_batch_size
from graphpipe.planning.profile import ProfileConfig
from graphpipe.planning.recompute import RecomputeSpec
from graphpipe.runtime.clip import check_clipping
from graphpipe.runtime.emulate import Emulate
from graphpipe.runtime.materialize import InitFn
from graphpipe.runtime.mesh import MESH_SHAPES
from graphpipe.runtime.nancheck import check_nan_check
from graphpipe.runtime.precision import check_precision
from graphpipe.runtime.refusals import refusal
from graphpipe.runtime.weights import PolicyOptions
from graphpipe.tracing.bind import batch_of, normalise
from graphpipe.tracing.tracer import LeafSpec

__all__ = [
    "OptimizerFactory",
    "RunSpec",
    "RuntimeConfig",
    "check_mesh",
    "check_reshard",
    "mesh_refusals",
    "plan_schedule",
    "schedule_for",
    "tp_degree",
    "tp_refusals",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]
DEFAULT_MICRO_BATCHES = 4


@dataclass(frozen=True)
class RuntimeConfig:
    """How the pipeline runs."""

    timeout: float = 60.0  # seconds any receive or collective may wait before failing
    backend: str | None = None  # None: "nccl" when CUDA is available, else "gloo"
    device: str | None = None  # None: cuda:LOCAL_RANK with nccl, else cpu
    record: bool = False  # time every action (see PipelinedModel.timeline)
    timer: str | None = None  # how: "host" ranges or "profiler"; None: profiler on CUDA only
    plan_timeout: float = 1800.0  # seconds ranks wait for rank 0's plan (profiling included)
    prefetch: bool | None = None  # post every receive of a call first; None: on gloo only
    emulate: Emulate | None = None  # stages wait the plan's times instead of computing
    quiet: bool = False  # rank 0 prints no line of what compile chose (compile.summary)

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.plan_timeout <= 0:
            raise ConfigError(
                f"timeouts must be positive, got timeout={self.timeout}, "
                f"plan_timeout={self.plan_timeout}"
            )
        if self.timer not in (None, "host", "profiler"):
            raise ConfigError(f"timer must be 'host' or 'profiler', got {self.timer!r}")


@dataclass(frozen=True)
class RunSpec:
    """One compiled run, as asked for and checked (see `graphpipe.compile` for each argument).

    Build it with `RunSpec.build`, which checks every field; the fields are then consistent
    with each other (the schedule runs the policy, M agrees with a given plan, ...).
    """

    # -- the training problem
    loss_fn: LossFn  # (model output, target) -> scalar, mean-reduced over the batch
    optimizer: OptimizerFactory  # builds one rank's optimizer from its parameter list
    # -- the pipeline's shape
    micro_batches: int  # M: the asked one, the given plan's, or 4
    micro_batch_size: int  # samples per micro-batch: the example batch / M
    weights: str  # the weight policy (`graphpipe.ir.registry.POLICIES`)
    schedule: str  # the schedule: the asked one, or the policy's (`SCHEDULES`)
    schedule_given: bool  # the user named the schedule (else a folded plan may change it)
    weight_options: PolicyOptions | None = None  # PipeMare's fixes
    # -- planning (rank 0), or the plan to use
    plan: Plan | None = None  # a given plan (loaded from its JSON); None: plan on rank 0
    plan_options: Mapping[str, Any] = field(default_factory=dict)  # PlanConfig fields
    devices: int | None = None  # the device count asked for; must equal the world size
    leaf_modules: tuple[LeafSpec, ...] = ()  # module types or paths traced as single nodes
    profile_config: ProfileConfig | None = None  # how rank 0 obtains op times
    recompute: RecomputeSpec = False  # activation checkpointing: True, stage list, "auto"
    # input name -> the largest whole-batch shape a step brings; None: the example's
    max_shapes: Mapping[str, tuple[int, ...]] | None = None
    # -- the runtime
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # timeouts, device, ...
    init_weights: InitFn | None = None  # initialises a meta model's real tensors
    checkpoint: Path | None = None  # a meta model's weights: state dict, safetensors, DCP
    compile_stages: bool = False  # torch.compile each stage module in place
    precision: str | None = None  # "bf16", "fp16" or None (float32)
    # -- the update hooks, in the order they run (fp16 unscale, NaN check, clipping)
    nan_check: bool = False  # stop a step at its first non-finite loss or gradient
    max_grad_norm: float | None = None  # clip the whole model's gradient norm to this
    grad_norm_type: float = 2.0  # p of that p-norm
    # -- data parallelism by FSDP2 over a ("pp", "dp") mesh (`graphpipe.runtime.mesh`)
    mesh: DeviceMesh | None = None  # the mesh; None: one device per rank, no dp
    data_parallel: int = 1  # dp: the mesh's dp size, or data_parallel= (the mesh is built then)
    dp_shard: bool = True  # FSDP2 shards each stage over dp; False: replicates it
    reshard_after_forward: bool = True  # FSDP2 frees gathered parameters after each forward
    # -- tensor parallelism by DTensor over the mesh's "tp" dimension (`graphpipe.runtime.tp`)
    tensor_parallel: int = 1  # the mesh's tp size
    tp_plan: Mapping[str, str] | None = None  # module path -> style; None: the model's own

    @property
    def meshed(self) -> bool:
        """Stages run under FSDP2 over a ("pp", "dp") mesh (given or to be built)."""
        return self.mesh is not None or self.data_parallel > 1

    @classmethod
    def build(
        cls,
        example_inputs: Any,
        *,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        micro_batches: int | None = None,
        schedule: str | None = None,
        weights: str = "flush",
        weight_options: PolicyOptions | None = None,
        partitioner: str | None = None,
        plan: Plan | str | Path | None = None,
        leaf_modules: Sequence[LeafSpec] = (),
        profile_config: ProfileConfig | None = None,
        runtime: RuntimeConfig | None = None,
        init_weights: InitFn | None = None,
        checkpoint: str | Path | None = None,
        max_grad_norm: float | None = None,
        grad_norm_type: float = 2.0,
        compile_stages: bool = False,
        recompute: RecomputeSpec = False,
        precision: str | None = None,
        nan_check: bool = False,
        mesh: DeviceMesh | None = None,
        data_parallel: int | None = None,
        dp_shard: bool = True,
        reshard_after_forward: bool | None = None,
        tp_plan: Mapping[str, str] | None = None,
        max_shapes: Mapping[str, Sequence[int]] | None = None,
        **plan_options: Any,
    ) -> RunSpec:
        """Check `compile()`'s arguments and freeze them (the same names and meanings).

        Raises:
            ConfigError: every problem found, at once, naming the values.
        """
        problems: list[str] = []
        _check(problems, _check_loss_fn, loss_fn)
        _check(problems, _check_optimizer, optimizer)
        known = len(problems)
        _check(problems, _check_micro_batches, micro_batches)
        bad_m = len(problems) > known
        resolved = _check(problems, schedule_for, weights, schedule)
        _check(problems, check_clipping, max_grad_norm, grad_norm_type, weights)
        _check(problems, check_precision, precision, weights)
        _check(problems, check_nan_check, nan_check, weights)
        _check(problems, _check_combinations, nan_check, precision, compile_stages, resolved)
        dp = _check(problems, check_mesh, mesh, data_parallel)
        bounds = _check(problems, _max_shapes, max_shapes)
        reshard = _check(problems, check_reshard, reshard_after_forward, resolved)
        tp = tp_degree(mesh) if isinstance(mesh, DeviceMesh) and dp is not None else 1
        problems.extend(tp_refusals(tp=tp, tp_plan=tp_plan, dp_shard=dp_shard))
        if mesh is not None or (dp or 1) > 1:
            asked = dict(
                weights=weights, nan_check=nan_check, compile_stages=compile_stages,
                replication=plan_options.get("replication", False),
            )  # fmt: skip
            problems.extend(mesh_refusals(**asked))
        devices = plan_options.pop("devices", None)  # the world size; said if it differs
        options = _check(problems, _plan_options, partitioner, plan_options)
        problems.extend(_plan_option_problems(plan_options, partitioner, devices))
        given = None if plan is None else _load_plan(plan)
        m = None if bad_m else _check(problems, _micro_batches, micro_batches, given)
        b = (
            None
            if m is None or dp is None
            else _check(problems, _micro_batch_size, example_inputs, m, dp)
        )
        if problems:
            raise ConfigError(_joined(problems))
        assert resolved is not None and options is not None and m is not None and b is not None
        assert dp is not None and reshard is not None
        return cls(
            loss_fn=loss_fn,
            optimizer=optimizer,
            micro_batches=m,
            micro_batch_size=b,
            weights=weights,
            schedule=resolved,
            schedule_given=schedule is not None,
            weight_options=weight_options,
            plan=given,
            plan_options=MappingProxyType(
                _planner_defaults(options, precision, weights, resolved)
                | _layout_defaults(options, schedule, resolved, compile_stages, mesh, dp)
            ),
            devices=devices,
            leaf_modules=tuple(leaf_modules),
            profile_config=profile_config,
            recompute=recompute,
            runtime=runtime or RuntimeConfig(),
            init_weights=init_weights,
            checkpoint=None if checkpoint is None else Path(checkpoint),
            compile_stages=compile_stages,
            precision=precision,
            nan_check=nan_check,
            max_grad_norm=max_grad_norm,
            grad_norm_type=grad_norm_type,
            mesh=mesh,
            data_parallel=dp,
            dp_shard=dp_shard,
            reshard_after_forward=reshard,
            tensor_parallel=tp,
            tp_plan=None if tp_plan is None else MappingProxyType(dict(tp_plan)),
            max_shapes=bounds,
        )

    @property
    def clip(self) -> tuple[float, float] | None:
        """(max norm, p) when clipping, else None."""
        return None if self.max_grad_norm is None else (self.max_grad_norm, self.grad_norm_type)


def _check(problems: list[str], check: Callable[..., Any], *args: Any) -> Any:
    """`check(*args)`, or None with its ConfigError's message added to `problems`."""
    try:
        return check(*args)
    except ConfigError as exc:
        problems.append(str(exc))
        return None


def _joined(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems: " + "; ".join(problems)


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
            f"loss_fn={loss_fn!r} is not callable; it must map (output, target) to a scalar"
        )


def _check_optimizer(optimizer: Any) -> None:
    """Raises: ConfigError: an optimizer instead of a factory of one."""
    if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer={optimizer!r} must build an optimizer from a parameter list, e.g. "
            "functools.partial(torch.optim.Adam, lr=1e-3); each rank owns "
            "only its stage's parameters"
        )


def _check_micro_batches(micro_batches: Any) -> None:
    """M must be a positive int (or None for the default).

    Raises:
        ConfigError: naming the value.
    """
    if micro_batches is None:
        return
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError(
            f"micro_batches={micro_batches!r}: it must be a positive integer (or None for the "
            f"plan's, or {DEFAULT_MICRO_BATCHES})"
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


def schedule_for(weights: str, schedule: str | None) -> str:
    """The schedule to run: the one given, checked against the policy, or the policy's.

    Raises:
        ConfigError: an unknown policy or schedule, or a schedule the policy cannot run with.
    """
    policy = policy_spec(weights)
    if schedule is None:
        return policy.schedule or DEFAULT_SCHEDULE
    flushed = not schedule_spec(schedule).asynchronous
    if (policy.flushed and not flushed) or (not policy.flushed and schedule != policy.schedule):
        need = policy.schedule or "a flushed schedule (gpipe, 1f1b, zb)"
        raise ConfigError(f"weights={weights!r} runs with {need}, not schedule={schedule!r}")
    return schedule


def plan_schedule(spec: RunSpec, plan: Plan) -> str:
    """The schedule `plan` was made for (`Plan.schedule`), for a run that names none: checked
    against the run as a named one is (`RunSpec.build`): its weight policy runs it
    (`schedule_for`), and compile_stages meets no split backward.

    Raises:
        ConfigError: naming the plan's schedule and every problem with it.
    """
    problems: list[str] = []
    _check(problems, schedule_for, spec.weights, plan.schedule)
    _check(problems, _check_combinations, False, None, spec.compile_stages, plan.schedule)
    if problems:
        raise ConfigError(
            f"the plan was made for schedule {plan.schedule!r}, which this run cannot run "
            "(name another with schedule=, or plan again):",
            problems,
        )
    return plan.schedule


MESH_PLAN_FIELDS = frozenset({"dp", "shard", "dp_link", "tp"})  # PlanConfig's
# PlanConfig fields that compile takes as arguments of its own (the rest are bound by name)
RENAMED_PLAN_FIELDS = MappingProxyType({"profile": "profile_config"})


def _plan_options(partitioner: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """PlanConfig options: pins imply the manual partitioner, and refuse any other.

    Raises:
        ConfigError: pins with a partitioner other than "manual", or the planner's mesh
            fields (compile takes its mesh as `mesh=` or `data_parallel=`).
    """
    mesh_fields = sorted(set(options) & MESH_PLAN_FIELDS)
    if mesh_fields:
        raise ConfigError(
            f"{mesh_fields} are the planner's mesh options (graphpipe.plan(..., dp=k)); "
            "compile takes the mesh as mesh= or data_parallel= (with dp_shard= and "
            "reshard_after_forward=) and does not yet hand it to the planner's cost model"
        )
    pins = options.get("pins")
    if pins and partitioner not in (None, "manual"):
        raise ConfigError(
            f"pins={dict(pins)} place stages by hand, which needs partitioner='manual' "
            f"(or none), not {partitioner!r}"
        )
    chosen = partitioner or ("manual" if pins else "graph")
    return {**options, "partitioner": chosen}


def _plan_option_problems(
    options: Mapping[str, Any], partitioner: str | None, devices: int | None
) -> list[str]:
    """The plan options' problems, found on every rank before any work (rank 0 would
    otherwise meet them only after profiling): unknown names, a field compile takes under
    another name, and bad values (`PlanConfig.problems_of`, at the given devices or 1: the
    world is not joined yet, and its size is checked against the plan later)."""
    problems = [
        f"plan option {name!r} is compile's {RENAMED_PLAN_FIELDS[name]}= argument"
        for name in sorted(set(options) & set(RENAMED_PLAN_FIELDS))
    ]
    skip = RENAMED_PLAN_FIELDS.keys() | MESH_PLAN_FIELDS  # said by _plan_options
    rest = {k: v for k, v in options.items() if k not in skip}
    if partitioner is not None:
        rest["partitioner"] = partitioner
    return problems + PlanConfig.problems_of(devices or 1, **rest)


def _planner_defaults(
    options: dict[str, Any], precision: str | None, weights: str, schedule: str
) -> dict[str, Any]:
    """What the planner must know of the run, unless the options say otherwise: the dtype
    crossing stages; no replicated stages (`graphpipe run`'s default too: compile builds a
    pipeline of distinct stages, and data parallelism is the mesh's, `data_parallel=k`;
    `replication=True` lets the planner copy a stage over ranks where that is faster, for
    a policy that keeps replicas in step, without a mesh); a folded chain for a placed
    schedule."""
    options = dict(options)
    options.setdefault("precision", precision)
    options.setdefault("replication", False)
    if not policy_spec(weights).replicas:
        options.setdefault("weight_versions", 2)
    placement = schedule_spec(schedule).placement
    if placement in ("loop", "v"):  # a chain of stages folded onto the devices
        options.setdefault("placement", placement)
        options.setdefault("virtual_stages", 2)
    return options


def _layout_defaults(
    options: dict[str, Any],
    schedule: str | None,
    resolved: str,
    compile_stages: bool,
    mesh: DeviceMesh | None,
    dp: int,
) -> dict[str, Any]:
    """What the planner's layout choice (`planning.layouts`) must respect, unless the options
    say otherwise: the schedule named (or the weight policy's), no zero-bubble schedule with
    compile_stages, one stage per device under a mesh (a weight tied across two stages of
    one rank is refused there)."""
    out: dict[str, Any] = {}
    if schedule is not None or resolved != DEFAULT_SCHEDULE:
        out["schedule"] = options.get("schedule", resolved)
    if compile_stages:
        out["split_backward"] = options.get("split_backward", False)
    if mesh is not None or dp > 1:
        out["layouts"] = options.get("layouts", ("one",))
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


def _micro_batch_size(example_inputs: Any, m: int, dp: int = 1) -> int:
    """The example batch / (M * dp): the rows each process runs per micro-batch.

    Raises:
        ConfigError: inputs that are not a batch, or a batch M * dp does not divide.
    """
    args, kwargs = normalise(example_inputs)
    batch = batch_of(args, kwargs)
    if dp > 1 and batch % (m * dp):
        raise ConfigError(
            f"a batch of {batch} does not split into {m} micro-batches of {dp} equal "
            f"data-parallel slices (M * dp = {m * dp} must divide it)"
        )
    return micro_batch_size(batch, m * dp)


def check_mesh(mesh: Any, data_parallel: Any) -> int:
    """dp, the data-parallel size: the mesh's "dp" size, data_parallel=, or 1.

    Raises:
        ConfigError: both given, a mesh that is not a DeviceMesh with dims ("pp", "dp"),
            ("pp", "tp") or ("pp", "dp", "tp"), or a data_parallel that is not a positive
            integer.
    """
    if mesh is not None and data_parallel is not None:
        raise ConfigError(
            f"mesh= and data_parallel={data_parallel!r} both given; data_parallel=k is the "
            "shorthand for a (world // k, k) mesh: pass one of them"
        )
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if not isinstance(mesh, DeviceMesh) or names not in MESH_SHAPES:
            raise ConfigError(
                f"mesh={mesh!r} (dims {names!r}): it must be a DeviceMesh with "
                f"mesh_dim_names one of {list(MESH_SHAPES)}, e.g. init_device_mesh('cpu', "
                "(2, 2), mesh_dim_names=('pp', 'dp'))"
            )
        return int(mesh["dp"].size()) if "dp" in names else 1
    if data_parallel is None:
        return 1
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ConfigError(f"data_parallel={data_parallel!r}: it must be a positive integer")
    return data_parallel


def tp_degree(mesh: DeviceMesh | None) -> int:
    """The mesh's "tp" size; 1 without a mesh or without that dimension."""
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return 1
    return int(mesh["tp"].size())


def tp_refusals(
    *,
    tp: int,
    tp_plan: Any,
    dp_shard: bool,
) -> list[str]:
    """What tensor parallelism (a "tp" mesh dimension) refuses, each named."""
    if tp == 1:
        return [] if tp_plan is None else [
            f"tp_plan= given ({len(tp_plan)} entries) but the mesh has no 'tp' dimension: "
            "pass a mesh with dims ('pp', 'tp') or ('pp', 'dp', 'tp')"
        ]  # fmt: skip
    out = []
    if tp_plan is not None and not isinstance(tp_plan, Mapping):
        out.append(f"tp_plan={tp_plan!r}: it must be a mapping of module path to style")
    if not dp_shard:
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


def mesh_refusals(
    *,
    weights: str,
    nan_check: bool,
    compile_stages: bool,
    replication: Any,
) -> list[str]:
    """What a mesh refuses (`graphpipe.runtime.refusals`), each named; empty if all is well."""
    out = []
    if weights != "flush":
        out.append(refusal("mesh-weights", f"weights={weights!r}"))
    if nan_check:
        out.append(refusal("mesh-nan-check", "nan_check=True"))
    if compile_stages:
        out.append(refusal("mesh-compile-stages", "compile_stages=True"))
    if replication:
        out.append(refusal("mesh-replication", f"replication={replication!r}"))
    return out
