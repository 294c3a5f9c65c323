"""Mini-batches in: checked against the compiled shapes, split into M micro-batches.

Every check here runs on every rank alike, before any communication, so a bad call raises
the same ConfigError everywhere and leaves the pipeline as it was.

What may change between steps: the batch size (B rows split as `torch.tensor_split` splits
them, so the first B mod M micro-batches hold one row more) and any other dimension of the
inputs (a sequence length, an image size), up to compile's `max_shapes` (else the example's
size) in every dimension: the plan's memory was planned at those shapes, so a larger input
is refused by name. What may not: the inputs' number, names, dtypes and number of
dimensions, and the trace's constants. Each micro-batch's shapes (its signature) select its
stages and message specs (`graphpipe.runtime.shapes`). With rows that differ between
micro-batches, micro-batch j's loss is weighted by its rows, r_j / B, instead of 1 / M: for
a loss that is a mean over the rows of its micro-batch, the sum is the mean over the whole
batch, as one process gets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from graphpipe._torch import keystr, tree_flatten_with_path, tree_map
from graphpipe.errors import ConfigError
from graphpipe.runtime.executor import Batch, scalar
from graphpipe.runtime.shapes import Lowered, Shapes, describe
from graphpipe.runtime.spec import LossFn, needs_target
from graphpipe.tracing.annotate import Source, trace_info
from graphpipe.tracing.bind import example_output, flat_inputs
from graphpipe.tracing.split import InputSplit

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
        dp_index: The slice this rank runs (`graphpipe.runtime.mesh.ParallelLayout.dp_index`).
        shapes: The stages at each micro-batch's shapes; None: only the compiled shapes.
        max_shapes: Input name -> the largest whole-batch shape a step may bring (compile's
            `max_shapes`); an input not named: the example's.
        split: How each input splits into micro-batches (compile's resolved input_split;
            None: dim 0). The target splits on dim 0.
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
        shapes: Shapes | None = None,
        max_shapes: Mapping[str, tuple[int, ...]] | None = None,
        split: InputSplit | None = None,
    ) -> None:
        self.gm, self.loss_fn, self.m, self.device = gm, loss_fn, micro_batches, device
        self.dp, self.dp_index, self.stages = dp, dp_index, shapes
        self.shapes = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self.names = list(trace_info(gm).input_names)
        self.sources = list(trace_info(gm).sources)
        self.split = split or InputSplit()
        self.static: dict[str, torch.Tensor] = dict(gm.meta.get("gp_static", {}))
        self.max_shapes = dict(max_shapes or {})
        self.model_inputs = frozenset(model_inputs)
        self.has_output = has_output
        self.needs_target = needs_target(loss_fn)
        self._loss_checked = False

    def batch(
        self,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        target: Any,
        first: int,
        outputs: bool = False,
    ) -> Batch:
        """The micro-batches of one call, numbered from `first`: with `outputs`, an
        inference call that keeps the model's outputs (no loss, no target).

        Raises:
            ConfigError: an input of another dtype or number of dimensions than compiled, or
                larger than compiled in some dimension; fewer rows than micro-batches; a
                micro-batch whose rows the mesh's dp slices do not divide; a target without
                the batch on dim 0; or shapes the stages cannot run at
                (`graphpipe.runtime.shapes.Shapes.lowered`).
        """
        flat = flat_inputs(self.gm, *args, **kwargs)
        named: dict[Source, torch.Tensor] = {k: kwargs[k] for k in self.static}
        named.update(zip(self.sources, flat, strict=True))
        self._check_static(named)
        rows = self._rows(flat, named)
        pieces = [  # views (a rule's function may copy): each input's M micro-batches
            self.split.micro_batches(s, named, self.m, self.dp, self.dp_index) for s in self.sources
        ]
        chunks = {  # only the inputs this rank's stages read are copied to its device
            name: [to_device(c, self.device) for c in cut]
            for name, cut in zip(self.names, pieces, strict=True)
            if name in self.model_inputs
        }
        shaped, shares = self._lowered(flat, pieces, rows)
        if outputs:
            return Batch(first, chunks, None, shaped, shares)
        if target is None:  # a loss of the output alone (step() checked it needs none)
            return Batch(first, chunks, [None] * self.m, shaped, shares)
        _check_target(target, sum(rows))
        if not self.has_output:  # only the loss's stage needs it
            return Batch(first, chunks, [None] * self.m, shaped, shares)
        return Batch(first, chunks, _split(target, self.m, self._micro_batches), shaped, shares)

    def _check_static(self, named: Mapping[Source, torch.Tensor]) -> None:
        """Every micro-batch's static inputs hold the values the graph was traced with.

        Raises:
            ConfigError: naming the input, the micro-batch and both values.
        """
        for source, traced in self.static.items():
            cut = self.split.micro_batches(source, named, self.m, self.dp, self.dp_index)
            for j, piece in enumerate(cut):
                if piece.shape != traced.shape or not torch.equal(piece.cpu(), traced):
                    raise ConfigError(
                        f"static input {source!r} of micro-batch {j} is {piece.tolist()}; the "
                        f"graph holds the values it was traced with, {traced.tolist()}, and "
                        "runs with those only (fixed-size images): compile again at the new "
                        "values, or give the input another rule in input_split"
                    )

    def _rows(
        self, flat: Sequence[torch.Tensor], named: Mapping[Source, torch.Tensor]
    ) -> list[int]:
        """Each micro-batch's rows, once every input (`flat`, and by source `named`) is
        checked against the compiled ones.

        Raises:
            ConfigError: see `batch`.
        """
        for name, x, (shape, dtype) in zip(self.names, flat, self.shapes, strict=True):
            if x.dtype != dtype or x.dim() != len(shape):
                raise ConfigError(
                    f"input {name} is {x.dtype}{list(x.shape)}, the pipeline was compiled "
                    f"for {dtype}{list(shape)}: the dtype and number of dimensions must stay"
                )
            bound = self.max_shapes.get(name, shape)
            beyond = [d for d, (n, most) in enumerate(zip(x.shape, bound, strict=True)) if n > most]
            if beyond:
                whose = "max_shapes'" if name in self.max_shapes else "the compiled example's"
                raise ConfigError(
                    f"input {name} is {list(x.shape)}: dim {beyond[0]} is beyond {whose} "
                    f"{list(bound)}, the largest shape the plan's memory was planned for; "
                    "compile with max_shapes (or an example) as large as the largest batch"
                )
        batch = self.split.batch(named) if flat else 0
        if batch < self.m:
            raise ConfigError(f"the batch has {batch} rows, fewer than the {self.m} micro-batches")
        q, r = divmod(batch, self.m)  # as torch.tensor_split: the first r hold one row more
        rows = [q + 1] * r + [q] * (self.m - r)
        if any(n % self.dp for n in rows):
            raise ConfigError(
                f"the batch of {batch} rows splits into micro-batches of {sorted(set(rows))} "
                f"rows, which the mesh's {self.dp} data-parallel slices do not divide"
            )
        return rows

    def _lowered(
        self,
        flat: Sequence[torch.Tensor],
        pieces: Sequence[Sequence[torch.Tensor]],
        rows: Sequence[int],
    ) -> tuple[list[Lowered] | None, list[float] | None]:
        """Each micro-batch's stages and specs (its signature: the shapes of its pieces of
        every input), and its share of the rows when they differ (None: all equal, each
        micro-batch's loss weighs 1 / M as before)."""
        shares = None if len(set(rows)) == 1 else [n / sum(rows) for n in rows]
        signatures = [
            tuple((tuple(cut[j].shape), x.dtype) for x, cut in zip(flat, pieces, strict=True))
            for j in range(self.m)
        ]
        if self.stages is None:  # only the compiled shapes
            compiled = tuple((tuple(x), d) for x, d in self.shapes)
            given = tuple((tuple(x.shape), x.dtype) for x in flat)
            if given != compiled:
                raise ConfigError(
                    f"the inputs are {describe(given)}, the pipeline was compiled for "
                    f"{describe(compiled)}"
                )
            return None, shares
        return [self.stages.lowered(s) for s in signatures], shares

    def _micro_batches(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x's M micro-batches on this rank's device: with a mesh, this rank's dp slice of
        each (`_slices`)."""
        if self.dp == 1:
            return list(to_device(x, self.device).tensor_split(self.m))
        return [to_device(c, self.device) for c in self._slices(x)]

    def _slices(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x's M micro-batches where it is: with a mesh, this rank's dp slice of each
        (micro-batch j, slice d: rows of split j of M, then split d of dp)."""
        return [c.tensor_split(self.dp)[self.dp_index] for c in x.tensor_split(self.m)]

    def check_loss(self, target: Any, batch: Batch | None = None) -> None:
        """Once, on every rank alike: loss_fn on the model's output for one micro-batch as
        meta tensors (no memory, no values; at the shapes of `batch`'s first micro-batch
        where they are known) and the target's first micro-batch must give a real scalar. A
        loss_fn that cannot run on the meta device is left to the stage that computes the
        loss.

        Raises:
            ConfigError: the loss is not a real scalar tensor, naming what it is.
        """
        if self._loss_checked:
            return
        shaped = None if batch is None or not batch.shaped else batch.shaped[0]
        out = example_output(self.gm, shapes=None if shaped is None else shaped.specs)
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
