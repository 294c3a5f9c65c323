"""Mini-batches in: checked against the compiled shapes, split into M micro-batches.

Every check here runs on every rank alike, before any communication, so a bad call raises
the same ConfigError everywhere and leaves the pipeline as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

from graphpipe.errors import ConfigError
from graphpipe.runtime.executor import Batch, scalar
from graphpipe.runtime.spec import LossFn
from graphpipe.tracing.annotate import trace_info
from graphpipe.tracing.bind import example_output, flat_inputs

__all__ = ["Inputs", "cpu", "to_device"]


class Inputs:
    """Turns one call's inputs and target into the micro-batches this rank needs.

    Args:
        gm: The whole traced graph (input names and order, the output's structure).
        example_inputs: The flat example inputs compile traced with (their shapes and dtypes
            are the only ones accepted).
        model_inputs: The model inputs this rank's stages read (only those are copied).
        loss_fn: The loss, checked once on meta tensors.
        micro_batches: M.
        device: This rank's device.
        has_output: This rank holds the stage computing the loss (which needs the target).
        dp: Data-parallel slices of each micro-batch (a mesh's dp size; 1 without one).
        dp_index: The slice this rank runs (`graphpipe.runtime.mesh.MeshLayout.dp_index`).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[torch.Tensor],
        model_inputs: Sequence[str],
        loss_fn: LossFn,
        micro_batches: int,
        device: torch.device,
        has_output: bool,
        dp: int = 1,
        dp_index: int = 0,
    ) -> None:
        self.gm, self.loss_fn, self.m, self.device = gm, loss_fn, micro_batches, device
        self.dp, self.dp_index = dp, dp_index
        self.shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self.names = list(trace_info(gm).input_names)
        self.model_inputs = frozenset(model_inputs)
        self.has_output = has_output
        self._loss_checked = False

    def batch(self, args: Sequence[Any], kwargs: dict[str, Any], target: Any, first: int) -> Batch:
        """The micro-batches of one call, numbered from `first`.

        Raises:
            ConfigError: an input of another shape or dtype than compiled, or a target
                without the batch on dim 0.
        """
        flat = flat_inputs(self.gm, *args, **kwargs)
        for name, x, (shape, dtype) in zip(self.names, flat, self.shapes, strict=True):
            if tuple(x.shape) != shape or x.dtype != dtype:
                raise ConfigError(
                    f"input {name} is {x.dtype}{list(x.shape)}, the pipeline was compiled "
                    f"for {dtype}{list(shape)}"
                )
        chunks = {  # only the inputs this rank's stages read are copied to its device
            name: self._micro_batches(x)
            for name, x in zip(self.names, flat, strict=True)
            if name in self.model_inputs
        }
        if target is None:
            return Batch(first, chunks, None)
        _check_target(target, flat[0].shape[0] if flat else 0)
        if not self.has_output:
            return Batch(first, chunks, [None] * self.m)  # only the loss's stage needs it
        return Batch(first, chunks, _split(target, self.m, self._micro_batches))

    def _micro_batches(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x's M micro-batches on this rank's device: with a mesh, this rank's dp slice of
        each (`_slices`)."""
        if self.dp == 1:
            return list(to_device(x, self.device).chunk(self.m))
        return [to_device(c, self.device) for c in self._slices(x)]

    def _slices(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x's M micro-batches where it is: with a mesh, this rank's dp slice of each
        (micro-batch j, slice d: rows of chunk j of M, then chunk d of dp)."""
        return [c.chunk(self.dp)[self.dp_index] for c in x.chunk(self.m)]

    def check_loss(self, target: Any) -> None:
        """Once, on every rank alike: loss_fn on the model's output for one micro-batch as
        meta tensors (no memory, no values) and the target's first micro-batch must give a
        real scalar. A loss_fn that cannot run on the meta device is left to the stage that
        computes the loss.

        Raises:
            ConfigError: the loss is not a real scalar tensor, naming what it is.
        """
        if self._loss_checked:
            return
        out = example_output(self.gm)
        first = tree_map(  # the target of the output's rows: this rank's slice under a mesh
            lambda t: self._slices(t.to("meta"))[0] if isinstance(t, torch.Tensor) else t,
            target,
        )
        try:
            loss = self.loss_fn(out, first)
        except Exception:  # e.g. reads values; the loss's stage still checks every loss
            loss = torch.zeros((), device="meta")
        scalar(loss, 0)
        self._loss_checked = True


def _check_target(target: Any, batch: int) -> None:
    """Every tensor in `target` must have the batch on dim 0.

    Raises:
        ConfigError: no tensor at all, or naming the first tensor that does not.
    """
    leaves, _ = tree_flatten_with_path(target)
    tensors = [(keystr(path), x) for path, x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ConfigError(
            f"target holds no tensor (it is a {type(target).__name__}); it must be a tensor, "
            "or a tuple/dict of tensors, with the batch on dim 0"
        )
    for path, x in tensors:
        if x.dim() == 0:
            raise ConfigError(
                f"target{path} is a scalar, the batch has {batch} rows; dim 0 must be the batch"
            )
        if x.shape[0] != batch:
            raise ConfigError(f"target{path} has {x.shape[0]} rows, the batch has {batch}")


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x` on `device`; from the CPU to CUDA through pinned memory, without blocking."""
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def cpu(x: Any) -> Any:
    """A tensor detached and copied to the CPU; anything else as it is."""
    return x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x


def _split(target: Any, m: int, split: Callable[[torch.Tensor], list[torch.Tensor]]) -> list[Any]:
    """The target's M micro-batches, each tensor leaf cut by `split` (others repeated)."""
    leaves = tree_map(lambda t: split(t) if isinstance(t, torch.Tensor) else [t] * m, target)
    return [
        tree_map(lambda chunks, j=j: chunks[j], leaves, is_leaf=lambda x: isinstance(x, list))
        for j in range(m)
    ]
