"""Mesh: pipeline stages over the "pp" dimension of a DeviceMesh, FSDP2 over its "dp" one.

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pm = graphpipe.compile(model, x, ..., mesh=mesh)     # or dp=2

The plan is made for `pp` devices; its device numbers are pp coordinates. The process at
mesh coordinate (p, d) (global rank `mesh.mesh[p, d]`) runs plan device p, on the d-th slice
of every micro-batch, and talks only to the processes of its own dp index d: plan device q
is global rank `mesh.mesh[q, d]` for it (`ParallelLayout.rank_of`). Everything that names a
rank in plan terms (the program, the stages a rank holds) reads `ParallelLayout.pp_index`;
everything that reaches a process (the transport's peers, and through it the failure
watch's) translates with `rank_of`. Without a mesh the layout is the identity (pp = world,
dp = 1) and nothing changes.

Each stage module is sharded by torch's FSDP2 (`fully_shard`) over its dp sub-mesh, block
by block (`shard_stage`; a flat exported graph's blocks outlined into submodules first,
`graphpipe.runtime.outline`), then as a whole. Gradients are reduced once per step:
`prepare_backward` tells FSDP, before each backward, whether it is the stage's last one
before the update; only then does it reduce-scatter (the others accumulate unsharded
gradients locally). With `reshard_after_forward` a block's parameters are gathered for its
forward and again for its backward and freed after each, so a stage holds its root's and at
most two blocks' (the current and the prefetched one) at a time. A split backward (zero
bubble) never reduces in autograd: its weight halves add into the gathered parameters'
gradients by hand, and `reduce_gradients` runs FSDP's reduction after the stage's last one.
Its parameters stay gathered from the forward to the last weight half
(`reshard_after_forward` is False under a split backward: a weight half may read a saved
parameter, whose storage a reshard would free).

Each micro-batch's loss is scaled by 1/M by the flush policy and FSDP averages the
reduce-scatter over dp, so the gradient is the whole mini-batch's mean. graphpipe's own
gradient sums (`graphpipe.runtime.sync`) are not used over dp: torch's engine serves.

precision="bf16" is FSDP2's mixed-precision policy on every unit (`Precision.fsdp_policy`):
parameters gathered in bf16, gradients reduced in float32 into the float32 shards.

`dp_shard=False` replicates instead of sharding: FSDP2 over a 2D (replicate=dp, shard=1)
mesh, which is HSDP with one shard, i.e. DDP-like all-reduce of whole gradients, through
the public `fully_shard`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import graphpipe._torch as _torch
from graphpipe._torch import tree_map_only
from graphpipe.errors import ConfigError
from graphpipe.ir.dims import MESH_SHAPES, ParallelDims
from graphpipe.runtime.outline import block_prefixes, outline_blocks
from graphpipe.runtime.precision import Precision

__all__ = [
    "RESHARDING",
    "ParallelLayout",
    "build_mesh",
    "dims_of",
    "prepare_backward",
    "reduce_gradients",
    "reshard",
    "shaped_like",
    "shard_stage",
    "stage_blocks",
    "whole",
]


Ranks = tuple[tuple[tuple[int, ...], ...], ...]  # ranks[p][d][t]
# stage.meta key: the paths of the block units that reshard after every backward, not only
# the step's last (`shard_stage` with reshard_after_forward; read by `prepare_backward`)
RESHARDING = "gp_resharding"


def dims_of(mesh: DeviceMesh, dp_shard: bool = True) -> ParallelDims:
    """The layout a given DeviceMesh is (its dim names and sizes).

    Raises:
        ConfigError: not a DeviceMesh, or dims other than `MESH_SHAPES`.
    """
    if not isinstance(mesh, DeviceMesh):
        raise ConfigError(
            f"mesh={mesh!r}: it must be a DeviceMesh with mesh_dim_names one of "
            f"{list(MESH_SHAPES)} (or 'auto', or None with dp= and tp=)"
        )
    names = tuple(mesh.mesh_dim_names or ())
    return ParallelDims.of_names(names, tuple(mesh.mesh.shape), dp_shard)


def build_mesh(dims: ParallelDims, device_type: str, world: int) -> DeviceMesh | None:
    """The process group's DeviceMesh for `dims` (a collective: every rank calls it), with
    pp resolved from `world` where it is open; None when the layout is not meshed. The one
    place graphpipe builds a mesh from sizes (compile's dp= and tp=, the CLI's --dp/--tp).

    Raises:
        ConfigError: the dims do not fit the world (`ParallelDims.on`).
    """
    dims = dims.on(world)
    if not dims.meshed:
        return None
    return init_device_mesh(device_type, dims.sizes, mesh_dim_names=dims.names)


@dataclass(frozen=True)
class ParallelLayout:
    """The run's parallel layout, seen from this process: its dims (`ParallelDims`), its
    coordinates, the ranks of the mesh and the rows it runs per micro-batch. Compile builds
    it once, from the mesh or the world, when it joins (`graphpipe.compile.steps.join_mesh`,
    `RunSpec.layout`); the planning step reads its dims, the runtime its coordinates and
    ranks.

    Attributes:
        dims: The layout's sizes (pp: the plan's num_devices; dp, tp: 1 without them).
        pp_index: This process's plan device.
        dp_index: This process's slice of every micro-batch.
        ranks: ranks[p][d][t], the global rank at mesh coordinate (p, d, t).
        mesh: The DeviceMesh; None without one (the identity layout).
        tp_index: This process's tp coordinate.
        rows: Rows of each micro-batch this process runs (its dp slice's); 0: not known.
    """

    dims: ParallelDims
    pp_index: int
    dp_index: int
    ranks: Ranks
    mesh: DeviceMesh | None = None
    tp_index: int = 0
    rows: int = 0

    @classmethod
    def identity(cls, rank: int, world: int) -> ParallelLayout:
        """No mesh: plan device = global rank, one data-parallel copy."""
        return cls(ParallelDims(pp=world), rank, 0, tuple(((r,),) for r in range(world)))

    @classmethod
    def of(cls, mesh: DeviceMesh, rank: int, dp_shard: bool = True) -> ParallelLayout:
        """The layout of `mesh` (dims `MESH_SHAPES`) seen from global rank `rank`.

        Raises:
            ConfigError: `rank` is not in the mesh, or the mesh's dims are not a layout.
        """
        dims = dims_of(mesh, dp_shard)
        grid = mesh.mesh
        if "dp" not in dims.names:
            grid = grid.unsqueeze(1)
        if "tp" not in dims.names:
            grid = grid.unsqueeze(-1)
        ranks: Ranks = tuple(
            tuple(tuple(int(r) for r in row) for row in plane) for plane in grid.tolist()
        )
        where = [
            (p, d, t)
            for p, plane in enumerate(ranks)
            for d, row in enumerate(plane)
            for t, r in enumerate(row)
            if r == rank
        ]
        if not where:
            raise ConfigError(f"rank {rank} is not in the mesh {grid.tolist()}")
        p, d, t = where[0]
        return cls(dims, p, d, ranks, mesh, t)

    @classmethod
    def current(
        cls, mesh: DeviceMesh | None, rows: int = 0, dp_shard: bool = True
    ) -> ParallelLayout:
        """This process's layout: of `mesh`, or the identity without one; `rows` per
        micro-batch."""
        rank = dist.get_rank()
        made = (
            cls.identity(rank, dist.get_world_size())
            if mesh is None
            else cls.of(mesh, rank, dp_shard)
        )
        return replace(made, rows=rows)

    @property
    def pp(self) -> int:
        """Pipeline devices (the plan's num_devices)."""
        assert self.dims.pp is not None  # resolved: built from a mesh or the world
        return self.dims.pp

    @property
    def dp(self) -> int:
        """Data-parallel copies of each pipeline device."""
        return self.dims.dp

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks of each stage."""
        return self.dims.tp

    @property
    def world(self) -> int:
        """Every process: pp x dp x tp."""
        return self.dims.devices

    @property
    def meshed(self) -> bool:
        """Stages run over a mesh (`ParallelDims.meshed`: FSDP2 where it has "dp",
        DTensor tensor parallelism where it has "tp")."""
        return self.dims.meshed

    @property
    def fsdp(self) -> bool:
        """Stages are wrapped by FSDP2: the mesh has a "dp" dimension."""
        return self.dims.fsdp

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The tp sub-mesh this process's stages are tensor-parallel over; None without."""
        if self.mesh is None or "tp" not in self.dims.names:
            return None
        return self.mesh["tp"]

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.pp_index][self.dp_index][self.tp_index]

    def rank_of(self, device: int) -> int:
        """The global rank running plan device `device` for this process's dp and tp
        indices (a value crossing stages goes to the same dp slice and tp rank)."""
        return self.ranks[device][self.dp_index][self.tp_index]

    def fsdp_mesh(self, shard: bool) -> DeviceMesh:
        """The mesh FSDP2 wraps this process's stages over (a collective when replicating:
        every rank builds it, in the same order).

        Args:
            shard: Shard over dp (the 1D dp sub-mesh); False: replicate over dp (a 2D
                (dp, 1) sub-mesh: HSDP with one shard).
        """
        assert self.mesh is not None, "the identity layout wraps nothing"
        if shard:
            return self.mesh["dp"]
        grid = DeviceMesh(
            self.mesh.device_type,
            self.mesh.mesh.unsqueeze(-1),
            mesh_dim_names=("pp", "dp", "dp_shard"),
        )
        return grid["dp", "dp_shard"]


def stage_blocks(stage: nn.Module, model: nn.Module) -> list[list[nn.Module]]:
    """The FSDP units of a stage: its called modules grouped by transformer-like block.

    A block is an element of an nn.ModuleList or nn.Sequential of the original model (the
    outermost one, e.g. `layers.3`); the modules the stage calls under one block's path form
    one unit, in the order the stage first calls them. A called module under no block is a
    unit of its own. Only modules with parameters count, and only those whose parameters no
    other unit or direct attribute read of the stage uses (those stay with the stage root).

    A stage traced by torch.export (a flat aten graph, e.g. a Hugging Face Llama) calls no
    module: its parameters are get_attr reads, which FSDP2's module hooks cannot see. So
    `shard_stage` first outlines each of its blocks into a submodule at the block's own path
    (`graphpipe.runtime.outline.outline_blocks`), which this then finds as a unit; before
    that (or for a block that cannot be outlined: a tied weight) it finds none there. An
    emulated stage (`graphpipe.runtime.emulate`), which is no graph, has none.

    Args:
        stage: The stage's GraphModule (its call_module targets are the model's paths), or
            an emulated stage.
        model: The original model (which containers are lists of blocks).

    Returns:
        The units, each a list of the stage's submodules, in call order.
    """
    if not isinstance(stage, fx.GraphModule):
        return []
    prefixes = block_prefixes(model)
    called = [n.target for n in stage.graph.nodes if n.op == "call_module"]
    used_by: dict[int, set[str]] = {}
    for n in stage.graph.nodes:
        if n.op == "get_attr":
            used_by.setdefault(id(_attr(stage, str(n.target))), set()).add("")
    units: dict[str, list[str]] = {}
    for target in dict.fromkeys(str(t) for t in called):
        if not any(True for _ in stage.get_submodule(target).parameters()):
            continue  # nothing to shard (an activation)
        key = next((p for p in prefixes if target.startswith(p + ".")), target)
        for p in stage.get_submodule(target).parameters():
            used_by.setdefault(id(p), set()).add(key)
        units.setdefault(key, []).append(target)
    out = []
    for key, targets in units.items():
        modules = [stage.get_submodule(t) for t in targets]
        params = [p for m in modules for p in m.parameters()]
        if params and all(used_by[id(p)] == {key} for p in params):
            out.append(modules)
    return out


def _attr(module: nn.Module, target: str) -> object:
    *path, name = target.split(".")
    return getattr(module.get_submodule(".".join(path)), name)


def shard_stage(
    stage: nn.Module,
    model: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    precision: Precision,
) -> list[list[nn.Module]]:
    """Wrap a stage with FSDP2: each block (`stage_blocks`), then the stage itself.

    The blocks of a flat graph (torch.export's) are outlined first, each into a submodule at
    its own path with its parameters under their own names
    (`graphpipe.runtime.outline.outline_blocks`), so they are units as a traced model's
    called blocks are: at most a block and the one it prefetches are gathered at once, with
    the stage root's own parameters (embedding, final norm, head), not the whole stage.

    Prefetching: in forward, each unit starts the next unit's all-gather (the units are in
    the stage graph's call order, which is the order it runs them); in backward, FSDP2
    prefetches by itself, in reverse forward order. With `reshard_after_forward` each block
    also reshards after every backward of the step (`RESHARDING`, `prepare_backward`), so
    the micro-batches' forwards and backwards each gather it again, as FSDP's ZeRO-3 does.

    Args:
        stage: The stage module, on its device (or on meta: `materialize_sharded`).
        model: The original model (for its blocks).
        mesh: The dp mesh (`ParallelLayout.fsdp_mesh`).
        reshard_after_forward: Free the gathered parameters after each forward (all-gather
            again for the backward); False keeps them until the backward.
        precision: Its `fsdp_policy` for the blocks and for the stage root.

    Returns:
        The units wrapped, in call order.
    """
    for path in outline_blocks(stage, model):  # a view it returns gets a tensor of its own
        stage.get_submodule(path).register_forward_hook(_own_outputs)
    units = stage_blocks(stage, model)
    for unit in units:
        fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=precision.fsdp_policy(root=False),
        )
    stage.register_forward_hook(_own_outputs)  # before FSDP2's post-forward hook: runs first
    fully_shard(
        stage,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=precision.fsdp_policy(root=True),
    )
    wrapped = [cast(FSDPModule, unit[0]) for unit in units]  # a unit's modules share its state
    for this, following in itertools.pairwise(wrapped):
        this.set_modules_to_forward_prefetch([following])  # call order = execution order
    if reshard_after_forward and isinstance(stage, fx.GraphModule):
        paths = {id(m): name for name, m in stage.named_modules()}
        stage.meta[RESHARDING] = tuple(paths[id(unit[0])] for unit in units)
    return units


