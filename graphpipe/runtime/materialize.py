"""Materialise a stage of a model built on the meta device: real tensors for this rank's stage
only, initialised or loaded by name.

    materialize(model, stage_module, device, init=init_weights, checkpoint="model.pt")

A model too big for one device is built under `torch.device("meta")`: every parameter and
buffer has a shape and no storage. graphpipe traces and plans it with fake tensors, and then
each rank gives real storage to the tensors its stage reads, and to no others. They get their
values in this order:

1. `init`, a callback `init(model)` (the torchtitan convention): it runs on the whole model, in
   which only this rank's tensors are real; initialising a meta tensor does nothing, so the
   usual `for m in model.modules(): ...` works unchanged. For a tied weight or a replicated
   stage to come out equal on every holder, initialise by name (e.g. seed by the parameter's
   name), or let graphpipe broadcast it from its first holder (`PipelinedModel` does).
2. Without `init` and without a checkpoint: `reset_parameters()` of each module that owns a
   materialised tensor, under a seed made from the module's path, so every rank that holds
   the module draws the same values.
3. `checkpoint`: the stage's slice, by name (any alias of a tied weight), from a `state_dict`
   file (`torch.save`), a safetensors file or a directory of them, or a
   torch.distributed.checkpoint (DCP) directory. It overrides 1 and 2 for the names it has;
   tensors it lacks (non-persistent buffers) are initialised as in 1 or 2.

Anything that would stay uninitialised is refused with a `ConfigError` that names it.
Afterwards the stage module reads the new tensors: `rebind` points its attributes at them.

Under a mesh (`materialize_sharded`), as torchtitan does: the stage is split while it is
still on meta, its parameters made DTensors by the tp plan (`graphpipe.runtime.tp.apply_tp`,
a "tp" dimension) and sharded again by FSDP2 over dp (a "dp" dimension), `to_empty` gives
storage to the local shards only (1/(tp x dp) of a split layer), and each tensor's value is
made whole, by the same rules, and only this rank's shard of it is kept (sliced by the
DTensor's placements over the whole mesh, no collective), one tensor (for
`reset_parameters`, one module's tensors) at a time:

- `reset_parameters()`: on a copy of the owning module's own tensors, seeded by its path;
  peak beyond the shards: the largest module's own tensors.
- a checkpoint: a DCP directory is read straight into the shards (DCP reads each
  DTensor's local rows): nothing beyond them. A file one entry at a time: a `torch.save`
  file is memory-mapped, so only the pages of this rank's rows are read; a safetensors
  entry is read whole: peak beyond the shards, the largest entry.
- `init`: it runs on the whole model, so the tensors it initialises (those no checkpoint
  holds; without one, the whole stage) are real and whole while it runs; peak beyond the
  shards: those tensors, freed before the stage is sharded.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from graphpipe.errors import ConfigError
from graphpipe.runtime.checkpoint_files import entries, load_into, load_slice, read_each
from graphpipe.tracing.annotate import is_meta

__all__ = [
    "InitFn",
    "is_meta",
    "load_slice",
    "materialize",
    "materialize_sharded",
    "names_by_id",
    "rebind",
]

InitFn = Callable[[nn.Module], None]


def materialize(
    model: nn.Module,
    stage: nn.Module,
    device: torch.device,
    init: InitFn | None = None,
    checkpoint: str | Path | None = None,
) -> list[str]:
    """Give real storage on `device` to the meta tensors `stage` reads, and their values.

    Args:
        model: The whole model, on the meta device (some tensors may be real already).
        stage: This rank's stage module; its tensor names are names in `model`.
        device: Where the stage runs.
        init: `init(model)`, initialising the real tensors.
        checkpoint: A state_dict file, safetensors file(s) or a DCP directory.

    Returns:
        The canonical names of the tensors materialised.

    Raises:
        ConfigError: a tensor with no way to get its value (no init, no reset_parameters()
            on its module, not in the checkpoint), or a checkpoint entry of the wrong shape.
    """
    names = _meta_names(model, stage)
    if not names:
        return []
    aliases = _aliases(model)
    persistent = set(model.state_dict(keep_vars=True))
    fresh = _allocate(model, names, device)
    loaded = load_slice(checkpoint, names, aliases) if checkpoint is not None else {}
    rest = [n for n in names if n not in loaded]
    _check_complete(checkpoint, rest, aliases, persistent)
    if init is not None:
        init(model)
    elif rest:
        _reset(model, rest)
    for name, value in loaded.items():
        _fill(fresh[name], value, name)
    rebind(stage, model)
    return names


def materialize_sharded(
    model: nn.Module,
    stage: nn.Module,
    device: torch.device,
    shard: Callable[[], object],
    init: InitFn | None = None,
    checkpoint: str | Path | None = None,
) -> list[str]:
    """Split and shard `stage` on meta with `shard()`, then give storage and values to this
    rank's shards only (the module docstring says the peak of each way).

    The values equal `materialize`'s: each tensor is made whole by the same rules (init,
    else reset_parameters seeded by its module's path; a checkpoint's entries override), and
    this rank's shard of it is copied into its local tensor.

    Args:
        model: The whole model, on the meta device.
        stage: This rank's stage module; its tensor names are names in `model`.
        device: Where the stage runs.
        shard: Makes `stage`'s parameters DTensors: by the tp plan
            (`graphpipe.runtime.tp.apply_tp`), then FSDP2 over dp
            (`graphpipe.runtime.mesh.shard_stage`), or either alone.
        init: `init(model)`, initialising the real tensors.
        checkpoint: A state_dict file, safetensors file(s) or a DCP directory.

    Returns:
        The canonical names of the meta tensors materialised.

    Raises:
        ConfigError: as `materialize`.
    """
    names = _meta_names(model, stage)
    aliases = _aliases(model)
    canonical = {n: every[0] for every in aliases.values() for n in every}
    loaded = set(entries(checkpoint, names, aliases)) if checkpoint is not None else set()
    rest = [n for n in names if n not in loaded]
    _check_complete(checkpoint, rest, aliases, set(model.state_dict(keep_vars=True)))
    kept = _real(stage, canonical)  # tensors already real: kept whole until sharded
    owners: dict[str, list[str]] = {}
    if init is not None and rest:
        kept.update(_initialised(model, rest, device, init))
    elif rest:
        owners = _owners(model, rest)
    scratch = {path: copy.deepcopy(model.get_submodule(path)) for path in owners}  # on meta
    shard()
    stage.to_empty(device=device)
    targets = _targets(stage, canonical)
    wanted = {n: targets[n] for n in loaded}
    in_shards = checkpoint is not None and load_into(checkpoint, wanted, aliases)  # DCP
    files = None if in_shards else checkpoint
    values = _values(kept, files, sorted(loaded), aliases, scratch, owners, device)
    for name, value in values:
        _fill(targets[name], value, name)
    return names


def _real(stage: nn.Module, canonical: dict[str, str]) -> dict[str, torch.Tensor]:
    """The stage's tensors that are not on meta, by canonical name."""
    return {canonical.get(n, n): t for n, t in _named(stage) if not t.is_meta}


