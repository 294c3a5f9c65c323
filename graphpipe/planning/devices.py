"""Device presets and the roofline: what an op costs on an accelerator one has not got.

A kernel that does `flops` floating-point operations and moves `nbytes` through device memory
takes, on the roofline (Williams et al., "Roofline: an insightful visual performance model
for multicore architectures", CACM 2009),

    roofline(flops, nbytes) = max(flops / (peak_flops * efficiency),
                                  nbytes / (memory_bandwidth * efficiency)) + launch * kernels

`launch` is the fixed cost of one kernel (launch latency and the tail of a small grid). So a
small micro-batch is less efficient: the weights are read and the kernel launched whatever
the batch, while the FLOPs shrink with it. `profile.ProfileConfig(mode="roofline")` applies
this to every node of a traced graph (see `graphpipe.planning.profile` for the node's FLOPs
and bytes).

Presets (`DEVICES`), dense bf16 tensor-core peaks, without sparsity:

    a100   NVIDIA A100 SXM4 80GB: 312 TFLOP/s bf16, 2.039 TB/s HBM2e, 80 GB
           (NVIDIA A100 Tensor Core GPU datasheet, 2021, "BFLOAT16 Tensor Core 312 TFLOPS",
           "GPU Memory Bandwidth 2,039 GB/s" for the 80GB SXM)
    h100   NVIDIA H100 SXM5 80GB: 989 TFLOP/s bf16, 3.35 TB/s HBM3, 80 GB
           (NVIDIA H100 Tensor Core GPU datasheet, 2023, "BFLOAT16 Tensor Core 1,979
           teraFLOPS*" with sparsity, so 989.5 dense; "GPU memory bandwidth 3.35TB/s")

Both take `launch` = 5 us per kernel, the order of a CUDA kernel launch plus a short grid
(measured launch latencies are 3 to 10 us), and `efficiency` = 1: the pure roofline, an
optimistic bound. Lower `efficiency` (e.g. 0.7, typical of large GEMMs) with
`dataclasses.replace` when the absolute times matter; ratios between plans barely move.

    >>> round(roofline(624e9, 1e9, DEVICES["a100"]) * 1e6, 3)  # 2 ms of compute + 5 us launch
    2005.0

Nodes (`NODES`): a cluster is nodes of `gpus` devices each. Inside a node the devices share a
fast link (NVLink through NVSwitch), between nodes each device has its own slower one (one
InfiniBand NIC per GPU). Both are per device and per direction, as the ring collectives of
`graphpipe.ir.cost.LinkModel` read them:

    h100x8  8 x h100 (DGX H100): NVLink 4, 900 GB/s per GPU both ways, so 450 GB/s each way;
            8 x 400 Gb/s ConnectX-7, one per GPU, so 50 GB/s each way
            (NVIDIA DGX H100 datasheet, 2023)
    a100x8  8 x a100 (DGX A100): NVLink 3, 600 GB/s per GPU both ways, so 300 GB/s each way;
            8 x 200 Gb/s HDR InfiniBand, one per GPU, so 25 GB/s each way
            (NVIDIA DGX A100 datasheet, 2020)

Latencies are the order of a collective step: 3 us inside a node, 10 us across nodes.

A mesh (pp, dp, tp) is laid out as torchtitan lays it out: tp innermost (consecutive ranks,
so tp sits inside a node when it divides the node's GPUs), then dp, then pp outermost
(`Node.mesh_links`). A dimension whose group fits inside one node (tp <= gpus for tp,
dp * tp <= gpus for dp, N <= gpus for pp) runs on the node's link, else on the link across
nodes: a ring crossing nodes moves as fast as its slowest hop, and a pipeline as its slowest
stage-to-stage link.

    >>> NODES["h100x8"].mesh_links(pp=4, dp=2, tp=4)[1].bandwidth  # dp x tp = 8: one node
    450000000000.0
"""

from __future__ import annotations

from dataclasses import dataclass

from graphpipe.errors import ConfigError
from graphpipe.ir.cost import LinkModel

__all__ = ["DEVICES", "NODES", "Device", "Node", "device_preset", "node_preset", "roofline"]


