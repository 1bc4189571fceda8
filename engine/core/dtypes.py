"""The compute dtype the engine picks when none is given (torch-free: the planner prices the
same choice the executor makes)."""

from __future__ import annotations

import json
import platform
from functools import cache
from pathlib import Path

HALF_DTYPES = ("float16", "bfloat16")
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


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype a checkpoint's config.json declares (transformers 5 `dtype`, 4.x
    `torch_dtype`), or None."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def default_dtype(compute_device: str, checkpoint: str | None) -> str:
    """float32 on a CPU, except bfloat16 for a half-precision checkpoint on a CPU with native
    bfloat16 (as vLLM's CPU backend does; float32 stays the exact reference); on CUDA the
    checkpoint's half type, float16 when it has none."""
    is_half = checkpoint in HALF_DTYPES
    if compute_device == "cpu":
        return "bfloat16" if is_half and cpu_has_native_bf16() else "float32"
    return checkpoint if checkpoint is not None and is_half else "float16"
