"""Scheduling: a `Plan` -> a `Schedule` -> per-rank `Program`s.

    generators.py  gpipe, 1f1b, zb, zb2, async, 2bw, interleaved, interleaved_zb, zbv,
                   dualpipev, graph_interleaved
    orders.py      the fixed orders written out (1F1B, interleaved, ZB-H1, ZB1P, ZB-V,
                   DualPipeV)
    greedy.py      greedy runs (plan's costs or the papers' F = I = W): zb's W, zb2, zbv,
                   graph_interleaved; replay of a fixed order
    program.py     the lowering: per rank, compute actions and fused communication groups
    simulate.py    a discrete-event run of a schedule over a plan's costs
    dryrun.py      schedule checks, programs run under NCCL's and gloo's semantics

It reads only the IR, so the planner can simulate candidate plans with it.
"""
