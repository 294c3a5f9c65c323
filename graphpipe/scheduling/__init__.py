"""Scheduling: a `Plan` -> a `Schedule` -> per-rank `Program`s.

    generators.py  gpipe, 1f1b, zb, async, 2bw, interleaved, zbv, graph_interleaved
    greedy.py      the greedy runs of a plan's costs that build zb's W, zbv, graph_interleaved
    program.py     the lowering: per rank, compute actions and fused communication groups
    simulate.py    a discrete-event run of a schedule over a plan's costs
    dryrun.py      schedule checks, programs run under NCCL's and gloo's semantics

It reads only the IR, so the planner can simulate candidate plans with it.
"""
