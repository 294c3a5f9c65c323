"""The cost model: what planning and simulation assume about links, memory and replication.

Times are seconds for one micro-batch; bytes are for one micro-batch unless named otherwise.

    transfer(bytes)      = latency + bytes / bandwidth                       (0 for 0 bytes)
    allreduce(bytes, r)  = 2 (r-1)/r * bytes / bandwidth + 2 (r-1) latency   (ring; 0 for r=1)
    stage_time(c, p, r)  = c * ceil(M / r) / M + allreduce(p, r) / M
    stage_memory         = p * (versions + 1 + optimizer_slots) + a * ceil(min(k, M) / r)

with c the stage's forward + backward time on one device, p its parameter bytes, r its data-
parallel replicas, M the micro-batches per mini-batch, a its activation bytes per micro-batch
and k its in-flight micro-batches. A replicated stage takes every r-th micro-batch on each
replica, so its busiest replica runs ceil(M / r) of the M (replicas beyond M would idle), and
its gradient all-reduce runs once per mini-batch, so it is spread over M.

Sharded data parallelism (`DataParallel`, FSDP2 over a ("pp", "dp") mesh of degree k): every
stage runs on k ranks, each taking 1/k of every micro-batch's rows. The planner plans one dp
rank: its op times and activation bytes are those of a micro-batch of b/k rows (linear in
the rows, or a roofline re-costed at b/k: `planning.mesh`), so c and a above are per rank.
On the dp link (`DataParallel.link`, else the pp link), with p the stage's parameter bytes:

    gather(p)            = (k-1)/k * p / bandwidth + (k-1) latency            (ring all-gather)
    scatter(p)           = gather(p)                                     (ring reduce-scatter)
    gathers per mb       g = 2 gather(p) (reshard_after_forward: forward and backward each
                         gather) or gather(p) / M (kept unsharded over the step)
    dp stage_time(c, p)  = max(c, g) + scatter(p) / M     (shard; prefetch hides the gathers
                         behind the compute unless they are longer)
                         = c + allreduce_dp(p, k) / M     (shard=False: replicated, HSDP-like)
    exposed gathers      max(0, g - c) per mb (reshard_after_forward); without it, the step's
                         one gather behind the step's first forward f: max(0, gather(p) - f) / M
    dp weights(p)        = p (versions + optimizer_slots) / k       sharded state, on each rank
                           + p * gather_share                       the unsharded copy held
                           + p                                      the unsharded gradient
                         = p (versions + 1 + optimizer_slots)       (shard=False)
    dp stage_memory      = dp weights(p) + a * min(k_in_flight, M)

The gradient is accumulated unsharded over the step's micro-batches and reduce-scattered once,
after the stage's last backward (FSDP2's `set_requires_gradient_sync(False)` until then), so
it does not divide by k; the reduce-scatter is paid in the update (U). `gather_share` is the
share of the stage's parameters unsharded at once: 1 when the stage is one `fully_shard`
unit, about 2/L when each of L blocks is one (the current block and the prefetched next).
Without reshard_after_forward the whole stage stays unsharded (share 1).

Tensor parallelism (`TensorParallel`, DTensor over a "tp" mesh dimension of degree t): each
stage runs on t ranks that split the layers of a tp plan (Megatron's column- and row-wise
Linears). The planner plans one tp rank (`planning.mesh.tp_rank_graph`): the planned layers'
parameter bytes and times, and the activations between a column-wise layer and the next
row-wise one, are 1/t; each row-wise layer's forward and each column-wise layer input's
backward carry a ring all-reduce of that activation over t on the tp link. So c, p and a
above are one tp rank's, with its collectives in c.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from graphpipe.errors import ConfigError
from graphpipe.ir.dims import ParallelDims
from graphpipe.ir.registry import policy_spec

__all__ = [
    "CostModel",
    "DataParallel",
    "LinkModel",
    "MemoryModel",
    "TensorParallel",
    "weight_copies",
]


def weight_copies(policy: str, warmup: int, correction: bool = True) -> int:
    """Peak copies of a stage's weights under a weight policy (see graphpipe.runtime.weights):
    `PolicySpec.weight_copies` of the registry's policy.

    Raises:
        ConfigError: an unknown policy.
    """
    return policy_spec(policy).weight_copies(warmup, correction)


@dataclass(frozen=True)
class LinkModel:
    """A device's link to the others: one latency and one bandwidth for every pair."""

    bandwidth: float = 12.5e9  # bytes/s per device (100 Gb/s)
    latency: float = 10e-6  # seconds per message

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise ConfigError(
                f"link needs bandwidth > 0 and latency >= 0, got bandwidth={self.bandwidth}, "
                f"latency={self.latency}"
            )

    def transfer(self, nbytes: float) -> float:
        """Seconds to move `nbytes` from one device to another (0 when nothing moves)."""
        return 0.0 if nbytes <= 0 else self.latency + nbytes / self.bandwidth

    def allreduce(self, nbytes: float, replicas: int) -> float:
        """Seconds for a ring all-reduce of `nbytes` over `replicas` devices."""
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (replicas - 1)
        return steps / replicas * nbytes / self.bandwidth + steps * self.latency

    def all_gather(self, nbytes: float, ranks: int) -> float:
        """Seconds for a ring all-gather of `nbytes` (the gathered size) over `ranks` devices:
        (r-1)/r * bytes / bandwidth + (r-1) latency. A ring reduce-scatter of `nbytes` (the
        unreduced size) takes the same (`reduce_scatter`)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        steps = ranks - 1
        return steps / ranks * nbytes / self.bandwidth + steps * self.latency

    def reduce_scatter(self, nbytes: float, ranks: int) -> float:
        """Seconds for a ring reduce-scatter of `nbytes` over `ranks` devices (`all_gather`)."""
        return self.all_gather(nbytes, ranks)


@dataclass(frozen=True)
class MemoryModel:
    """Per-device memory: weights × versions (plus gradients and optimizer state) + activations."""

    budget: float | None = None  # bytes per device; None means unlimited
    weight_versions: int = 1  # weight copies the weight policy keeps (flush 1, 2bw 2)
    optimizer_slots: int = 2  # optimizer state tensors per parameter (Adam 2, SGD momentum 1)

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget <= 0:
            raise ConfigError(f"memory budget must be positive, got {self.budget}")
        if self.weight_versions < 1 or self.optimizer_slots < 0:
            raise ConfigError(
                f"weight_versions must be >= 1 and optimizer_slots >= 0, got "
                f"{self.weight_versions} and {self.optimizer_slots}"
            )

    def weights(
        self, param_bytes: float, versions: int | None = None, frozen: float = 0.0
    ) -> float:
        """Bytes for parameters: the kept versions, one gradient and the optimizer state;
        of them, the `frozen` bytes one copy only (they never change, and take neither a
        gradient nor optimizer state)."""
        kept = self.weight_versions if versions is None else versions
        return (param_bytes - frozen) * (kept + 1 + self.optimizer_slots) + frozen

    def fits(self, nbytes: float) -> bool:
        """Whether `nbytes` fits in the budget."""
        return self.budget is None or nbytes <= self.budget


@dataclass(frozen=True)
class DataParallel:
    """What the dp dimension costs besides its size (`CostModel.dims`: dp and dp_shard):
    FSDP2's resharding, the share of a stage unsharded at once, and the dp link. See the
    module docstring for the costs.
    """

    reshard_after_forward: bool = True  # FSDP2's option: gather again for the backward
    gather_share: float = 1.0  # share of the stage's parameters unsharded at once
    link: LinkModel | None = None  # the dp link; None: the same as the pp link

    def __post_init__(self) -> None:
        if not 0 < self.gather_share <= 1:
            raise ConfigError(f"gather_share must be in (0, 1], got {self.gather_share}")


@dataclass(frozen=True)
class TensorParallel:
    """What the tp dimension costs besides its size (`CostModel.dims.tp`): its link (the
    module docstring gives the costs)."""

    link: LinkModel | None = None  # the tp link; None: the same as the pp link


@dataclass(frozen=True)
class CostModel:
    """Everything planning assumes besides the per-op times, recorded in every Plan."""

    micro_batch_size: int
    micro_batches: int
    link: LinkModel = field(default_factory=LinkModel)
    memory: MemoryModel = field(default_factory=MemoryModel)
    profile: str = "flops"  # where op times came from: "flops" (estimate) or "measure"
    device: str = "cpu"  # the device the op times are for
    # the parallel layout: pp (the plan's devices, set by the Plan), dp, tp, dp_shard
    dims: ParallelDims = field(default_factory=ParallelDims)
    dp: DataParallel = field(default_factory=DataParallel)  # the dp dimension's other costs
    tp: TensorParallel = field(default_factory=TensorParallel)  # the tp dimension's link

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.micro_batches < 1:
            raise ConfigError(
                f"micro_batch_size and micro_batches must be >= 1, got {self.micro_batch_size} "
                f"and {self.micro_batches}"
            )

    def stage_time(self, compute: float, param_bytes: float, replicas: int) -> float:
        """Seconds per micro-batch of a stage: its busiest replica's share of the compute plus
        its all-reduce, both spread over the M micro-batches of a mini-batch; with a dp
        dimension, "dp stage_time" of the module docstring (`replicas` must be 1)."""
        m = self.micro_batches
        if self.dims.dp > 1:
            return self._dp_stage_time(compute, param_bytes, replicas)
        share = math.ceil(m / replicas) / m
        return compute * share + self.link.allreduce(param_bytes, replicas) / m

    def stage_times(self, compute: float, param_bytes: float, replicas: int) -> np.ndarray:
        """`stage_time` on 1..`replicas` replicas, as one array (the same operations per
        element, so the same values)."""
        m, link = self.micro_batches, self.link
        if self.dims.dp > 1:  # no replicas beside the dp dimension
            times = np.full(replicas, np.inf)
            times[0] = self._dp_stage_time(compute, param_bytes, 1)
            return times
        r = np.arange(1, replicas + 1, dtype=np.float64)
        share = np.ceil(m / r) / m
        steps = 2 * (r - 1)
        allreduce = steps / r * param_bytes / link.bandwidth + steps * link.latency
        if param_bytes <= 0:
            allreduce[:] = 0.0
        allreduce[0] = 0.0
        return compute * share + allreduce / m

    def stage_memory(
        self,
        param_bytes: float,
        activation_bytes: float,
        in_flight: int,
        replicas: int,
        frozen: float = 0.0,
    ) -> float:
        """Peak bytes on one replica of a stage with `in_flight` micro-batches in flight
        (`frozen`: the parameter bytes that take no gradient, `weights`)."""
        held = math.ceil(min(in_flight, self.micro_batches) / replicas)
        return self.weights(param_bytes, frozen=frozen) + activation_bytes * held

    # -- the dp dimension (module docstring) ------------------------------------------------

    def describe_mesh(self) -> str:
        """The dims besides pp in words, with FSDP2's resharding where it is not the
        default, e.g. "dp 2 (sharded) x tp 2"."""
        words = self.dims.describe_inner()
        if self.dims.sharded and not self.dp.reshard_after_forward:
            words = words.replace("(sharded)", "(sharded, kept unsharded over the step)")
        return words

    @property
    def tp_link(self) -> LinkModel:
        """The link of the tp dimension: its own, or the pp link."""
        return self.tp.link or self.link

    @property
    def dp_link(self) -> LinkModel:
        """The link of the dp dimension: its own, or the pp link."""
        return self.dp.link or self.link

    def weights(
        self, param_bytes: float, versions: int | None = None, frozen: float = 0.0
    ) -> float:
        """Bytes for a stage's parameters on one rank: `MemoryModel.weights`, or with sharded
        dp, the sharded state + the unsharded copy held + the unsharded gradient (`frozen`
        bytes: one sharded copy and the unsharded one, no gradient or optimizer state)."""
        k, dp = self.dims.dp, self.dp
        if not self.dims.sharded:
            return self.memory.weights(param_bytes, versions, frozen)
        kept = self.memory.weight_versions if versions is None else versions
        share = dp.gather_share if dp.reshard_after_forward else 1.0
        trained = param_bytes - frozen
        sharded = (trained * (kept + self.memory.optimizer_slots) + frozen) / k
        return sharded + param_bytes * share + trained

    def gather_time(self, param_bytes: float) -> float:
        """Seconds of all-gathers of a stage's parameters per micro-batch on the dp link: two
        (forward, backward) with reshard_after_forward, else one per step spread over M."""
        if not self.dims.sharded:
            return 0.0
        once = self.dp_link.all_gather(param_bytes, self.dims.dp)
        return 2 * once if self.dp.reshard_after_forward else once / self.micro_batches

    def dp_sync_time(self, param_bytes: float) -> float:
        """Seconds per step to sync a stage's gradients over the dp dimension: a ring
        reduce-scatter (sharded) or all-reduce (replicated); 0 without dp."""
        k, link = self.dims.dp, self.dp_link
        if k == 1:
            return 0.0
        if self.dims.dp_shard:
            return link.reduce_scatter(param_bytes, k)
        return link.allreduce(param_bytes, k)

    def update_sync(self, param_bytes: float, replicas: int) -> float:
        """Seconds of an update's gradient communication: the replicas' all-reduce and the
        dp dimension's sync (`dp_sync_time`)."""
        allreduce = self.link.allreduce(param_bytes, replicas)
        return allreduce + self.dp_sync_time(param_bytes) if self.dims.dp > 1 else allreduce

    def exposed_gather(
        self, forward: float, backward: float, param_bytes: float
    ) -> tuple[float, float]:
        """A stage's forward and backward seconds per micro-batch with the all-gathers that
        prefetch does not hide, added in proportion to each (c = f + b): max(0, g - c) with
        reshard_after_forward (each micro-batch gathers for its forward and its backward);
        without it, the step's one gather less what the first forward hides, over M:
        max(0, gather(p) - f) / M."""
        c = forward + backward
        exposed = max(0.0, self.gather_time(param_bytes) - c)
        if self.dims.sharded and not self.dp.reshard_after_forward:
            # once per step, before the step's first forward uses the parameters: that
            # forward hides what it can (FSDP2 prefetches the next block's gather behind the
            # current block); the later micro-batches find them gathered. Spread over M.
            once = self.dp_link.all_gather(param_bytes, self.dims.dp)
            exposed = max(0.0, once - forward) / self.micro_batches
        if exposed == 0.0:
            return forward, backward
        f_share = forward / c if c > 0 else 0.5
        return forward + exposed * f_share, backward + exposed * (1 - f_share)

    def _dp_stage_time(self, compute: float, param_bytes: float, replicas: int) -> float:
        if replicas > 1:
            raise ConfigError(
                f"a stage has {replicas} replicas and dp degree {self.dims.dp}: replication "
                "inside the pp dimension and dp > 1 are exclusive"
            )
        m = self.micro_batches
        return max(compute, self.gather_time(param_bytes)) + self.dp_sync_time(param_bytes) / m

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (without `dims`, `dp` or `tp` when the default, as before
        they existed)."""
        data = asdict(self)
        data["dims"] = self.dims.to_dict()
        if not self.dims.meshed:
            del data["dims"]
        if self.dp == DataParallel():
            del data["dp"]
        if self.tp == TensorParallel():
            del data["tp"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """Inverse of `to_dict` (also of plans written before `dims`, whose `dp` and `tp`
        held the degrees)."""
        fields = dict(data)
        fields["link"] = LinkModel(**fields.get("link", {}))
        fields["memory"] = MemoryModel(**fields.get("memory", {}))
        dp = dict(fields.get("dp", {}))
        tp = dict(fields.get("tp", {}))
        dims = dict(fields.get("dims", {}))
        old = {"dp": dp.pop("degree", 1), "tp": tp.pop("degree", 1)}
        if "dims" not in fields and old != {"dp": 1, "tp": 1}:  # a plan from before dims
            dims = {**old, "dp_shard": dp.pop("shard", True)}
        dp.pop("shard", None)
        fields["dims"] = ParallelDims.from_dict(dims)
        for part in (dp, tp):
            if part.get("link") is not None:
                part["link"] = LinkModel(**part["link"])
        fields["dp"] = DataParallel(**dp)
        fields["tp"] = TensorParallel(**tp)
        return cls(**fields)
