"""Options: every setting of a run, defined once, in groups, with the same name everywhere.

`graphpipe.compile`, `graphpipe.plan` and the command line (`graphpipe plan`, `graphpipe run`)
take the same options under the same names, defined here once each: its group, its default,
its meaning and its command-line flag. They may come as groups or as keywords, or both:

    compile(model, x, loss_fn=..., optimizer=...,
            parallelism=Parallelism(dp=2), numerics=Numerics(precision="bf16"))
    compile(model, x, loss_fn=..., optimizer=..., dp=2, precision="bf16")   # the same run

| group         | what it decides                                                        |
|---------------|------------------------------------------------------------------------|
| `Planning`    | how the model is cut and scheduled: M, schedule, partitioner, layouts |
| `Parallelism` | the layout over devices: devices, mesh, dp, tp, sharding, replicas    |
| `Numerics`    | what is computed: weight policy, precision, clipping, the NaN check   |
| `Memory`      | what is kept: budget, recompute, optimizer state, the largest shapes  |
| `Init`        | where a meta model's weights come from                                 |

The runtime's group (timeouts, backend, device, emulation) is
`graphpipe.runtime.spec.RuntimeConfig`, a layer above. `split` routes keywords to their groups
(an unknown name is a ConfigError naming the closest known one; a name given twice, as a
keyword and in its group, is one too), and `table()` is the reference the docs quote.

Each group checks the type of each of its values (`problems`); what depends on several
options (a schedule the weight policy cannot run, a dp that does not divide the devices) is
checked where they meet: `graphpipe.planning.partition.PlanConfig` for the planner,
`graphpipe.runtime.spec.RunSpec` for a run. Every check runs on every rank before any work,
and every problem is reported at once.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, TypeVar

from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.ir.cost import LinkModel
from graphpipe.ir.plan import LAYOUTS
from graphpipe.ir.registry import PolicyOptions
from graphpipe.planning.profile import ProfileConfig
from graphpipe.planning.recompute import RecomputeSpec
from graphpipe.tracing.tracer import LeafSpec

__all__ = [
    "ALIASES",
    "GROUPS",
    "Init",
    "Memory",
    "Numerics",
    "OptionGroup",
    "Parallelism",
    "Planning",
    "default",
    "field_default",
    "fields_of",
    "group_of",
    "joined",
    "split",
    "table",
]

InitFn = Callable[[nn.Module], None]  # initialises a rank's real tensors of a meta model


def option(default: Any, doc: str, flag: str | None = None, *, factory: bool = False) -> Any:
    """A group's field: its default, its one-line meaning, and its command-line flag (None:
    the API only). `factory=True`: `default` is called for each value (a mutable default)."""
    meta = {"doc": doc, "flag": flag}
    if factory:
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


class OptionGroup:
    """A group of options: a frozen dataclass whose fields are made with `option`."""

    name = ""  # the group's keyword in compile() and plan()

    def problems(self) -> list[str]:
        """Every problem with the group's values, each naming its value."""
        return [p for f in fields(self) if (p := _field_problem(self, f))]  # type: ignore[arg-type]

    def bad_fields(self) -> set[str]:
        """The names of the fields `problems` names."""
        return {f.name for f in fields(self) if _field_problem(self, f)}  # type: ignore[arg-type]


_Group = TypeVar("_Group", bound=OptionGroup)


@dataclass(frozen=True)
class Planning(OptionGroup):
    """How the model is cut into stages and scheduled (`docs/planning.md`)."""

    name = "planning"
    micro_batches: int | str | None = option(
        None,
        "M, micro-batches per mini-batch (None: a given plan's, or 4; 'auto' with mesh='auto')",
        "--micro-batches",
    )
    schedule: str | None = option(
        None,
        "the schedule (1f1b, gpipe, zb, interleaved, zbv, ...); None: the weight policy's, or "
        "the one the planner chose with its layout",
        "--schedule",
    )
    partitioner: str | None = option(
        None, "graph, sequential or manual (None: manual with pins, else graph)", "--partitioner"
    )
    pins: Mapping[str, int] | None = option(
        None, "manual partitioner: module path or op name -> stage"
    )
    layouts: tuple[str, ...] = option(
        LAYOUTS, "the layouts the graph partitioner simulates, keeping the fastest"
    )
    virtual_stages: int = option(1, "stages per device: a chain of N*v stages, folded")
    placement: str = option("loop", "with virtual_stages > 1: loop (interleaved) or v (ZB-V)")
    interleave: bool = option(
        False, "graph: also fold finer stage DAGs onto the devices", "--interleave"
    )
    split_backward: bool = option(True, "zero-bubble schedules may be chosen")
    objective: str = option("pipeline", "pipeline: least step time; bottleneck: least stage")
    max_units: int = option(128, "the most units the search considers (at least 4N)")
    search_workers: int = option(
        1,
        "mesh='auto': processes that plan candidate meshes at once (forked from this one: "
        "Linux); the choice is the same for any count",
        "--search-workers",
    )
    profile: ProfileConfig = option(
        ProfileConfig, "how op times are obtained (measured, FLOPs, roofline)", factory=True
    )
    leaf_modules: tuple[LeafSpec, ...] = option((), "module types or paths traced as one node")
    input_split: Mapping[Any, Any] | None = option(
        None,
        "input -> how it splits into micro-batches where dim 0 is not the batch: a dim, "
        "'replicate' or fn(x, inputs, n) (graphpipe.tracing.split); None: dim 0, or inferred",
        "--input-split",
    )
    link: LinkModel = option(LinkModel, "the link between devices", factory=True)


