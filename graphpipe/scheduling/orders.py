"""The fixed orders: the textbook and published schedules written out, as plain per-stage
(`Order`) or per-device (`RankOrder`) lists of compute steps. They read the plan's shape
only, never its times; `graphpipe.scheduling.generators` turns them into schedules (and,
where a cost-aware construction competes, keeps the faster, `graphpipe.scheduling.greedy`).

    1F1B with flush (PipeDream-Flush)        one_f_one_b
    Megatron's interleaved 1F1B ("loop")     interleaved, loop_step
    ZB-H1 (arXiv 2401.10241, section 3.1)    paper_zb_h1, deferred_weights
    interleaved zero bubble (ZB1P, "loop")   interleaved_zb
    ZB-V (arXiv 2405.15362, figure 4)        paper_zbv
    DualPipeV (DeepSeek, arXiv 2412.19437)   dualpipev
"""

from __future__ import annotations

from graphpipe.ir import ActionKind, Plan, edges_to_sink
from graphpipe.scheduling.greedy import Order, RankOrder, Step

__all__ = [
    "deferred_weights",
    "dualpipev",
    "interleaved",
    "interleaved_zb",
    "loop_step",
    "one_f_one_b",
    "paper_zb_h1",
    "paper_zbv",
]

F, B, I, W = (ActionKind(k) for k in "FBIW")  # noqa: E741 -- the kinds' own letters
_OLDEST = -1  # the stage of a W step that takes the oldest pending weight half (DualPipeV)


def one_f_one_b(mbs: list[int], warmup: int, backward: ActionKind = B) -> Order:
    """1F1B over `mbs` on a stage that warms up with `warmup` forwards, then alternates
    one forward with one `backward` (B, or I under zero bubble), then drains."""
    w = min(warmup, len(mbs))
    order: Order = [(F, j) for j in mbs[:w]]
    for i, j in enumerate(mbs[w:]):
        order += [(F, j), (backward, mbs[i])]
    return order + [(backward, j) for j in mbs[len(mbs) - w :]]


