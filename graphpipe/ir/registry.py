"""What each schedule and each weight policy is: one registry that every phase reads.

compile, the command line, the cost model, the planner, the generators and the runtime ask
these tables instead of keeping their own sets of names:

    >>> SCHEDULES["zbv"].split_backward, SCHEDULES["zbv"].placement
    (True, 'v')
    >>> POLICIES["2bw"].schedule
    '2bw'

A new schedule is a `ScheduleSpec` here and a generator in `graphpipe.scheduling.generators`
(which refuses to import when the two disagree): every fact about it (what it runs, which
layout the planner picks it for, whether its order reads stage times, its bound on M) is a
field of its spec. A new weight policy is a `PolicySpec` here and a `WeightPolicy` in
`graphpipe.runtime.weights`. Which schedule a run runs is decided in one place,
`schedule_for`: the one named, else the weight policy's, else the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphpipe.errors import ConfigError

__all__ = [
    "ALIASES",
    "ANY_PLACEMENT",
    "DEFAULT_SCHEDULE",
    "POLICIES",
    "SCHEDULES",
    "PolicyOptions",
    "PolicySpec",
    "ScheduleSpec",
    "policy_spec",
    "schedule_for",
    "schedule_names",
    "schedule_spec",
]


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule is, for everyone who must choose or check one.

    Attributes:
        name: The generator's name (`make_schedule(plan, name)`).
        summary: One line for people (the CLI's help, errors).
        split_backward: Runs the backward as I (input gradients) and W (weight gradients)
            instead of B (zero bubble); stages are compiled with the split.
        placement: Which plans it runs: None, one stage per device; "loop" or "v", a chain
            of stages folded onto the devices so (`graphpipe.planning.place`); "any", any
            placement of single-device stages (folded stage DAGs).
        asynchronous: Micro-batches flow across step() calls with no flush; an update follows
            backwards inside the run, and the run ends with a drain.
        dag: Runs a stage DAG (fan-out, fan-in), not only a chain.
        replicas: Runs data-parallel (replicated) stages.
        training: Has backwards and updates (False for inference's forward-only schedule).
        layout: The layout the planner picks it for when the run names no schedule ("one",
            "loop", "v", "graph"; several: the planner simulates each), None: only named.
        reads_times: Its order reads the plan's stage times and links (it keeps the
            candidate that replays fastest, or builds greedily over them), so ranks that
            measured other times may make other orders; every other order reads the plan's
            shape alone.
        min_micro_batches: Its bound on M beyond its placement's: "depth" (M >= the plan's
            depth) or "2n" (M >= 2 x devices), None: none.
    """

    name: str
    summary: str
    split_backward: bool = False
    placement: str | None = None
    asynchronous: bool = False
    dag: bool = True
    replicas: bool = True
    training: bool = True
    layout: str | None = None
    reads_times: bool = False
    min_micro_batches: str | None = None

    @property
    def folds_chain(self) -> bool:
        """Runs a chain folded "loop" or "v" onto the devices (interleaved, zbv, dualpipev)."""
        return self.placement in ("loop", "v")

    @property
    def stages_per_device(self) -> str:
        """ "one" (one stage per device) or "several" (placed or folded plans)."""
        return "one" if self.placement is None else "several"


SCHEDULES: dict[str, ScheduleSpec] = {
    s.name: s
    for s in (
        ScheduleSpec("gpipe", "all forwards, then all backwards, one update (GPipe)"),
        ScheduleSpec(
            "1f1b", "one forward, one backward, a flush (graph 1F1B on a stage DAG)", layout="one"
        ),
        ScheduleSpec(
            "zb",
            "ZB-H1: 1F1B's peak memory, the backward split, W deferred",
            True,
            reads_times=True,
        ),
        ScheduleSpec("zb2", "ZB-H2: zero bubble with up to 2p-1 micro-batches in flight", True),
        ScheduleSpec(
            "async",
            "1F1B without a flush, an update after every backward (PipeDream)",
            asynchronous=True,
            replicas=False,
        ),
        ScheduleSpec(
            "2bw",
            "1F1B without a flush, an update per mini-batch (PipeDream-2BW)",
            asynchronous=True,
            replicas=False,
            min_micro_batches="depth",  # one update per mini-batch: 2 buffers per stage
        ),
        ScheduleSpec(
            "interleaved",
            "Megatron's interleaved 1F1B on a chain folded 'loop' onto the devices",
            placement="loop",
            dag=False,
            replicas=False,
            layout="loop",
        ),
        ScheduleSpec(
            "interleaved_zb",
            "interleaved zero bubble (ZB1P) on a chain folded 'loop' onto the devices",
            split_backward=True,
            placement="loop",
            dag=False,
            replicas=False,
            layout="loop",
        ),
        ScheduleSpec(
            "zbv",
            "ZB-V on a chain of 2N stages folded 'v' onto N devices",
            split_backward=True,
            placement="v",
            dag=False,
            replicas=False,
            layout="v",  # listed before dualpipev: on equal steps the planner keeps zbv
            reads_times=True,
        ),
        ScheduleSpec(
            "dualpipev",
            "DualPipeV (DeepSeek) on a chain of 2N stages folded 'v' onto N devices",
            split_backward=True,
            placement="v",
            dag=False,
            replicas=False,
            layout="v",
            min_micro_batches="2n",  # DualPipe's and torch's bound
        ),
        ScheduleSpec(
            "graph_interleaved",
            "1F1B on any placement of a stage DAG's single-device stages",
            placement="any",
            replicas=False,
            layout="graph",
            reads_times=True,
        ),
        ScheduleSpec(
            "forward", "every forward, no backward: inference", placement="any", training=False
        ),
    )
}
ALIASES = {"graph1f1b": "1f1b"}
(DEFAULT_SCHEDULE,) = [n for n, s in SCHEDULES.items() if s.layout == "one"]  # run when none
# is asked for, on one stage per device


