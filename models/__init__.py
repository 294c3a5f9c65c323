"""Branchy example models for graphpipe, each a factory of synthetic-data workloads.

    mmt         multi-modal transformer: one encoder branch per modality, fused by an MLP
    dlrm        DLRM: dense MLP branches and embedding-bag tables, dot-product interaction
    candle_uno  CANDLE-Uno: feature towers of Dense layers, concatenated, MSE regression
    nbranch     N parallel transformer encoders over the same input, summed
    inception   Inception-style CNN: four parallel conv branches in every block
    vlm         vision-language model (LLaVA): a ViT encoder, a projector, a causal decoder
                reading the image tokens then the text; the encoder optionally frozen

Every module follows the factory protocol of `graphpipe.tools.workload`: it exposes
`PRESETS` ("tiny", "cpu", "paper") and

    workload(preset: str = "tiny", *, seed: int = 0, **options) -> graphpipe.tools.workload.Workload

where `options` override the preset's values (unknown ones raise `ConfigError`). Presets:
"tiny" for tests (well under a second), "cpu" for example runs (a minute on 2 CPU cores),
"paper" for the GraphPipe paper's sizes, built on the meta device: plan and simulate it, but
its `make_batch` raises. The same preset, options and seed give the same weights and data in
every process, without touching the global RNG. The data is learnable: each target is a fixed
random function of the inputs, so the loss falls when training. No model uses dropout.

    graphpipe plan models.mmt --devices 8
    graphpipe plan models.mmt --preset paper --devices 32
    python -m models.mmt --devices 2

    >>> import torch
    >>> from models import mmt
    >>> w = mmt.workload("tiny", branches=3)
    >>> inputs, target = w.make_batch(torch.Generator().manual_seed(1))
    >>> loss = w.loss_fn(w.model(*inputs), target)
"""
