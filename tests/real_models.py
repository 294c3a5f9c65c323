"""Real models for the real-model tier: Hugging Face transformers at tiny sizes (random
weights, no download) and CNNs with the concatenations that real vision models cut across.

Each case builds a seeded model, a step's batch (keyword inputs as the model takes them, and
a target) and a loss, so that the pipelined run and the single-process reference see the same
numbers. Dropout is off everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

B = 8  # mini-batch
M = 4  # micro-batches
L = 6  # sequence length
V = 64  # vocabulary


@dataclass(frozen=True)
class Case:
    """One model: how to build it, a step's inputs and target, and the loss."""

    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], dict[str, Any]]
    target: Callable[[torch.Generator], torch.Tensor]
    loss: Callable[..., torch.Tensor]  # (output, target), or (output) where target_free
    constants: dict[str, Any] = field(default_factory=dict)  # keyword constants of the trace
    pins: dict[int, dict[str, int]] = field(default_factory=dict)  # by world size: a manual
    # plan where the hard case needs one
    target_free: bool = False  # the loss is the output's own (labels among the inputs):
    # loss(out), and step() takes no target
    split: dict[str, Any] = field(default_factory=dict)  # input_split's rules: the batch dim
    # of an input whose dim 0 is not the batch ("static": dim 0, a constant of the trace)

    def micro(self, inputs: dict[str, Any], j: int) -> dict[str, Any]:
        """Micro-batch j of M of `inputs`, each cut along its batch dim (or by its rule's
        function)."""
        rules = {k: 0 if r == "static" else r for k, r in self.split.items()}
        cut = {k: r(inputs[k], inputs, M) for k, r in rules.items() if callable(r)}
        return {
            k: cut[k][j] if k in cut else v.chunk(M, rules.get(k, 0))[j] for k, v in inputs.items()
        }


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return build()

    return make


def _tokens(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(3, V, (B, L), generator=gen)


def _lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertModel(cfg)


def _bert_inputs(gen: torch.Generator) -> dict[str, Any]:
    mask = torch.ones(B, L, dtype=torch.long)
    mask[:, L - 2 :] = (torch.rand(B, 2, generator=gen) > 0.5).long()  # some padding
    return {"input_ids": _tokens(gen), "attention_mask": mask}


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=V,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)  # lm_head.weight is transformer.wte.weight


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=V,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(cfg)  # shared = encoder/decoder embed_tokens = lm_head


def _t5_inputs(gen: torch.Generator) -> dict[str, Any]:
    return {"input_ids": _tokens(gen), "decoder_input_ids": _tokens(gen)}


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config={
            "vocab_size": V,
            "hidden_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "max_position_embeddings": 32,
            "eos_token_id": 2,
        },
        vision_config={
            "hidden_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "image_size": 8,
            "patch_size": 4,
        },
        projection_dim=8,
    )
    return CLIPModel(cfg)


def _clip_inputs(gen: torch.Generator) -> dict[str, Any]:
    ids = _tokens(gen)
    ids[:, -1] = 2  # end of text
    return {"input_ids": ids, "pixel_values": torch.randn(B, 3, 8, 8, generator=gen)}


def _clip_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """The contrastive loss within each micro-batch: `target` holds each row's index in it."""
    return (
        F.cross_entropy(out.logits_per_image, target) + F.cross_entropy(out.logits_per_text, target)
    ) / 2


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def _conv_bn(cin: int, cout: int, k: int = 3) -> nn.Sequential:
    """torchvision's BasicConv2d: its ReLU writes in place (a cut before it sends a value
    the next stage writes)."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, padding=k // 2), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


class InceptionNet(nn.Module):
    """A stem, two Inception blocks (four branches, concatenated) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = _conv_bn(3, 8)
        self.block1 = InceptionBlock(8)
        self.block2 = InceptionBlock(16)
        self.head = nn.Linear(16, 5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.stem(image)))  # (B, 16, 8, 8)
        return self.head(x.mean(dim=(2, 3)))


class InceptionBlock(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b1 = _conv_bn(cin, 4, 1)
        self.b3 = nn.Sequential(_conv_bn(cin, 4, 1), _conv_bn(4, 4))
        self.b5 = nn.Sequential(_conv_bn(cin, 4, 1), _conv_bn(4, 4), _conv_bn(4, 4))
        self.pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), _conv_bn(cin, 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.pool(x)], dim=1)


