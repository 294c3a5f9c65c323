"""Checkpoints as directories: torch.distributed.checkpoint (DCP) shards keyed by name.

    pm.save("ckpt")                    # every rank, collectively; atomic
    pm.load("ckpt")                    # under this plan, or another one, or another world size
    graphpipe.export_checkpoint("ckpt", "model.pt")   # a plain state_dict, one process

Every rank writes its own shard of one DCP checkpoint. Keys are names, never positions:

    model/<name>             a parameter or buffer, under its first name in the model
    optim/<name>/<key>       that parameter's optimizer state (Adam's exp_avg, step, ...)
    optim_groups/rank<r>     rank r's param_groups settings (lr, betas, ...), pickled
    policy/rank<r>           rank r's weight-policy state, pickled

Copies of one tensor on several ranks (tied weights, replicas) write the same key and DCP
keeps one. So do the copies of a tied weight that two stages of one rank hold under FSDP2
(`graphpipe.runtime.groups.own_copies`, equal after every step): one is written, a load
reads into one and copies it into the others (`_fill_copies`), and each copy's optimizer
state gets the one saved state, a tensor of its own.

Under a ("pp", "dp") mesh (FSDP2 per stage) a parameter and its optimizer state of the same
shape (Adam's exp_avg, exp_avg_sq) are DTensors: each dp rank writes its shard of the one
key, and a load reads into buffers laid out as the loading run's parameters
(`_state_buffer`), so DCP reshards by name between any two layouts: a mesh's to another
mesh's, to a pipeline without one, and back. `<r>` in the per-rank keys is the plan device,
which a device's dp ranks share (same values: DCP keeps one); graphpipe.json records the
mesh's (pp, dp) under "mesh" (null without one), and the global rank 0 owns the directory.

`graphpipe.json` records the plan, the world size, the weight policy, the step
count, the precision's loss scale and every name of every tensor (tied aliases), so a load
under another plan asks for the keys its own stages hold (resharding by name), and export
writes a state dict that loads strictly into the unpipelined model. A weight policy that
keeps per-stage state beyond its version (PipeMare's velocities) resumes only under the same
plan; the error says so.

Saves are atomic (`_publish`): DCP writes into `<path>.tmp` (files fsynced), rank 0 adds
graphpipe.json, then renames `<path>` to `<path>.old`, the new one to `<path>`, and removes
the old one. `load` takes `<path>`, or `<path>.old` when a kill came between the renames; a
half-written `.tmp` is never read.

Each local step of a save (rank 0's directory, DCP's shards, the hashes, rank 0's publish)
is agreed by every rank (`_agreed`; DCP gathers its own writers' errors): a full disk or a
refused write on any rank raises CheckpointError on every rank, naming each rank's error,
and leaves `<path>` as it was. graphpipe.json also records every file's size and sha256 and
its own digest (`graphpipe.runtime.integrity`); a load checks them first, each rank a share
of the hashes, and refuses a damaged checkpoint on every rank by file name.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from graphpipe.errors import CheckpointError, ConfigError
from graphpipe.ir import Plan
from graphpipe.runtime import integrity
from graphpipe.runtime.failures import first_line, guarded
from graphpipe.runtime.integrity import META
from graphpipe.runtime.sync import local_part
from graphpipe.runtime.weights import WeightPolicy

__all__ = ["Checkpointable", "export_checkpoint", "load", "resolve", "save"]

T = TypeVar("T")


class Checkpointable(Protocol):
    """What a checkpoint reads from and restores into one rank's pipeline
    (`graphpipe.runtime.state.ModelState` is the one a PipelinedModel hands over)."""

    @property
    def rank(self) -> int: ...  # this process's rank
    @property
    def plan(self) -> Plan: ...  # the plan it runs
    @property
    def weights(self) -> str: ...  # the weight policy's name
    @property
    def micro_batches(self) -> int: ...  # M
    @property
    def stage_indices(self) -> tuple[int, ...]: ...  # this rank's stages
    @property
    def module(self) -> nn.Module | None: ...  # this rank's stage module(s); None: idle
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...  # over the module's parameters
    @property
    def policy(self) -> WeightPolicy | None: ...  # its weight policy; None: idle
    @property
    def orphans(self) -> Mapping[str, torch.Tensor]: ...  # tensors no stage holds
    @property
    def canonical(self) -> Mapping[str, str]: ...  # every name of a tensor -> its first
    @property
    def held_names(self) -> Mapping[str, str]: ...  # the module's keys -> the model's first
    @property
    def names(self) -> Sequence[str]: ...  # the model's state dict keys, in order

    @property
    def loss_scale(self) -> float | None: ...  # fp16's loss scale (None without fp16)
    @property
    def mesh_shape(self) -> tuple[int, int] | None: ...  # (pp, dp) of a mesh; None: none

    steps_done: int  # step() calls so far

    def restore_loss_scale(self, scale: float) -> None:
        """Set fp16's loss scale to a saved one."""

    def drain(self) -> None:
        """Land an asynchronous pipeline's updates in flight."""