@dataclass(frozen=True)
class Device:
    """An accelerator as the roofline sees it."""

    name: str
    peak_flops: float  # FLOP/s, dense bf16 tensor cores
    memory_bandwidth: float  # bytes/s of device memory (HBM)
    memory: float  # bytes of device memory
    launch: float = 5e-6  # seconds per kernel launch
    efficiency: float = 1.0  # share of both peaks a kernel reaches (1: the pure roofline)

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.memory_bandwidth, self.memory) <= 0 or self.launch < 0:
            raise ConfigError(
                f"device {self.name!r} needs positive peak_flops, memory_bandwidth and memory "
                f"and launch >= 0, got {self.peak_flops}, {self.memory_bandwidth}, "
                f"{self.memory} and {self.launch}"
            )
        if not 0 < self.efficiency <= 1:
            raise ConfigError(
                f"device {self.name!r} efficiency must be in (0, 1], got {self.efficiency}"
            )


DEVICES: dict[str, Device] = {
    "a100": Device("a100", peak_flops=312e12, memory_bandwidth=2.039e12, memory=80e9),
    "h100": Device("h100", peak_flops=989e12, memory_bandwidth=3.35e12, memory=80e9),
}


def device_preset(name: str) -> Device:
    """The preset called `name` (see `DEVICES`).

    Raises:
        ConfigError: no such preset.
    """
    if name not in DEVICES:
        raise ConfigError(f"unknown device preset {name!r}; known: {sorted(DEVICES)}")
    return DEVICES[name]


def roofline(flops: float, nbytes: float, device: Device, kernels: int = 1) -> float:
    """Seconds for `kernels` kernels doing `flops` FLOPs and moving `nbytes` bytes in all.

    Args:
        flops: Floating-point operations.
        nbytes: Bytes read and written in device memory.
        device: The device.
        kernels: Kernel launches, each costing `device.launch`.

    Returns:
        max(flops / peak, nbytes / bandwidth) / efficiency + kernels * launch.

    Example:
        >>> roofline(0, 2.039e12, DEVICES["a100"], kernels=0)  # one second of HBM traffic
        1.0
    """
    compute = flops / device.peak_flops
    memory = nbytes / device.memory_bandwidth
    return max(compute, memory) / device.efficiency + kernels * device.launch


@dataclass(frozen=True)
class Node:
    """A node of `gpus` devices: a fast link inside it, a slower one per device across nodes."""

    name: str
    device: Device  # every device of the node
    gpus: int  # devices per node
    intra: LinkModel  # per device and direction, inside the node (NVLink)
    inter: LinkModel  # per device and direction, to other nodes (its own NIC)

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise ConfigError(f"node {self.name!r} needs gpus >= 1, got {self.gpus!r}")

    def link(self, span: int) -> LinkModel:
        """The link of a group of ranks spanning `span` consecutive ranks: the node's own
        when they fit in one node, else the link across nodes."""
        return self.intra if span <= self.gpus else self.inter

    def mesh_links(self, pp: int, dp: int, tp: int) -> tuple[LinkModel, LinkModel, LinkModel]:
        """The (pp, dp, tp) links of a mesh laid out tp innermost, then dp, then pp (module
        docstring)."""
        return self.link(pp * dp * tp), self.link(dp * tp), self.link(tp)


NODES: dict[str, Node] = {
    "h100x8": Node(
        "h100x8",
        DEVICES["h100"],
        8,
        intra=LinkModel(bandwidth=450e9, latency=3e-6),
        inter=LinkModel(bandwidth=50e9, latency=10e-6),
    ),
    "a100x8": Node(
        "a100x8",
        DEVICES["a100"],
        8,
        intra=LinkModel(bandwidth=300e9, latency=3e-6),
        inter=LinkModel(bandwidth=25e9, latency=10e-6),
    ),
}


def node_preset(node: str | Node) -> Node:
    """The node `node` names (see `NODES`), or `node` itself.

    Raises:
        ConfigError: no such preset.
    """
    if isinstance(node, Node):
        return node
    if node not in NODES:
        raise ConfigError(f"unknown node preset {node!r}; known: {sorted(NODES)}")
    return NODES[node]
