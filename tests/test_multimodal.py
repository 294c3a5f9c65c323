"""Multi-modal Hugging Face models train pipelined exactly as in one process.

The families of tests/multimodal.py: LLaVA (image tokens merged into the text, its check
that they agree with the image features kept as a device-side assert), PaliGemma (an image
prefix under prefix-LM attention), a ViT encoder with a cross-attending GPT-2 decoder,
SigLIP (two towers, a contrastive loss), Whisper (a speech encoder-decoder) and Qwen2-VL
with images (patch rows per image grid; the grid static, so the vision attention's blocks,
sized by its `.tolist()`, are literals of the trace; mrope positions (3, B, L)). Each is
compiled as a user would (keyword inputs, the default planner, torch.export's trace checked
against the model's forward) and trained 3 steps: at 2 ranks under 1f1b, at 4 ranks as
pp 2 x dp 2 under zb (SigLIP, off dp, under zb at 2 ranks and as a pipeline of 4; Qwen2-VL
also as a pipeline of 4).
Losses, every parameter and every buffer equal single-process gradient accumulation over
the same micro-batches (rtol 1e-5), and the pipeline's state dict loads into the plain
model with strict=True.

LLaVA given its labels, its loss its own `out.loss` (`loss_fn=lambda out: out.loss`), steps
without a target.

LLaVA with its vision tower frozen (its recipe) runs the tower alone on the first stage,
forward only: that stage has no B, I or W and no gradient comes back to it.

SigLIP's contrastive loss pairs every row of a micro-batch with every other, so a dp slice
of it is not the micro-batch's loss: it runs on the pipelines alone.

PaliGemma called without `token_type_ids` is refused at trace: Hugging Face's SDPA path
then skips the causal mask of an all-ones attention mask while its text attention is not
causal (`use_bidirectional_attention`), so the eager forward attends both ways and the
exported graph causally (docs/failures.md#traces).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from multimodal import CASES, FROZEN_PINS, paligemma_inputs
from real_models import reference, trained

from graphpipe.errors import TraceError
from graphpipe.runtime.launch import launch
from graphpipe.tracing.tracer import trace

STEPS = 3
TIMEOUT = 420  # seconds for one launch
OFF_DP = "siglip"  # its contrastive loss pairs the rows of a micro-batch: no dp slices
# Each family trains under 1f1b at 2 ranks and under zb on pp 2 x dp 2 at 4 ranks; SigLIP,
# off dp, under zb at 2 ranks and as a pipeline of 4 instead; Qwen2-VL (the static grid) as a
# pipeline of 4 too. A suite-time budget: a family's other combinations cut it as these do.
BF16_RTOL, BF16_ATOL = 1e-2, 1e-3  # the composition matrix's bf16 tolerances
# bf16 runs on a pinned cut, so that one process's recipe rounds what crosses it: the
# vision encoder alone on stage 0, its output the one value sent (module, pins)
BF16 = {
    "llava_frozen": ("model.vision_tower", FROZEN_PINS),
    "llava": ("model.vision_tower", FROZEN_PINS),
    "paligemma": ("model.vision_tower", FROZEN_PINS),
    "qwen2_vl": ("model.visual", {"model.visual": 0, "model.language_model": 1, "lm_head": 1}),
    "vision_gpt2": ("encoder", {"encoder": 0, "decoder": 1}),
    "siglip": ("vision_model", {"vision_model": 0, "text_model": 1}),
    "whisper": ("model.encoder", {"model.encoder": 0, "model.decoder": 1, "proj_out": 1}),
}
TWO = (
    *((n, "1f1b", "pp") for n in CASES),
    (OFF_DP, "zb", "pp"),
    *((n, "1f1b", "bf16") for n in BF16),
)
FOUR = (
    (OFF_DP, "1f1b", "pp"),
    ("qwen2_vl", "1f1b", "pp"),
    *((n, "zb", "dp") for n in CASES if n != OFF_DP),
)


def _run(name: str, schedule: str, dims: str) -> dict[str, Any]:
    case = CASES[name]
    options: dict[str, Any] = {"pins": case.pins[2]} if case.pins else {}  # pp 2 on both
    if dims == "dp":
        options["dp"] = 2
    if dims == "bf16":
        options["precision"] = "bf16"
        options["pins"] = BF16[name][1]
    losses, state, pm = trained(case, STEPS, schedule=schedule, replication=False, **options)
    return {
        "losses": losses,
        "state": state,
        "stages": len(pm.plan.stages),
        "held": [] if pm.module is None else sorted(pm.module.state_dict()),
        "backward": [s.backward for s in pm.plan.stages],
        "schedule": str(pm.schedule),
    }


def _worker(runs: tuple[tuple[str, str, str], ...]) -> dict[tuple[str, str, str], Any]:
    return {run: _run(*run) for run in runs}


@pytest.fixture(scope="module", params=[2, 4], ids=["2_ranks", "4_ranks"])
def runs(request: pytest.FixtureRequest) -> list[dict[tuple[str, str, str], Any]]:
    world = request.param
    return launch(_worker, world, args=(TWO if world == 2 else FOUR,), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], torch.nn.Module]]:
    return {name: reference(case, STEPS) for name, case in CASES.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_multimodal_models_train_pipelined_as_one_process(
    runs: list[dict[tuple[str, str, str], Any]],
    references: dict[str, tuple[list[float], torch.nn.Module]],
    name: str,
) -> None:
    ref_losses, ref_model = references[name]
    ran = {k: r for k, r in runs[0].items() if k[0] == name and k[2] != "bf16"}
    assert ran, sorted(runs[0])
    expected = ref_model.state_dict()
    for (_, schedule, dims), result in ran.items():
        where = f"{name} {schedule} {dims} at {len(runs)} ranks"
        torch.testing.assert_close(result["losses"], ref_losses, rtol=1e-5, atol=1e-7, msg=where)
        state = result["state"]
        assert list(state) == list(expected), where
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=where + key)
        CASES[name].build().load_state_dict(state, strict=True)
        held = [r[(name, schedule, dims)]["held"] for r in runs]
        assert all(held), f"{where}: a rank holds nothing"  # every rank trains a part
        pp = len(runs) // (2 if dims == "dp" else 1)
        assert result["stages"] >= pp, where


@pytest.mark.parametrize("runs", [2], ids=["2_ranks"], indirect=True)  # its launch
@pytest.mark.parametrize("name", sorted(BF16))
def test_bf16_is_the_autocast_recipe_of_one_process(
    runs: list[dict[tuple[str, str, str], Any]], name: str
) -> None:
    """bf16 on float32 masters, every family (the frozen LLaVA's tower forward only on stage
    0, Qwen2-VL's static grid folded into its vision tower), the encoder alone on stage 0:
    equal to one process's autocast run within bf16's tolerance, the losses within 2% of
    float32's without equalling them. (An exported graph checked each `.to()`'s input for the traced
    float32, which under autocast a projector's output is not: those checks are dropped,
    `runtime.stage.drop_metadata_asserts`.)"""
    result = runs[0][(name, "1f1b", "bf16")]
    want_losses, want_model = reference(CASES[name], STEPS, bf16_at=BF16[name][0])
    fp32_losses, _ = reference(CASES[name], STEPS)
    want_state = want_model.state_dict()
    assert result["losses"] == pytest.approx(want_losses, rel=BF16_RTOL)
    assert result["losses"] == pytest.approx(fp32_losses, rel=0.02)
    assert result["losses"] != pytest.approx(fp32_losses, rel=1e-6)  # bf16 ran
    for key, value in want_state.items():
        torch.testing.assert_close(
            result["state"][key], value, rtol=BF16_RTOL, atol=BF16_ATOL, msg=key
        )


def test_a_frozen_encoder_stage_runs_forward_only(
    runs: list[dict[tuple[str, str, str], Any]],
) -> None:
    for (name, schedule, dims), result in runs[0].items():
        if name != "llava_frozen":
            continue
        assert result["backward"] == [False, True], (schedule, dims)
        first = result["schedule"].splitlines()[0]  # rank 0: stage 0's actions
        assert " 0F3 " in first and not any(f"0{k}" in first for k in "BIW"), first
        assert "RB" not in first and "SB" not in result["schedule"].split("rank 1")[-1]


def test_an_image_prefix_whose_eager_forward_is_not_its_graph_is_refused() -> None:
    """PaliGemma without token_type_ids: eager SDPA attends both ways (no mask is built for
    an all-ones attention mask and the text attention is not causal), the exported graph
    causally. The trace is refused, naming the output and how far it is off."""
    case = CASES["paligemma"]
    inputs = paligemma_inputs(torch.Generator().manual_seed(0), prefix=False)
    with pytest.raises(
        TraceError, match=r"the worst output is out\['logits'\], float32\[2, 12, 64\], differs by "
    ):
        trace(case.build(), {**inputs, "use_cache": False}, micro_batch_size=2)