# -- the directory protocol -------------------------------------------------------------------


def _complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / META).is_file()


def resolve(path: str | Path) -> Path:
    """The complete checkpoint at `path` (or its `.old`, after a kill between the renames).

    Raises:
        ConfigError: neither is a complete checkpoint.
    """
    path = Path(path)
    for candidate in (path, path.with_name(path.name + ".old")):
        if _complete(candidate):
            return candidate
    raise ConfigError(
        f"no complete checkpoint at {path} (a directory with .metadata and {META}; "
        f"{path.name}.tmp, if there, is an unfinished save)"
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path) -> None:
    """Swap the finished `tmp` in for `path` (rank 0; each step leaves a loadable one)."""
    old = path.with_name(path.name + ".old")
    if old.exists() and path.exists():
        shutil.rmtree(old)  # a leftover of an earlier save: `path` is the newer one
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync(path.parent)
    if old.exists():
        shutil.rmtree(old)


# -- what one rank holds ----------------------------------------------------------------------


def _model_items(pm: Checkpointable) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by `model/<first name>`, as live tensors."""
    items = {}
    if pm.module is not None:
        for key, value in pm.module.state_dict(keep_vars=True).items():
            items[f"model/{pm.held_names[key]}"] = value.detach()
    if pm.rank == 0:
        for name, value in pm.orphans.items():
            items[f"model/{pm.canonical.get(name, name)}"] = value.detach()
    return items


def _names(pm: Checkpointable) -> dict[str, str]:
    """The stage module's parameter names (DCP's FQNs) -> the model's first names.

    DCP's helpers key the optimizer state by the FQNs of the module they are given, which
    here is this rank's stage module: a ModuleList of several stages prefixes them, and a
    tied weight may be held under another alias than the model's first one. A checkpoint
    must be keyed by the model's names to load under another plan, so this map translates.
    """
    assert pm.module is not None
    return {n: pm.held_names[n] for n, _ in pm.module.named_parameters()}


def _optim_items(pm: Checkpointable) -> dict[str, Any]:
    """This rank's optimizer state by parameter name, its settings and its policy state."""
    if pm.module is None or pm.policy is None:
        return {}
    names = _names(pm)
    items: dict[str, Any] = {}
    # An optimizer that has not stepped holds no state; DCP's helper would make some by a
    # step with zero gradients (moving Adam's step count), so it is not asked.
    if pm.optimizer.state:
        state = cast(dict[str, Any], get_optimizer_state_dict(pm.module, pm.optimizer)["state"])
        for fqn, entries in state.items():
            for key, value in entries.items():
                is_tensor = isinstance(value, torch.Tensor)
                items[f"optim/{_name(names, fqn)}/{key}"] = (
                    value if is_tensor else pickle.dumps(value)
                )
    groups = [{k: v for k, v in g.items() if k != "params"} for g in pm.optimizer.param_groups]
    items[f"optim_groups/rank{pm.rank}"] = pickle.dumps(groups)
    items[f"policy/rank{pm.rank}"] = pickle.dumps(pm.policy.state())
    return items


def _name(names: Mapping[str, str], fqn: str) -> str:
    """The model's name of DCP's `fqn`.

    Raises:
        ConfigError: an FQN that is no parameter name of the stage module.
    """
    if fqn not in names:
        raise ConfigError(
            f"the optimizer holds state for {fqn!r}, which is not a parameter of this "
            f"rank's stage module (its parameters: {sorted(names)[:5]}...)"
        )
    return names[fqn]


