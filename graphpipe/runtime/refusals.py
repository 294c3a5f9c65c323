"""Every combination graphpipe refuses by name, in one table.

A refusal is a row: the combination, why it is refused, whether that is a gap ("not yet")
or the design ("by design"), and what to do instead. Each place that refuses builds its
message from its row (`refusal`), naming the offending value, so the table and the errors
cannot drift apart; the guides quote `table()` (tests/test_refusals.py checks they do).
What is not here runs: stash and 2bw over dp (each dp rank's stages whole, their gradients
averaged over dp at each update), bf16 and fp16 on every mesh, a weight tied across pp ranks
under dp and tp, a weight tied across two stages of one pp rank under dp (each stage's FSDP2
root shards a copy of its own, their gradients summed: `runtime.groups.own_copies`) and tp
(one DTensor), a weight tied to a tp-split layer (one layout for both uses, `runtime.tp`),
a mixture of experts under tp (its own plan's expert entries kept whole), `pm(...)` and
`eval_step` under a mesh, an exported graph at other shapes under a mesh, the production
recipe (pp x dp x tp, bf16, interleaved, recompute) on a model torch.export traced.

    raise ConfigError(refusal("mesh-weights", f"weights={weights!r}"))
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["REFUSALS", "Refusal", "refusal", "table"]


@dataclass(frozen=True)
class Refusal:
    """One refused combination.

    Attributes:
        key: Its name in code.
        when: The combination, in the user's words.
        why: Why it is refused.
        gap: True: not yet supported (planned); False: refused by design.
        instead: What to do instead.
    """

    key: str
    when: str
    why: str
    gap: bool
    instead: str


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "mesh-weights",
        "weights='pipemare' with a mesh",
        "FSDP2 holds one version of each stage's sharded parameters, and PipeMare's backward "
        "swaps in corrected whole weights per micro-batch; whole stages over dp (as stash "
        "and 2bw run) are not tested for it",
        True,
        "use weights='flush', 'stash' or '2bw'",
    ),
    Refusal(
        "mesh-versions-tp",
        "weights='stash' or '2bw' with a 'tp' dimension, or with mesh='auto' (which may "
        "choose one)",
        "their versions alias whole weight tensors, kept whole on each dp rank; tp's DTensor "
        "parameters are not versioned here",
        True,
        "use a ('pp', 'dp') mesh or dp=k, or weights='flush'",
    ),
    Refusal(
        "mesh-nan-check",
        "nan_check=True with a mesh",
        "its agreement names whole parameters, where an FSDP2 rank holds shards",
        True,
        "check the loss yourself, or run without a mesh",
    ),
    Refusal(
        "mesh-compile-stages",
        "compile_stages=True with a mesh",
        "torch.compile of an FSDP2-wrapped stage is not tested here",
        True,
        "leave compile_stages=False with a mesh",
    ),
    Refusal(
        "mesh-replication",
        "replication=True with a mesh",
        "the mesh's dp dimension replicates every stage already",
        False,
        "plan with replication=False (compile's default)",
    ),
    Refusal(
        "meta-tie-one-rank",
        "a weight tied across two stages of one pp rank, in a model on the meta device, with "
        "a mesh",
        "each stage is materialised shard by shard on its own, and the copy they share got "
        "another module's reset_parameters() values than one process gives it (an embedding "
        "tied to an output Linear got the Linear's, measured under tp)",
        True,
        "build the model on a real device, or put the tie's readers on two pp ranks",
    ),
    Refusal(
        "tp-hsdp",
        "dp_shard=False (HSDP) with a 'tp' dimension",
        "FSDP2's replicate mesh is not composed with the tp DTensors here",
        True,
        "shard over dp (dp_shard=True, the default)",
    ),
    Refusal(
        "emulated-shapes",
        "emulated stages at a shape other than the compiled one",
        "a stand-in waits the plan's times, which are the compiled shape's",
        False,
        "emulate at the shape you measure",
    ),
    Refusal(
        "async-tie",
        "a weight tied across ranks under stash, 2bw or pipemare",
        "its copies update at different points of the schedule, so their gradients have no "
        "moment to be summed",
        False,
        "use weights='flush', which sums them before each update, or give the modules "
        "copies of their own",
    ),
)

_BY_KEY = {r.key: r for r in REFUSALS}


def refusal(key: str, subject: str) -> str:
    """The error message of refusal `key`, naming `subject` (the offending value).

    Example:
        >>> refusal("mesh-nan-check", "nan_check=True").split(":")[0]
        'nan_check=True'
    """
    row = _BY_KEY[key]
    status = "not yet supported (planned)" if row.gap else "refused by design"
    return f"{subject}: {row.when} is {status}: {row.why}; {row.instead}"


def table() -> str:
    """The refusals as a Markdown table, as the guides quote it."""
    lines = [
        "| refused | why | status | instead |",
        "| --- | --- | --- | --- |",
    ]
    for r in REFUSALS:
        status = "not yet" if r.gap else "by design"
        lines.append(f"| {r.when} | {r.why} | {status} | {r.instead} |")
    return "\n".join(lines)
