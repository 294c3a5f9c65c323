"""DLRM: a deep learning recommendation model with dense MLP and embedding-bag branches.

Inputs: `dense` floats (B, dense_branches, dense_in) and `sparse` int64 indices (B, tables, bag).
Each dense branch is an MLP over `dense[:, i]` ending at width `dim`; each table is an
`nn.EmbeddingBag` (sum) over the `bag` indices `sparse[:, t]`. The interaction stacks all
features (B, F, dim), takes their pairwise dot products and keeps the strict upper triangle;
that and the dense vectors feed the top MLP, which gives one click logit (BCE-with-logits loss).
The int64 indices test integer tensors crossing stage boundaries.

Presets (options in `PRESETS`; any can be overridden, e.g. `tables=4`):
    tiny    2 dense branches, 3 tables of 50 rows, batch 8: tests
    cpu     4 dense branches of 3 × 256, 4 tables of 1000 × 32, batch 128: example runs
    paper   7 dense branches of 4 × 4096, 8 tables of 1e6 × 128, bag 32, top MLP 2 × 4096,
            batch 2048: the GraphPipe paper's DLRM, built on the meta device, for planning only

    graphpipe plan models.dlrm --devices 8
    python -m models.dlrm --devices 2
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
    mlp,
    preset_options,
    projection,
    run_example,
)

__all__ = ["DLRM", "PRESETS", "DLRMConfig", "workload"]

# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(dense_branches=2, dense_in=4, depth=2, width=16, tables=3, rows=50, dim=8,
                 bag=4, top=16, top_depth=2, batch=8, micro_batches=2),
    "cpu": dict(dense_branches=4, dense_in=32, depth=3, width=256, tables=4, rows=1000, dim=32,
                bag=8, top=256, top_depth=2, batch=128, micro_batches=4),
    "paper": dict(dense_branches=7, dense_in=512, depth=4, width=4096, tables=8,
                  rows=1_000_000, dim=128, bag=32, top=4096, top_depth=2, batch=2048,
                  micro_batches=8),
}
# fmt: on


@dataclass(frozen=True)
class DLRMConfig:
    """The options of a preset."""

    dense_branches: int  # dense MLP branches
    dense_in: int  # input features of each dense branch
    depth: int  # Linear + ReLU layers of width `width` per dense branch, before one to `dim`
    width: int  # dense branch width
    tables: int  # embedding-bag tables
    rows: int  # rows per table
    dim: int  # embedding width, and the width every dense branch ends at
    bag: int  # indices per table and sample, summed
    top: int  # top MLP width
    top_depth: int  # top MLP Linear + ReLU layers, before the one to the logit
    batch: int  # samples per mini-batch
    micro_batches: int  # default micro-batches per mini-batch


class DLRM(nn.Module):
    """Dense MLP branches and embedding-bag tables, a dot-product interaction, a top MLP."""

    upper_i: torch.Tensor  # buffers: the strict upper triangle of the (F, F) dot products
    upper_j: torch.Tensor

    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        dense = [cfg.dense_in, *[cfg.width] * cfg.depth, cfg.dim]
        self.dense = nn.ModuleList(mlp(dense) for _ in range(cfg.dense_branches))
        tables = [nn.EmbeddingBag(cfg.rows, cfg.dim, mode="sum") for _ in range(cfg.tables)]
        for table in tables:  # the reference DLRM's init; N(0, 1) would swamp the dot products
            nn.init.uniform_(table.weight, -(cfg.rows**-0.5), cfg.rows**-0.5)
        self.tables = nn.ModuleList(tables)
        n = cfg.dense_branches + cfg.tables  # features that interact
        upper_i, upper_j = torch.triu_indices(n, n, offset=1)  # (n(n-1)/2,) each
        self.register_buffer("upper_i", upper_i, persistent=False)
        self.register_buffer("upper_j", upper_j, persistent=False)
        top_in = cfg.dense_branches * cfg.dim + len(upper_i)
        self.top = mlp([top_in, *[cfg.top] * cfg.top_depth, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        dense_out = [branch(dense[:, i]) for i, branch in enumerate(self.dense)]  # (B, dim) each
        sparse_out = [table(sparse[:, t]) for t, table in enumerate(self.tables)]  # (B, dim)
        features = torch.stack(dense_out + sparse_out, 1)  # (B, F, dim)
        dots = torch.bmm(features, features.transpose(1, 2))  # (B, F, F)
        pairs = dots[:, self.upper_i, self.upper_j]  # (B, F(F-1)/2)
        return self.top(torch.cat([*dense_out, pairs], 1))  # (B, 1) logit


def _teacher(cfg: DLRMConfig, gen: torch.Generator) -> Teacher:
    """A click iff a fixed projection of `dense` plus fixed scores of the `sparse` rows > 0."""
    weight = projection(gen, cfg.dense_branches * cfg.dense_in, 1)  # (branches * dense_in, 1)
    row_score = torch.randn(cfg.rows, generator=gen) / (cfg.tables * cfg.bag) ** 0.5  # (rows,)

    def label(inputs: Inputs) -> torch.Tensor:
        dense, sparse = inputs
        score = dense.flatten(1) @ weight + row_score[sparse].sum((1, 2)).unsqueeze(1)  # (B, 1)
        return (score > 0).float()  # (B, 1) in {0, 1}

    return label


def workload(preset: str = "tiny", *, seed: int = 0, **options: Any) -> Workload:
    """Build the DLRM workload (see the module docstring for the presets).

    Args:
        preset: "tiny", "cpu" or "paper".
        seed: Seeds the weights, the example inputs and the teacher.
        **options: Overrides of the preset's values (the fields of `DLRMConfig`).

    Raises:
        ConfigError: an unknown preset or option, or an invalid value.
    """
    options = preset_options("dlrm", PRESETS, preset, options)
    cfg = DLRMConfig(**options)
    recipe = Recipe(
        name="dlrm",
        model=partial(DLRM, cfg),
        specs=[
            InputSpec((cfg.batch, cfg.dense_branches, cfg.dense_in)),
            InputSpec((cfg.batch, cfg.tables, cfg.bag), high=cfg.rows),
        ],
        teacher=partial(_teacher, cfg),
        loss_fn=F.binary_cross_entropy_with_logits,
        micro_batches=cfg.micro_batches,
        description=f"DLRM, {cfg.dense_branches} dense MLP branches and {cfg.tables} tables",
    )
    return build_workload(recipe, preset, seed, options)


if __name__ == "__main__":
    run_example("models.dlrm")