def _own_outputs(module: nn.Module, args: object, output: Any) -> Any:
    """A forward hook on a stage (or an outlined block) FSDP2 wraps, run before FSDP2's
    own: each output that requires grad and is a view (a cut right after a reshape or a
    transpose; a tensor-parallel output made whole by `DTensor.full_tensor()`, which returns
    a view) copied into a tensor of its own. FSDP2 hangs its pre-backward hook on the unit's
    outputs, and an in-place op on a view would drop it (FSDP2 warns "returned a view
    tensor" for each). The copy is the size of the values the unit hands on."""
    if not torch.is_grad_enabled():
        return output
    return tree_map_only(
        torch.Tensor, lambda t: t.clone() if t.requires_grad and _torch.is_view(t) else t, output
    )


def prepare_backward(module: nn.Module, last: bool) -> None:
    """Before a stage's backward: reduce gradients only on its last one of the step; the
    others accumulate unsharded gradients locally. The stage root reshards after its last
    backward only (it stays gathered between micro-batches); a block unit reshards after
    every backward where it reshards after every forward (`RESHARDING`: one block and the
    prefetched one gathered at a time, as the cost model's `gather_share` assumes), else
    only after the last one. A module FSDP does not wrap is left alone.

    Args:
        module: The stage module.
        last: This is the stage's last backward before the update.
    """
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(last)
        module.set_is_last_backward(last)
        module.set_reshard_after_backward(last)
        meta = getattr(module, "meta", None)
        for path in meta.get(RESHARDING, ()) if isinstance(meta, dict) else ():
            block = cast(FSDPModule, module.get_submodule(path))
            block.set_reshard_after_backward(True, recurse=False)


