"""Tracing: an `nn.Module` and example inputs -> an annotated `torch.fx.GraphModule`.

tracer.py    symbolic_trace, torch.export as the fallback; micro-batch size; state guard
bind.py      a call's arguments -> one tensor per placeholder; the model's output back
annotate.py  node.meta facts (shapes, bytes, FLOPs, parameters); `TraceInfo`
"""
