"""`return_freed_memory`: hand the heap pages freed by a large request back to the OS.

glibc keeps freed memory for reuse, and after a large allocation is freed it raises its
threshold for serving big blocks from the heap, so a few large bodies can leave the
daemon hundreds of MB larger for good. `malloc_trim(0)` returns the free pages. On other
C libraries this does nothing. What a refused request parsed can outlive it in a reference
cycle (an exception's traceback holds the frames that hold the parsed body) until the
garbage collector next runs, which an idle daemon may not do for a long while: so the
cycles are collected first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

logger = logging.getLogger("nanoflex.server")

LARGE_BODY_BYTES = 1 << 20
"""After a request body at least this large, the daemon trims its heap."""


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    return trim


_TRIM = _malloc_trim()


def return_freed_memory() -> None:
    """Free what unreachable cycles hold, then release free heap pages to the OS (glibc;
    elsewhere only the first)."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)