@dataclass(frozen=True)
class Parallelism(OptionGroup):
    """How the run is laid out over devices: a pipeline, and a mesh's dp and tp
    (`docs/meshes.md`, `docs/tensor-parallel.md`)."""

    name = "parallelism"
    devices: int | None = option(
        None, "N, every device (pp x dp x tp); compile: the world size", "--devices"
    )
    mesh: Any = option(
        None,
        "a DeviceMesh with dims (pp, dp), (pp, tp) or (pp, dp, tp) (None: built from dp and "
        "tp), or 'auto': the planner chooses pp x dp x tp (graphpipe.plan)",
    )
    node: Any = option(
        None,
        "the cluster's node for mesh='auto': a preset (h100x8, a100x8) or a Node; tp inside "
        "it, dp and pp across (None: one flat link)",
    )
    dp: int | str | None = option(
        None,
        "data-parallel degree: each stage FSDP2-sharded over dp ranks; the planner also takes "
        "'auto'; None: the mesh's, or 1",
        "--dp",
    )
    tp: int | None = option(
        None, "tensor-parallel degree: tp_plan's layers split over tp ranks (None: 1)", "--tp"
    )
    tp_plan: Mapping[str, str] | None = option(
        None,
        "module path ('*': one component) -> colwise or rowwise; None: the model's own",
        "--tp-plan",
    )
    dp_shard: bool = option(
        True, "dp shards parameters, gradients and optimizer state (False: replicas)"
    )
    reshard_after_forward: bool | None = option(
        None, "FSDP2 frees gathered parameters after each forward (None: True, but False for zb)"
    )
    replication: bool = option(
        False,
        "the planner may copy a stage over devices where that is faster (no mesh)",
        "--replication",
    )
    dp_link: LinkModel | None = option(None, "the dp dimension's link (None: link)")
    tp_link: LinkModel | None = option(None, "the tp dimension's link (None: link)")


@dataclass(frozen=True)
class Numerics(OptionGroup):
    """What each step computes: the weight policy, the precision and the update's checks
    (`docs/training.md`)."""

    name = "numerics"
    weights: str = option("flush", "flush, stash, 2bw or pipemare", "--weights")
    weight_options: PolicyOptions | None = option(None, "PipeMare's fixes")
    precision: str | None = option(
        None, "bf16 or fp16 on float32 masters; None: float32", "--precision"
    )
    max_grad_norm: float | None = option(
        None, "clip the whole model's gradient norm to this", "--max-grad-norm"
    )
    grad_norm_type: float = option(2.0, "p of that p-norm (math.inf: the largest value)")
    nan_check: bool = option(False, "stop a step at its first non-finite loss or gradient")


@dataclass(frozen=True)
class Memory(OptionGroup):
    """What each device keeps (`docs/planning.md`, `docs/shapes.md`)."""

    name = "memory"
    memory_budget: float | None = option(
        None, "bytes per device the plan must fit; None: unlimited", "--memory-budget"
    )
    recompute: RecomputeSpec = option(
        False, "activation checkpointing: True, stage indices or 'auto'", "--recompute"
    )
    max_shapes: Mapping[str, Sequence[int]] | None = option(
        None, "input name -> the largest whole-batch shape a step brings; None: the example's"
    )
    optimizer_slots: int = option(2, "optimizer state tensors per parameter (Adam: 2)")
    weight_versions: int | None = option(
        None, "weight copies the policy keeps; None: the policy's (flush 1, 2bw 2)"
    )


