"""The runtime: every rank runs its stage's part of the schedule over torch.distributed.

    stage.py     carve a stage's GraphModule out of the traced graph; micro-batch shapes
    comm.py      one packed message per edge and micro-batch, timeouts naming the peer
    executor.py  run a rank's actions (F, B, I, W, sends, receives, updates)
    backward.py  whole backward, or split into input and weight halves (zero bubble)
    weights.py   weight policies: which weights each pass uses, when to step
    sync.py      gradient sums over data-parallel replicas and tied copies

`graphpipe.compile` wires them together; `graphpipe.launch` starts local processes.
"""
