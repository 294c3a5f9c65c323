"""Checkpoint files read by name: a stage's slice of a model's tensors, and nothing more.

    load_slice("model.pt", ["0.weight"], aliases)     # {"0.weight": tensor}
    entries("model.pt", names, aliases)               # which of names the file holds
    for name, tensor in read_each("model.pt", names, aliases): ...   # one at a time

The formats: a `torch.save` state_dict file (memory-mapped: a tensor's pages are read only
when touched), a `.safetensors` file or a directory of them, and a torch.distributed.checkpoint
(DCP) directory (it has a `.metadata` file). A tensor is found under any of its names (a tied
weight stored once under one alias, as Hugging Face does).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from graphpipe.errors import ConfigError

__all__ = ["entries", "load_into", "load_slice", "read_each"]


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
    return dict(read_each(checkpoint, names, aliases))


def read_each(
    checkpoint: str | Path, names: list[str], aliases: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The entries of `checkpoint` for `names`, one at a time (canonical name, tensor): a
    `torch.save` file memory-mapped once (a tensor's pages read when touched), a
    safetensors file opened once and each tensor read when its turn comes, a DCP
    directory read one entry at a time.

    Raises:
        ConfigError: as `load_slice`.
    """
    path, files = _files(checkpoint)
    if not files:
        for name in names:
            yield from _load_dcp(path, [name], aliases).items()
    for file in files:
        yield from _each_in_file(file, names, aliases)


def load_into(
    checkpoint: str | Path, targets: dict[str, torch.Tensor], aliases: dict[str, list[str]]
) -> bool:
    """Read a DCP checkpoint's entries for `targets` (canonical name -> tensor, a DTensor's
    shard included) straight into them: DCP reads each DTensor's local rows only, so no
    entry is ever whole here. A file format is not read (False: use `read_each`).

    Returns:
        Whether `checkpoint` is a DCP directory (its entries then loaded).

    Raises:
        ConfigError: as `load_slice`.
    """
    path, files = _files(checkpoint)
    if files:
        return False
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: t for n, t in targets.items() if (k := _lookup(set(meta), n, aliases)) is not None}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return True


def _files(checkpoint: str | Path) -> tuple[Path, list[Path]]:
    """The checkpoint's path and its files; none for a DCP directory.

    Raises:
        ConfigError: the path does not exist or holds no known format.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise ConfigError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir() and (path / ".metadata").exists():
        return path, []
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"checkpoint directory {str(path)!r} holds no .safetensors file")
    return path, files


def entries(checkpoint: str | Path, names: list[str], aliases: dict[str, list[str]]) -> list[str]:
    """Which of `names` `checkpoint` holds (under any alias), from its index: no value read
    (a `torch.save` file is memory-mapped).

    Raises:
        ConfigError: as `load_slice`.
    """
    path, files = _files(checkpoint)
    keys: set[str] = set()
    if not files:
        import torch.distributed.checkpoint as dcp

        keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    for file in files:
        keys |= {k for k, _ in _each_in_file(file, None, {})}
    return [n for n in names if _lookup(keys, n, aliases) is not None]


def _lookup(available: set[str], name: str, aliases: dict[str, list[str]]) -> str | None:
    return next((a for a in aliases.get(name, [name]) if a in available), None)


def _each_in_file(
    file: Path, names: list[str] | None, aliases: dict[str, list[str]]
) -> Iterator[tuple[str, Any]]:
    """The file's entries for `names` by canonical name, each read when its turn comes;
    None: every key, with no value."""
    if file.suffix == ".safetensors":
        try:
            from safetensors import safe_open
        except ImportError as exc:
            raise ConfigError(
                f"reading {str(file)!r} needs the safetensors package: pip install safetensors"
            ) from exc

        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            if names is None:
                yield from ((k, None) for k in keys)
                return
            for n in names:
                if (k := _lookup(keys, n, aliases)) is not None:
                    yield n, f.get_tensor(k)
        return
    state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint {str(file)!r} holds a {type(state).__name__}, not a dict")
    if names is None:
        yield from ((k, None) for k in state)
        return
    keys = set(state)
    yield from ((n, state[k]) for n in names if (k := _lookup(keys, n, aliases)) is not None)


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
