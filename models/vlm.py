"""VLM: a vision-language model as LLaVA builds it: a vision encoder, a projector, a decoder.

Each sample holds `images` images, each as `patches` rows of `patch_dim` pixels (a ViT's
patches, flattened), and `text` tokens. The vision encoder (a ViT: patch embedding, position
embedding, `vision_layers` encoder layers) runs on every image; a two-layer MLP projector
(LLaVA-1.5's) maps its patch features, `merge` neighbouring patches at a time (1 in LLaVA,
4 in Qwen2-VL's merger), to the decoder's width, and those image tokens are
merged into the text: the decoder reads the images' tokens, then the text's (LLaVA's prompt
with the image first), through `layers` causal layers and an LM head over the text positions.
With `frozen=True` the encoder takes no gradient (LLaVA's recipe trains the projector and
the decoder): graphpipe then runs a stage holding only encoder ops forward only.

The encoder's ops are a branch beside the text embedding until the merge, so with several
images or a large encoder the graph planner can run the encoder on its own devices beside
the decoder's first stage, where a sequential pipeline puts it all on stage 0 (torchtitan).

Presets (options in `PRESETS`; any can be overridden, e.g. `images=4`, `frozen=True`):
    tiny    1 image of 4 patches, widths 16, 1 + 2 layers, batch 8: tests
    cpu     2 images of 16 patches, widths 64, 2 + 4 layers, batch 16: runs on 2 CPU cores
    paper   LLaVA-1.5-7B's sizes: a ViT-L/14 at 336 px (576 patches, 1024 wide, 24 layers,
            0.3 B parameters) and a 7 B-class decoder (4096 wide, 32 layers, 32 heads),
            512 text tokens, batch 64, on the meta device for planning only

    graphpipe plan models.vlm --devices 4
    graphpipe plan models.vlm --preset paper --devices 16 -o images=4 -o frozen=True
    python -m models.vlm --devices 2
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
    encoder_stack,
    preset_options,
    projection,
    run_example,
)

__all__ = ["PRESETS", "VLM", "VLMConfig", "workload"]

# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(images=1, patches=4, patch_dim=12, vision_hidden=16, vision_heads=2,
                 vision_ffn=32, vision_layers=1, merge=1, hidden=16, heads=2, ffn=32,
                 layers=2, vocab=32, text=8, batch=8, micro_batches=4, frozen=False),
    "cpu": dict(images=2, patches=16, patch_dim=48, vision_hidden=64, vision_heads=4,
                vision_ffn=128, vision_layers=2, merge=4, hidden=64, heads=4, ffn=128,
                layers=4, vocab=256, text=32, batch=16, micro_batches=4, frozen=False),
    "paper": dict(images=1, patches=576, patch_dim=588, vision_hidden=1024, vision_heads=16,
                  vision_ffn=4096, vision_layers=24, merge=1, hidden=4096, heads=32,
                  ffn=16384, layers=32, vocab=32000, text=512, batch=64, micro_batches=8,
                  frozen=False),
}
# fmt: on


@dataclass(frozen=True)
class VLMConfig:
    """The options of a preset."""

    images: int  # images per sample
    patches: int  # patch rows per image (a ViT's tokens)
    patch_dim: int  # pixels per patch (channels x patch x patch)
    vision_hidden: int  # the encoder's width
    vision_heads: int
    vision_ffn: int
    vision_layers: int
    merge: int  # patches pooled into one image token (Qwen2-VL's 2 x 2 merger: 4)
    hidden: int  # the decoder's width
    heads: int
    ffn: int
    layers: int  # decoder layers
    vocab: int
    text: int  # text tokens per sample
    batch: int  # samples per mini-batch
    micro_batches: int  # default micro-batches per mini-batch
    frozen: bool  # the vision encoder takes no gradient

    @property
    def image_tokens(self) -> int:
        """Image tokens per sample, merged ahead of the text."""
        return self.images * (self.patches // self.merge)


class VisionEncoder(nn.Module):
    """A ViT over patch rows: (n, patches, patch_dim) -> (n, patches, vision_hidden)."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.patch = nn.Linear(cfg.patch_dim, cfg.vision_hidden)
        self.position = nn.Parameter(0.02 * torch.randn(1, cfg.patches, cfg.vision_hidden))
        h, heads, ffn = cfg.vision_hidden, cfg.vision_heads, cfg.vision_ffn
        self.layers = encoder_stack(h, heads, ffn, cfg.vision_layers)
        self.norm = nn.LayerNorm(cfg.vision_hidden)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layers(self.patch(patches) + self.position))


