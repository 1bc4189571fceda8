"""One paged attention kernel for a whole step on CUDA, in Triton: prefill, decode and mixed.

A step's sequences each bring `q_len` new rows (1: a decode; more: a prefill chunk) over
`kv_len` keys (its paged past, then the new rows' own keys, already written to the pool).
`paged_attention` runs any mix of them in one launch, reading every key where it lies in the
layer's KV pool through the sequences' slot table (B, W): no gathered copy, no padding of the
queries, no Python loop over sequences or chunks. The engine (`engine.executor.attention`)
launches it once for a step's decodes and once for its chunks, each with its own `Tiles`: a
decode in a 128-row tile of a chunk would multiply 32 times the products it needs.

- **Programs.** One program per (block of `BLOCK_Q` query rows of one sequence, kv head,
  split of the keys). The block's rows for the kv head's `GROUP` query heads are one tile of
  BLOCK_M = BLOCK_Q x GROUP rows (row m: token m // GROUP, head m % GROUP), so each key tile
  is loaded once for every query head that reads it (grouped-query attention) and a decode,
  one token, still fills a tensor-core tile with its heads. The grid is sized from the step's
  row and sequence counts alone (sum over sequences of ceil(q_len / BLOCK_Q) <= T // BLOCK_Q
  + B); each program finds its sequence by a binary search of the row offsets, so a launch
  needs no value read back from the GPU, and a program past its sequence's last block exits.
- **Keys.** Query row t of a sequence sits at position p = kv_len - q_len + t and sees keys
  [0, p], the last `window` of them (sliding window), or those of its own chunk (Llama 4's
  chunked attention). A block walks its keys `BLOCK_N` at a time in three runs: tiles that
  some row sees only in part (masked), tiles every row of the block sees whole (no mask: a
  long prefill spends nearly all its time there), then the diagonal (masked again).
- **Softmax.** Online, in float32, in base 2 (the scale carries log2(e): one `exp2` a score);
  gpt-oss's sinks are one more term of each head's sum (2^(sink log2 e - max)), without a
  value. Tiles multiply on the tensor cores in the KV's type (float32 tiles in IEEE float32),
  probabilities rounded to the values' type before the second product, as flash attention
  does.
- **Splits** (flash-decoding). A decode-only step of few long sequences gives too few
  programs to fill the GPU; its keys are then cut into splits, each writing unnormalized
  partial sums that `triton_attention.decode_merge` merges (with the sinks). Steps with a
  prefill chunk run one split: their blocks fill the GPU.

Block sizes for sm_90 (H100, H200; compiled with no GPU: `python -m
engine.kernels.triton_compile`), `PREFILL` and `DECODE`: a step with prefill rows takes
BLOCK_M = 128 rows (two warpgroups of 64 rows, 8 warps, the wgmma shape) and BLOCK_N = 64
keys, four 16-token pages a tile, with two pipelining stages (cp.async gathers of the next
tile's rows behind the current tile's products): at head_dim 128, 96 KiB of shared memory
and 192 registers a thread, no spills, one program of 8 warps a multiprocessor, as flash
attention 2 runs on Hopper. A decode-only step takes the smallest tile the tensor cores
multiply (16 rows: Llama-3-8B's 4 heads a kv head fill 4 of them; its memory traffic, not
its products, sets its time), 4 warps and three stages (118 registers, 39 KiB: four
programs a multiprocessor), so more programs, each with more bytes in flight, stream the
keys. `python -m bench.gpu.attention --sweep` times other `Tiles` on a GPU. Soft-capped
scores (Gemma 2) and 4-bit KV rows stay on the gather-and-SDPA path.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels.triton_attention import (
    DECODE_BLOCK_N,
    NO_WINDOW,
    _bounds,
    _products,
    decode_splits,
    merge_splits,
    multiprocessors,
    split_parts,
    values_at,
)
from engine.kernels.triton_launch import Kernel, next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the gather-and-SDPA path runs instead
    triton = None

__all__ = ["paged_attention"]

LOG2E = math.log2(math.e)


@dataclass(frozen=True, slots=True)
class Tiles:
    """One launch configuration of the kernel: its tile and how it runs on a multiprocessor."""

    block_m: int
    """Rows a program (query tokens x the heads of a kv head), a power of two >= 16."""
    block_n: int
    """Keys a tile, a power of two >= 16."""
    num_warps: int
    num_stages: int
    """Software-pipelining stages: tiles of keys in flight through shared memory."""


PREFILL = Tiles(block_m=128, block_n=64, num_warps=8, num_stages=2)
"""A step with prefill rows: two warpgroups of 64 rows (the wgmma shape), four 16-token
pages a key tile, the next tile's rows gathered (cp.async) behind the current products."""
DECODE = Tiles(block_m=16, block_n=DECODE_BLOCK_N, num_warps=4, num_stages=3)
"""A decode-only step: the smallest tile the tensor cores multiply (its bytes, not its
products, set its time), more stages and programs to keep more bytes in flight."""
PROGRAMS_PER_SM = 4
"""A decode-only step splits keys until it has this many programs per multiprocessor: a
program streams one split's keys, so more programs keep more loads in flight (the split
tiles are DECODE_BLOCK_N keys: `triton_attention.decode_splits`)."""


