"""Workloads: a model with its inputs, loss and synthetic data, and the factory protocol.

The CLI (`graphpipe plan MODEL`, `graphpipe run MODEL`) and the examples load a `Workload` from
a MODEL string, in one of two forms:

    models.mmt                 a module exposing  workload(preset="tiny", **options)
    path/to/file.py:make_it    a function in a file, called as  make_it(preset, **options)

Both return a `Workload`. The factory protocol:

- `preset` is a name the factory knows; every model in `models/` has "tiny" (tests, a few
  seconds), "cpu" (example runs, about a minute on 2 cores) and "paper" (the sizes in the
  GraphPipe paper; for planning and simulation, too big to run on a CPU).
- `**options` are model-specific (e.g. `branches=4`); unknown options raise `ConfigError`.
- The factory is deterministic: the same preset, options and `seed` build the same weights on
  every rank, without touching the global RNG.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.tracing.tracer import LeafSpec

__all__ = ["Workload", "find_workload", "load_workload"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
BatchFn = Callable[[torch.Generator], tuple[tuple[torch.Tensor, ...], torch.Tensor]]


@dataclass
class Workload:
    """Everything needed to plan and train one model on synthetic data."""

    name: str  # short name, e.g. "mmt"
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]  # one mini-batch of positional inputs (dim 0)
    loss_fn: LossFn  # (model output, target) -> scalar, mean over the batch
    make_batch: BatchFn  # a fresh mini-batch (inputs, target) of the example's shapes
    leaf_modules: Sequence[LeafSpec] = ()  # module types/paths to trace as single nodes
    micro_batches: int = 4  # the default M for this preset
    description: str = ""  # one line for tables and --help
    options: dict[str, Any] = field(default_factory=dict)  # the preset and options used

    @property
    def batch_size(self) -> int:
        """Samples per mini-batch."""
        return int(self.example_inputs[0].shape[0])


def load_workload(spec: str, preset: str = "tiny", **options: Any) -> Workload:
    """Build a Workload from `module.path` or `file.py:function` (see the module docstring).

    Raises:
        ConfigError: the module, file or function does not exist, or it did not return a
            Workload.
    """
    factory = _factory(spec)
    try:
        result = factory(preset, **options)
    except TypeError as exc:
        raise ConfigError(f"{spec}: bad preset or options {options}: {exc}") from exc
    if not isinstance(result, Workload):
        raise ConfigError(f"{spec} returned {type(result).__name__}, expected a Workload")
    return result


def find_workload(spec: str) -> Callable[..., Any]:
    """The factory `spec` names, imported but not called: a cheap check of a model argument.

    Raises:
        ConfigError: the module, file or function does not exist.
    """
    return _factory(spec)


def _factory(spec: str) -> Callable[..., Any]:
    if ":" in spec:
        path, _, name = spec.rpartition(":")
        module = _module_from_file(Path(path))
    else:
        name = "workload"
        try:
            module = importlib.import_module(spec)
        except ImportError as exc:
            raise ConfigError(
                f"cannot import {spec!r} ({exc}); give a module path such as models.mmt "
                "(run from the directory that holds it) or path/to/file.py:function"
            ) from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{spec}: no callable {name!r} in {module.__name__}")
    if not inspect.signature(fn).parameters:
        raise ConfigError(f"{spec}: {name}() must take the preset name as its first argument")
    return fn


def _module_from_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"model file {str(path)!r} does not exist")
    name = f"_graphpipe_workload_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
