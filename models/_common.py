"""Helpers shared by the example models: presets, deterministic building, synthetic data.

Every model builds its modules inside `seeded(seed)` and its data with `synthetic_data`, so the
same preset, options and seed give the same weights and batches in any process, and the global
RNG is never touched.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.tools.workload import BatchFn, Workload

Inputs = tuple[torch.Tensor, ...]
Teacher = Callable[[Inputs], torch.Tensor]  # inputs -> target: the function to be learnt

_TEACHER_SALT = 0x7E4C4E5  # keeps the teacher's random stream apart from the data's


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU RNG seeded with `seed`, restoring the global RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)  # torch.manual_seed would reseed CUDA too
        yield


def preset_options(
    name: str, presets: Mapping[str, Mapping[str, Any]], preset: str, options: Mapping[str, Any]
) -> dict[str, Any]:
    """Merge a preset with user options, and check them.

    Args:
        name: The model's name, for messages.
        presets: The model's presets, by name; each lists every option the model knows.
        preset: The preset chosen.
        options: User overrides of the preset's values.

    Returns:
        The preset's options updated with `options` (lists made tuples).

    Raises:
        ConfigError: the preset or an option is unknown, an integer option is not positive,
            a flag (a preset's bool) is not a bool, or `batch` does not split into
            `micro_batches`.
    """
    if preset not in presets:
        raise ConfigError(f"{name}: unknown preset {preset!r}; known presets: {', '.join(presets)}")
    known = presets[preset]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"{name}: unknown option(s) {', '.join(unknown)}; known options: {', '.join(known)}"
        )
    merged: dict[str, Any] = {**known, **options}
    merged.update([(key, tuple(v)) for key, v in merged.items() if isinstance(v, list)])
    problems = [
        f"{key}={value!r} must be a positive integer or a tuple of them"
        if not isinstance(known[key], bool)
        else f"{key}={value!r} must be True or False"
        for key, value in merged.items()
        if not (_positive_ints(value) if not isinstance(known[key], bool) else _bool(value))
    ]
    if not problems and merged["batch"] % merged["micro_batches"]:
        problems.append(
            f"batch={merged['batch']} does not split into micro_batches={merged['micro_batches']}"
        )
    if problems:
        raise ConfigError(f"{name}: invalid options", problems)
    return merged


def _bool(value: Any) -> bool:
    return isinstance(value, bool)


def _positive_ints(value: Any) -> bool:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return bool(values) and all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values
    )


def cyclic(values: Sequence[int], n: int) -> list[int]:
    """The first `n` items of `values` repeated: `cyclic((3, 5), 3) == [3, 5, 3]`."""
    return [values[i % len(values)] for i in range(n)]


def mlp(widths: Sequence[int], last_relu: bool = True) -> nn.Sequential:
    """Linear layers `widths[0] -> widths[1] -> ...`, each followed by a ReLU.

    Args:
        widths: Input width, then the width of every layer.
        last_relu: Whether the last layer has a ReLU too (False for a logit or regression head).
    """
    layers: list[nn.Module] = []
    for i, (w_in, w_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(w_in, w_out))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def encoder_stack(hidden: int, heads: int, ffn: int, layers: int) -> nn.Sequential:
    """`layers` transformer encoder layers (batch first, no dropout); (B, T, hidden) -> same.

    Raises:
        ConfigError: `hidden` is not a multiple of `heads`.
    """
    if hidden % heads:
        raise ConfigError(f"hidden={hidden} is not a multiple of heads={heads}")
    return nn.Sequential(
        *(
            nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
    )


@dataclass(frozen=True)
class InputSpec:
    """One model input: standard-normal floats, or int64 indices in [0, high) when high > 0."""

    shape: tuple[int, ...]  # dim 0 is the batch
    high: int = 0

    def draw(self, gen: torch.Generator) -> torch.Tensor:
        """A random tensor of this spec, drawn from `gen`."""
        if self.high:
            return torch.randint(0, self.high, self.shape, generator=gen)
        return torch.randn(self.shape, generator=gen)

    def empty_meta(self) -> torch.Tensor:
        """An uninitialised tensor of this spec on the meta device."""
        dtype = torch.int64 if self.high else torch.float32
        return torch.empty(self.shape, dtype=dtype, device="meta")


def projection(gen: torch.Generator, n_in: int, n_out: int) -> torch.Tensor:
    """A fixed random matrix (n_in, n_out) that keeps unit-variance inputs at unit variance."""
    return torch.randn(n_in, n_out, generator=gen) / n_in**0.5


def synthetic_data(
    name: str,
    specs: Sequence[InputSpec],
    make_teacher: Callable[[torch.Generator], Teacher],
    seed: int,
    meta: bool,
) -> tuple[Inputs, BatchFn]:
    """Example inputs and a `make_batch` that labels random inputs with a fixed teacher.

    Args:
        name: The model's name, for messages.
        specs: The model's positional inputs.
        make_teacher: Builds, from a generator for its fixed random weights, the teacher: the
            function from a batch of inputs to its target that the model is to learn.
        seed: Seeds the example inputs and the teacher.
        meta: Build the example inputs on the meta device; `make_batch` then raises.

    Returns:
        `(example_inputs, make_batch)`.
    """
    if meta:

        def planning_only(gen: torch.Generator) -> tuple[Inputs, torch.Tensor]:
            raise ConfigError(
                f"{name}: the paper preset lives on the meta device and is for planning only; "
                "use the tiny or cpu preset to train"
            )

        return tuple(spec.empty_meta() for spec in specs), planning_only

    teacher = make_teacher(torch.Generator().manual_seed(seed + _TEACHER_SALT))

    def make_batch(gen: torch.Generator) -> tuple[Inputs, torch.Tensor]:
        inputs = tuple(spec.draw(gen) for spec in specs)
        return inputs, teacher(inputs)

    return make_batch(torch.Generator().manual_seed(seed))[0], make_batch


@dataclass(frozen=True)
class Recipe:
    """What a model module hands `build_workload`: everything that differs per model."""

    name: str  # the model's short name
    model: Callable[[], nn.Module]  # builds the model (called seeded, on the right device)
    specs: Sequence[InputSpec]  # its inputs
    teacher: Callable[[Inputs], torch.Tensor]  # the fixed function the target comes from
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    micro_batches: int
    description: str
    leaf_modules: tuple[type, ...] = ()


def build_workload(recipe: Recipe, preset: str, seed: int, options: dict[str, Any]) -> Workload:
    """The Workload of a recipe: the paper preset on the meta device, the others on the CPU."""
    paper = preset == "paper"
    with seeded(seed), torch.device("meta" if paper else "cpu"):
        model = recipe.model()
    inputs, make_batch = synthetic_data(recipe.name, recipe.specs, recipe.teacher, seed, meta=paper)
    return Workload(
        name=recipe.name,
        model=model,
        example_inputs=inputs,
        loss_fn=recipe.loss_fn,
        make_batch=make_batch,
        leaf_modules=recipe.leaf_modules,
        micro_batches=recipe.micro_batches,
        description=recipe.description,
        options=options,
    )


def run_example(module: str) -> None:
    """`python -m models.<name> [options]`: `graphpipe run models.<name> [options]`.

    Options: --devices N (default 2), --preset (default cpu), --schedule, --weights, --steps,
    --micro-batches, --out; `graphpipe run --help` lists them all.
    """
    import sys

    from graphpipe.tools.cli import main

    sys.exit(main(["run", module, *sys.argv[1:]]))