if triton is not None:

    @triton.jit
    def _tile(
        q,
        KV,
        table,
        start,
        hi,
        pos,
        top,
        total,
        acc,
        stride_row,
        kvh,
        qk_scale,
        window,
        chunk,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        V_AT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASKED: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Keys [start, start + BLOCK_N) (those below `hi`) of kv head `kvh`, read through the
        sequence's slots `table` where they lie in the pool (the values V_AT past the keys; 0:
        the keys are the values, loaded once): the rows' scores (MASKED: each row sees only
        its causal, windowed, chunked keys; else every row sees every key) and the online
        softmax's running maximum, sum and output (base 2) updated. A row that has seen no
        key yet keeps a maximum of -inf and sums nothing."""
        keys = start + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_PAD)
        if MASKED:
            key_ok = keys < hi
            slot = tl.load(table + keys, mask=key_ok, other=0)
        else:
            slot = tl.load(table + keys)
        rows = KV + slot[:, None] * stride_row + kvh * HEAD_DIM + dims[None, :]
        if MASKED and HEAD_PAD != HEAD_DIM:
            ok = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
        elif MASKED:
            ok = key_ok[:, None]
        else:
            ok = (dims < HEAD_DIM)[None, :]
        if MASKED or HEAD_PAD != HEAD_DIM:
            k = tl.load(rows, mask=ok, other=0.0)
        else:
            k = tl.load(rows)
        if V_AT == 0:
            v = k
        elif MASKED or HEAD_PAD != HEAD_DIM:
            v = tl.load(rows + V_AT, mask=ok, other=0.0)
        else:
            v = tl.load(rows + V_AT)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            seen = key_ok[None, :] & (keys[None, :] <= pos[:, None])
            seen = seen & (keys[None, :] > pos[:, None] - window)
            seen = seen & (keys[None, :] >= pos[:, None] - pos[:, None] % chunk)
            scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        probs = tl.math.exp2(scores - safe[:, None])
        shrink = tl.math.exp2(top - safe)
        total = total * shrink + tl.sum(probs, 1)
        acc = acc * shrink[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        return new_top, total, acc

    def _paged_attention(
        Q,
        KV,
        OUT,
        ACC,
        MAX,
        SUM,
        TABLE,
        Q_STARTS,
        KV_LENS,
        SINKS,
        stride_qt,
        stride_qh,
        stride_row,
        stride_table,
        stride_ot,
        stride_oh,
        num_seqs,
        split_len,
        num_splits,
        qk_scale,
        window,
        chunk,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        V_AT: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ONE_SPLIT: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Program (block, kv head, split): BLOCK_Q = BLOCK_M // GROUP query tokens of one
        sequence, with the kv head's GROUP query heads, over the split's share of their keys:
        the output (one split) or the split's unnormalized sums (`decode_merge`'s layout)."""
        BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # the sequence: the last b whose first block, q_starts[b] // BLOCK_Q + b, is <= pid
        lo_b = tl.zeros([], tl.int32)
        hi_b = tl.zeros([], tl.int32) + num_seqs - 1
        while lo_b < hi_b:
            mid = (lo_b + hi_b + 1) // 2
            first_block = (tl.load(Q_STARTS + mid) // BLOCK_Q + mid).to(tl.int32)
            lo_b = tl.where(first_block <= pid, mid, lo_b)
            hi_b = tl.where(first_block <= pid, hi_b, mid - 1)
        b = lo_b
        q_start = tl.load(Q_STARTS + b)
        q_len = (tl.load(Q_STARTS + b + 1) - q_start).to(tl.int32)
        block = pid - (q_start // BLOCK_Q + b).to(tl.int32)
        if block * BLOCK_Q >= q_len:  # past the sequence's last block
            return
        kv_len = tl.load(KV_LENS + b).to(tl.int32)
        m = tl.arange(0, BLOCK_M)
        token = block * BLOCK_Q + m // GROUP
        head = kvh * GROUP + m % GROUP
        row_ok = (m < BLOCK_Q * GROUP) & (token < q_len)
        pos = kv_len - q_len + token  # each row's own key position
        dims = tl.arange(0, HEAD_PAD)
        dim_ok = dims < HEAD_DIM
        q_rows = (q_start + token).to(tl.int64)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        # the block's first and last row positions, and the keys any of its rows sees
        first = kv_len - q_len + block * BLOCK_Q
        last = tl.minimum(first + BLOCK_Q, kv_len) - 1
        lo = tl.maximum(first - window + 1, 0)
        lo = tl.maximum(lo, first - first % chunk)
        hi = last + 1
        # the split's share, then the keys every row sees: [lo_all, hi_all)
        lo = lo + split * split_len
        hi = tl.minimum(hi, lo + split_len)
        lo_all = tl.maximum(last - window + 1, last - last % chunk)
        hi_all = tl.minimum(first + 1, hi)
        # three runs of whole tiles from lo: masked up to lo_all, unmasked while a tile ends
        # by hi_all, masked to hi
        mid_lo = tl.minimum(lo + tl.cdiv(tl.maximum(lo_all - lo, 0), BLOCK_N) * BLOCK_N, hi)
        mid_hi = mid_lo + tl.maximum(hi_all - mid_lo, 0) // BLOCK_N * BLOCK_N
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        table = TABLE + b.to(tl.int64) * stride_table
        for start in range(lo, mid_lo, BLOCK_N):
            top, total, acc = _tile(
                q, KV, table, start, hi, pos, top, total, acc, stride_row, kvh, qk_scale,
                window, chunk, HEAD_DIM, HEAD_PAD, V_AT, BLOCK_N, True, PRECISION, UPCAST,
            )  # fmt: skip
        for start in range(mid_lo, mid_hi, BLOCK_N):
            top, total, acc = _tile(
                q, KV, table, start, hi, pos, top, total, acc, stride_row, kvh, qk_scale,
                window, chunk, HEAD_DIM, HEAD_PAD, V_AT, BLOCK_N, False, PRECISION, UPCAST,
            )  # fmt: skip
        for start in range(mid_hi, hi, BLOCK_N):
            top, total, acc = _tile(
                q, KV, table, start, hi, pos, top, total, acc, stride_row, kvh, qk_scale,
                window, chunk, HEAD_DIM, HEAD_PAD, V_AT, BLOCK_N, True, PRECISION, UPCAST,
            )  # fmt: skip
        if ONE_SPLIT:
            if HAS_SINKS:  # each head's sink: one more term of the sum, without a value
                sink = tl.load(SINKS + head, mask=row_ok, other=0.0)
                total += tl.math.exp2(sink * 1.4426950408889634 - top)
            out = acc / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(
                OUT + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                out.to(OUT.dtype.element_ty),
                mask=row_ok[:, None] & dim_ok[None, :],
            )
        else:  # decode_merge's layout: part (row, head, split), its maximum in natural units
            num_heads = tl.num_programs(1) * GROUP
            part = (q_rows * num_heads + head) * num_splits + split
            tl.store(
                ACC + part[:, None] * HEAD_PAD + dims[None, :],
                acc,
                mask=row_ok[:, None] & dim_ok[None, :],
            )
            tl.store(MAX + part, top * 0.6931471805599453, mask=row_ok)
            tl.store(SUM + part, total, mask=row_ok)


VARYING = ("stride_table", "num_seqs", "num_splits")
"""The kernel's arguments that change from step to step (the table's width, the sequences,
the splits): compiled for any value, so that no step meets a specialization the warm-up did
not (`triton_launch`); each is only an offset or a bound, where a known divisor buys little."""
VARYING_ALIGNMENT = ("TABLE", "Q_STARTS", "KV_LENS")
"""Index tensors that may lie at any 8-byte offset (lengths after offsets in one copy)."""


@functools.cache
def step_kernel(num_warps: int, num_stages: int) -> Kernel:
    """The kernel's source with these launch options (one compiled kernel per `Tiles`)."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return Kernel(_paged_attention, options, VARYING, VARYING_ALIGNMENT)


if triton is not None:
    prefill_step = step_kernel(PREFILL.num_warps, PREFILL.num_stages)
    """The kernel for a step with prefill rows (`PREFILL`)."""
    decode_step = step_kernel(DECODE.num_warps, DECODE.num_stages)
    """The kernel for a decode-only step (`DECODE`)."""


def paged_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor,
    q_starts: torch.Tensor,
    kv_lens: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    window: int,
    q_max: int,
    kv_max: int,
    sinks: torch.Tensor | None = None,
    split_len: int | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Attention of a step's new rows over their sequences' keys, read in place
    (`PagedAttention`): q (T, heads, head_dim), each sequence's rows back to back; rows
    (slots, 2 * kv_dim), a layer's pool as keys then values, or (slots, kv_dim), keys that
    are the values too (`values_at`); table (B, W) int64, each sequence's key slots (a
    column past its kv_len is never read); q_starts (B + 1,) int64, where each sequence's
    rows begin in q; kv_lens (B,) int64, its keys, its new rows' last. `q_max`, `kv_max`:
    the most new rows and keys of a sequence, known to the host (they choose the tiles and
    the splits, with no read-back). `window` > 0: a sliding window; < 0: chunked attention
    of -window; `sinks`: (heads,) float32 (gpt-oss). `split_len`: keys a split in a
    decode-only step (tests); by default as many splits as fill the GPU. `tiles`: the launch
    configuration (benchmarks sweep them); by default DECODE for a decode-only step, else
    PREFILL."""
    total, num_heads, head_dim = q.shape
    num_seqs = kv_lens.shape[0]
    out = torch.empty_like(q)
    if num_seqs == 0 or total == 0:
        return out
    group = num_heads // num_kv_heads
    on_gpu = q.is_cuda
    decode = q_max == 1
    tiles = tiles or (DECODE if decode else PREFILL)
    block_m = max(tiles.block_m, next_pow2(group))
    block_q = block_m // group
    num_blocks = total // block_q + num_seqs  # >= sum of ceil(q_len / block_q)
    reach = min(kv_max, window if window > 0 else NO_WINDOW, -window if window < 0 else NO_WINDOW)
    num_splits, split_len_used = 1, NO_WINDOW  # a step with prefill rows: one split
    if decode and split_len is not None:
        num_splits, split_len_used = -(-max(1, reach) // split_len), split_len
    elif decode:
        num_splits, split_len_used = decode_splits(
            num_seqs, num_kv_heads, reach, multiprocessors(q), PROGRAMS_PER_SM
        )
    parts = split_parts(out, num_splits)
    step_kernel(tiles.num_warps, tiles.num_stages).launch(
        (num_blocks, num_kv_heads, num_splits),
        on_gpu,
        q,
        rows,
        out,
        *parts,
        table,
        q_starts,
        kv_lens,
        out if sinks is None else sinks,  # not read without sinks
        q.stride(0),
        q.stride(1),
        rows.stride(0),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        num_seqs,
        split_len_used,
        num_splits,
        scale * LOG2E,
        *_bounds(window),
        HEAD_DIM=head_dim,
        HEAD_PAD=next_pow2(head_dim),
        V_AT=values_at(rows, num_kv_heads * head_dim),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        ONE_SPLIT=num_splits == 1,
        HAS_SINKS=sinks is not None,
        **_products(q.dtype, on_gpu),
    )
    if num_splits > 1:
        merge_splits(out, parts, sinks)
    return out


_TYPES = (
    ["*{t}", "*{t}", "*{t}", "*fp32", "*fp32", "*fp32", "*i64", "*i64", "*i64", "*fp32"]
    + ["i32"] * 9
    + ["fp32", "i32", "i32"]
)
_LLAMA_3_8B = dict(HEAD_DIM=128, HEAD_PAD=128, V_AT=1024, GROUP=4, HAS_SINKS=True)
COMPILE_CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "prefill_step": (
        _TYPES,
        dict(
            _LLAMA_3_8B, BLOCK_M=PREFILL.block_m, BLOCK_N=PREFILL.block_n, ONE_SPLIT=True,
            PRECISION="tf32", UPCAST=False,
        ),
    ),
    "decode_step": (
        _TYPES,
        dict(
            _LLAMA_3_8B, BLOCK_M=DECODE.block_m, BLOCK_N=DECODE.block_n, ONE_SPLIT=False,
            PRECISION="tf32", UPCAST=False,
        ),
    ),
}  # fmt: skip
"""The kernel's two launch configurations and their constants for a Llama-3-8B layer
(head_dim 128, 32 query heads over 8 kv heads), with sinks (their code compiled in too)."""
