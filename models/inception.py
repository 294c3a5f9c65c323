"""Inception: an Inception-style CNN, four parallel branches in every block.

A stem of `ConvBNReLU`s, then `blocks` Inception blocks. Each block runs four branches on the
same input (1x1; 1x1 -> 3x3; 1x1 -> 3x3 -> 3x3; 3x3 max-pool -> 1x1) and concatenates them on
channels. The blocks form stages of `widths[s]` output channels, with a stride-2 max-pool
between stages; then adaptive average pooling and a Linear classify (cross-entropy loss).
`ConvBNReLU` is in `leaf_modules`, so each is one node of the op graph.

BatchNorm couples the samples of a batch: pipelined training matches single-process training
with gradient accumulation over the same micro-batches, not one full-batch step.

Presets (options in `PRESETS`; any can be overridden, e.g. `blocks=3`):
    tiny    16×16 images, 2 blocks of 16 and 32 channels, batch 8: tests
    cpu     32×32 images (8×8 after the stem), 6 blocks of 32, 64 and 128 channels, batch 32:
            example runs on 2 CPU cores
    paper   299×299 images (75×75 after the stem), 9 blocks of 288, 768 and 2048 channels
            (Inception-v3-like), batch 64: built on the meta device, for planning only

    graphpipe plan models.inception --devices 8
    python -m models.inception --devices 2
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphpipe.errors import ConfigError
from graphpipe.tools.workload import Workload
from models._common import (
    Inputs,
    InputSpec,
    Recipe,
    Teacher,
    build_workload,
    preset_options,
    projection,
    run_example,
)

__all__ = ["PRESETS", "ConvBNReLU", "Inception", "InceptionConfig", "workload"]

# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(image=16, stem=8, stem_stride=1, widths=(16, 32), blocks=2, classes=4,
                 batch=8, micro_batches=2),
    "cpu": dict(image=32, stem=16, stem_stride=2, widths=(32, 64, 128), blocks=6, classes=10,
                batch=32, micro_batches=4),
    "paper": dict(image=299, stem=192, stem_stride=2, widths=(288, 768, 2048), blocks=9,
                  classes=1000, batch=64, micro_batches=8),
}
# fmt: on


@dataclass(frozen=True)
class InceptionConfig:
    """The options of a preset."""

    image: int  # height and width of the RGB input images
    stem: int  # output channels of the stem
    stem_stride: int  # the stem shrinks the image by stem_stride ** 2 (1: not at all)
    widths: tuple[int, ...]  # output channels of the blocks of each stage (at least 4)
    blocks: int  # Inception blocks, split evenly over the stages
    classes: int  # output classes
    batch: int  # samples per mini-batch
    micro_batches: int  # default micro-batches per mini-batch


class ConvBNReLU(nn.Module):
    """Conv2d (no bias, 'same' padding) + BatchNorm2d + ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))  # (B, c_out, H / stride, W / stride)


class InceptionBlock(nn.Module):
    """Four branches over the same input, concatenated: (B, c_in, H, W) -> (B, c_out, H, W)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        b = c_out // 4  # channels of each of the first three branches
        r = max(1, 3 * b // 4)  # 1x1 reduction ahead of the 3x3s, as in Inception-v3
        self.one = ConvBNReLU(c_in, b, 1)
        self.three = nn.Sequential(ConvBNReLU(c_in, r, 1), ConvBNReLU(r, b, 3))
        self.five = nn.Sequential(  # a 5x5 field of view, factorised as in Inception-v3
            ConvBNReLU(c_in, r, 1), ConvBNReLU(r, b, 3), ConvBNReLU(b, b, 3)
        )
        self.pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), ConvBNReLU(c_in, c_out - 3 * b, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = [self.one(x), self.three(x), self.five(x), self.pool(x)]  # (B, ~c_out/4, H, W)
        return torch.cat(branches, 1)  # (B, c_out, H, W)


class Inception(nn.Module):
    """Stem, Inception blocks in stages (a stride-2 max-pool between), pool, Linear."""

    def __init__(self, cfg: InceptionConfig):
        super().__init__()
        half, s = max(1, cfg.stem // 2), cfg.stem_stride
        shrink = [nn.MaxPool2d(3, s, 1)] if s > 1 else []
        self.stem = nn.Sequential(ConvBNReLU(3, half, 3, s), *shrink, ConvBNReLU(half, cfg.stem, 3))
        self.blocks = nn.Sequential(*_stages(cfg))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(cfg.widths[-1], cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))  # (B, 3, H, W) -> (B, widths[-1], H', W')
        return self.head(self.pool(h).flatten(1))  # (B, widths[-1]) -> (B, classes)


def _stages(cfg: InceptionConfig) -> list[nn.Module]:
    """The Inception blocks, with a stride-2 max-pool wherever a new stage begins."""
    layers: list[nn.Module] = []
    c_in, stage = cfg.stem, 0
    for i in range(cfg.blocks):
        if i * len(cfg.widths) // cfg.blocks > stage:  # a new stage: halve the image
            stage = i * len(cfg.widths) // cfg.blocks
            layers.append(nn.MaxPool2d(3, 2, 1))
        layers.append(InceptionBlock(c_in, cfg.widths[stage]))
        c_in = cfg.widths[stage]
    return layers


def _check(cfg: InceptionConfig) -> None:
    """Raise `ConfigError` unless every block has 4 branches and every stage a block."""
    problems = []
    if min(cfg.widths) < 4:
        problems.append(f"widths={cfg.widths}: each must be at least 4, one per branch")
    if cfg.blocks < len(cfg.widths):
        problems.append(f"blocks={cfg.blocks} is fewer than the stages of widths={cfg.widths}")
    if problems:
        raise ConfigError("inception: invalid options", problems)


def _teacher(cfg: InceptionConfig, gen: torch.Generator) -> Teacher:
    """The class is the argmax of a fixed projection of the image's mean colour."""
    weight = projection(gen, 3, cfg.classes)  # (3, classes)

    def label(inputs: Inputs) -> torch.Tensor:
        return (inputs[0].mean((2, 3)) @ weight).argmax(1)  # (B,) int64

    return label


def workload(preset: str = "tiny", *, seed: int = 0, **options: Any) -> Workload:
    """Build the Inception workload (see the module docstring for the presets).

    Args:
        preset: "tiny", "cpu" or "paper".
        seed: Seeds the weights, the example inputs and the teacher.
        **options: Overrides of the preset's values (the fields of `InceptionConfig`).

    Raises:
        ConfigError: an unknown preset or option, or an invalid value.
    """
    options = preset_options("inception", PRESETS, preset, options)
    cfg = InceptionConfig(**options)
    _check(cfg)
    recipe = Recipe(
        name="inception",
        model=partial(Inception, cfg),
        specs=[InputSpec((cfg.batch, 3, cfg.image, cfg.image))],
        teacher=partial(_teacher, cfg),
        loss_fn=F.cross_entropy,
        micro_batches=cfg.micro_batches,
        description=f"Inception-style CNN, {cfg.blocks} blocks of 4 branches",
        leaf_modules=(ConvBNReLU,),
    )
    return build_workload(recipe, preset, seed, options)


if __name__ == "__main__":
    run_example("models.inception")
