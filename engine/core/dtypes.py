"""The checkpoint's declared dtype; the engine's default compute dtype is policy/dtypes.py's
(torch-free: the planner prices the same choice the executor makes)."""

from __future__ import annotations

import json
from pathlib import Path

from policy.dtypes import HALF_DTYPES, cpu_has_native_bf16, default_dtype

__all__ = ["HALF_DTYPES", "checkpoint_dtype", "cpu_has_native_bf16", "default_dtype"]


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype a checkpoint's config.json declares (transformers 5 `dtype`, 4.x
    `torch_dtype`), or None."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None