def _metadata(pm: Checkpointable) -> dict[str, Any]:
    return {
        "plan": json.loads(pm.plan.to_json()),
        "world_size": dist.get_world_size(),
        "weights": pm.weights,
        "step": pm.steps_done,
        "micro_batches": pm.micro_batches,
        "loss_scale": pm.loss_scale,
        "mesh": None if pm.mesh_shape is None else list(pm.mesh_shape),
        "names": list(pm.names),
        "canonical": dict(pm.canonical),
    }


# -- save and load ----------------------------------------------------------------------------


def save(pm: Checkpointable, path: str | Path) -> Path:
    """Write `pm`'s checkpoint to the directory `path`, atomically (a collective).

    Returns:
        The checkpoint's path.

    Raises:
        CheckpointError: on every rank, when a rank could not write its part (no space, no
            permission, ...), naming each rank's error; the previous checkpoint at `path`
            is left as it was and the unfinished one removed.
    """
    pm.drain()  # an asynchronous pipeline's updates in flight land first
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    first = dist.get_rank() == 0  # the one process that owns the directory
    try:
        _agreed(path, "making its directory", lambda: _prepare(tmp) if first else None)
        items = {**_model_items(pm), **_optim_items(pm)}
        _dcp_save(items, tmp, path)
        files = _agreed(path, "hashing its files", lambda: _hash_share(tmp))
        record = {**_metadata(pm), "files": {k: v for part in files for k, v in part.items()}}
        _agreed(path, "publishing it", lambda: _finish(tmp, path, record) if first else None)
    except CheckpointError:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what it took (a full disk)
        raise
    return path


