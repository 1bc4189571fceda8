"""`return_freed_memory`: hand the heap pages freed by a large request back to the OS.

glibc keeps freed memory for reuse, and after a large allocation is freed it raises its
threshold for serving big blocks from the heap, so a few large bodies can leave the
daemon hundreds of MB larger for good. `malloc_trim(0)` returns the free pages. On other
C libraries this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
    """Release free heap pages to the OS (glibc); a no-op elsewhere."""
    if _TRIM is not None:
        _TRIM(0)
