"""Native CPU kernels, compiled on this machine the first time they are asked for.

- `paged_decode` (paged_decode.cpp) is decode attention read in place from a layer's KV pool:
  what vLLM's CPU backend does with its own kernels. Torch has no op that attends over rows
  scattered in a pool, so the portable path (`engine.executor.attention`) gathers them into
  a padded copy first; on a CPU, whose memory bandwidth is the limit in decode attention,
  that copy costs more than the attention itself.
- `paged_prefill` (paged_prefill.cpp) is the prefill chunks' attention, also read from the
  pool: flash attention with register-blocked products, where torch's CPU flash kernel
  reaches about a quarter of the GEMM rate (measured in bench/kernels/prefill_attention.py). Its
  tiles need AVX-512; without it the engine runs torch's flash kernel instead
  (`tiled_prefill`).
- `apply_token_bitmask` (token_mask.cpp) sets the logits of tokens a structured output's
  grammar forbids to -inf, straight from llguidance's bits (engine/executor/logits.py).
- `dense_ops` (dense_ops.cpp) are the small operations around a layer's GEMMs, one pass
  each: RMSNorm, residual add + RMSNorm, rotary, SiLU-and-multiply (vLLM has the same as
  CPU ops). They round where the torch ops they replace round.

The library is built with torch's C++ extension loader (a C++ compiler and ninja) for this
CPU's own instruction set (`-march=native`; `$NANOFLEX_KERNEL_ISA` picks a baseline level
instead, `ISA_LEVELS`), into torch's extensions folder
(`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions), once per source, flags, CPU
and checkout (`build_name`): a later process loads the built library in well under a second. Where
`$NANOFLEX_KERNEL_DIR` names a folder of libraries built ahead for each baseline level
(prebuilt.py: the Docker images do, and carry no compiler), the best level this CPU runs is
loaded from there and nothing is compiled. Where the library cannot be built (no compiler,
say), one warning says why and torch's own ops run instead: the same results, slower.
`EngineArgs.native_kernels=False` (`--no-native-kernels`) never builds or uses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.kernels.sources import CFLAGS as CFLAGS
from engine.kernels.sources import HEADERS as HEADERS
from engine.kernels.sources import HERE, SOURCES, build_name, cflags
from engine.kernels.sources import ISA_ENV as ISA_ENV
from engine.kernels.sources import ISA_LEVELS as ISA_LEVELS
from engine.kernels.sources import isa_level as isa_level
from engine.kernels.sources import library_name as library_name
from engine.kernels.sources import supported_levels as supported_levels

logger = logging.getLogger("nanoflex.engine")


PagedDecode = Callable[..., torch.Tensor]
"""(q (B, heads, head_dim), pool (slots, 2 * kv_dim), slots (B * kv_max,) int64,
kv_lens (B,) int64, num_kv_heads, scale, window, sinks) -> (B, heads, head_dim); `window`
negative: chunked attention (engine.executor.attention.in_window); `sinks`: None, or
(heads,) float32 sink logits on q's device (gpt-oss)."""

PagedPrefill = Callable[..., torch.Tensor]
"""(q (T, heads, head_dim), pool (slots, 2 * kv_dim), slots (sum of kv_len,) int64: each
sequence's keys back to back, q_starts and kv_starts (B + 1,) int64: where each sequence's
rows of q and of slots begin, num_kv_heads, scale, window) -> (T, heads, head_dim); query t
of a sequence sees its keys [0, kv_len - q_len + t] (the last `window` of them; 0: all;
negative: its own chunk), `sinks` as in decode."""

PagedAttention = Callable[..., torch.Tensor]
"""Decodes and prefill chunks, any mix of them, in one call: (q (T, heads, head_dim),
each sequence's rows back to back, pool (slots, 2 * kv_dim), table (B, W) int64: each
sequence's key slots, q_starts (B + 1,) int64: where its rows begin in q, kv_lens (B,) int64:
its keys, the new rows' last, num_kv_heads, scale, window, q_max, kv_max: the most new rows
and keys of a sequence (host ints), sinks) -> (T, heads, head_dim); query t of a sequence
sees its keys as in `PagedPrefill`."""

_lock = threading.Lock()


