"""N-branch: N parallel transformer encoders over the same input, summed.

The synthetic model of the GraphPipe paper's branch-count sweep. Every branch runs `layers`
encoder layers over the same x (B, seq, hidden) and mean-pools over the sequence. The branch
vectors are summed and a Linear classifies them. With `branches` N, a sequential pipeline
serialises N identical branches, while graph pipelining runs them side by side.

Presets (options in `PRESETS`; any can be overridden, e.g. `branches=8`):
    tiny    2 branches × 1 layer, hidden 16, batch 8: tests
    cpu     4 branches × 2 layers, hidden 64, batch 32: example runs on 2 CPU cores
    paper   16 branches × 4 layers, hidden 1024, 16 heads, FFN 4096, seq 256, batch 64: built
            on the meta device, for planning only

    graphpipe plan models.nbranch --devices 8
    graphpipe plan models.nbranch --preset paper -o branches=8 --devices 32
    python -m models.nbranch --devices 2
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
    encoder_stack,
    preset_options,
    projection,
    run_example,
)

__all__ = ["PRESETS", "NBranch", "NBranchConfig", "workload"]

# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(branches=2, seq=8, hidden=16, heads=2, ffn=32, layers=1, classes=4, batch=8,
                 micro_batches=2),
    "cpu": dict(branches=4, seq=16, hidden=64, heads=4, ffn=128, layers=2, classes=10,
                batch=32, micro_batches=4),
    "paper": dict(branches=16, seq=256, hidden=1024, heads=16, ffn=4096, layers=4, classes=1000,
                  batch=64, micro_batches=8),
}
# fmt: on


@dataclass(frozen=True)
class NBranchConfig:
    """The options of a preset."""

    branches: int  # parallel encoder branches
    seq: int  # sequence length
    hidden: int  # model width, also the input's feature width
    heads: int  # attention heads
    ffn: int  # feed-forward width
    layers: int  # encoder layers per branch
    classes: int  # output classes
    batch: int  # samples per mini-batch
    micro_batches: int  # default micro-batches per mini-batch


class NBranch(nn.Module):
    """`branches` encoder stacks over the same input, mean-pooled, summed, then a Linear."""

    def __init__(self, cfg: NBranchConfig):
        super().__init__()
        self.branches = nn.ModuleList(
            encoder_stack(cfg.hidden, cfg.heads, cfg.ffn, cfg.layers) for _ in range(cfg.branches)
        )
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = [branch(x).mean(1) for branch in self.branches]  # (B, hidden) each
        return self.head(torch.stack(pooled).sum(0))  # (B, hidden) -> (B, classes)


def _teacher(cfg: NBranchConfig, gen: torch.Generator) -> Teacher:
    """The class is the argmax of a fixed projection of the sequence mean of x."""
    weight = projection(gen, cfg.hidden, cfg.classes)  # (hidden, classes)

    def label(inputs: Inputs) -> torch.Tensor:
        return (inputs[0].mean(1) @ weight).argmax(1)  # (B,) int64

    return label


def workload(preset: str = "tiny", *, seed: int = 0, **options: Any) -> Workload:
    """Build the N-branch workload (see the module docstring for the presets).

    Args:
        preset: "tiny", "cpu" or "paper".
        seed: Seeds the weights, the example inputs and the teacher.
        **options: Overrides of the preset's values (the fields of `NBranchConfig`).

    Raises:
        ConfigError: an unknown preset or option, or an invalid value.
    """
    options = preset_options("nbranch", PRESETS, preset, options)
    cfg = NBranchConfig(**options)
    recipe = Recipe(
        name="nbranch",
        model=partial(NBranch, cfg),
        specs=[InputSpec((cfg.batch, cfg.seq, cfg.hidden))],
        teacher=partial(_teacher, cfg),
        loss_fn=F.cross_entropy,
        micro_batches=cfg.micro_batches,
        description=f"{cfg.branches} parallel transformer branches × {cfg.layers} layers",
    )
    return build_workload(recipe, preset, seed, options)


if __name__ == "__main__":
    run_example("models.nbranch")
