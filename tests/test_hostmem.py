"""On CPU, a compiled pipeline's process reuses freed host memory (`graphpipe.runtime.hostmem`).

Each case runs in a fresh interpreter: glibc's settings are the whole process's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HOSTMEM = Path(__file__).parents[1] / "graphpipe" / "runtime" / "hostmem.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# after `setup`, allocate a 24 MB tensor (a stage's weight gradients) and free it; print the MB
# the process gave back to the system (its resident size before the free minus after), then
# whether keep_freed ran. Without it glibc serves the first such block by mmap and unmaps it
# when freed (its threshold starts at 128 KB and follows the blocks freed before, so the
# plain case imports nothing more).
SCRIPT = """
import sys, torch
{setup}
def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
x = torch.ones(6 << 20)
held = resident_mb()
del x
hostmem = sys.modules.get("graphpipe.runtime.hostmem")
print(held - resident_mb(), 0 if hostmem is None else hostmem.keep_freed.cache_info().currsize)
"""

# hostmem alone, without importing graphpipe (whose imports move glibc's thresholds)
ALONE = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("graphpipe.runtime.hostmem", {str(HOSTMEM)!r})
hostmem = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = hostmem
spec.loader.exec_module(hostmem)
assert hostmem.keep_freed()
"""

COMPILE = """
import functools, graphpipe, torch.distributed as dist, torch.nn.functional as F
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
pm = graphpipe.compile(model, torch.randn(8, 4), loss_fn=F.mse_loss, micro_batches=2,
                       optimizer=functools.partial(torch.optim.SGD, lr=0.1), quiet=True,
                       host_cache={host_cache})
pm.step(torch.randn(8, 4), target=torch.randn(8, 1))
"""


def _run(setup: str) -> tuple[int, int]:
    """The MB given back when the block was freed, and whether `keep_freed` ran (1) or not."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    given, called = done.stdout.split()[-2:]
    return int(given), int(called)


def _kept(given: int) -> bool:
    """The 24 MB block stayed (the resident size, in whole MB, moved by rounding at most)."""
    return given <= 2


def test_keep_freed_keeps_a_freed_block_for_the_next_allocation() -> None:
    given, called = _run("")
    assert given >= 22 and called == 0  # glibc unmapped it: the next one faults it in again
    given, called = _run(ALONE)
    assert _kept(given) and called == 1


def test_compile_on_cpu_keeps_freed_memory_unless_told_not_to() -> None:
    given, called = _run(COMPILE.format(host_cache=True))
    assert _kept(given) and called == 1
    _, called = _run(COMPILE.format(host_cache=False))
    assert called == 0
