"""Q4_K, Q5_K and Q6_K encoders: the gguf package decodes these types but cannot make them, and
the GGUF tests need files in the quantizations people download.

Each block of 256 values is packed in the byte layout the gguf package's decoder reads (and
llama.cpp writes). The scales are plain min-max ones, not llama.cpp's searched ones: the bytes
are valid blocks of the type, which is all a reader can tell apart.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _blocks(values: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> (rows * cols / 256, 256) blocks; cols must be a multiple of 256."""
    assert values.shape[-1] % QK_K == 0, f"rows of {values.shape[-1]} do not split into 256"
    return values.astype(np.float32).reshape(-1, QK_K)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins per block -> the 12 bytes Q4_K and Q5_K keep."""
    sc, mn = scales.astype(np.uint8), mins.astype(np.uint8)
    d = (sc[:, :4] & 0x3F) | ((sc[:, 4:] & 0x30) << 2)
    m = (mn[:, :4] & 0x3F) | ((mn[:, 4:] & 0x30) << 2)
    md = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, m, md], axis=1)


def _min_max(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per 32-value sub-block: q in [0, levels], and the packed super-block scales (d, dmin)
    and 6-bit sub-block scales and mins, so that x ~ d * sc * q - dmin * m."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    high = sub.max(axis=-1)
    scale = (high - low) / levels
    minimum = -low
    d = (scale.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (minimum.max(axis=-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 0, 63)
    mn = np.clip(np.round(minimum / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63)
    step = (d[:, None] * sc)[..., None]
    q = np.round((sub + (dmin[:, None] * mn)[..., None]) / np.where(step > 0, step, 1))
    return np.clip(q, 0, levels).astype(np.uint8), d, dmin, sc, mn


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 8, 32) 4-bit values -> (n, 128) bytes: sub-blocks 2c and 2c + 1 share 32 bytes,
    low and high nibble."""
    pairs = q.reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, mn = _min_max(_blocks(values), 15)
    rows = np.concatenate([_f16(d), _f16(dmin), _pack_scales(sc, mn), _nibbles(q)], axis=1)
    return rows.reshape(values.shape[0], -1)


def quantize_q5_k(values: np.ndarray) -> np.ndarray:
    q, d, dmin, sc, mn = _min_max(_blocks(values), 31)
    high = (q >> 4).astype(np.uint8)  # (n, 8, 32): bit i of byte b is sub-block i's value b
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for i in range(8):
        qh |= high[:, i] << i
    packed = [_f16(d), _f16(dmin), _pack_scales(sc, mn), qh, _nibbles(q & 0x0F)]
    return np.concatenate(packed, axis=1).reshape(values.shape[0], -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """16 sub-blocks of 16 with int8 scales: x ~ d * sc * (q - 32), q in [0, 63]."""
    blocks = _blocks(values)
    sub = blocks.reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), -128, 127)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(sub / np.where(step > 0, step, 1)) + 32, 0, 63).astype(np.uint8)
    rows = q.reshape(-1, 8, 32)  # the decoder's (row, column) order of the 256 values
    ql = np.zeros((q.shape[0], 128), np.uint8)
    qh = np.zeros((q.shape[0], 64), np.uint8)
    for r in range(8):
        half, nibble, part = r // 4, (r // 2) % 2, r % 2
        start = half * 64 + part * 32
        ql[:, start : start + 32] |= (rows[:, r] & 0x0F) << (4 * nibble)
        qh[:, half * 32 : half * 32 + 32] |= (rows[:, r] >> 4) << (2 * (r % 4))
    packed = [ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)]
    return np.concatenate(packed, axis=1).reshape(values.shape[0], -1)


ENCODERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
