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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from graphpipe.errors import ConfigError
from graphpipe.ir.registry import policy_spec

__all__ = ["CostModel", "LinkModel", "MemoryModel", "weight_copies"]


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

    def weights(self, param_bytes: float, versions: int | None = None) -> float:
        """Bytes for parameters: the kept versions, one gradient and the optimizer state."""
        kept = self.weight_versions if versions is None else versions
        return param_bytes * (kept + 1 + self.optimizer_slots)

    def fits(self, nbytes: float) -> bool:
        """Whether `nbytes` fits in the budget."""
        return self.budget is None or nbytes <= self.budget


@dataclass(frozen=True)
class CostModel:
    """Everything planning assumes besides the per-op times, recorded in every Plan."""

    micro_batch_size: int
    micro_batches: int
    link: LinkModel = field(default_factory=LinkModel)
    memory: MemoryModel = field(default_factory=MemoryModel)
    profile: str = "flops"  # where op times came from: "flops" (estimate) or "measure"
    device: str = "cpu"  # the device the op times are for

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.micro_batches < 1:
            raise ConfigError(
                f"micro_batch_size and micro_batches must be >= 1, got {self.micro_batch_size} "
                f"and {self.micro_batches}"
            )

    def stage_time(self, compute: float, param_bytes: float, replicas: int) -> float:
        """Seconds per micro-batch of a stage: its busiest replica's share of the compute plus
        its all-reduce, both spread over the M micro-batches of a mini-batch."""
        m = self.micro_batches
        share = math.ceil(m / replicas) / m
        return compute * share + self.link.allreduce(param_bytes, replicas) / m

    def stage_times(self, compute: float, param_bytes: float, replicas: int) -> np.ndarray:
        """`stage_time` on 1..`replicas` replicas, as one array (the same operations per
        element, so the same values)."""
        m, link = self.micro_batches, self.link
        r = np.arange(1, replicas + 1, dtype=np.float64)
        share = np.ceil(m / r) / m
        steps = 2 * (r - 1)
        allreduce = steps / r * param_bytes / link.bandwidth + steps * link.latency
        if param_bytes <= 0:
            allreduce[:] = 0.0
        allreduce[0] = 0.0
        return compute * share + allreduce / m

    def stage_memory(
        self, param_bytes: float, activation_bytes: float, in_flight: int, replicas: int
    ) -> float:
        """Peak bytes on one replica of a stage with `in_flight` micro-batches in flight."""
        held = math.ceil(min(in_flight, self.micro_batches) / replicas)
        return self.memory.weights(param_bytes) + activation_bytes * held

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """Inverse of `to_dict`."""
        fields = dict(data)
        fields["link"] = LinkModel(**fields.get("link", {}))
        fields["memory"] = MemoryModel(**fields.get("memory", {}))
        return cls(**fields)