def _named(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]


def _targets(stage: nn.Module, canonical: dict[str, str]) -> dict[str, torch.Tensor]:
    """The sharded stage's tensors (a parameter a DTensor), by canonical name."""
    return {canonical.get(n, n): t for n, t in _named(stage)}


def _initialised(
    model: nn.Module, names: list[str], device: torch.device, init: InitFn
) -> dict[str, torch.Tensor]:
    """`names` made real and whole in `model`, `init(model)` run, and their values; the
    model's meta tensors are put back, so `model` still holds no storage afterwards."""
    aliases = _aliases(model)
    meta = {name: _get(model, name) for name in names}
    fresh = _allocate(model, names, device)
    init(model)
    for name, old in meta.items():
        for alias in aliases.get(name, [name]):
            _set(model, alias, old)
    return fresh


def _values(
    kept: dict[str, torch.Tensor],
    checkpoint: str | Path | None,
    loaded: list[str],
    aliases: dict[str, list[str]],
    scratch: dict[str, nn.Module],
    owners: dict[str, list[str]],
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor's whole value by canonical name, one at a time (or one module's): the
    real ones, then the checkpoint's entries, then the ones reset_parameters() makes."""
    yield from kept.items()
    if checkpoint is not None:
        yield from read_each(checkpoint, loaded, aliases)
    for path in sorted(owners):
        module = scratch.pop(path)
        module.to_empty(device=device, recurse=False)  # its own tensors, not its children's
        _reset_module(module, path)
        yield from ((name, _get(module, name.rpartition(".")[2])) for name in owners[path])


