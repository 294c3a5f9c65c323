"""Real-model planning benchmark: Hugging Face models at full size, built on the meta device.

    python -m benchmarks.real_models                   # about a minute on 2 cores

Each model is built under `torch.device("meta")` (no memory), traced at the micro-batch size
(torch.export, with `use_cache=False`) and planned by the graph partitioner with FLOP-estimated
op times, as `graphpipe.compile` does on rank 0 for a model too big for one device. Columns:
trace and plan seconds, op count, stages and depth of the plan, and the largest stage's
parameter bytes (what one rank materialises).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

from benchmarks._common import log, machine
from graphpipe._units import format_bytes
from graphpipe.planning.partition import PlanConfig, partition
from graphpipe.planning.profile import profile
from graphpipe.tracing.tracer import flat_inputs, trace

BATCH, M, SEQ = 8, 4, 512
DEVICES = (4, 8)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=24,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=4096,
        )
    )


def _bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    return BertModel(
        BertConfig(
            hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
        )
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
    "llama 24L h4096": (_llama, {"use_cache": False}),
    "bert-large": (_bert, {}),
}


def rows() -> list[list[Any]]:
    """One row per model and device count."""
    table = []
    ids = torch.randint(0, 30000, (BATCH, SEQ))
    for name, (build, constants) in MODELS.items():
        with torch.device("meta"):
            model = build()
        start = time.perf_counter()
        gm = trace(model, {"input_ids": ids, **constants}, micro_batch_size=BATCH // M)
        traced = time.perf_counter() - start
        ops = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
        log(f"{name}: traced {ops} ops in {traced:.1f} s")
        prof = profile(gm, flat_inputs(gm, input_ids=ids), BATCH // M)
        for n in DEVICES:
            start = time.perf_counter()
            plan = partition(gm, prof, PlanConfig(devices=n, micro_batches=M))
            planned = time.perf_counter() - start
            log(f"{name}: planned for {n} devices in {planned:.1f} s")
            biggest = max(s.param_bytes for s in plan.stages)
            table.append(
                [
                    name,
                    n,
                    ops,
                    f"{traced:.1f}",
                    f"{planned:.1f}",
                    len(plan.stages),
                    plan.depth,
                    format_bytes(biggest),
                ]
            )
    return table


def report() -> str:
    """The markdown section."""
    headers = ["model", "N", "ops", "trace s", "plan s", "stages", "depth", "largest stage"]
    table = tabulate(rows(), headers=headers, tablefmt="github")
    return (
        "## Real models on the meta device: trace and plan time\n\n"
        f"`python -m benchmarks.real_models` on {machine()}. Hugging Face models at full size, "
        f"built on the meta device, traced at micro-batch {BATCH // M} (sequence {SEQ}) and "
        "planned with FLOP-estimated op times.\n\n" + table + "\n"
    )


if __name__ == "__main__":
    print(report())
