"""The runtime: every rank runs its stage's part of the schedule over torch.distributed.

    stage.py     carve a stage's GraphModule out of the traced graph; micro-batch shapes
    comm.py      one packed message per edge and micro-batch, timeouts naming the peer
    executor.py  run a rank's actions (F, B, I, W, sends, receives, updates)
    routes.py    a rank's program resolved once: each message's peer, tag and edge
    backward.py  whole backward, or split into input and weight halves (zero bubble)
    weights.py   weight policies: which weights each pass uses, when to step
    sync.py      gradient sums over data-parallel replicas and tied copies
    failures.py  the failure board and the watch every wait runs under
    precision.py autocast, half-width values between stages, fp16 loss scaling
    emulate.py   emulated devices: stage compute replaced by waits of the plan's times
    hostmem.py   on CPU, glibc keeps freed blocks for reuse, as a device's caching allocator
    factory.py   real stages or emulated stand-ins, chosen once from RuntimeConfig.emulate
    spec.py      RunSpec: compile's arguments, checked once and frozen; RuntimeConfig
    hooks.py     update hooks run before each optimizer step: fp16 unscale, NaN check, clip
    groups.py    process groups for replicas and tied weights
    wiring.py    build a rank's stages, groups, hooks, policy, transport and executor
    pieces.py    what wiring returns, by concern (Place, Holdings, Update, Run)
    batching.py  a call's inputs and target checked and split into micro-batches
    stepping.py  step() and drain(), and the program each call runs
    inference.py eval_step() and __call__(): forward only, in eval mode
    state.py     state dicts and the weight versions; what a checkpoint reads
    timelines.py recording the actions' spans and gathering them
    checkpoint.py  save and load (torch.distributed.checkpoint directories)
    pipeline.py  PipelinedModel: the public class, delegating to the parts above

`graphpipe.compile` checks its arguments into a RunSpec and builds a PipelinedModel;
`graphpipe.runtime.launch` starts local processes.
"""
