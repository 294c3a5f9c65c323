"""Planning: a traced graph -> a `Plan` (a DAG of stages on devices).

    profile.py, devices.py   per-op times (FLOPs, measured, roofline of a device preset)
    opgraph.py               the networkx view the algorithms read
    partition.py             `plan()`: fold, coarsen, search, place, recompute, assemble
    fold.py, sptree.py, pieces.py, search.py, manual.py, place.py, recompute.py,
    interleave.py, assemble.py   the partitioner's steps
    validate.py              checks of a Plan against its graph
    schedule_memory.py       a plan's in-flight counts and memory for a schedule's order

The planner compares candidate plans by simulating them, so it imports `graphpipe.scheduling`
(which knows only the IR).
"""
