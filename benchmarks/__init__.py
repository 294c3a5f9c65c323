"""graphpipe's benchmarks. `python -m benchmarks` runs them all and writes BENCHMARKS.md.

python -m benchmarks.planner       graph vs sequential plans of the paper presets (simulated)
python -m benchmarks.runtime       2 CPU processes: vs torch.distributed.pipelining, vs one
                                   process, simulated vs measured step time
python -m benchmarks.peers         emulated ranks: every graphpipe schedule beside every torch one
python -m benchmarks.convergence   the weight policies on a teacher-student regression
python -m benchmarks.vlm           models.vlm at 16-64 simulated H100s: the graph against
                                   torchtitan's VLM layout and the best sequential pipeline
"""
