"""Multi-modal Hugging Face models at tiny sizes (random weights, built offline from configs):
the families graph pipelining exists for.

- llava: image tokens merged into the text embeddings (`masked_scatter`), with HF's check
  that the image tokens and the image features agree (a value check, not a shape);
  llava_frozen: its vision tower frozen, alone on the first stage (forward only);
  llava_labels: given its labels, its loss its own `out.loss` (no target to step());
- paligemma: an image prefix with prefix-LM attention (`token_type_ids`);
- vision_gpt2: cross-attention from a GPT-2 decoder to a ViT encoder
  (`VisionEncoderDecoderModel`);
- siglip: two towers and a contrastive loss;
- whisper: a speech encoder-decoder on log-mel features;
- qwen2_vl: patch rows with per-image grids (`pixel_values` rows are patches,
  `image_grid_thw` says how many per image and sizes the vision attention's blocks through
  `.tolist()`): the grid is static (`input_split`), mrope's `position_ids` are (3, B, L).

Each builds a seeded model, a step's keyword inputs and target, and a loss, as
`real_models.Case` does, so that one process and the pipeline see the same numbers. Every
dropout is off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from real_models import Case, _seeded
from torch import nn

B = 8  # mini-batch
V = 64  # vocabulary
IMAGE = 63  # the image token
L = 8  # text tokens


def _text(gen: torch.Generator, length: int = L) -> torch.Tensor:
    return torch.randint(3, V - 2, (B, length), generator=gen)


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


def _llama_text() -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": V,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 32,
        "max_position_embeddings": 64,
    }


def _clip_vision(image: int = 8) -> dict[str, Any]:
    return {
        "model_type": "clip_vision_model",
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "image_size": image,
        "patch_size": 4,
    }


def _llava() -> nn.Module:
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    cfg = LlavaConfig(
        vision_config=_clip_vision(),
        text_config=_llama_text(),
        image_token_id=IMAGE,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",  # the 4 patches, not the CLS token
    )
    return LlavaForConditionalGeneration(cfg)


def _llava_frozen() -> nn.Module:
    """LLaVA with its vision tower frozen, as LLaVA's training recipe has it."""
    model = _llava()
    model.model.vision_tower.requires_grad_(False)
    return model


# the frozen tower alone on stage 0 (ops not named follow their inputs)
FROZEN_PINS = {
    "model.vision_tower": 0,
    "model.multi_modal_projector": 1,
    "model.language_model": 1,
    "lm_head": 1,
}


def _llava_inputs(gen: torch.Generator) -> dict[str, Any]:
    ids = _text(gen, L + 4)
    ids[:, 1:5] = IMAGE  # one image of 4 patches after the first token
    return {"input_ids": ids, "pixel_values": torch.randn(B, 3, 8, 8, generator=gen)}


def _llava_labelled(gen: torch.Generator) -> dict[str, Any]:
    """LLaVA's inputs with `labels` (its image tokens ignored, -100), as Hugging Face trains
    it: the model computes its own shifted loss."""
    inputs = _llava_inputs(gen)
    labels = inputs["input_ids"].clone()
    labels[labels == IMAGE] = -100
    return {**inputs, "labels": labels}


def _siglip_vision() -> dict[str, Any]:
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 8,
        "patch_size": 4,
        "vision_use_head": False,
    }


def _paligemma() -> nn.Module:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    text = {
        "model_type": "gemma",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "vocab_size": V,
    }
    cfg = PaliGemmaConfig(
        vision_config=_siglip_vision(),
        text_config=text,
        image_token_index=IMAGE,
        vocab_size=V,
        projection_dim=16,
        hidden_size=16,
    )
    return PaliGemmaForConditionalGeneration(cfg)


def paligemma_inputs(gen: torch.Generator, prefix: bool = True) -> dict[str, Any]:
    """4 image tokens, then the text; `token_type_ids` mark the prefix (image and prompt,
    attended both ways) and the suffix (causal), as PaliGemma's processor does."""
    ids = torch.cat([torch.full((B, 4), IMAGE), _text(gen)], 1)
    inputs = {"input_ids": ids, "pixel_values": torch.randn(B, 3, 8, 8, generator=gen)}
    if prefix:
        types = torch.ones_like(ids)
        types[:, :6] = 0  # the image and a two-token prompt
        inputs["token_type_ids"] = types
    return inputs


