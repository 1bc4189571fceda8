"""Native CPU kernels, compiled on this machine the first time they are asked for.

`paged_decode` (paged_decode.cpp) is decode attention read in place from a layer's KV pool:
what vLLM's CPU backend does with its own kernels. Torch has no op that attends over rows
scattered in a pool, so the portable path (`engine.executor.attention`) gathers them into a
padded copy first; on a CPU, whose memory bandwidth is the limit in decode attention, that
copy costs more than the attention itself.

The kernel is built with torch's C++ extension loader (a C++ compiler and ninja) for this
CPU's own instruction set (`-march=native`), into torch's extensions folder
(`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions), once per source, flags and
CPU: a later process loads the built library in well under a second. Where it cannot be built
(no compiler, say), `paged_decode()` logs why once and returns None, and attention takes the
portable path: the same results, slower. `EngineArgs.native_kernels=False`
(`--no-native-kernels`) never builds or uses it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("nanoflex.engine")

SOURCE = Path(__file__).with_name("paged_decode.cpp")
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp")
"""`-fopenmp` makes `at::parallel_for` run on torch's own OpenMP threads (the library
links `libgomp.so.1`, which resolves to the copy torch has loaded), not serially."""

PagedDecode = Callable[..., torch.Tensor]
"""(q (B, heads, head_dim), pool (slots, 2 * kv_dim), slots (B * kv_max,) int64,
kv_lens (B,) int64, num_kv_heads, scale, window) -> (B, heads, head_dim)."""

_lock = threading.Lock()


def _cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU model and its feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))


def library_name() -> str:
    """One build per source, flags and CPU (a home folder shared by unlike machines)."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), _cpu_signature().encode()):
        digest.update(part)
    return f"nanoflex_kernels_{digest.hexdigest()[:12]}"


@functools.cache
def _build() -> PagedDecode | None:
    try:
        from torch.utils.cpp_extension import load

        load(
            name=library_name(),
            sources=[str(SOURCE)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        logger.warning(
            "native CPU attention kernel unavailable (%s); decode attention gathers a "
            "padded copy instead (same results, slower)",
            reason,
        )
        return None
    op: PagedDecode = torch.ops.nanoflex.paged_decode
    return op


def paged_decode() -> PagedDecode | None:
    """The built `torch.ops.nanoflex.paged_decode`, or None where it cannot be built."""
    with _lock:
        return _build()
