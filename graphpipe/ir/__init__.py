"""The IR: the plain, frozen data every phase reads and writes, and the rules that go with it.

    Plan      (plan.py)      stages, their devices and edges, and the cost model's predictions
    Schedule  (actions.py)   per rank, an ordered tuple of `Action`s (`2F0`, `2SF0>3`, `2U`),
                             each of an `ActionKind`; a send or receive carries a `Message`
    messages.py              the communication rule: what a compute action awaits and sends
    Program   (program.py)     per rank, compute actions and fused communication groups
    Timeline  (timeline.py)  spans of actions, simulated or measured
    CostModel (cost.py)      links, memory and replication assumed by planning and simulation
    registry.py              what each schedule and weight policy is (ScheduleSpec, PolicySpec)

Index letters used throughout graphpipe:

    s, t  stages        j  micro-batch        r  replicas of a stage
    S     #stages       M  micro-batches      N  devices (= ranks)
"""

from graphpipe.ir.actions import (
    COMPUTE,
    KINDS,
    Action,
    ActionKind,
    Message,
    Schedule,
    channel,
    parse_ranks,
)
from graphpipe.ir.cost import CostModel, LinkModel, MemoryModel, weight_copies
from graphpipe.ir.dims import ParallelDims
from graphpipe.ir.messages import Occurrences, awaits, message_time, sends, with_messages
from graphpipe.ir.plan import (
    WEIGHT_SHARE,
    Plan,
    Stage,
    StageEdge,
    chain_in_order,
    compute_time,
    device_of,
    edges_to_sink,
    freed,
    input_halves,
    over_budget,
    transfer_time,
    weight_share,
)
from graphpipe.ir.program import Comm, Op, Program, parse_ops
from graphpipe.ir.registry import (
    ANY_PLACEMENT,
    DEFAULT_SCHEDULE,
    POLICIES,
    SCHEDULES,
    PolicySpec,
    ScheduleSpec,
    policy_spec,
    schedule_names,
    schedule_spec,
)
from graphpipe.ir.timeline import Span, Timeline

__all__ = [
    "ANY_PLACEMENT",
    "COMPUTE",
    "DEFAULT_SCHEDULE",
    "KINDS",
    "POLICIES",
    "SCHEDULES",
    "WEIGHT_SHARE",
    "Action",
    "ActionKind",
    "Comm",
    "CostModel",
    "LinkModel",
    "MemoryModel",
    "Message",
    "Occurrences",
    "Op",
    "ParallelDims",
    "Plan",
    "PolicySpec",
    "Program",
    "Schedule",
    "ScheduleSpec",
    "Span",
    "Stage",
    "StageEdge",
    "Timeline",
    "awaits",
    "chain_in_order",
    "channel",
    "compute_time",
    "device_of",
    "edges_to_sink",
    "freed",
    "input_halves",
    "message_time",
    "over_budget",
    "parse_ops",
    "parse_ranks",
    "policy_spec",
    "schedule_names",
    "schedule_spec",
    "sends",
    "transfer_time",
    "weight_copies",
    "weight_share",
    "with_messages",
]