def loop_step(plan: Plan, rank: int, k: int, kind: ActionKind) -> Step:
    """The k-th forward (or backward half) of `rank` on a "loop" placement, Megatron's
    order: rounds of N micro-batches through the device's stages, backwards in reverse."""
    n = plan.num_devices
    v = len(plan.stages) // n
    chunk = (k // n) % v
    if kind != F:
        chunk = v - 1 - chunk
    return chunk * n + rank, kind, (k // (n * v)) * n + k % n


def _loop_sizes(plan: Plan, mbs: list[int]) -> tuple[int, int, int]:
    """A "loop" placement's devices N, stages per device v, and steps per device M * v."""
    n = plan.num_devices
    v = len(plan.stages) // n
    return n, v, len(mbs) * v


def interleaved(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """Megatron's interleaved 1F1B on a "loop" placement (`graphpipe.scheduling.generators`
    describes it)."""
    n, v, total = _loop_sizes(plan, mbs)
    orders = []
    for rank in range(n):
        warmup = min(2 * (n - 1 - rank) + (v - 1) * n, total)
        order = [loop_step(plan, rank, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            order += [loop_step(plan, rank, warmup + k, F), loop_step(plan, rank, k, B)]
        order += [loop_step(plan, rank, k, B) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def interleaved_zb(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """Interleaved zero bubble (ZB1P) on a "loop" placement (`graphpipe.scheduling.generators`
    describes it)."""
    n, v, total = _loop_sizes(plan, mbs)
    orders = []
    for rank in range(n):
        warmup = min((n - 1 - rank) + (v - 1) * n, total)
        order = [loop_step(plan, rank, k, F) for k in range(warmup)]
        pending: list[Step] = []
        for k in range(total):
            if warmup + k < total:
                order.append(loop_step(plan, rank, warmup + k, F))
            order.append(loop_step(plan, rank, k, I))
            pending.append(order[-1])
            if k >= rank:  # rank r defers its first r weight halves into the cool-down
                stage, _, j = pending.pop(0)
                order.append((stage, W, j))
        orders.append(order + [(stage, W, j) for stage, _, j in pending])
    return orders


def paper_zbv(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """ZB-V's order as the paper draws it (arXiv 2405.15362, figure 4), per device d of N
    with stages a = d (down the V) and b = 2N-1-d (back up), counted over
    max(M, 2N-1) micro-batches and then restricted to the M there are:

        warm-up   2(N-d)-1 a-forwards; d times Fb Fa; N-d times Fb Ib Wb
        steady    Fa Ia Wa Fb Ib Wb until every forward is done
        cool-down d times Ia Ib; N-d times Ia Wa; the b weights left, then the a ones
    """
    n, m = plan.num_devices, len(mbs)
    return [
        [(s, k, mbs[j]) for s, k, j in paper_zbv_device(n, d, max(m, 2 * n - 1)) if j < m]
        for d in range(n)
    ]


def paper_zbv_device(n: int, d: int, count: int) -> RankOrder:
    """Device d's ZB-V order over `count` micro-batches 0..count-1 (see `paper_zbv`)."""
    a, b = d, 2 * n - 1 - d
    done = dict.fromkeys([(s, k) for s in (a, b) for k in (F, I, W)], 0)
    order: RankOrder = []

    def run(*steps: tuple[int, ActionKind]) -> None:
        for stage, kind in steps:
            order.append((stage, kind, done[(stage, kind)]))
            done[(stage, kind)] += 1

    run(*[(a, F)] * (2 * (n - d) - 1))
    run(*[(b, F), (a, F)] * d)
    run(*[(b, F), (b, I), (b, W)] * (n - d))
    while done[(b, F)] < done[(a, F)] or done[(a, F)] < count:
        run(*[(a, F)] * (done[(a, F)] < count))
        run((a, I), (a, W), (b, F), (b, I), (b, W))
    run(*[(a, I), (b, I)] * d)
    run(*[(a, I), (a, W)] * (n - d))
    run(*[(b, W)] * (done[(b, I)] - done[(b, W)]), *[(a, W)] * (done[(a, I)] - done[(a, W)]))
    return order


def dualpipev(plan: Plan, mbs: list[int]) -> list[RankOrder]:
    """DualPipeV's order (DeepSeek-V3's DualPipe, arXiv 2412.19437, cut in half onto a "v"
    placement, as github.com/deepseek-ai/DualPipe and torch's ScheduleDualPipeV build it),
    per device d of N with stages a = d and b = 2N-1-d, for M >= 2N micro-batches:

        warm-up   2(N-d-1) Fa; d+1 times Fa Fb; N-d-1 times Ib W Fb
        steady    (M-2N+d+1) times (Fa with Bb) (Fb with Ba); N-d-1 times Bb (Fb with Ba)
        cool-down d+1 B then d+1 I, alternating b and a; N-d-1 times W Ia; d+1 times W

    A W is always the oldest pending weight half of either stage. "Fa with Bb" is the pair
    DualPipe overlaps (one chunk's forward with the other's full backward, so each hides the
    other's communication); here the pair runs one after the other, forward first (as
    torch's runtime runs its OVERLAP_F_B), each half sending as it ends (torch sends after
    the pair): without the overlap the order is what remains. O(M) per device.
    """
    n = plan.num_devices
    return [[(s, k, mbs[j]) for s, k, j in dualpipev_device(n, d, len(mbs))] for d in range(n)]


def dualpipev_device(n: int, d: int, count: int) -> RankOrder:
    """Device d's DualPipeV order over `count` >= 2N micro-batches (see `dualpipev`)."""
    a, b = d, 2 * n - 1 - d
    w = (_OLDEST, W)
    done = dict.fromkeys([(s, k) for s in (a, b) for k in (F, I)], 0)  # a B counts as an I
    pending: list[tuple[int, int]] = []  # (stage, micro-batch) of the I passes owing a W
    order: RankOrder = []

    def run(*steps: tuple[int, ActionKind]) -> None:
        for stage, kind in steps:
            if kind == W:
                stage, j = pending.pop(0)
            else:
                key = (stage, F if kind == F else I)
                j, done[key] = done[key], done[key] + 1
            order.append((stage, kind, j))
            if kind == I:
                pending.append((stage, j))

    run(*[(a, F)] * (2 * (n - d - 1)), *[(a, F), (b, F)] * (d + 1))
    run(*[(b, I), w, (b, F)] * (n - d - 1))
    run(*[(a, F), (b, B), (b, F), (a, B)] * (count - 2 * n + d + 1))
    run(*[(b, B), (b, F), (a, B)] * (n - d - 1))
    cool = [(b, B), (a, B)] * (d + 1)  # the first d+1 of them full, the rest split
    run(*cool[: d + 1], *[(s, I) for s, _ in cool[d + 1 :]])
    run(*[w, (a, I)] * (n - d - 1), *[w] * (d + 1))
    return order


def paper_zb_h1(plan: Plan, base: dict[int, Order]) -> dict[int, Order]:
    """Each stage's 1F1B order `base` (F and I) with its W passes placed as the paper's
    ZB-H1: right after each I once the stage has deferred as many as the stages before it."""
    before = edges_to_sink(plan.stage_graph.reverse())
    return {  # replicas hold disjoint micro-batches, each in its own order
        s.index: [
            step
            for rank in s.devices
            for step in deferred_weights(
                [a for a in base[s.index] if s.device_for(a[1]) == rank], before[s.index]
            )
        ]
        for s in plan.stages
    }


def deferred_weights(order: Order, defer: int) -> Order:
    """`order` (F and I) with the W of the oldest pending micro-batch right after each I from
    the (defer + 1)-th on, and the Ws still pending at its end."""
    out: Order = []
    pending: list[int] = []
    inputs = 0  # I passes so far
    for kind, j in order:
        out.append((kind, j))
        if kind == I:
            pending.append(j)
            inputs += 1
            if inputs > defer:
                out.append((W, pending.pop(0)))
    return out + [(W, j) for j in pending]
