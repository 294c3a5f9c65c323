"""MMT: a multi-modal transformer, one transformer encoder branch per modality.

Each modality m is a sequence of feature vectors (B, seq, features[m]). Its branch embeds them
to `hidden`, adds a learned position embedding, runs `layers` encoder layers and mean-pools
over the sequence. The pooled vectors are concatenated and classified by a two-layer MLP. The
branches are independent until the fusion, so graph pipelining runs them as concurrent stages.

Presets (options in `PRESETS`; any can be overridden, e.g. `branches=3`):
    tiny    2 modalities, hidden 16, 1 layer each, batch 8: tests
    cpu     2 modalities, hidden 64, 2 layers each, batch 32: example runs on 2 CPU cores
    paper   4 modalities × 8 layers, hidden 1024, 16 heads, FFN 4096, seq 256, batch 64: the
            GraphPipe paper's MMT, built on the meta device, for planning only

    graphpipe plan models.mmt --devices 8
    graphpipe plan models.mmt --preset paper --devices 32
    python -m models.mmt --devices 2
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
    encoder_stack,
    mlp,
    preset_options,
    projection,
    run_example,
)

__all__ = ["PRESETS", "MMTConfig", "MultiModalTransformer", "workload"]

# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(branches=2, features=(6, 10), seq=8, hidden=16, heads=2, ffn=32, layers=1,
                 classes=4, batch=8, micro_batches=2),
    "cpu": dict(branches=2, features=(16, 24), seq=16, hidden=64, heads=4, ffn=128, layers=2,
                classes=10, batch=32, micro_batches=4),
    "paper": dict(branches=4, features=(768, 1024, 512, 2048), seq=256, hidden=1024, heads=16,
                  ffn=4096, layers=8, classes=1000, batch=64, micro_batches=8),
}
# fmt: on


@dataclass(frozen=True)
class MMTConfig:
    """The options of a preset."""

    branches: int  # modalities, one input and one encoder branch each
    features: tuple[int, ...]  # input width per modality, repeated when there are more
    seq: int  # sequence length of every modality
    hidden: int  # model width
    heads: int  # attention heads
    ffn: int  # feed-forward width
    layers: int  # encoder layers per branch
    classes: int  # output classes
    batch: int  # samples per mini-batch
    micro_batches: int  # default micro-batches per mini-batch

    @property
    def modality_features(self) -> list[int]:
        """The input width of each modality."""
        return cyclic(self.features, self.branches)


class Modality(nn.Module):
    """One branch: (B, seq, feat) -> embed + position -> encoder layers -> mean -> (B, hidden)."""

    def __init__(self, feat: int, cfg: MMTConfig):
        super().__init__()
        self.embed = nn.Linear(feat, cfg.hidden)
        self.position = nn.Parameter(0.02 * torch.randn(1, cfg.seq, cfg.hidden))
        self.encoder = encoder_stack(cfg.hidden, cfg.heads, cfg.ffn, cfg.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position  # (B, seq, hidden)
        return self.encoder(h).mean(1)  # (B, hidden)


class MultiModalTransformer(nn.Module):
    """One `Modality` branch per input, fused by concatenation and an MLP classifier."""

    def __init__(self, cfg: MMTConfig):
        super().__init__()
        self.branches = nn.ModuleList(Modality(feat, cfg) for feat in cfg.modality_features)
        self.fusion = mlp([cfg.branches * cfg.hidden, cfg.hidden, cfg.classes], last_relu=False)

    def forward(self, *modalities: torch.Tensor) -> torch.Tensor:
        # index, not zip: torch.fx cannot iterate over the traced *modalities
        pooled = [branch(modalities[i]) for i, branch in enumerate(self.branches)]
        return self.fusion(torch.cat(pooled, 1))  # (B, branches * hidden) -> (B, classes)


def _teacher(cfg: MMTConfig, gen: torch.Generator) -> Teacher:
    """The class is the argmax of a fixed projection of the sequence-mean features."""
    weight = projection(gen, sum(cfg.modality_features), cfg.classes)  # (sum(feat), classes)

    def label(inputs: Inputs) -> torch.Tensor:
        means = torch.cat([x.mean(1) for x in inputs], 1)  # (B, sum(feat))
        return (means @ weight).argmax(1)  # (B,) int64

    return label


def workload(preset: str = "tiny", *, seed: int = 0, **options: Any) -> Workload:
    """Build the MMT workload (see the module docstring for the presets).

    Args:
        preset: "tiny", "cpu" or "paper".
        seed: Seeds the weights, the example inputs and the teacher.
        **options: Overrides of the preset's values (the fields of `MMTConfig`).

    Raises:
        ConfigError: an unknown preset or option, or an invalid value.
    """
    options = preset_options("mmt", PRESETS, preset, options)
    cfg = MMTConfig(**options)
    recipe = Recipe(
        name="mmt",
        model=partial(MultiModalTransformer, cfg),
        specs=[InputSpec((cfg.batch, cfg.seq, feat)) for feat in cfg.modality_features],
        teacher=partial(_teacher, cfg),
        loss_fn=F.cross_entropy,
        micro_batches=cfg.micro_batches,
        description=f"multi-modal transformer, {cfg.branches} branches × {cfg.layers} layers",
    )
    return build_workload(recipe, preset, seed, options)


if __name__ == "__main__":
    run_example("models.mmt")
