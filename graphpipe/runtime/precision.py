"""Mixed precision: autocast per stage, half-width values between stages, fp16 loss scaling.

    pm = graphpipe.compile(model, x, ..., precision="bf16")   # or "fp16", or None (fp32)

- Each stage's forward runs under `torch.autocast` with the chosen dtype; parameters and the
  optimizer state stay float32 (the master weights). Under a mesh with a "dp" dimension
  bf16 and fp16 are FSDP2's `MixedPrecisionPolicy` instead (`Precision.fsdp_policy`):
  parameters gathered in the half dtype, gradients reduce-scattered in float32 (fp16's loss
  scale agreed over every rank, below).
- A graph torch.export traced keeps autocast under a mesh too (`Precision.by_autocast`):
  export wrote the model's own dtype handling into the graph (HF's RMSNorm and rotary
  embedding upcast to float32 on purpose, then cast back to the dtype they were given,
  which export fixed at float32). bf16 parameters would meet those casts (a float32 matmul
  input against a bf16 weight); rewriting the casts to bf16 would change the model's
  numerics, not only its precision. Under autocast the graph computes as the model does
  under `torch.autocast` on one process: matmuls in bf16, the upcast parts in float32.
  FSDP2 then gathers the float32 masters (twice the bytes of bf16 gathers) and reduces
  gradients in float32.
- A float32 value that crosses to another stage is cast to that dtype inside the autograd
  graph, so the message is half as large and its gradient comes back in the same dtype. The
  cast saturates: an additive attention mask made with `torch.finfo(float32).min` becomes
  fp16's most negative finite value, not -inf (which would give NaN rows after a softmax).
- fp16 only: a `LossScaler`, as `torch.amp.GradScaler` does it. The loss of every micro-batch
  is multiplied by the scale before its backward; at the update the gradients are unscaled,
  a found-inf flag is all-reduced over every rank that holds a stage (MAX), and on an inf or
  NaN anywhere every rank skips the optimizer step and halves the scale. After `interval`
  good steps in a row the scale doubles. All stages therefore always agree on the scale.
  The unscale and the inf/NaN check are torch's (the fused kernel of
  `torch.amp.GradScaler.unscale_`); `LossScaler` says why the rest is graphpipe's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import graphpipe._torch as _torch
from graphpipe.errors import ConfigError
from graphpipe.ir.registry import POLICIES, policy_spec
from graphpipe.runtime.sync import local_part

__all__ = ["DTYPES", "LossScaler", "Precision", "check_precision", "saturating_cast"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
ITEM_BYTES = {None: 4, "bf16": 2, "fp16": 2}  # bytes of a floating value between stages


def check_precision(precision: str | None, weights: str = "flush") -> None:
    """Refuse an unknown precision, or fp16 under a policy that cannot skip a step.

    Raises:
        ConfigError: naming the value (an unknown policy too, with fp16).
    """
    if precision is not None and precision not in DTYPES:
        raise ConfigError(f"precision must be 'bf16', 'fp16' or None, got {precision!r}")
    if precision == "fp16" and not policy_spec(weights).whole_step:
        whole = sorted(name for name, spec in POLICIES.items() if spec.whole_step)
        raise ConfigError(
            f"precision='fp16' needs weights in {whole}, got weights={weights!r}: its loss "
            "scaler skips a whole step on every rank when a gradient overflows, and an "
            "asynchronous policy has no whole step to skip (use precision='bf16')"
        )


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`, clamped to its finite range first (differentiable)."""
    info = torch.finfo(dtype)
    if torch.finfo(x.dtype).max > info.max:
        x = x.clamp(info.min, info.max)
    return x.to(dtype)


