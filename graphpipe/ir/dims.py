"""The parallel layout: one value for how a run's ranks are laid out over dimensions.

    dims = ParallelDims(pp=2, dp=2, tp=2)      # 8 ranks: pipeline x FSDP2 x tensor parallel
    dims.names                                 # ('pp', 'dp', 'tp'): the DeviceMesh's dims
    dims.meshed                                # True: stages run over a mesh
    str(dims)                                  # 'pp 2 x dp 2 (sharded) x tp 2'

Every phase reads this one value: the options resolve to it (`Parallelism.dims`), the
planner plans for it and the cost model prices it (`CostModel.dims`), the Plan carries it
(`Plan.dims`), compile builds the process group's DeviceMesh from it (the one builder,
`graphpipe.runtime.mesh.build_mesh`, and `dims_of` reads a given mesh back), and the runtime
sees it from its rank (`ParallelLayout.dims`). Its checks are `problems()`, in one place.

The dimensions, outermost first, as a DeviceMesh names them:

    pp  pipeline: the plan's devices; a value crossing stages goes to the same (dp, tp) rank
    dp  data parallel: each stage's copies, each on 1/dp of every micro-batch's rows;
        sharded by FSDP2 (`dp_shard`, the default) or replicated (HSDP with one shard)
    tp  tensor parallel: each stage's planned layers split over tp ranks (DTensor)
    ep  expert parallel (not built yet: 1)
    cp  context parallel (not built yet: 1)

A dimension of size 1 is left out of the mesh unless a given mesh names it (`size_one`), so
"meshed" means one thing everywhere: the run has a dimension besides pp.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from graphpipe.errors import ConfigError

__all__ = ["DIMS", "MESH_SHAPES", "ParallelDims"]

DIMS = ("pp", "dp", "tp", "ep", "cp")  # every dimension, outermost first
# the dimension names a mesh may carry today (ep and cp are not built yet)
MESH_SHAPES = (("pp", "dp"), ("pp", "tp"), ("pp", "dp", "tp"))
_NOT_BUILT = {
    "ep": "expert parallelism (an 'ep' dimension) is not built yet",
    "cp": "context parallelism (a 'cp' dimension) is not built yet",
}


@dataclass(frozen=True)
class ParallelDims:
    """The run's parallel layout: the size of each dimension and how dp holds its copies.

    Attributes:
        pp: Pipeline ranks: the plan's devices. None only before the world is known
            (`on(world)` resolves it to the ranks the other dimensions leave).
        dp: Data-parallel ranks of each pipeline rank.
        tp: Tensor-parallel ranks of each (pp, dp) coordinate.
        ep: Expert-parallel ranks (1: not built yet).
        cp: Context-parallel ranks (1: not built yet).
        dp_shard: dp shards parameters, gradients and optimizer state (FSDP2); False: every
            dp rank keeps a whole replica and gradients are all-reduced.
        size_one: Dimensions of size 1 a given mesh names all the same (they stay in its
            `names`, and make it meshed).

    Raises:
        ConfigError: `problems()` is not empty.
    """

    pp: int | None = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    dp_shard: bool = True
    size_one: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        found = self.problems()
        if found:
            raise ConfigError("; ".join(found))

    def problems(self) -> list[str]:
        """Every problem with the sizes, each naming its value (empty when they are fine)."""
        out = []
        if self.pp is not None and not _positive_int(self.pp):
            out.append(f"pp must be an int >= 1, got {self.pp!r}")
        for name in ("dp", "tp", "ep", "cp"):
            size = getattr(self, name)
            if not _positive_int(size):
                out.append(f"{name} must be an int >= 1, got {size!r}")
            elif name in _NOT_BUILT and size > 1:
                out.append(f"{name}={size}: {_NOT_BUILT[name]}")
        if not isinstance(self.dp_shard, bool):
            out.append(f"dp_shard must be True or False, got {self.dp_shard!r}")
        odd = [d for d in self.size_one if d not in DIMS[1:] or getattr(self, d) != 1]
        if odd:
            out.append(f"size_one names {odd}: only dimensions of size 1 besides pp")
        return out

    @classmethod
    def of_names(
        cls, names: Sequence[str], sizes: Sequence[int], dp_shard: bool = True
    ) -> ParallelDims:
        """The layout of a mesh with dims `names` of `sizes` (a DeviceMesh's
        mesh_dim_names and shape).

        Raises:
            ConfigError: the names are not one of `MESH_SHAPES`.
        """
        names = tuple(names)
        if names not in MESH_SHAPES:
            raise ConfigError(
                f"a mesh with dims {names!r}: its mesh_dim_names must be one of "
                f"{list(MESH_SHAPES)}, e.g. init_device_mesh('cpu', (2, 2), "
                "mesh_dim_names=('pp', 'dp'))"
            )
        size = dict(zip(names, (int(s) for s in sizes), strict=True))
        ones = tuple(d for d in names[1:] if size[d] == 1)
        return cls(**size, dp_shard=dp_shard, size_one=ones)

    def on(self, world: int, said: str = "") -> ParallelDims:
        """These dims on a world of `world` ranks: pp resolved where it was left open.

        Args:
            world: The ranks.
            said: How errors name the world ("devices=4"); by default "the world size 4".

        Raises:
            ConfigError: the dimensions do not divide the world, or pp x the others is not
                the world.
        """
        inner, said = self.inner, said or f"the world size {world}"
        if self.pp is None:
            if world % inner:
                raise ConfigError(
                    f"{self.factors} does not divide {said}: a layout of pp x {self.factors} "
                    f"takes a multiple of {inner} ranks"
                )
            return replace(self, pp=world // inner)
        if self.pp * inner != world:
            raise ConfigError(
                f"{self} is {self.pp * inner} ranks, the process group {world}: the mesh must "
                "span every rank"
            )
        return self

    @property
    def factors(self) -> str:
        """The dimensions besides pp as sizes, e.g. "dp=2 x tp=1" (ep and cp where > 1)."""
        names = ["dp", "tp"] + [d for d in DIMS[3:] if getattr(self, d) > 1]
        return " x ".join(f"{d}={getattr(self, d)}" for d in names)

    @property
    def inner(self) -> int:
        """Ranks of each pipeline rank: dp x tp x ep x cp."""
        return self.dp * self.tp * self.ep * self.cp

    @property
    def devices(self) -> int:
        """Every rank: pp x dp x tp x ep x cp.

        Raises:
            ConfigError: pp is not resolved yet (`on`).
        """
        if self.pp is None:
            raise ConfigError(f"{self}: pp is not known before the world is (ParallelDims.on)")
        return self.pp * self.inner

    @property
    def names(self) -> tuple[str, ...]:
        """The mesh's dimension names: pp, then every other of size > 1 or named."""
        return ("pp", *(d for d in DIMS[1:] if getattr(self, d) > 1 or d in self.size_one))

    @property
    def sizes(self) -> tuple[int, ...]:
        """The mesh's shape, in `names` order (pp must be resolved)."""
        pp = self.devices // self.inner  # raises while pp is open
        return tuple(pp if d == "pp" else getattr(self, d) for d in self.names)

    @property
    def meshed(self) -> bool:
        """The run has a dimension besides pp: stages run over a DeviceMesh (FSDP2 where it
        has dp, DTensor where it has tp). The one definition graphpipe uses."""
        return len(self.names) > 1

    @property
    def fsdp(self) -> bool:
        """Stages are wrapped by FSDP2: the mesh has a dp dimension."""
        return "dp" in self.names

    @property
    def sharded(self) -> bool:
        """Parameters are sharded over dp (dp > 1 and dp_shard)."""
        return self.dp > 1 and self.dp_shard

    def describe_inner(self) -> str:
        """The dimensions besides pp in words, e.g. "dp 2 (sharded) x tp 2" ("dp 1" with
        none)."""
        parts = [self._dp_words()] if self.dp > 1 or "dp" in self.size_one else []
        parts += [f"{d} {getattr(self, d)}" for d in DIMS[2:] if d in self.names]
        return " x ".join(parts) or "dp 1"

    def _dp_words(self) -> str:
        if self.dp == 1:
            return "dp 1"
        return f"dp {self.dp} ({'sharded' if self.dp_shard else 'replicated'})"

    def __str__(self) -> str:
        pp = "pp ?" if self.pp is None else f"pp {self.pp}"
        return pp if not self.meshed else f"{pp} x {self.describe_inner()}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: the sizes that are not 1, and dp_shard where False."""
        data: dict[str, Any] = {"pp": self.pp}
        data.update({d: getattr(self, d) for d in DIMS[1:] if getattr(self, d) != 1})
        if not self.dp_shard:
            data["dp_shard"] = False
        if self.size_one:
            data["size_one"] = list(self.size_one)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelDims:
        """Inverse of `to_dict`."""
        fields = dict(data)
        fields["size_one"] = tuple(fields.get("size_one", ()))
        return cls(**fields)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