class DenseNet(nn.Module):
    """A dense block: each layer reads the concatenation of every earlier feature map, so a
    cut after layer k sends both x0 and f(x0) to later stages."""

    def __init__(self, layers: int = 4, growth: int = 4) -> None:
        super().__init__()
        self.stem = _conv_bn(3, 8)
        self.layers = nn.ModuleList(_conv_bn(8 + i * growth, growth) for i in range(layers))
        self.norm = nn.BatchNorm2d(8 + layers * growth)
        self.head = nn.Linear(8 + layers * growth, 5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        features = [self.stem(image)]
        for layer in self.layers:
            features.append(layer(torch.cat(features, dim=1)))
        x = F.relu(self.norm(torch.cat(features, dim=1)), inplace=True)  # (B, 24, 8, 8)
        return self.head(x.mean(dim=(2, 3)))


def _images(gen: torch.Generator) -> dict[str, Any]:
    return {"image": torch.randn(B, 3, 8, 8, generator=gen)}


def _classes(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 5, (B,), generator=gen)


HF_CASES: dict[str, Case] = {
    "bert": Case(
        _seeded(_bert),
        _bert_inputs,
        lambda gen: torch.randn(B, L, generator=gen),
        lambda out, t: F.mse_loss(out.last_hidden_state.mean(-1), t),
    ),
    "gpt2": Case(
        _seeded(_gpt2),
        lambda gen: {"input_ids": _tokens(gen)},
        _tokens,
        _lm_loss,
        {"use_cache": False},
    ),
    "t5": Case(_seeded(_t5), _t5_inputs, _tokens, _lm_loss, {"use_cache": False}),
    "clip": Case(
        _seeded(_clip),
        _clip_inputs,
        lambda gen: torch.arange(B) % (B // M),
        _clip_loss,
    ),
    "llama": Case(
        _seeded(_llama),
        lambda gen: {"input_ids": _tokens(gen)},
        _tokens,
        _lm_loss,
        {"use_cache": False},
    ),
}


def _mixtral() -> nn.Module:
    """A tiny Mixtral: 4 experts, 2 per token (its router normalises its top-k weights in
    place, `div_`)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return MixtralForCausalLM(cfg)


def _qwen2_moe() -> nn.Module:
    """A tiny Qwen2-MoE: 4 routed experts, 2 per token, and a gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=32,
    )
    return Qwen2MoeForCausalLM(cfg)


MOE_CASES: dict[str, Case] = {
    name: Case(
        _seeded(build),
        lambda gen: {"input_ids": _tokens(gen)},
        _tokens,
        _lm_loss,
        {"use_cache": False},
    )
    for name, build in (("mixtral", _mixtral), ("qwen2_moe", _qwen2_moe))
}

CNN_CASES: dict[str, Case] = {
    "inception": Case(_seeded(InceptionNet), _images, _classes, F.cross_entropy),
    "densenet": Case(
        _seeded(DenseNet),
        _images,
        _classes,
        F.cross_entropy,
        pins={  # stage 0 sends x0, x1 and cat(x0, x1); unpinned ops follow their inputs
            2: {"stem": 0, "layers.0": 0, "layers.1": 1},
            3: {"stem": 0, "layers.0": 0, "layers.1": 1, "layers.2": 2},
        },
    ),
}

CASES = {**HF_CASES, **CNN_CASES}


def step_data(case: Case, step: int) -> tuple[dict[str, Any], torch.Tensor]:
    """Step `step`'s keyword inputs and target."""
    gen = torch.Generator().manual_seed(100 + step)
    return case.inputs(gen), case.target(gen)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def rounded_to(dtype: torch.dtype) -> Any:
    """A forward hook: the output rounded to `dtype` and back, as a value crossing stages
    is sent (its gradient, coming back through the same casts, is rounded too)."""
    from torch.utils._pytree import tree_map

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        return tree_map(
            lambda x: x.to(dtype).float() if torch.is_tensor(x) and x.is_floating_point() else x,
            out,
        )

    return hook


def trained(case: Case, steps: int, **options: Any) -> tuple[list[float], Any, Any]:
    """The case compiled as a user would (its keyword inputs and constants, M micro-batches,
    a 120 s timeout; `options` as compile takes them) and trained `steps` steps: the losses,
    the state dict on rank 0 (None elsewhere; a collective, so every rank asks) and the
    pipelined model."""
    from graphpipe.compile import RuntimeConfig
    from graphpipe.compile import compile as gp_compile

    example, _ = step_data(case, 0)
    if case.split:
        options.setdefault("input_split", case.split)
    pm = gp_compile(
        case.build(),
        {**example, **case.constants},
        loss_fn=case.loss,
        optimizer=optimizer,
        micro_batches=M,
        runtime=RuntimeConfig(timeout=120),
        **options,
    )
    losses = []
    for step in range(steps):
        inputs, target = step_data(case, step)
        losses.append(pm.step(**inputs) if case.target_free else pm.step(**inputs, target=target))
    state = pm.state_dict()
    return losses, state if pm.rank == 0 else None, pm


def reference(case: Case, steps: int, bf16_at: str | None = None) -> tuple[list[float], nn.Module]:
    """Single-process gradient accumulation over the same M micro-batches. With `bf16_at`
    (a module path), the bf16 recipe: forward and loss under `torch.autocast(bfloat16)` over
    the float32 weights, gradients accumulated in float32, that module's output (what
    crosses the pipeline's cut) rounded to bf16 as the message is."""
    model = case.build()
    if bf16_at is not None:
        model.get_submodule(bf16_at).register_forward_hook(rounded_to(torch.bfloat16))
    opt = optimizer(model.parameters())
    losses = []
    for step in range(steps):
        inputs, target = step_data(case, step)
        total = 0.0
        for j in range(M):
            part = case.micro(inputs, j)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_at is not None):
                out = model(**part, **case.constants)
                loss = case.loss(out) if case.target_free else case.loss(out, target.chunk(M)[j])
            (loss / M).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total / M)
    return losses, model
