"""FSDP2's collectives under the failure watch: the all-gathers and reduce-scatters it runs
over the dp ranks of a mesh, inside a stage's forward and backward.

    guard_collectives(stage_module, stage=1)

FSDP2 calls its collectives itself, outside graphpipe's `guarded`. Given to it as custom
comms (`FSDPModule.set_custom_all_gather` and `set_custom_reduce_scatter`, which take any
object with FSDP2's `allocate` and call signatures: `Comm`, `AllGather` and `ReduceScatter`
in torch's FSDP2 API), each runs under `guarded`: while it lasts the rank publishes on the
failure board that it waits for its dp peers, so a rank that waits for it follows the chain
to the rank that stalls it; it stops as soon as another rank posts a failure; and after
`RuntimeConfig.timeout` it names the rank that blocks it. A peer that dies in one is named as
any death is (`Watch.failed`).

Each runs synchronously (FSDP2 is given no `Work` to wait for): under gloo on the CPU FSDP2's
"asynchronous" collectives overlap nothing anyway. On NCCL FSDP2's own are kept (on its
streams; the process group's timeout and watchdog bound them), as `guarded` runs NCCL calls on
this thread too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from graphpipe.runtime.failures import guarded

__all__ = ["GuardedAllGather", "GuardedReduceScatter", "guard_collectives"]


class _Guarded:
    """What FSDP2's all-gather and reduce-scatter protocols share: a fresh buffer per call
    (`Comm.allocate`, its default's behaviour), and the collective run under the watch.

    Args:
        what: The collective, as an error names it.
    """

    def __init__(self, what: str) -> None:
        self.what = what

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An empty tensor of `size`."""
        return torch.empty(*size, dtype=dtype, device=device)

    def _run(self, collective: Callable[[], Any], group: dist.ProcessGroup) -> None:
        """`collective` over `group`'s ranks under the watch, waited for."""
        guarded(self.what, collective, dist.get_process_group_ranks(group))


class GuardedAllGather(_Guarded):
    """FSDP2's parameter all-gather, under the watch."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        """Gather `input_tensor` of every rank of `group` into `output_tensor`, waited for."""
        self._run(lambda: dist.all_gather_single(output_tensor, input_tensor, group=group), group)


class GuardedReduceScatter(_Guarded):
    """FSDP2's gradient reduce-scatter, under the watch."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        """Reduce `input_tensor` over `group` with `op`, this rank's part in `output_tensor`."""
        self._run(
            lambda: dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, group=group, op=op
            ),
            group,
        )


def guard_collectives(module: nn.Module, stage: int) -> None:
    """Run the all-gathers and reduce-scatters of every FSDP2 unit in `module` under the
    watch; nothing on NCCL. (A replicated stage's all-reduce over dp, `dp_shard=False`, is
    FSDP2's own still: its group's timeout bounds it, `set_collective_timeout`.)

    Args:
        module: The stage module, wrapped by `graphpipe.runtime.mesh.shard_stage`.
        stage: Its index, for the errors.
    """
    if dist.get_backend() == "nccl":
        return
    gather = GuardedAllGather(f"FSDP2's all-gather of stage {stage}'s parameters")
    reduce = GuardedReduceScatter(f"FSDP2's reduce-scatter of stage {stage}'s gradients")
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_custom_all_gather(gather)  # type: ignore[arg-type]  # FSDP2's protocol
            unit.set_custom_reduce_scatter(reduce)  # type: ignore[arg-type]
