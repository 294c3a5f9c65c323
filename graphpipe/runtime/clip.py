"""Global gradient clipping across the stages of a pipeline.

`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` on one process scales every
gradient by min(1, max_norm / (norm + 1e-6)), where norm is the p-norm of all gradients
together. In a pipeline each rank holds only its stages' gradients, so the norm is reduced
over the ranks:

    local   sum of |g|^p over the gradients this rank counts (max |g| for p = inf)
    total   all-reduce (SUM, or MAX for inf) over every rank that holds a stage, then ^(1/p)

A parameter is counted once: a tied weight held by several stages by the rank of the first
of them, a replicated stage's parameters by its first device.

Under a ("pp", "dp") mesh (FSDP2 per stage) each gradient is a DTensor shard over dp. torch's
norm of DTensors is a DTensor over the dp mesh, made whole there (`mesh.whole`, a reduction
over the stage's dp ranks); the all-reduce then runs over the pp ranks of this rank's dp
index only (`groups.update_group`), since every dp rank of a stage now holds the same
stage norm: each stage is counted once, and every dp index gets the same total. The scaling
multiplies each rank's own shards by that total's factor. The weight policy calls the
clipper after the gradient sums over replicas and tied copies and before the optimizer step
(the last of its update hooks, `graphpipe.runtime.hooks`), so every copy is scaled by the
same factor. The norm stays on the device; `PipelinedModel.last_grad_norm` reads it when asked.

What is torch's and what is graphpipe's. Each rank's local norm is
`torch.nn.utils.get_total_norm` of the gradients it counts, and the scaling is
`torch.nn.utils.clip_grads_with_norm_` with the total norm (the two halves of
`clip_grad_norm_`, in torch since 2.6). graphpipe's floor is torch 2.4, so on 2.4 and 2.5
`_total_norm` and `_clip_with_norm` compute the same two halves themselves (the norm of the
per-tensor norms; one factor min(1, max_norm / (norm + 1e-6)) for every gradient), tested
against torch's in tests/test_precision.py. The reduction in between
stays graphpipe's: torch's functions see one process's tensors (or a DTensor's mesh), while a
pipeline's parameters are plain tensors spread over the stage ranks, a tied weight or a
replicated stage held by several ranks that must count it once (`counted`), and the
all-reduce runs under graphpipe's failure guard, so a dead peer is a PipelineError naming it.

Only a policy whose every rank updates once per step on the same gradients
(`PolicySpec.whole_step`: flush) has one global norm per update. stash and PipeMare update
each stage after each of its own micro-batches, at different times on different stages: no
global norm exists, and clipping is refused (`check_clipping`). 2bw updates each stage once
per mini-batch and could pair its stages' k-th updates; it is refused until that is tested
against its recurrence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.ir.registry import POLICIES, policy_spec
from graphpipe.runtime.failures import guarded
from graphpipe.runtime.mesh import whole

__all__ = ["GradClipper", "check_clipping"]


def check_clipping(max_norm: float | None, norm_type: float, weights: str) -> None:
    """Refuse clipping settings that cannot work, naming the value.

    Raises:
        ConfigError: a non-positive max_norm or norm_type, an unknown policy, or a policy
            without one global update per mini-batch.
    """
    if max_norm is None:
        return
    if not max_norm > 0:
        raise ConfigError(f"max_grad_norm must be positive, got {max_norm}")
    if not norm_type > 0:
        raise ConfigError(f"grad_norm_type must be positive (or inf), got {norm_type}")
    if not policy_spec(weights).whole_step:
        whole = sorted(name for name, spec in POLICIES.items() if spec.whole_step)
        raise ConfigError(
            f"max_grad_norm needs one global update per mini-batch (weights in {whole}); "
            f"weights={weights!r} updates the stages at different times, so there is no one "
            "global norm to clip by"
        )


class GradClipper:
    """Scales this rank's gradients by the global clipping factor (module docstring)."""

    def __init__(
        self,
        max_norm: float,
        norm_type: float,
        params: Sequence[nn.Parameter],
        counted: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
    ) -> None:
        """
        Args:
            max_norm: The largest total norm allowed.
            norm_type: p of the p-norm (math.inf for the largest absolute value).
            params: Every parameter of this rank (all are scaled).
            counted: Those this rank counts in the norm.
            group: The ranks that hold a stage (None: the default group).
        """
        self.max_norm, self.norm_type, self.group = max_norm, float(norm_type), group
        self.params, self.counted = list(params), list(counted)
        self.last: torch.Tensor | None = None

    def _local(self, device: torch.device) -> torch.Tensor:
        """This rank's share of the total: the sum of |g|^p over the gradients it counts
        (their largest |g| for p = inf), as float32 on `device` (zero without gradients).

        Under a mesh the gradients are FSDP2's DTensor shards, and torch's norm of them is a
        DTensor over the dp mesh: `whole` reduces it there (a collective over the stage's dp
        ranks), so every dp rank of a stage holds the stage's whole norm."""
        grads = [p.grad for p in self.counted if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norm = whole(_total_norm(grads, self.norm_type)).to(device, torch.float32)
        return norm if math.isinf(self.norm_type) else norm.pow(self.norm_type)

    def __call__(self, device: torch.device) -> torch.Tensor:
        """Reduce the norm over the ranks, scale the gradients, and return the total norm."""
        total = self._local(device).reshape(1)
        inf = math.isinf(self.norm_type)
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        guarded(
            "the all-reduce of the gradient norm",
            lambda: dist.all_reduce(total, op, self.group),
            ranks,
        )
        norm = total[0] if inf else total[0].pow(1.0 / self.norm_type)
        _clip_with_norm(self.params, self.max_norm, norm)
        self.last = norm.detach()
        return self.last


def _total_norm(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The p-norm of `grads` taken together: `torch.nn.utils.get_total_norm` (torch 2.6+), or
    on torch 2.4 and 2.5 the same norm of the per-tensor norms."""
    if hasattr(nn.utils, "get_total_norm"):
        return nn.utils.get_total_norm(grads, norm_type)
    norms = [torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


def _clip_with_norm(params: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient of `params` by min(1, max_norm / (total + 1e-6)):
    `torch.nn.utils.clip_grads_with_norm_` (torch 2.6+), or on torch 2.4 and 2.5 the same
    factor applied here."""
    if hasattr(nn.utils, "clip_grads_with_norm_"):
        nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(factor.to(p.grad.device))