def _prepare(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _dcp_save(items: dict[str, Any], tmp: Path, path: Path) -> None:
    """DCP's save, whose failure on any rank (DCP gathers them) fails it on every rank.

    Raises:
        CheckpointError: naming each rank's error.
    """
    try:
        guarded("the checkpoint save", lambda: dcp.save(items, checkpoint_id=tmp))
    except CheckpointException as exc:  # a BaseException: DCP's, raised on every rank
        failures = [f"rank {r}: {first_line(e[0])}" for r, e in sorted(exc.failures.items())]
        raise CheckpointError(
            f"could not save the checkpoint {path} (writing the shards); the previous one is kept",
            failures,
            path=str(path),
        ) from None


def _hash_share(tmp: Path) -> dict[str, dict[str, Any]]:
    names = integrity.files_of(tmp)
    return integrity.describe(tmp, integrity.share(names, dist.get_rank(), dist.get_world_size()))


def _finish(tmp: Path, path: Path, record: dict[str, Any]) -> None:
    """Rank 0: graphpipe.json (sealed with its digest) into `tmp`, then the swap."""
    meta = tmp / META
    meta.write_text(json.dumps(integrity.seal(record), indent=1))
    _fsync(meta)
    _publish(tmp, path)


def _agreed(path: Path, what: str, fn: Callable[[], T]) -> list[T]:
    """Every rank's result of `fn` (a local step of a save), or, when it failed on any rank,
    a CheckpointError on every rank naming each rank's error (a collective)."""
    result: Any = None
    error = ""
    try:
        result = fn()
    except Exception as exc:  # a full disk, a refused write: every rank must hear of it
        error = first_line(exc)
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    guarded(
        f"the checkpoint's agreement after {what}",
        lambda: dist.all_gather_object(gathered, (error, result)),
    )
    failures = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
    if failures:
        raise CheckpointError(
            f"could not save the checkpoint {path} ({what}); the previous one is kept",
            failures,
            path=str(path),
        )
    return [r for _, r in gathered]


def _checked(where: Path) -> dict[str, Any]:
    """The checkpoint's record, once every rank checked its share of the files (a
    collective).

    Raises:
        CheckpointError: on every rank, naming each file that is not as it was saved.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    problems = integrity.verify(where, rank, world)
    gathered: list[Any] = [None] * world
    guarded("the checkpoint's check", lambda: dist.all_gather_object(gathered, problems))
    found = sorted({p for part in gathered for p in part})
    if found:
        raise CheckpointError(f"refusing to load {where}", found, path=str(where))
    return integrity.read_record(where)


def load(pm: Checkpointable, path: str | Path) -> dict[str, Any]:
    """Load the checkpoint at `path` into `pm` (a collective), resharding by name.

    Returns:
        The checkpoint's graphpipe.json record.

    Raises:
        ConfigError: no complete checkpoint, another weight policy, keys this rank's stages
            need that the checkpoint lacks, or per-stage policy state under another plan.
        CheckpointError: a file is not as it was saved (missing, truncated, changed, or
            another save's), or graphpipe.json was edited: every problem named.
    """
    where = resolve(path)
    meta = _checked(where)
    if meta["weights"] != pm.weights:
        raise ConfigError(
            f"{where} was saved with weights={meta['weights']!r}; this pipeline runs "
            f"weights={pm.weights!r}"
        )
    saved = dcp.FileSystemReader(str(where)).read_metadata().state_dict_metadata
    same_plan = meta["plan"] == json.loads(pm.plan.to_json())
    model = _model_items(pm)
    missing = sorted(k[len("model/") :] for k in model if k not in saved)
    if missing:
        raise ConfigError(f"{where} lacks {missing}, held by stages {list(pm.stage_indices)}")
    optim = _optim_template(pm, saved, same_plan)
    template = {**model, **optim}
    guarded("the checkpoint load", lambda: dcp.load(template, checkpoint_id=str(where)))
    _fill_copies(pm, template)
    _restore(pm, template, same_plan, meta)
    return meta


def _fill_copies(pm: Checkpointable, loaded: Mapping[str, Any]) -> None:
    """Copy each loaded value into the other tensors of this rank's module under its key:
    the copies of a tied weight two stages of the rank hold (`_model_items` keeps one).
    Local parts of one layout (the copies are laid out alike)."""
    if pm.module is None:
        return
    with torch.no_grad():
        for key, value in pm.module.state_dict(keep_vars=True).items():
            source = local_part(loaded[f"model/{pm.held_names[key]}"]).detach()
            target = local_part(value).detach()
            if target.data_ptr() != source.data_ptr():  # not the one DCP read into
                target.copy_(source)


def _optim_template(pm: Checkpointable, saved: dict[str, Any], same_plan: bool) -> dict[str, Any]:
    """Buffers for this rank's optimizer state, settings and policy state."""
    if pm.module is None:
        return {}
    names = _names(pm)
    params = {names[fqn]: p for fqn, p in pm.module.named_parameters()}  # by the model's names
    template: dict[str, Any] = {}
    for key, info in saved.items():
        name = key[len("optim/") :].rsplit("/", 1)[0] if key.startswith("optim/") else None
        if name in params and isinstance(info, TensorStorageMetadata):
            template[key] = _state_buffer(info, params[name])
        elif name in params and isinstance(info, BytesStorageMetadata):
            template[key] = b""
    settings = (
        f"optim_groups/rank{pm.rank}" if same_plan else _first_rank_key(saved, "optim_groups/")
    )
    policy = f"policy/rank{pm.rank}" if same_plan else _first_rank_key(saved, "policy/")
    for key in (settings, policy):
        if key in saved:
            template[key] = b""
    return template


def _state_buffer(info: TensorStorageMetadata, param: torch.Tensor) -> torch.Tensor:
    """A buffer DCP reads one saved optimizer state tensor into: sharded like `param` where
    the state has the parameter's shape and the parameter is a mesh's DTensor (Adam's
    exp_avg; DCP reads this rank's shard of it, whatever layout saved it), else whole (a
    step count, or a parameter that is not sharded)."""
    if isinstance(param, DTensor) and tuple(info.size) == tuple(param.shape):
        return torch.empty_like(param, dtype=info.properties.dtype)
    return torch.empty(info.size, dtype=info.properties.dtype)


def _first_rank_key(saved: dict[str, Any], prefix: str) -> str:
    return min((k for k in saved if k.startswith(prefix)), default=prefix + "none")


def _restore(
    pm: Checkpointable, template: dict[str, Any], same_plan: bool, meta: dict[str, Any]
) -> None:
    """Put what DCP read into the optimizer, the policy and the counters."""
    pm.steps_done = int(meta["step"])
    if pm.loss_scale is not None and meta.get("loss_scale"):
        pm.restore_loss_scale(float(meta["loss_scale"]))
    if pm.module is None or pm.policy is None:
        return
    _restore_optimizer(pm, template)
    policy = next((v for k, v in template.items() if k.startswith("policy/")), None)
    if policy:
        _restore_policy(pm, pm.policy, pickle.loads(policy), same_plan)


def _restore_optimizer(pm: Checkpointable, template: dict[str, Any]) -> None:
    """The optimizer's state by the stage module's FQNs, loaded with DCP's helper.

    Parameters without saved state (a checkpoint made before their first step, or a
    stateless optimizer) start fresh, as they would have: hence strict=False. The settings
    (lr, betas, ...) are the saved ones over the current ones, group by group.
    """
    assert pm.module is not None
    state: dict[str, dict[str, Any]] = {}
    named: set[str] = set()  # names given their state already: a copy's gets its own tensors
    for fqn, name in _names(pm).items():
        prefix = f"optim/{name}/"
        entries = {
            k[len(prefix) :]: _entry(v, name in named)
            for k, v in template.items()
            if k.startswith(prefix)
        }
        named.add(name)
        if entries:
            state[fqn] = entries
    fqn_of = {id(p): n for n, p in pm.module.named_parameters()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in pm.optimizer.param_groups]
    settings = next((v for k, v in template.items() if k.startswith("optim_groups/")), None)
    if settings:
        loaded = pickle.loads(settings)
        groups = [{**g, **loaded[min(i, len(loaded) - 1)]} for i, g in enumerate(groups)]
    if not fqn_of:  # a stage without parameters: its optimizer holds a placeholder
        for current, group in zip(pm.optimizer.param_groups, groups, strict=True):
            current.update(group)
        return
    for group, current in zip(groups, pm.optimizer.param_groups, strict=True):
        group["params"] = [fqn_of[id(p)] for p in current["params"]]
    set_optimizer_state_dict(
        pm.module,
        pm.optimizer,
        cast(Any, {"state": state, "param_groups": groups}),
        options=StateDictOptions(strict=False),
    )


def _entry(value: Any, again: bool) -> Any:
    """A saved optimizer state entry: a tensor (cloned `again`, for a second copy of a tied
    weight: the optimizer updates each copy's state in place), else unpickled."""
    if isinstance(value, torch.Tensor):
        return value.clone() if again else value
    return pickle.loads(value)


def _restore_policy(
    pm: Checkpointable, policy: WeightPolicy, state: dict[str, Any], same_plan: bool
) -> None:
    if same_plan:
        policy.load_state(state)
        return
    if set(state) != {"version"}:
        raise ConfigError(
            f"the {pm.weights} policy keeps per-stage state ({sorted(set(state) - {'version'})})"
            " that cannot be resharded: resume it under the plan it was saved with, "
            "compile(..., plan=graphpipe.saved_plan(path)) (plans made from measured op times "
            "may differ from run to run)"
        )
    policy.version = int(state["version"])


# -- export -----------------------------------------------------------------------------------


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """Write the model of the checkpoint at `path` as a plain `torch.save` state dict.

    One process, no process group. Every name of the unpipelined model's `state_dict()` is
    there (tied weights under each of their names), in the model's order, so
    `model.load_state_dict(torch.load(out), strict=True)` works.

    Returns:
        `out`.

    Raises:
        ConfigError: no complete checkpoint at `path`.
        CheckpointError: a file of it is not as it was saved.
    """
    where = resolve(path)
    problems = integrity.verify(where)
    if problems:
        raise CheckpointError(f"refusing to export {where}", problems, path=str(where))
    meta = integrity.read_record(where)
    saved = dcp.FileSystemReader(str(where)).read_metadata().state_dict_metadata
    template = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in saved.items()
        if k.startswith("model/") and isinstance(v, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "no process group: loading in one process", as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=str(where), no_dist=True)
    canonical = meta["canonical"]
    state = {n: template[f"model/{canonical.get(n, n)}"] for n in meta["names"]}
    out = Path(out)
    torch.save(state, out)
    return out
