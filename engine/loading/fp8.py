"""FP8 checkpoints as DeepSeek-V3, R1 and Kimi K2 ship them: e4m3 weights with one float32
scale per 128 x 128 block (`<name>.weight_scale_inv`, the factor that restores the weight),
dequantized at load into the compute dtype.

Why at load: no GEMM nanoflex runs takes FP8 (oneDNN on the CPU; the CUDA path's dense
GEMMs and its group-wise 4-bit path take bfloat16 or float32 weights), so an FP8 weight
would be expanded before every product anyway; expanded once, every tier, kernel and the
4-bit compression treat it as any other weight, and the cost model prices what is stored
(the checkpoint's bytes times two in bfloat16). Keeping the blocks compressed, priced as
8-bit the way the 4-bit path is, would halve DeepSeek-V3's 1.34 TB in bfloat16 and is the
next step. transformers on a CPU dequantizes the same way (float32 product, then the
model's dtype), so the weights are the ones it computes with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.quant_config import Fp8ConfigError

SCALE_SUFFIX = "_scale_inv"
"""`<module>.weight_scale_inv` beside an FP8 `<module>.weight`."""


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """(rows, cols) e4m3 weight and its (ceil(rows / block_rows), ceil(cols / block_cols))
    scales -> the float32 weight: each block times its scale (the last blocks of a side that
    is no multiple of the block, such as DeepSeek-V3's 576-row kv_a_proj, cover what is left)."""
    rows, cols = weight.shape
    expanded = scale.float().repeat_interleave(block[0], dim=0)[:rows]
    expanded = expanded.repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * expanded


def dequantizing_getters(
    getters: dict[str, Callable[[], torch.Tensor]], block: tuple[int, int]
) -> dict[str, Callable[[], torch.Tensor]]:
    """A checkpoint's tensor getters with every weight that has a scale beside it read
    dequantized (float32) and the scales themselves gone; the other tensors as they are."""
    out = dict(getters)
    for scale_name in [n for n in getters if n.endswith(SCALE_SUFFIX)]:
        name = scale_name.removesuffix(SCALE_SUFFIX)
        if name in out:
            out[name] = _dequantizer(name, out[name], out.pop(scale_name), block)
    return out


def _dequantizer(
    name: str,
    weight: Callable[[], torch.Tensor],
    scale: Callable[[], torch.Tensor],
    block: tuple[int, int],
) -> Callable[[], torch.Tensor]:
    def get() -> torch.Tensor:
        w = weight()
        if w.dtype != torch.float8_e4m3fn:
            raise Fp8ConfigError(f"{name} is {w.dtype} with an FP8 scale beside it")
        return dequantize_fp8(w, scale(), block)

    return get
