"""Inputs whose dim 0 is not the batch (graphpipe.tracing.split).

Pure logic: the rules (a dim, "replicate", a function of the whole batch) cut as they say;
an input's batch dim is inferred where exactly one dim has the batch's size; everything
else is refused by name, naming the rule to give.

Multi-process: two models train pipelined exactly as one process cutting the same
micro-batches, at 2 ranks (1f1b) and on pp 2 x dp 2 (zb):
- Qwen2-VL's language model with its own mrope positions, `position_ids` (3, B, L): the
  batch on dim 1, inferred (Hugging Face's `Qwen2VLForConditionalGeneration`, exported);
- a VLM fed as recent ones are, `pixel_values` as patch rows of every image of the batch
  (two images a sample) and `image_grid` (images, 2) saying each image's grid: both split
  by functions that follow the grid, the patch rows merged into the text at its image
  tokens (fx).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from real_models import optimizer
from torch import nn

from graphpipe.compile import RuntimeConfig
from graphpipe.compile import compile as gp_compile
from graphpipe.errors import ConfigError
from graphpipe.runtime.launch import launch
from graphpipe.tracing.split import InputSplit

B, M, STEPS = 8, 4, 3
V, IMAGE, HIDDEN = 64, 63, 16
IMAGES, PATCHES, PATCH_DIM = 2, 4, 12  # images a sample, patch rows an image (a 2 x 2 grid)
L = 10  # text tokens, IMAGES * PATCHES of them image tokens


def by_grid(x: torch.Tensor, inputs: Mapping[Any, torch.Tensor], n: int) -> list[torch.Tensor]:
    """Patch rows: piece j holds the patches of the images of the j-th n-th of the batch."""
    rows = inputs["image_grid"].prod(-1)  # patch rows of each image
    return list(x.split([int(r.sum()) for r in rows.tensor_split(n)]))


def by_image(x: torch.Tensor, inputs: Mapping[Any, torch.Tensor], n: int) -> list[torch.Tensor]:
    """One row per image, the images in the batch's order."""
    return list(x.tensor_split(n))


RULES = {"pixel_values": by_grid, "image_grid": by_image}


