"""How the process's C allocator keeps freed host memory (glibc on Linux)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

KEEP_BYTES = 256 << 20
"""Blocks up to this size come from malloc's heap, and up to this much freed memory at its
top stays there (glibc's defaults: 128 KiB, rising with use to 32 MiB, and 128 KiB)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks of up to 256 MiB for the next allocation instead
    of handing them back to the kernel; True where it took effect (once per process).

    By default glibc maps each block over 32 MiB on its own and unmaps it when freed, so a
    step's large activations (a 2048-token step's MLP output is 92 MB in float32 on a 1.1B
    model) and oneDNN's GEMM scratch come back as fresh pages, zeroed by the kernel one page
    fault at a time: a large float32 GEMM runs 10% slower, a 1.1B model's mixed workload
    about 6% (docs/benchmarks.md). tcmalloc, which vLLM's CPU build preloads, keeps such
    blocks too. The process then keeps up to that much freed memory resident;
    `NANOFLEX_KEEP_FREED_MEMORY=0` leaves glibc's behaviour."""
    if os.environ.get("NANOFLEX_KEEP_FREED_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) and mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
