"""`return_freed_memory`: hand the heap pages freed by a large request back to the OS.

glibc keeps freed memory for reuse, and after a large allocation is freed it raises its
threshold for serving big blocks from the heap, so a few large bodies can leave the
daemon hundreds of MB larger for good. `malloc_trim(0)` returns the free pages. On other
C libraries this does nothing. What a refused request parsed can outlive it in a reference
cycle (an exception's traceback holds the frames that hold the parsed body) until the
garbage collector next runs, which an idle daemon may not do for a long while: so the
cycles are collected first.

`keep_heaps_trimmed`: glibc raises its thresholds for returning memory after a large block
is freed (up to 64 MB per heap), and a worker thread's heap keeps its free top below that
threshold, which `malloc_trim` does not return: four concurrent 15 MiB token-id bodies left
the daemon 25-80 MB larger, varying run to run. With the trim threshold fixed at 1 MiB (which
also fixes the mmap threshold at its default), each heap returns its free top as it frees
(measured: within 5 MB). The engine runs in its own process and keeps glibc's defaults.
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


def _libc_function(name: str) -> Callable[..., int] | None:
    """The C library's function `name`, or None where there is none (not glibc)."""
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    return function


_TRIM = _libc_function("malloc_trim")
_MALLOPT = _libc_function("mallopt")
_M_TRIM_THRESHOLD = -1
"""glibc's mallopt parameter: free memory at the top of a heap beyond this is returned
(malloc.h)."""
TRIM_THRESHOLD_BYTES = 1 << 20


def return_freed_memory() -> None:
    """Free what unreachable cycles hold, then release free heap pages to the OS (glibc;
    elsewhere only the first)."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


def keep_heaps_trimmed() -> None:
    """Fix glibc's trim threshold at `TRIM_THRESHOLD_BYTES` in this process (elsewhere
    nothing); child processes are not affected."""
    if _MALLOPT is not None:
        _MALLOPT(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
