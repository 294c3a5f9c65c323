"""Shared test set-up: one thread per process, as on CI's two cores; a one-rank process
group for modules that compile in this process (`one_rank`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A one-rank gloo process group for a module's single-process compiles (use it with
    `pytestmark = pytest.mark.usefixtures("one_rank")`)."""
    if dist.is_initialized():  # pragma: no cover - another module left one
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