@functools.cache
def _build() -> str | None:
    """Load the library built ahead for this CPU where there is one (`$NANOFLEX_KERNEL_DIR`),
    else build (or find built) and load it; the instruction-set level it was built for
    (`ISA_LEVELS`), or None, with one warning, where it cannot be built."""
    from engine.kernels import prebuilt

    if prebuilt.load():
        return prebuilt.pick_level() or "native"
    try:
        from torch.utils.cpp_extension import load

        with _ninja_of_the_package():
            load(
                name=build_name(),
                sources=[str(p) for p in SOURCES],
                extra_include_paths=[str(HERE)],
                extra_cflags=list(cflags()),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:
        text = str(e.__cause__ or e).strip()  # a load error's cause names the symbol
        reason = text.splitlines()[-1] if text else type(e).__name__
        logger.warning(
            "native CPU kernels unavailable (%s; rebuild with TORCH_EXTENSIONS_DIR set and "
            "verbose torch logging to see the compiler's output); torch's own ops run instead "
            "(same results, slower)",
            reason,
        )
        return None
    return isa_level()


def tiled_prefill(level: str, cpu_levels: list[str]) -> bool:
    """Whether a library built for `level` on a CPU that runs `cpu_levels` has the prefill
    kernel's AVX-512 register tiles (paged_prefill.cpp). Without them each query row runs in
    plain loops, and torch's flash attention over a gathered copy is faster: on a 2-core
    AVX2 EPYC, 16 prompts of 1,024 tokens prefill 1.9x faster through it (docs/benchmarks.md,
    "Prefill attention without AVX-512")."""
    return level.startswith("avx512") or (level == "native" and "avx512" in cpu_levels)


@contextlib.contextmanager
def _ninja_of_the_package() -> Iterator[None]:
    """PATH with the `ninja` package's own binary (a dependency of nanoflex) first, while
    torch's loader runs `ninja` from PATH. Ninja versions keep their build logs apart (1.12
    changed the log's command hash): with a system ninja 1.11 beside the package's 1.13, a
    process with the virtualenv's bin on PATH and one without each rebuilt the library whole
    over the other's build (a minute or more of compiling at every alternation)."""
    try:
        import ninja
    except ImportError:  # the system's ninja, if any, then
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


@dataclass(frozen=True, slots=True)
class PagedKernels:
    """Attention read in place from a layer's KV pool: the native kernels on the CPU
    (`paged_kernels`), Triton's on CUDA (`cuda_paged_kernels`)."""

    decode: PagedDecode
    """Decodes: one query token a sequence."""
    prefill: PagedPrefill | None
    """Prefill chunks: any number of query tokens a sequence, causal; None: prefill chunks
    gather their keys for SDPA."""
    attention: PagedAttention | None = None
    """Decodes and prefill chunks alike (Triton's one paged kernel, triton_paged.py), called
    once per group of a step; None: `decode` and `prefill`."""


def paged_kernels() -> PagedKernels | None:
    """The built `torch.ops.nanoflex.paged_decode` and `paged_prefill`, or None where the
    library cannot be built."""
    with _lock:
        built = _build()
    if not built:
        return None
    return PagedKernels(torch.ops.nanoflex.paged_decode, torch.ops.nanoflex.paged_prefill)


def cuda_paged_kernels(one_kernel: bool = True) -> PagedKernels | None:
    """Triton's one paged kernel (triton_paged.py) for every step, decode, prefill and mixed,
    or None, with one warning, where Triton is not installed. `one_kernel=False`: the
    previous pair, the Triton decode kernel (triton_attention.py) for decodes and prefill
    chunks gathered for SDPA, whose flash kernel the H200 measured at 4.6x the first Triton
    prefill kernel (bench/gpu/attention.py compares them all)."""
    from engine.kernels import triton_attention, triton_paged

    if not triton_attention.available():
        logger.warning("triton is not installed: CUDA attention gathers the keys for SDPA")
        return None
    one = triton_paged.paged_attention if one_kernel else None
    return PagedKernels(triton_attention.paged_decode, None, one)


@dataclass(frozen=True, slots=True)
class DenseOps:
    """The operations around a layer's GEMMs: fused, one pass each (dense_ops.cpp,
    `dense_ops()`), or the torch ops they fuse (the Llama model's `TORCH_OPS`)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(x (T, hidden), weight, eps) -> RMSNorm(x), as transformers' LlamaRMSNorm rounds."""
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    """(h, delta, weight, eps) -> (h + delta, RMSNorm(h + delta))."""
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
    """(x (T, heads, D), cos, sin (T, 1, D), rotated) -> x * cos + rotate_half(x) * sin
    for heads [0, rotated), the rest as they are: one contiguous (T, heads, D)."""
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    """(T, 2 I) gate then up -> SiLU(gate) * up (T, I)."""


def dense_ops() -> DenseOps | None:
    """The built fused ops, or None where the library cannot be built."""
    with _lock:
        built = _build()
    if not built:
        return None
    ops = torch.ops.nanoflex
    return DenseOps(ops.rms_norm, ops.add_rms_norm, ops.rotary, ops.silu_mul)


def attention_kernels(cuda: bool) -> PagedKernels | None:
    """The attention kernels the engine runs on its compute device: native on a CPU (where
    they build; prefill chunks only where the library has the prefill kernel's AVX-512
    tiles, `tiled_prefill`, else they gather their keys for SDPA), Triton on CUDA (where it
    is installed)."""
    if cuda:
        return cuda_paged_kernels()
    kernels = paged_kernels()
    with _lock:
        level = _build()
    if kernels is None or level is None or tiled_prefill(level, supported_levels()):
        return kernels
    return dataclasses.replace(kernels, prefill=None)


def fused_dense_ops(cuda: bool) -> DenseOps | None:
    """The fused ops around the GEMMs the engine runs on its compute device: native on a CPU,
    Triton on CUDA; None where they are missing (torch's own ops run)."""
    return cuda_dense_ops() if cuda else dense_ops()


def cuda_dense_ops() -> DenseOps | None:
    """The fused ops in Triton (triton_dense.py) for CUDA, or None, with one warning, where
    Triton is not installed."""
    from engine.kernels import triton_dense, triton_launch

    if not triton_launch.available():
        logger.warning("triton is not installed: CUDA runs torch's unfused norm and rotary ops")
        return None
    td = triton_dense
    return DenseOps(td.rms_norm, td.add_rms_norm, td.rotary, td.silu_mul)


TokenMask = Callable[[torch.Tensor, torch.Tensor], None]
"""(logits (rows, vocab) float32, bits (rows, ceil(vocab / 32)) int32) -> None: in place."""


def token_mask() -> TokenMask | None:
    """The built `torch.ops.nanoflex.apply_token_bitmask`, or None where the library cannot
    be built."""
    with _lock:
        built = _build()
    op: TokenMask | None = torch.ops.nanoflex.apply_token_bitmask if built else None
    return op
