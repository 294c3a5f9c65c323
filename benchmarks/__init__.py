"""graphpipe's benchmarks. `python -m benchmarks` runs them all and writes BENCHMARKS.md.

python -m benchmarks.planner     graph vs sequential plans of the paper presets (simulated)
"""
