"""The runtime: every rank runs its stage's part of the schedule over torch.distributed.

    stage.py     carve a stage's GraphModule out of the traced graph; micro-batch shapes
    comm.py      one packed message per edge and micro-batch, timeouts naming the peer
    executor.py  run a rank's actions (F, B, I, W, sends, receives, updates)
    backward.py  whole backward, or split into input and weight halves (zero bubble)
    weights.py   weight policies: which weights each pass uses, when to step
    sync.py      gradient sums over data-parallel replicas and tied copies
    failures.py  the failure board and the watch every wait runs under
    precision.py autocast, half-width values between stages, fp16 loss scaling
    emulate.py   emulated devices: stage compute replaced by waits of the plan's times

`graphpipe.compile` wires them together; `graphpipe.runtime.launch` starts local processes.
"""
