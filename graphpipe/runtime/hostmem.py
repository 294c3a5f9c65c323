"""Host memory on CPU ranks: freed blocks kept for reuse, as a device's caching allocator does.

A training step on CPU allocates and frees the same tensors every micro-batch: a Linear(1024)'s
4 MB weight gradient, added into `.grad` and freed, then its twin at the next micro-batch. By
default glibc gives a freed block of that size back to the operating system once the free
memory at the top of its heap passes its trim threshold (twice its mmap threshold, which
follows the largest block freed), and the next allocation faults every page in again and
zeroes it. Measured on the 2-core VM (`benchmarks.runtime`, 2 ranks of 8 x Linear(1024),
M = 8): 3,000 to 24,000 page faults a step on a rank, 10-15% of its time; with the
thresholds raised, 9 to 219.

`keep_freed` raises both with `mallopt`: blocks up to 32 MiB (glibc's largest dynamic mmap
threshold on 64-bit) come from the heap, and the heap is not trimmed below 2 GiB free. A
process then holds the memory its largest step needed, as PyTorch's CUDA caching allocator
does on a GPU. It applies to the whole process, once; `RuntimeConfig.host_cache=False` leaves
glibc as it is. Where the C library is not glibc (no `mallopt`), it does nothing and warns
once. The environment variables `MALLOC_MMAP_THRESHOLD_` and
`MALLOC_TRIM_THRESHOLD_` do the same from a process's start (`benchmarks.emulated.KEEP_FREED`).
"""

from __future__ import annotations

import ctypes
import functools
import warnings

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed"]

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int


@functools.cache
def keep_freed() -> bool:
    """Tell glibc to keep freed blocks for reuse (once per process).

    Returns:
        True when glibc took both settings; False where there is no glibc `mallopt` (warned).
    """
    libc = ctypes.CDLL(None)  # the C library the process already uses
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        warnings.warn(
            "host_cache=True: this C library has no glibc mallopt, so freed host memory goes "
            "back to the system as it decides (host_cache=False says nothing)",
            stacklevel=2,
        )
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting the trim threshold fixes the mmap threshold where it is
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
