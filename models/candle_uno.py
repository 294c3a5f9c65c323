"""CANDLE-Uno: drug-response regression from several feature towers.

Each input (B, features[i]) (cell-line expression, drug descriptors, drug fingerprints, ...) goes
through its own tower of `depth` × Dense(width) + ReLU. The tower outputs are concatenated, then
`top_depth` × Dense(width) + ReLU and Dense(1) predict the response (MSE loss). The towers are
independent, so graph pipelining runs them as concurrent stages.

Presets (options in `PRESETS`; any can be overridden, e.g. `towers=4`):
    tiny    7 towers of 4 × 16, batch 8: tests
    cpu     7 towers of 4 × 256, batch 64: example runs on 2 CPU cores
    paper   7 towers of 4 × 4096 over 942 to 5270 features, 2 × 4096 on top, batch 512: the
            GraphPipe paper's CANDLE-Uno, built on the meta device, for planning only

    graphpipe plan models.candle_uno --devices 8
    python -m models.candle_uno --devices 2
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphpipe.tools.workload import Workload
from models._common import (
    Inputs,
    InputSpec,
    Recipe,
    Teacher,
    build_workload,
    cyclic,
    mlp,
    preset_options,
    projection,
    run_example,
)

__all__ = ["PRESETS", "CandleUno", "UnoConfig", "workload"]

# The paper's features are Uno-like: cell RNA-seq (942), and the descriptors (5270) and
# fingerprints (2048) of two drugs, and two more feature sets.
# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(towers=7, features=(6, 10, 8, 12), width=16, depth=4, top_depth=2, batch=8,
                 micro_batches=2),
    "cpu": dict(towers=7, features=(64, 96, 128, 48), width=256, depth=4, top_depth=2, batch=64,
                micro_batches=4),
    "paper": dict(towers=7, features=(942, 5270, 2048, 5270, 2048, 1000, 3000), width=4096,
                  depth=4, top_depth=2, batch=512, micro_batches=8),
}
# fmt: on


@dataclass(frozen=True)
class UnoConfig:
    """The options of a preset."""

    towers: int  # feature towers, one input each
    features: tuple[int, ...]  # input width per tower, repeated when there are more towers
    width: int  # width of every Dense layer
    depth: int  # Dense + ReLU layers per tower
    top_depth: int  # Dense + ReLU layers after the concatenation, before Dense(1)
    batch: int  # samples per mini-batch
    micro_batches: int  # default micro-batches per mini-batch

    @property
    def tower_features(self) -> list[int]:
        """The input width of each tower."""
        return cyclic(self.features, self.towers)


class CandleUno(nn.Module):
    """One MLP tower per input, concatenated, then an MLP regression head."""

    def __init__(self, cfg: UnoConfig):
        super().__init__()
        self.towers = nn.ModuleList(
            mlp([feat, *[cfg.width] * cfg.depth]) for feat in cfg.tower_features
        )
        self.top = mlp([cfg.towers * cfg.width, *[cfg.width] * cfg.top_depth, 1], last_relu=False)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        # index, not zip: torch.fx cannot iterate over the traced *inputs
        towers = [tower(inputs[i]) for i, tower in enumerate(self.towers)]  # (B, width) each
        return self.top(torch.cat(towers, 1))  # (B, towers * width) -> (B, 1)


def _teacher(cfg: UnoConfig, gen: torch.Generator) -> Teacher:
    """The response is a fixed projection of all the features (unit variance)."""
    weight = projection(gen, sum(cfg.tower_features), 1)  # (sum(features), 1)

    def response(inputs: Inputs) -> torch.Tensor:
        return torch.cat(inputs, 1) @ weight  # (B, 1)

    return response


def workload(preset: str = "tiny", *, seed: int = 0, **options: Any) -> Workload:
    """Build the CANDLE-Uno workload (see the module docstring for the presets).

    Args:
        preset: "tiny", "cpu" or "paper".
        seed: Seeds the weights, the example inputs and the teacher.
        **options: Overrides of the preset's values (the fields of `UnoConfig`).

    Raises:
        ConfigError: an unknown preset or option, or an invalid value.
    """
    options = preset_options("candle_uno", PRESETS, preset, options)
    cfg = UnoConfig(**options)
    recipe = Recipe(
        name="candle_uno",
        model=partial(CandleUno, cfg),
        specs=[InputSpec((cfg.batch, feat)) for feat in cfg.tower_features],
        teacher=partial(_teacher, cfg),
        loss_fn=F.mse_loss,
        micro_batches=cfg.micro_batches,
        description=f"CANDLE-Uno, {cfg.towers} towers of {cfg.depth} × Dense({cfg.width})",
    )
    return build_workload(recipe, preset, seed, options)


if __name__ == "__main__":
    run_example("models.candle_uno")
