"""What a checkpoint's `quantization_config` says, read with the config (hf_config.py);
the dequantizing itself is engine/loading/fp8.py and engine/loading/mxfp4.py."""

from __future__ import annotations

from typing import Any


class Fp8ConfigError(ValueError):
    """A quantization_config nanoflex does not load."""


def fp8_block_size(quantization: dict[str, Any] | None) -> tuple[int, int] | None:
    """The (rows, columns) of one scale block of a checkpoint's `quantization_config`, or None
    without one; an FP8 variant other than block-scaled e4m3 with dynamic activations (what
    DeepSeek-V3 and Kimi K2 ship), or another method, raises `Fp8ConfigError` naming it."""
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method != "fp8":
        raise Fp8ConfigError(f"quantization method {method!r}")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise Fp8ConfigError(f"FP8 format {quantization.get('fmt')!r}")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise Fp8ConfigError(f"FP8 activation scheme {quantization.get('activation_scheme')!r}")
    block = quantization.get("weight_block_size") or [128, 128]
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise Fp8ConfigError(f"FP8 weight_block_size {block!r}")
    return int(block[0]), int(block[1])


def is_mxfp4(quantization: dict[str, Any] | None) -> bool:
    """The checkpoint's quantization_config says MXFP4 (gpt-oss's)."""
    return quantization is not None and quantization.get("quant_method") == "mxfp4"
