"""Tools over the phases: pictures, reports, the command line, the example loop.

render.py, timeline.py   graphviz pictures of plans; SVG and Chrome traces of timelines
report.py                tabulate tables of plans and simulated runs
calibrate.py             costs measured on a running pipeline -> a Plan for the simulator
workload.py              the factory protocol of models/
train.py, cli.py         the example loop, `graphpipe plan / run / export`
deps.py                  the import-layer check (`python -m graphpipe.tools.deps`)
"""
