"""The trace is a claim to check: the traced graph must compute what the model computes.

    verify_trace(model, gm, (args, kwargs))     # TraceError if they differ

A trace is a second program. torch.fx records the Python the model ran; torch.export
records ATen ops under its own rules, and where a model's code asks whether it is being
compiled or exported (Hugging Face's `is_torchdynamo_compiling()`), the exported program may
take another branch than the eager forward: it is then another function, and training it
would train another model without a word. So every trace is run once on the example (the
rows it was traced at) beside the model's own forward, from the same random state, in the
model's own mode (train mode for training), and every output leaf is compared. Where they
differ beyond rounding, `TraceError` names the worst leaf, its shape, the largest difference
and the size of the values, and nothing is trained.

Rounding: `|graph - model| <= atol + rtol * max|model|` per leaf, the tolerances by dtype
(`TOLERANCE`); integer and boolean leaves must be equal. Both runs are under `no_grad`
(an eager forward with autograd would hold its activations), and buffers a forward updates
(BatchNorm's statistics) are put back after each run. A model on the meta device has no
values to compare and is not checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from graphpipe._torch import leaves_with_paths
from graphpipe.errors import TraceError
from graphpipe.tracing.annotate import is_meta, restore, snapshot
from graphpipe.tracing.bind import Args, Kwargs, flat_inputs, model_output

__all__ = ["TOLERANCE", "verify_trace"]

# dtype -> (rtol, atol): rtol against the leaf's largest magnitude, atol absolute
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-4, 1e-6),
    torch.float16: (2e-3, 1e-5),
    torch.bfloat16: (2e-2, 1e-4),
}


def verify_trace(model: nn.Module, gm: fx.GraphModule, inputs: tuple[Args, Kwargs]) -> None:
    """Run `gm` and `model` on `inputs` from the same random state and compare the outputs.

    Args:
        model: The model `gm` was traced from, in the mode it will run in.
        gm: The traced graph (`graphpipe.trace`).
        inputs: The positional and keyword inputs it was traced at (constants included).

    Raises:
        TraceError: the outputs differ in structure, or a leaf differs beyond rounding,
            naming the worst leaf, its shape and dtype, the difference and the values' size.
    """
    if is_meta(model):
        return
    args, kwargs = inputs
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    flat = flat_inputs(gm, *args, **tensors)
    with _same_start(model) as again, torch.no_grad():
        expected = model(*args, **kwargs)
        again()
        got = model_output(gm, fx.Interpreter(gm).run(*flat))
    mode = "train mode" if model.training else "eval mode"
    _compare(f"{type(model).__name__} ({mode})", expected, got)


@contextmanager
def _same_start(model: nn.Module) -> Iterator[Any]:
    """Yield a function that puts the random state and the buffers back as they were at
    entry; both are restored on exit too."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
    saved = snapshot(model)
    with torch.random.fork_rng(devices=devices):
        cpu = torch.get_rng_state()
        cuda = [torch.cuda.get_rng_state(d) for d in devices]

        def again() -> None:
            restore(model, saved)
            torch.set_rng_state(cpu)
            for d, state in zip(devices, cuda, strict=True):
                torch.cuda.set_rng_state(state, d)

        try:
            yield again
        finally:
            restore(model, saved)


def _compare(name: str, expected: Any, got: Any) -> None:
    want, have = leaves_with_paths(expected), leaves_with_paths(got)
    paths = [f"out{p}" for p, _ in want]
    if paths != [f"out{p}" for p, _ in have]:  # by path: fx's immutable_dict is a dict
        raise TraceError(
            f"the traced graph of {name} returns the leaves {[f'out{p}' for p, _ in have]} "
            f"where the model returns {paths}; graphpipe will not train a graph that is not "
            "the model"
        )
    worst: tuple[float, str, str] | None = None
    for path, (_, a), (_, b) in zip(paths, want, have, strict=True):
        excess = _excess(a, b)
        if excess is not None and (worst is None or excess[0] > worst[0]):
            worst = (excess[0], path, excess[1])
    if worst is not None:
        raise TraceError(
            f"the traced graph of {name} does not compute what the model's own forward "
            f"computes on the example (the same random state): the worst output is "
            f"{worst[1]}, {worst[2]}. graphpipe will not train another function than "
            "the model's; docs/failures.md#traces says why a trace can differ and what to do"
        )


def _excess(a: Any, b: Any) -> tuple[float, str] | None:
    """(how far past its tolerance, a description) where leaf `b` differs from `a`."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None if a == b else (float("inf"), f"is {b!r} where the model gives {a!r}")
    what = f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
    if a.shape != b.shape or a.dtype != b.dtype:
        got = f"{str(b.dtype).removeprefix('torch.')}{list(b.shape)}"
        return float("inf"), f"is {got} where the model gives {what}"
    if not a.is_floating_point():
        n = int((a != b).sum())
        return (float("inf"), f"{what}, differs in {n} entries") if n else None
    if a.numel() == 0:
        return None
    rtol, atol = TOLERANCE.get(a.dtype, TOLERANCE[torch.float32])
    a, b = a.detach().double(), b.detach().double()
    gap = (a - b).abs().nan_to_num(nan=float("inf"))
    gap[a.isnan() & b.isnan()] = 0  # NaN where the model gives NaN too
    size = float(a.nan_to_num(nan=0.0).abs().max())
    diff = float(gap.max())
    bound = atol + rtol * size
    if diff <= bound:
        return None
    return (
        diff / bound,
        f"{what}, differs by {diff:.3g} (max abs) where the model's reach {size:.3g}",
    )
