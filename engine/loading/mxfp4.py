"""MXFP4 experts as gpt-oss ships them: each stacked expert tensor `<name>` stored as
`<name>_blocks` (experts, rows, columns / 32, 16) uint8, two e2m1 values a byte (low nibble
first), and `<name>_scales` (experts, rows, columns / 32) uint8, one power-of-two exponent
(biased by 127) per 32 values along a row; dequantized at load, as FP8 is and for the same
reasons (engine/loading/fp8.py), into the stacked layout transformers holds in memory
((experts, columns, rows): gpt-oss applies its experts as x @ W), which the model's `fuse`
splits per expert. Every e2m1 value times a power of two is exact in bfloat16 and float32.
Keeping the experts in 4 bits, priced as the cost model prices its own 4-bit path, is the
next step: they are 90% of gpt-oss-120b's bytes."""

from __future__ import annotations

from collections.abc import Callable

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of a 4-bit e2m1 code (its index)."""
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., rows, groups, 16) codes and (..., rows, groups) exponents -> float32
    (..., columns, rows): the values of each row, 32 a group, times 2 ** (exponent - 127),
    the last two dimensions swapped as the stacked experts are held."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # (..., rows, groups, 32)
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None])
    return values.flatten(-2).transpose(-1, -2).contiguous()


def dequantizing_getters(
    getters: dict[str, Callable[[], torch.Tensor]], numels: dict[str, int]
) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, int]]:
    """A checkpoint's getters and element counts with each `<name>_blocks` and `_scales`
    pair replaced by `<name>`, read dequantized; the other tensors as they are."""
    out, counts = dict(getters), dict(numels)
    for blocks_name in [n for n in getters if n.endswith(BLOCKS)]:
        name = blocks_name.removesuffix(BLOCKS)
        if f"{name}{SCALES}" not in out:
            continue
        blocks, scales = out.pop(blocks_name), out.pop(f"{name}{SCALES}")
        out[name] = _dequantizer(blocks, scales)
        counts[name] = 2 * counts.pop(blocks_name)
        counts.pop(f"{name}{SCALES}")
    return out, counts


def _dequantizer(
    blocks: Callable[[], torch.Tensor], scales: Callable[[], torch.Tensor]
) -> Callable[[], torch.Tensor]:
    return lambda: dequantize_mxfp4(blocks(), scales())