class PatchVLM(nn.Module):
    """A vision encoder over patch rows, a projector, and a decoder whose image tokens take
    the projected patches (LLaVA's merge), with each image's grid embedded (its size)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(PATCH_DIM, HIDDEN)
        self.size = nn.Linear(2, HIDDEN)
        self.encoder = nn.TransformerEncoderLayer(HIDDEN, 2, 32, dropout=0.0, batch_first=True)
        self.project = nn.Linear(HIDDEN, HIDDEN)
        self.embed = nn.Embedding(V, HIDDEN)
        self.decoder = nn.TransformerEncoderLayer(HIDDEN, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(HIDDEN, V)

    def forward(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor, image_grid: torch.Tensor
    ) -> torch.Tensor:
        images = image_grid.shape[0]
        x = self.patch(pixel_values).view(images, -1, HIDDEN)  # (images, patches, hidden)
        x = x + self.size(image_grid.float()).unsqueeze(1)
        features = self.project(self.encoder(x)).reshape(-1, HIDDEN)  # (patch rows, hidden)
        text = self.embed(input_ids)  # (b, L, hidden)
        where = (input_ids == IMAGE).unsqueeze(-1).expand_as(text)
        return self.head(self.decoder(text.masked_scatter(where, features)))


def _patch_vlm() -> nn.Module:
    torch.manual_seed(0)
    return PatchVLM()


def _patch_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, V - 2, (B, L), generator=gen)
    ids[:, 1 : 1 + IMAGES * PATCHES] = IMAGE
    grid = torch.tensor([[2, 2]]).repeat(B * IMAGES, 1)
    pixels = torch.randn(B * IMAGES * PATCHES, PATCH_DIM, generator=gen)
    return {"input_ids": ids, "pixel_values": pixels, "image_grid": grid}


def _qwen2_vl() -> nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2VLConfig(
        text_config={
            "vocab_size": V,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [1, 1, 2],
            },
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        },
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2},
        image_token_id=60,
        video_token_id=63,
        vision_start_token_id=61,
        vision_end_token_id=62,
    )
    return Qwen2VLForConditionalGeneration(cfg)


def _qwen_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 59, (B, 6), generator=gen)
    positions = torch.arange(6).expand(3, B, 6).clone()  # (3, B, L): temporal, height, width
    positions[1:] = positions[1:] // 2
    return {"input_ids": ids, "position_ids": positions}


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


CASES: dict[str, tuple[Any, Any, dict[str, Any], Mapping[str, Any] | None]] = {
    "patch_vlm": (_patch_vlm, _patch_inputs, {}, RULES),
    "qwen2_vl_text": (_qwen2_vl, _qwen_inputs, {"use_cache": False}, None),  # dim 1 inferred
}


def _step(name: str, step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    inputs = CASES[name][1](gen)
    return inputs, torch.randint(3, V - 2, inputs["input_ids"].shape, generator=gen)


def _reference(name: str) -> tuple[list[float], nn.Module]:
    """One process: gradient accumulation over the micro-batches the rules cut."""
    build, _, constants, rules = CASES[name]
    model = build()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        inputs, target = _step(name, step)
        split = InputSplit(rules).resolved(inputs)
        pieces = {k: split.micro_batches(k, inputs, M) for k in inputs}
        total = 0.0
        for j in range(M):
            part = {k: v[j] for k, v in pieces.items()}
            loss = _lm_loss(model(**part, **constants), target.tensor_split(M)[j])
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return losses, model


def _run(name: str, schedule: str, dp: int) -> dict[str, Any]:
    build, _, constants, rules = CASES[name]
    example, _ = _step(name, 0)
    pm = gp_compile(
        build(),
        {**example, **constants},
        loss_fn=_lm_loss,
        optimizer=optimizer,
        micro_batches=M,
        schedule=schedule,
        replication=False,
        input_split=rules,
        runtime=RuntimeConfig(timeout=120),
        **({"dp": dp} if dp > 1 else {}),
    )
    losses = [pm.step(**_step(name, s)[0], target=_step(name, s)[1]) for s in range(STEPS)]
    state = pm.state_dict()  # a collective: every rank calls it
    return {"losses": losses, "state": state if pm.rank == 0 else None}


def _worker(schedule: str, dp: int) -> dict[str, Any]:
    return {name: _run(name, schedule, dp) for name in CASES}


@pytest.fixture(scope="module", params=[("1f1b", 1, 2), ("zb", 2, 4)], ids=["pp2", "pp2xdp2"])
def runs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    schedule, dp, world = request.param
    return launch(_worker, world, args=(schedule, dp), timeout=300)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], nn.Module]]:
    return {name: _reference(name) for name in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inputs_split_by_their_rules_train_as_one_process(
    runs: list[dict[str, Any]], references: dict[str, tuple[list[float], nn.Module]], name: str
) -> None:
    ref_losses, ref_model = references[name]
    result = runs[0][name]
    torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=1e-7)
    expected = ref_model.state_dict()
    assert list(result["state"]) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_each_rule_cuts_as_it_says() -> None:
    inputs = _patch_inputs(torch.Generator().manual_seed(0))
    inputs["scale"] = torch.ones(3)
    split = InputSplit({**RULES, "scale": "replicate"}).resolved(inputs)
    assert split.batch(inputs) == B
    pixels = split.micro_batches("pixel_values", inputs, M, dp=2, index=1)
    # micro-batch j, dp slice 1: the patches of sample 2j + 1's two images
    assert [tuple(p.shape) for p in pixels] == [(IMAGES * PATCHES, PATCH_DIM)] * M
    rows = IMAGES * PATCHES
    torch.testing.assert_close(pixels[2], inputs["pixel_values"][5 * rows : 6 * rows])
    assert all(s is inputs["scale"] for s in split.micro_batches("scale", inputs, M))
    ids = split.micro_batches("input_ids", inputs, M)
    torch.testing.assert_close(torch.cat(ids), inputs["input_ids"])


def test_the_batch_dim_is_inferred_where_one_dim_has_the_batch_size() -> None:
    inputs = _qwen_inputs(torch.Generator().manual_seed(0))
    split = InputSplit().resolved(inputs)
    assert split.dim("position_ids") == 1 and "position_ids dim 1 (inferred)" in split.describe()
    firsts = split.micro_batches("position_ids", inputs, M)
    assert tuple(firsts[0].shape) == (3, B // M, 6)


def test_an_input_whose_batch_cannot_be_told_is_refused_naming_it_and_the_rule() -> None:
    inputs = _patch_inputs(torch.Generator().manual_seed(0))
    with pytest.raises(
        ConfigError,
        match=r"input pixel_values is \[64, 12\]: its dim 0 is not the batch of 8 .* input_split",
    ):
        InputSplit().resolved(inputs)
    with pytest.raises(ConfigError, match="image_grid"):
        InputSplit({"pixel_values": by_grid}).resolved(inputs)


def test_a_function_that_returns_other_pieces_is_refused_by_name() -> None:
    inputs = _patch_inputs(torch.Generator().manual_seed(0))
    split = InputSplit({**RULES, "pixel_values": lambda x, inputs, n: [x]}).resolved(inputs)
    with pytest.raises(ConfigError, match=r"for pixel_values .* returned 1 pieces .* for n=4"):
        split.micro_batches("pixel_values", inputs, M)


def test_no_input_carrying_the_batch_and_bad_rules_are_refused() -> None:
    inputs = {"x": torch.ones(4, 2)}
    with pytest.raises(ConfigError, match="no input carries the batch"):
        InputSplit({"x": "replicate"}).resolved(inputs).batch(inputs)
    with pytest.raises(ConfigError, match=r"'x': 'rows'"):
        InputSplit({"x": "rows"})