@dataclass(frozen=True)
class Init(OptionGroup):
    """Where a meta-device model's weights come from (`docs/training.md`)."""

    name = "init"
    checkpoint: Any = option(
        None, "a state dict, safetensors file(s) or DCP directory to load each stage from"
    )
    init_weights: InitFn | None = option(
        None, "init_weights(model) initialises a rank's real tensors (None: reset_parameters)"
    )


GROUPS: tuple[type[OptionGroup], ...] = (Planning, Parallelism, Numerics, Memory, Init)
# old names still taken, each with a FutureWarning naming the new one
ALIASES: Mapping[str, str] = {
    "data_parallel": "dp",
    "profile_config": "profile",
    "shard": "dp_shard",
}

# each field's type rule: (holds, what it must be); fields not named take any value
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {}


def _rule(*names: str, must: str) -> Callable[[Callable[[Any], bool]], Callable[[Any], bool]]:
    def register(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
        for name in names:
            _RULES[name] = (check, must)
        return check

    return register


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@_rule("micro_batches", must="a positive int, 'auto' or None")
def _m(value: Any) -> bool:
    return value == "auto" or _positive_or_none(value)


@_rule("devices", "tp", "weight_versions", must="a positive int or None")
def _positive_or_none(value: Any) -> bool:
    return value is None or (_int(value) and value >= 1)


@_rule("virtual_stages", "max_units", must="a positive int")
def _positive(value: Any) -> bool:
    return _int(value) and value >= 1


@_rule("optimizer_slots", must="an int >= 0")
def _count(value: Any) -> bool:
    return _int(value) and value >= 0


@_rule("dp", must="a positive int, 'auto' or None")
def _dp(value: Any) -> bool:
    return value in (None, "auto") or (_int(value) and value >= 1)


@_rule("interleave", "split_backward", "dp_shard", "replication", "nan_check", must="True or False")
def _bool(value: Any) -> bool:
    return isinstance(value, bool)


@_rule("reshard_after_forward", must="True, False or None")
def _bool_or_none(value: Any) -> bool:
    return value is None or isinstance(value, bool)


@_rule("memory_budget", "max_grad_norm", must="a positive number or None")
def _positive_number(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not _bool(value) and value > 0)


@_rule("grad_norm_type", must="a positive number (math.inf: the largest value)")
def _norm(value: Any) -> bool:
    return isinstance(value, (int, float)) and not _bool(value) and value > 0


@_rule("schedule", "partitioner", "precision", must="a name (str) or None")
def _name(value: Any) -> bool:
    return value is None or isinstance(value, str)


@_rule("weights", "placement", "objective", must="a name (str)")
def _str(value: Any) -> bool:
    return isinstance(value, str)


@_rule("pins", "tp_plan", "max_shapes", "input_split", must="a mapping (dict) or None")
def _mapping(value: Any) -> bool:
    return value is None or isinstance(value, Mapping)


@_rule("profile", must="a ProfileConfig")
def _profile(value: Any) -> bool:
    return isinstance(value, ProfileConfig)


@_rule("link", must="a LinkModel")
def _link(value: Any) -> bool:
    return isinstance(value, LinkModel)


@_rule("dp_link", "tp_link", must="a LinkModel or None")
def _link_or_none(value: Any) -> bool:
    return value is None or isinstance(value, LinkModel)


@_rule("weight_options", must="a PolicyOptions or None")
def _policy_options(value: Any) -> bool:
    return value is None or isinstance(value, PolicyOptions)


@_rule("init_weights", must="a callable or None")
def _callable(value: Any) -> bool:
    return value is None or callable(value)


@_rule("layouts", "leaf_modules", must="a tuple or list")
def _sequence(value: Any) -> bool:
    return isinstance(value, (tuple, list))


@_rule("recompute", must="True, False, 'auto' or a list of stage indices")
def _recompute(value: Any) -> bool:
    if isinstance(value, bool) or value == "auto":
        return True
    return isinstance(value, (list, tuple)) and all(_int(i) and i >= 0 for i in value)


def _field_problem(group: OptionGroup, f: Field[Any]) -> str | None:
    """The problem of one field's value, naming it; None when it is fine."""
    rule = _RULES.get(f.name)
    value = getattr(group, f.name)
    if rule is None or rule[0](value):
        return None
    return f"{f.name}={value!r}: it must be {rule[1]}"


def field_default(f: Field[Any]) -> Any:
    """A dataclass field's default value (its factory's, called)."""
    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def joined(problems: Sequence[str]) -> str:
    """Problems as one message: the one, or their count and each."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems: " + "; ".join(problems)


def default(name: str, groups: Sequence[type[OptionGroup]] = GROUPS) -> Any:
    """The default of option `name` (a fresh one for a mutable default), among `groups`."""
    _group, f = fields_of(groups)[name]
    return field_default(f)


def group_of(name: str) -> type[OptionGroup]:
    """The group option `name` belongs to.

    Raises:
        ConfigError: an unknown name, naming the closest known ones.
    """
    found = fields_of().get(name)
    if found is None:
        raise ConfigError(unknown_option(name, fields_of()))
    return found[0]


def fields_of(
    groups: Sequence[type[OptionGroup]] = GROUPS,
) -> dict[str, tuple[type[OptionGroup], Field[Any]]]:
    """Option name -> (its group, its field), over `groups`."""
    return {f.name: (g, f) for g in groups for f in fields(g)}  # type: ignore[arg-type]


def unknown_option(name: str, known: Iterable[str]) -> str:
    """The problem of an unknown option, naming the closest known ones."""
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=2)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return f"unknown option {name!r}{hint}"


def split(
    given: Mapping[str, OptionGroup | None],
    keywords: Mapping[str, Any],
    groups: Sequence[type[OptionGroup]] = GROUPS,
    *,
    elsewhere: Mapping[str, str] | None = None,
) -> tuple[dict[str, OptionGroup], list[str]]:
    """The groups of a call: each given one (or its defaults) with the keywords of its
    fields set, and every problem found (unknown names, a name given twice, a group of the
    wrong type, each group's bad values), not raised: the caller reports them with its own.

    Args:
        given: Group keyword ("planning", ...) -> the group given, or None.
        keywords: Option name -> value (old names in `ALIASES` taken with a FutureWarning).
        groups: The groups this call takes.
        elsewhere: Option names this call does not take -> why (e.g. a compile option
            passed to plan()).

    Returns:
        (group keyword -> group, problems).
    """
    known = fields_of(groups)
    problems: list[str] = []
    by_group: dict[str, dict[str, Any]] = {g.name: {} for g in groups}
    for raw, value in keywords.items():
        name = _renamed(raw, problems, keywords)
        if name is None:
            continue
        if elsewhere and name in elsewhere:
            problems.append(f"{name}= {elsewhere[name]}")
        elif name not in known:
            problems.append(unknown_option(name, [*known, *(elsewhere or ())]))
        else:
            by_group[known[name][0].name][name] = value
    out: dict[str, OptionGroup] = {}
    for cls in groups:
        base = _given(cls, given.get(cls.name), problems)
        keys = by_group[cls.name]
        twice = sorted(k for k in keys if given.get(cls.name) is not None)
        problems.extend(f"{k}= given as a keyword and in {cls.name}=; pass it once" for k in twice)
        try:
            group = replace(base, **keys)  # type: ignore[type-var]
        except ConfigError as exc:  # a group that checks itself on construction
            problems.append(str(exc))
            group = base
        problems.extend(group.problems())
        out[cls.name] = group
    return out, problems


def _renamed(raw: str, problems: list[str], keywords: Mapping[str, Any]) -> str | None:
    """An option's current name; an old one warns, and is a problem beside its new one."""
    new = ALIASES.get(raw)
    if new is None:
        return raw
    if new in keywords:
        problems.append(f"{raw}= is the old name of {new}=, which is given too; pass {new}=")
        return None
    warnings.warn(f"{raw}= is now called {new}=", FutureWarning, stacklevel=4)
    return new


def _given(cls: type[_Group], value: Any, problems: list[str]) -> _Group:
    if value is None:
        return cls()
    if not isinstance(value, cls):
        problems.append(f"{cls.name}={value!r}: it must be a {cls.__name__}(...)")
        return cls()
    return value


def table(groups: Sequence[type[OptionGroup]] = GROUPS) -> str:
    """Every option as a markdown table: group, name, default, command-line flag, meaning
    (the reference `docs/training.md` quotes; tests/test_options.py keeps them equal)."""
    rows = [
        "| group | option | default | flag | meaning |",
        "|-------|--------|---------|------|---------|",
    ]
    for cls in groups:
        for f in fields(cls):  # type: ignore[arg-type]
            shown = _shown(field_default(f))
            flag = f"`{f.metadata['flag']}`" if f.metadata["flag"] else ""
            rows.append(f"| {cls.name} | `{f.name}` | {shown} | {flag} | {f.metadata['doc']} |")
    return "\n".join(rows)


def _shown(value: Any) -> str:
    if isinstance(value, (ProfileConfig, LinkModel)):
        return f"`{type(value).__name__}()`"
    return f"`{value!r}`"