def reduce_gradients(module: nn.Module) -> None:
    """After a stage's last weight half of the step (zero bubble): reduce its gradients and
    reshard now. A module FSDP does not wrap is left alone.

    A split backward runs each micro-batch's input half through autograd (which passes
    FSDP2's post-backward hooks, with no parameter gradient yet) and its weight half by
    `torch.autograd.grad` on the gathered parameters (which passes none), so every backward
    of the step runs with `prepare_backward(module, last=False)` and the reduction is asked
    for here, once, as torch's own pipelining does for its split backward.

    Args:
        module: The stage module.
    """
    if isinstance(module, FSDPModule):
        prepare_backward(module, last=True)
        _torch.fsdp_post_backward(module)


def reshard(module: nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit in `module`, after forwards with no
    backward to follow (evaluation): FSDP2 keeps a root's parameters gathered after its
    forward, for the backward it expects. A module FSDP does not wrap is left alone."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def whole(value: torch.Tensor) -> torch.Tensor:
    """A state dict value whole: a sharded parameter gathered over dp (and tp) (a collective
    over its mesh: every rank of the stage's mesh calls it, in the same order), else as it is.

    One mesh dimension at a time, outermost first: a (dp, tp) parameter is FSDP2's
    strided shard over dp of a tp shard, which `full_tensor()` would gather in one
    redistribution that torch warns about on every rank ("2 sequential all_gather
    operations"); gathered over dp (giving the tp shard), then over tp, it is the same two
    all-gathers, unwarned.
    """
    if not isinstance(value, DTensor):
        return value
    placements = list(value.placements)
    for dim in range(len(placements)):
        if not placements[dim].is_replicate():
            placements[dim] = Replicate()
            value = value.redistribute(value.device_mesh, placements)
    return value.to_local()


def shaped_like(current: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a whole tensor) laid out as `current`: this rank's shard of it where
    `current` is sharded, else as it is."""
    if not isinstance(current, DTensor):
        return value
    local = value.to(device=current.device, dtype=current.dtype)
    return distribute_tensor(local, current.device_mesh, current.placements)