@dataclass(frozen=True)
class Precision:
    """How one rank's stages compute: the autocast dtype (None: float32 throughout).

    Under a mesh (`sharded`) there is no autocast: FSDP2's `MixedPrecisionPolicy`
    (`fsdp_policy`) gathers the parameters in the dtype, so every op of the stage runs in
    it, and reduces the gradients in float32 into float32 shards (the master weights).
    """

    name: str | None = None
    sharded: bool = False  # stages are FSDP2 units: cast by their policy, not by autocast
    by_autocast: bool = False  # sharded too, but cast by autocast (an exported graph)

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype."""
        return DTYPES.get(self.name) if self.name else None

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        """The context a stage's forward runs in."""
        if self.dtype is None or (self.sharded and not self.by_autocast):
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.dtype)

    def fsdp_policy(self, root: bool) -> MixedPrecisionPolicy:
        """FSDP2's mixed precision for a unit of a stage under a mesh: parameters gathered
        in the dtype, gradients reduced (and accumulated between reductions) in float32.
        The stage root's outputs come back as float32, so the loss is computed in float32
        and a value crossing stages is cast by `crossing` as without a mesh. Float32 (no
        dtype): the policy that casts nothing.

        Under `by_autocast` the parameters are gathered as they are (float32) and autocast
        casts them per op.

        Args:
            root: The policy of the stage module itself (else of one of its blocks).
        """
        if self.dtype is None:
            return MixedPrecisionPolicy()
        if self.by_autocast:
            return MixedPrecisionPolicy(reduce_dtype=torch.float32)
        return MixedPrecisionPolicy(
            param_dtype=self.dtype,
            reduce_dtype=torch.float32,
            output_dtype=torch.float32 if root else None,
        )

    def crossing(self, x: torch.Tensor) -> torch.Tensor:
        """A value as it leaves its stage: float32 becomes the autocast dtype."""
        if self.dtype is None or x.dtype != torch.float32:
            return x
        return saturating_cast(x, self.dtype)

    def spec_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a value of `dtype` crosses stages in."""
        return self.dtype if self.dtype is not None and dtype == torch.float32 else dtype


class LossScaler:
    """fp16 loss scaling agreed by every rank (see the module docstring).

    torch's part: the unscale and the inf/NaN check are the fused kernel
    `torch.amp.GradScaler.unscale_` runs (`graphpipe._torch.unscale_and_check_`), per
    device and dtype as there, and the defaults and the update rule are `GradScaler`'s.

    graphpipe's part, and why `torch.amp.GradScaler` or
    `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` (which all-reduces the
    flag over a `process_group`) does not serve as it is:

    - Both record the flag per optimizer (`unscale_(optimizer)` walks its `param_groups`)
      and act on it only inside `step(optimizer)`, which runs `optimizer.step()` itself;
      the flag has no public reader. graphpipe's update belongs to the weight policy
      (its update hooks, `graphpipe.runtime.hooks`), which holds one optimizer per stage
      on a rank and needs one agreed answer before any of them steps, to skip them all and
      drop the gradients.
    - ShardedGradScaler's agreement is a bare `dist.all_reduce` per optimizer and device
      inside `unscale_`. Here it is one collective per step, `all_reduce_max`, which the
      pipeline runs under its failure guard, so a dead peer is a PipelineError naming it
      rather than a hang.
    - The executor multiplies each micro-batch's loss by the scale as a Python float.
      GradScaler keeps the scale in a device tensor, and reading it (`get_scale()`) is a
      second device-to-host read per step; here reading the agreed flag is the only one.

    Args:
        all_reduce_max: Reduces a one-element float tensor with MAX over the ranks that
            hold stages (a collective).
        scale: The first scale.
        growth: Factor after `interval` good steps.
        backoff: Factor after a step with an inf or NaN.
        interval: Good steps between two growths.
    """

    def __init__(
        self,
        all_reduce_max: Callable[[torch.Tensor], None],
        scale: float = 2.0**16,
        growth: float = 2.0,
        backoff: float = 0.5,
        interval: int = 2000,
    ) -> None:
        self.all_reduce_max = all_reduce_max
        self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
        self.good = 0  # good steps since the last change of scale
        self.skipped = 0  # steps skipped so far

    def unscale(self, params: Sequence[torch.Tensor], device: torch.device) -> bool:
        """Divide the gradients by the scale; whether every rank's are finite (collective)."""
        flag = torch.zeros(1, dtype=torch.float32, device=device)  # 1: an inf or NaN here
        held = [local_part(p.grad) for p in params if p.grad is not None]  # shards too
        for grads in _by_device_and_dtype(held):
            on = grads[0].device
            found = torch.zeros(1, dtype=torch.float32, device=on)
            inv = torch.full((1,), 1.0 / self.scale, dtype=torch.float32, device=on)
            _torch.unscale_and_check_(grads, found, inv)
            flag = torch.maximum(flag, found.to(device))
        self.all_reduce_max(flag)
        return bool(flag.item() == 0)

    def update(self, finite: bool) -> None:
        """The next scale after a step whose gradients were `finite`."""
        if not finite:
            self.scale *= self.backoff
            self.good = 0
            self.skipped += 1
            return
        self.good += 1
        if self.good >= self.interval:
            self.scale *= self.growth
            self.good = 0


def _by_device_and_dtype(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`grads` in groups of one device and dtype, as the fused unscale kernel takes them."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return list(groups.values())