class VLM(nn.Module):
    """The encoder, the projector and a causal decoder reading image tokens then text."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionEncoder(cfg)
        self.projector = nn.Sequential(  # `merge` neighbouring patches in, one token out
            nn.Linear(cfg.vision_hidden * cfg.merge, cfg.hidden),
            nn.GELU(),
            nn.Linear(cfg.hidden, cfg.hidden),
        )
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.decoder = encoder_stack(cfg.hidden, cfg.heads, cfg.ffn, cfg.layers)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab)
        length = cfg.image_tokens + cfg.text
        causal = torch.full((length, length), float("-inf")).triu(1)
        self.register_buffer("causal", causal, persistent=False)
        if cfg.frozen:
            self.vision.requires_grad_(False)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # sizes from the config, the batch as -1: a size read off an input (b =
        # images.shape[0]) used before and after the encoder would bind it all to one stage
        cfg = self.cfg
        patches = images.reshape(-1, cfg.patches, cfg.patch_dim)
        seen = self.vision(patches)  # (b * images, patches, vision_hidden)
        pooled = seen.reshape(-1, cfg.image_tokens, cfg.merge * cfg.vision_hidden)
        merged = torch.cat([self.projector(pooled), self.embed(tokens)], 1)
        x = merged  # (b, image tokens + text, hidden), the image first
        for layer in self.decoder:
            x = layer(x, src_mask=self.causal, is_causal=True)
        return self.head(self.norm(x[:, cfg.image_tokens :]))  # (b, text, vocab)


def _teacher(cfg: VLMConfig, gen: torch.Generator) -> Teacher:
    """Each next token is the current one shifted by 1 or 2, as the images say (the sign of
    a fixed projection of their mean patch)."""
    weight = projection(gen, cfg.patch_dim, 1)

    def label(inputs: Inputs) -> torch.Tensor:
        images, tokens = inputs
        shift = 1 + (images.mean((1, 2)) @ weight > 0).long()  # (B, 1)
        return (tokens + shift) % cfg.vocab  # (B, text)

    return label


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every text position."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def workload(preset: str = "tiny", *, seed: int = 0, **options: Any) -> Workload:
    """Build the VLM workload (see the module docstring for the presets).

    Args:
        preset: "tiny", "cpu" or "paper".
        seed: Seeds the weights, the example inputs and the teacher.
        **options: Overrides of the preset's values (the fields of `VLMConfig`).

    Raises:
        ConfigError: an unknown preset or option, or an invalid value.
    """
    options = preset_options("vlm", PRESETS, preset, options)
    cfg = VLMConfig(**options)
    if cfg.patches % cfg.merge:
        raise ConfigError(f"vlm: merge={cfg.merge} does not divide patches={cfg.patches}")
    frozen = cfg.frozen
    recipe = Recipe(
        name="vlm",
        model=partial(VLM, cfg),
        specs=[
            InputSpec((cfg.batch, cfg.images, cfg.patches, cfg.patch_dim)),
            InputSpec((cfg.batch, cfg.text), high=cfg.vocab),
        ],
        teacher=partial(_teacher, cfg),
        loss_fn=lm_loss,
        micro_batches=cfg.micro_batches,
        description=(
            f"vision-language model, {cfg.images} image(s) x {cfg.patches} patches, "
            f"encoder {cfg.vision_layers} layers{' (frozen)' if frozen else ''}, "
            f"decoder {cfg.layers} layers"
        ),
    )
    return build_workload(recipe, preset, seed, options)


if __name__ == "__main__":
    run_example("models.vlm")
