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
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.tracing.annotate import is_meta

__all__ = ["InitFn", "is_meta", "load_slice", "materialize", "names_by_id", "rebind"]

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
    lacking = [n for n in rest if persistent & set(aliases.get(n, [n]))]
    if checkpoint is not None and lacking:
        raise ConfigError(f"checkpoint {str(checkpoint)!r} lacks tensors this stage needs", lacking)
    if init is not None:
        init(model)
    elif rest:
        _reset(model, rest)
    with torch.no_grad():
        for name, value in loaded.items():
            target = fresh[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ConfigError(
                    f"checkpoint entry {name!r} has shape {list(value.shape)}, the model's "
                    f"tensor has {list(target.shape)}"
                )
            target.copy_(value)
    rebind(stage, model)
    return names


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
    for path in sorted(owners):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(path.encode()))
            model.get_submodule(path).reset_parameters()  # type: ignore[operator]


def rebind(stage: nn.Module, model: nn.Module) -> None:
    """Point every tensor attribute of `stage` at the tensor of the same name in `model`."""
    for name, _ in [
        *stage.named_parameters(remove_duplicate=False),
        *stage.named_buffers(remove_duplicate=False),
    ]:
        _set(stage, name, _get(model, name))


def load_slice(
    checkpoint: str | Path, names: list[str], aliases: dict[str, list[str]]
) -> dict[str, torch.Tensor]:
    """The entries of `checkpoint` for `names` (found under any alias), read lazily.

    Args:
        checkpoint: A `torch.save` state_dict file, a `.safetensors` file, a directory of
            safetensors files, or a DCP directory (it has a `.metadata` file).
        names: Canonical names wanted.
        aliases: Every name of each canonical name.

    Returns:
        Canonical name -> tensor, for the names the checkpoint has.

    Raises:
        ConfigError: the path does not exist or holds no known format.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir() and (path / ".metadata").exists():
        return _load_dcp(path, names, aliases)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"checkpoint directory {str(path)!r} holds no .safetensors file")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        found.update(_load_file(file, names, aliases))
    return found


def _lookup(available: set[str], name: str, aliases: dict[str, list[str]]) -> str | None:
    return next((a for a in aliases.get(name, [name]) if a in available), None)


def _load_file(
    file: Path, names: list[str], aliases: dict[str, list[str]]
) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        try:
            from safetensors import safe_open
        except ImportError as exc:
            raise ConfigError(
                f"reading {str(file)!r} needs the safetensors package: pip install safetensors"
            ) from exc

        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            return {
                n: f.get_tensor(k) for n in names if (k := _lookup(keys, n, aliases)) is not None
            }
    state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint {str(file)!r} holds a {type(state).__name__}, not a dict")
    keys = set(state)
    return {n: state[k] for n in names if (k := _lookup(keys, n, aliases)) is not None}


def _load_dcp(
    path: Path, names: list[str], aliases: dict[str, list[str]]
) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    wanted = {n: k for n in names if (k := _lookup(set(meta), n, aliases)) is not None}
    state = {
        k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype)  # type: ignore[union-attr]
        for k in wanted.values()
    }
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {n: state[k] for n, k in wanted.items()}