def _vision_gpt2() -> nn.Module:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        VisionEncoderDecoderModel,
        ViTConfig,
        ViTModel,
    )

    encoder = ViTModel(
        ViTConfig(
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            image_size=8,
            patch_size=4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        add_pooling_layer=False,
    )
    decoder = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=V,
            n_embd=16,
            n_layer=2,
            n_head=2,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            add_cross_attention=True,
            is_decoder=True,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    model = VisionEncoderDecoderModel(encoder=encoder, decoder=decoder)
    model.config.decoder_start_token_id = 0
    model.config.pad_token_id = 0
    return model


def _vision_gpt2_inputs(gen: torch.Generator) -> dict[str, Any]:
    return {
        "pixel_values": torch.randn(B, 3, 8, 8, generator=gen),
        "decoder_input_ids": _text(gen),
    }


def _siglip() -> nn.Module:
    from transformers import SiglipConfig, SiglipModel

    text = {
        "vocab_size": V,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": L,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    vision = {k: v for k, v in _siglip_vision().items() if k not in ("model_type",)}
    vision["vision_use_head"] = True
    return SiglipModel(SiglipConfig(text_config=text, vision_config=vision))


def _siglip_inputs(gen: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _text(gen), "pixel_values": torch.randn(B, 3, 8, 8, generator=gen)}


def _contrastive(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy both ways within each micro-batch: `target` holds each row's index in
    it."""
    return (
        F.cross_entropy(out.logits_per_image, target) + F.cross_entropy(out.logits_per_text, target)
    ) / 2


def _whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=V,
        num_mel_bins=8,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        d_model=16,
        max_source_positions=8,  # 16 frames, halved by the second convolution
        max_target_positions=16,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    return WhisperForConditionalGeneration(cfg)


def _whisper_inputs(gen: torch.Generator) -> dict[str, Any]:
    return {
        "input_features": torch.randn(B, 8, 16, generator=gen),
        "decoder_input_ids": _text(gen),
    }


QWEN_PATCHES = 16  # patch rows per image: a 4 x 4 grid, merged 2 x 2 into 4 image tokens
QWEN_IMAGE = 60  # the image token


def _qwen2_vl() -> nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = _llama_text()
    text.pop("model_type")
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]}
    cfg = Qwen2VLConfig(
        text_config={
            **text,
            "rope_parameters": rope,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 16,
            "hidden_size": 16,
            "num_heads": 2,
            "patch_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=QWEN_IMAGE,
        video_token_id=QWEN_IMAGE - 3,
        vision_start_token_id=QWEN_IMAGE - 2,
        vision_end_token_id=QWEN_IMAGE - 1,
    )
    return Qwen2VLForConditionalGeneration(cfg)


_QWEN_ROPE: list[Any] = []  # one model's get_rope_index, built once


def _qwen2_vl_inputs(gen: torch.Generator) -> dict[str, Any]:
    """One image per sample, its 4 tokens after the first; mrope positions computed as the
    data pipeline does (Hugging Face's `get_rope_index`, outside the model)."""
    ids = torch.randint(3, QWEN_IMAGE - 3, (B, L + 4), generator=gen)
    ids[:, 1:5] = QWEN_IMAGE
    grid = torch.tensor([[1, 4, 4]]).repeat(B, 1)
    if not _QWEN_ROPE:
        _QWEN_ROPE.append(_qwen2_vl().model.get_rope_index)
    kinds = (ids == QWEN_IMAGE).int()
    positions, _ = _QWEN_ROPE[0](ids, mm_token_type_ids=kinds, image_grid_thw=grid)
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(B * QWEN_PATCHES, 3 * 2 * 2 * 2, generator=gen),
        "image_grid_thw": grid,
        "position_ids": positions,
    }


def by_grid(x: torch.Tensor, inputs: Any, n: int) -> list[torch.Tensor]:
    """`pixel_values` into n pieces, each the patch rows of its images (input_split)."""
    rows = inputs["image_grid_thw"].prod(-1)  # patch rows per image
    return list(x.split([int(r.sum()) for r in rows.tensor_split(n)]))


_WITHOUT_CACHE = {"use_cache": False}
CASES: dict[str, Case] = {
    "llava": Case(
        _seeded(_llava), _llava_inputs, lambda gen: _text(gen, L + 4), _lm_loss, _WITHOUT_CACHE
    ),
    "llava_labels": Case(
        _seeded(_llava),
        _llava_labelled,
        lambda gen: _text(gen, L + 4),
        lambda out: out.loss,
        _WITHOUT_CACHE,
        target_free=True,
    ),
    "llava_frozen": Case(
        _seeded(_llava_frozen),
        _llava_inputs,
        lambda gen: _text(gen, L + 4),
        _lm_loss,
        _WITHOUT_CACHE,
        pins={2: FROZEN_PINS},
    ),
    "paligemma": Case(
        _seeded(_paligemma),
        paligemma_inputs,
        lambda gen: _text(gen, L + 4),
        _lm_loss,
        _WITHOUT_CACHE,
    ),
    "vision_gpt2": Case(
        _seeded(_vision_gpt2), _vision_gpt2_inputs, _text, _lm_loss, _WITHOUT_CACHE
    ),
    "siglip": Case(_seeded(_siglip), _siglip_inputs, lambda gen: torch.arange(B) % 2, _contrastive),
    "whisper": Case(_seeded(_whisper), _whisper_inputs, _text, _lm_loss, _WITHOUT_CACHE),
    "qwen2_vl": Case(
        _seeded(_qwen2_vl),
        _qwen2_vl_inputs,
        lambda gen: _text(gen, L + 4),
        _lm_loss,
        _WITHOUT_CACHE,
        split={"image_grid_thw": "static", "pixel_values": by_grid, "position_ids": 1},
    ),
}
