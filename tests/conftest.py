"""Shared test set-up: one thread per process, as on CI's two cores."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