def schedule_names(**where: object) -> list[str]:
    """The schedules whose spec has every given attribute value, in the table's order.

    Example:
        >>> schedule_names(training=True, asynchronous=False, placement=None)
        ['gpipe', '1f1b', 'zb', 'zb2']
    """
    return [n for n, s in SCHEDULES.items() if all(getattr(s, k) == v for k, v in where.items())]


# the training schedule for any placement of single-device stages (folded stage DAGs)
(ANY_PLACEMENT,) = schedule_names(placement="any", training=True)


def schedule_spec(name: str, *, training: bool = True) -> ScheduleSpec:
    """The spec of schedule `name` (or of its alias).

    Args:
        name: A schedule name.
        training: Refuse a schedule without backwards (inference's "forward").

    Raises:
        ConfigError: an unknown name, naming the known ones.
    """
    spec = SCHEDULES.get(ALIASES.get(name, name))
    if spec is None or (training and not spec.training):
        known = sorted(s for s, v in SCHEDULES.items() if v.training or not training)
        raise ConfigError(f"unknown schedule {name!r}; known: {known}")
    return spec


@dataclass(frozen=True)
class PolicySpec:
    """What a weight policy is.

    Attributes:
        name: The policy's name (`compile(..., weights=name)`).
        summary: One line for people.
        schedule: The schedule it runs with; None: any flushed (synchronous) schedule.
        whole_step: Every rank updates once per step() call on the same gradients, so a step
            can be skipped or scaled as a whole: gradient clipping, fp16's loss scaler and
            the NaN check need it.
        replicas: Allows data-parallel (replicated) stages and weights tied across ranks.
        versions: The weight copies a stage keeps (`weight_copies`): "live" (the weights
            alone), "stashed" (one per micro-batch in flight), "double" (two buffers) or
            "corrected" (PipeMare's moving average and corrected weights).
    """

    name: str
    summary: str
    schedule: str | None = None
    whole_step: bool = False
    replicas: bool = False
    versions: str = "live"

    def weight_copies(self, warmup: int, correction: bool = True) -> int:
        """Peak copies of a stage's weights whose 1F1B warm-up is `warmup` forwards.

        live 1; stashed warm-up + 1 (one per micro-batch in flight, the live one among them);
        double 2; corrected 1, plus the moving average of its steps and the corrected weights
        of the backward in progress when `correction` is on and the stage has a warm-up.
        """
        if self.versions == "stashed":
            return warmup + 1
        if self.versions == "double":
            return 2
        if self.versions == "corrected":
            return 1 + (2 if correction and warmup > 0 else int(correction))
        return 1

    @property
    def flushed(self) -> bool:
        """Runs with a flushed (synchronous) schedule."""
        return self.schedule is None


POLICIES: dict[str, PolicySpec] = {
    p.name: p
    for p in (
        PolicySpec("flush", "synchronous: one update per step", None, True, True),
        PolicySpec("stash", "PipeDream's weight stashing", "async", versions="stashed"),
        PolicySpec("2bw", "PipeDream-2BW's double-buffered weights", "2bw", versions="double"),
        PolicySpec(
            "pipemare", "PipeMare: asynchronous with corrections", "async", versions="corrected"
        ),
    )
}


def policy_spec(name: str) -> PolicySpec:
    """The spec of weight policy `name`.

    Raises:
        ConfigError: an unknown name, naming the known ones.
    """
    if name not in POLICIES:
        raise ConfigError(f"unknown weight policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name]


@dataclass(frozen=True)
class PolicyOptions:
    """Settings of the PipeMare fixes (the other policies have none)."""

    lr_reschedule: bool = True  # scale the rate by 1 / tau^(1 - min(k/K, 1))
    correction: bool = True  # backward with w - w_i * delta instead of the live weights
    warmup_updates: int = 100  # K: updates until the rate is back to the full rate
    ema: float = 0.9  # delta <- ema * delta + (1 - ema) * (w_new - w_old)


def schedule_for(weights: str, named: str | None, made_for: str | None = None) -> str | None:
    """The schedule a run runs, decided once for compile, the planner and the command line:
    `named` (the run's `schedule=`), checked against the weight policy; else the policy's
    own (2bw, async, pipemare); else `made_for` (the plan's schedule, `Plan.schedule`),
    checked too; else None: none is named, and the planner chooses with its layout.

    Raises:
        ConfigError: an unknown policy or schedule, or a schedule the policy cannot run with.
    """
    policy = policy_spec(weights)
    given = named if named is not None else policy.schedule or made_for
    if given is None:
        return None
    name = schedule_spec(given).name
    if policy.flushed == schedule_spec(name).asynchronous or (
        not policy.flushed and name != policy.schedule
    ):
        need = policy.schedule or "a flushed schedule (gpipe, 1f1b, zb)"
        raise ConfigError(f"weights={weights!r} runs with {need}, not schedule={given!r}")
    return name
