"""State: the model's weights under their original names, and what a checkpoint reads.

`ModelState` gathers and loads full state dicts, reports the weight policy's versions, and is
the `graphpipe.runtime.checkpoint.Checkpointable` a checkpoint saves and loads: the
checkpoint module reads this public interface, never the pipeline's internals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.ir import Plan
from graphpipe.runtime.batching import cpu
from graphpipe.runtime.collectives import Collectives
from graphpipe.runtime.mesh import shaped_like, whole
from graphpipe.runtime.pieces import Holdings, Place, Update
from graphpipe.runtime.stepping import Stepper
from graphpipe.runtime.weights import WeightPolicy

__all__ = ["ModelState"]


class ModelState:
    """This rank's weights, optimizer, policy and counters, by the model's names.

    Args:
        place: The rank's place (its rank, stages and mesh).
        holdings: Its stage module and the model's names for its tensors.
        update: Its optimizer, weight policy and fp16's scaler.
        plan: The plan (a checkpoint records it).
        micro_batches: M (a checkpoint records it).
        stepper: The step counter, and drain().
        collectives: Gathers the state dict.
    """

    def __init__(
        self,
        place: Place,
        holdings: Holdings,
        update: Update,
        plan: Plan,
        micro_batches: int,
        stepper: Stepper,
        collectives: Collectives,
    ) -> None:
        self.place, self.holdings, self.update = place, holdings, update
        self._plan, self._micro_batches = plan, micro_batches
        self.stepper, self.collectives = stepper, collectives
        self.canonical: Mapping[str, str] = holdings.canonical
        self.names: tuple[str, ...] = holdings.names  # the model's order
        self._by_name = {n: names for names in holdings.aliases.values() for n in names}
        self.held_names: Mapping[str, str] = self._held_names()

    # -- the Checkpointable interface ----------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.place.rank

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def weights(self) -> str:
        return self.update.weights

    @property
    def micro_batches(self) -> int:
        return self._micro_batches

    @property
    def stage_indices(self) -> tuple[int, ...]:
        return self.place.stage_indices

    @property
    def module(self) -> nn.Module | None:
        return self.holdings.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.update.optimizer

    @property
    def policy(self) -> WeightPolicy | None:
        return self.update.policy

    @property
    def orphans(self) -> Mapping[str, torch.Tensor]:
        return self.holdings.orphans

    @property
    def steps_done(self) -> int:
        return self.stepper.steps_done

    @steps_done.setter
    def steps_done(self, steps: int) -> None:
        self.stepper.steps_done = steps

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None without fp16)."""
        return None if self.update.scaler is None else self.update.scaler.scale

    @property
    def mesh_shape(self) -> tuple[int, int] | None:
        """(pp, dp) of the mesh the stages run over; None without one."""
        layout = self.place.layout
        return (layout.pp, layout.dp) if layout.meshed else None

    def restore_loss_scale(self, scale: float) -> None:
        """Set fp16's loss scale to a saved one.

        Raises:
            ConfigError: this pipeline has no fp16 loss scale.
        """
        scaler = self.update.scaler
        if scaler is None:
            raise ConfigError(f"loss_scale={scale} set on a pipeline without precision='fp16'")
        scaler.scale = scale

    def drain(self) -> None:
        """Land an asynchronous pipeline's updates in flight."""
        self.stepper.drain()

    # -- full state dicts ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict under the original names, gathered on every rank."""
        self.drain()
        mine: dict[str, torch.Tensor] = {}
        if self.module is not None:
            for name, value in self.module.state_dict(keep_vars=True).items():
                for alias in self._aliases(name, value):
                    mine[alias] = cpu(whole(value))  # a mesh's shards gathered over dp
        if self.rank == 0:
            mine.update(self.holdings.orphans)
        gathered = self.collectives.gather(mine, "the state dict")
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return {k: merged[k] for k in self.names if k in merged}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take this rank's stages' part of a full state dict (tied weights under any name).

        A tensor the model keeps out of its own state dict (a non-persistent buffer, such as
        a Hugging Face rotary embedding's `inv_freq`, which an exported stage holds as a
        buffer) is not asked for: it keeps its value, as `model.load_state_dict` keeps it.

        Raises:
            ConfigError: names this rank's stages need that `state` lacks.
        """
        if self.module is None:
            return
        found: dict[str, torch.Tensor] = {}
        missing = []
        saved = set(self.names)
        for key, value in self.module.state_dict(keep_vars=True).items():
            aliases = self._aliases(key, value)
            names = [a for a in aliases if a in state]
            if names:
                found[key] = shaped_like(value, state[names[0]])  # a mesh's: this rank's shard
            elif saved.intersection(aliases):
                missing.append(key)
        if missing:
            raise ConfigError(
                f"state dict lacks {missing} (needed by stages {list(self.stage_indices)})"
            )
        self.module.load_state_dict(found, strict=False)  # the unsaved keep their values

    def _aliases(self, key: str, value: torch.Tensor) -> list[str]:
        """Every name of the model's tensor that this rank's module holds as `key`: by
        identity, or by name where FSDP2 (a mesh) replaced the tensor with its sharded
        parameter."""
        found = self.holdings.aliases.get(id(value))
        if found is not None:
            return found
        name = self._stage_name(key)
        return self._by_name.get(name, [name])

    def _stage_name(self, key: str) -> str:
        """The name a stage holds a tensor under, from this rank's module's key: several
        stages are a ModuleList, whose keys put the stage's position first ("1.head.bias")."""
        return key.split(".", 1)[1] if len(self.stage_indices) > 1 else key

    def _held_names(self) -> dict[str, str]:
        """Each key of this rank's module's state dict (and parameter name: DCP's FQNs) ->
        the model's first name of that tensor, so that a checkpoint is keyed by the model's
        names whatever the plan (several stages per rank included)."""
        if self.module is None:
            return {}
        keys = [*self.module.state_dict(keep_vars=True), *dict(self.module.named_parameters())]
        names = {k: self._stage_name(k) for k in keys}
        return {k: self.canonical.get(n, n) for k, n in names.items()}

    def versions(self) -> dict[str, Any]:
        """This rank's weight bookkeeping: the copies it holds and, per micro-batch, the
        updates reflected in the weights its forward and its backward used."""
        policy = self.policy
        if policy is None:  # a rank without a stage (and so without an executor)
            return {"copies": 0, "peak_copies": 0, "forward": {}, "backward": {}}
        log = policy.log
        return {
            "copies": policy.copies(),
            "peak_copies": policy.peak_copies,
            "forward": {j: k for kind, j, k in log if kind == "F"},
            "backward": {j: k for kind, j, k in log if kind == "B"},
        }