def _fill(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy `value` (a whole tensor) into `target`: into its local shard where `target` is
    a DTensor (this rank's rows, sliced here: no collective), else whole.

    Raises:
        ConfigError: `value` is not shaped as the model's tensor `name`.
    """
    if tuple(value.shape) != tuple(target.shape):
        raise ConfigError(
            f"checkpoint entry {name!r} has shape {list(value.shape)}, the model's tensor has "
            f"{list(target.shape)}"
        )
    with torch.no_grad():
        if isinstance(target, DTensor):
            value = value.to(device=target.device, dtype=target.dtype)
            mine = distribute_tensor(
                value, target.device_mesh, target.placements, src_data_rank=None
            )
            target.to_local().copy_(mine.to_local())
        else:
            target.copy_(value)


def _check_complete(
    checkpoint: str | Path | None,
    rest: list[str],
    aliases: dict[str, list[str]],
    persistent: set[str],
) -> None:
    """Raises: ConfigError: `checkpoint` lacks persistent tensors of `rest`, naming them."""
    lacking = [n for n in rest if persistent & set(aliases.get(n, [n]))]
    if checkpoint is not None and lacking:
        raise ConfigError(f"checkpoint {str(checkpoint)!r} lacks tensors this stage needs", lacking)


def _meta_names(model: nn.Module, stage: nn.Module) -> list[str]:
    """Canonical names (in `model`) of the meta tensors `stage` holds."""
    canonical = {i: names[0] for i, names in names_by_id(model).items()}
    held = {id(t) for _, t in [*stage.named_parameters(), *stage.named_buffers()] if t.is_meta}
    return sorted(canonical[i] for i in held if i in canonical)


def names_by_id(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter and buffer (non-persistent ones too), by identity."""
    by_id: dict[int, list[str]] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        by_id.setdefault(id(t), []).append(name)
    return by_id


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each tensor, under its canonical (first) name."""
    return {names[0]: names for names in names_by_id(model).values()}


def _allocate(model: nn.Module, names: list[str], device: torch.device) -> dict[str, Any]:
    """Replace each named meta tensor, under all its names, by an empty real one."""
    aliases = _aliases(model)
    fresh: dict[str, Any] = {}
    for name in names:
        old = _get(model, name)
        new: Any = torch.empty_like(old, device=device)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for alias in aliases.get(name, [name]):
            _set(model, alias, new)
        fresh[name] = new
    return fresh


def _get(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def _set(root: nn.Module, name: str, value: torch.Tensor) -> None:
    """Point attribute `name` of `root` at `value`, keeping its kind: `nn.Module.__setattr__`
    registers a Parameter as a parameter and keeps a tensor in a buffer's slot (and its
    persistence)."""
    owner, _, attr = name.rpartition(".")
    setattr(root.get_submodule(owner), attr, value)


def _reset(model: nn.Module, names: list[str]) -> None:
    """`reset_parameters()` of every module owning one of `names`, seeded by its path.

    Raises:
        ConfigError: owners without reset_parameters(), naming them and their tensors.
    """
    for path in sorted(_owners(model, names)):
        _reset_module(model.get_submodule(path), path)


def _reset_module(module: nn.Module, path: str) -> None:
    """`module.reset_parameters()` under a seed made from its path in the model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(path.encode()))
        module.reset_parameters()  # type: ignore[operator]


def _owners(model: nn.Module, names: list[str]) -> dict[str, list[str]]:
    """The modules owning `names`, by path, each with the names it owns.

    Raises:
        ConfigError: owners without reset_parameters(), naming them and their tensors.
    """
    owners: dict[str, list[str]] = {}
    for name in names:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    missing = {
        path: held
        for path, held in owners.items()
        if not callable(getattr(model.get_submodule(path), "reset_parameters", None))
    }
    if missing:
        raise ConfigError(
            "the model is on the meta device and these modules have no reset_parameters() to "
            "initialise their tensors: pass init_weights=fn(model) or checkpoint=...",
            [f"{path or type(model).__name__}: {held}" for path, held in sorted(missing.items())],
        )
    return owners


def rebind(stage: nn.Module, model: nn.Module) -> None:
    """Point every tensor attribute of `stage` at the tensor of the same name in `model`."""
    for name, _ in [
        *stage.named_parameters(remove_duplicate=False),
        *stage.named_buffers(remove_duplicate=False),
    ]:
        _set(stage, name, _get(model, name))
