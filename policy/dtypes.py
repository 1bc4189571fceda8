"""The compute dtype the engine picks when none is given, and what it costs per element.

Torch-free and engine-free: `nanoflex plan` prices the dtype the engine computes in on the
same device (a CPU computes float32, unless it multiplies bfloat16 in hardware), and the
engine (engine/core/dtypes.py) picks it from here.
"""

from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

DTYPES = ("float16", "bfloat16", "float32")
HALF_DTYPES = ("float16", "bfloat16")
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}
"""/proc/cpuinfo flags of bfloat16 dot products in hardware: x86's AVX512-BF16 and AMX-BF16,
Arm's BF16 (FEAT_BF16)."""


@cache
def cpu_has_native_bf16() -> bool:
    """The CPU multiplies bfloat16 in hardware (Linux; False where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(_BF16_CPU_FLAGS & set(value.split()))
    return platform.machine() == "arm64"  # macOS on Apple silicon has no /proc; M2+ have BF16


def default_dtype(compute_device: str, checkpoint: str | None) -> str:
    """float32 on a CPU, except bfloat16 for a half-precision checkpoint on a CPU with native
    bfloat16 (as vLLM's CPU backend does; float32 stays the exact reference); on CUDA the
    checkpoint's half type, float16 when it has none."""
    is_half = checkpoint in HALF_DTYPES
    if compute_device == "cpu":
        return "bfloat16" if is_half and cpu_has_native_bf16() else "float32"
    return checkpoint if checkpoint is not None and is_half else "float16"
