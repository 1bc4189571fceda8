"""The Triton decode kernel and the pieces the one step kernel (triton_paged.py) shares.

The CPU runs its own C++ kernels (paged_decode.cpp, paged_prefill.cpp); on CUDA, one kernel
(triton_paged.py) attends a whole step, decodes and prefill chunks alike. This module keeps
what came before it and what it shares:
- **Decode** (flash-decoding), `paged_decode`, the CUDA path's decode kernel before the step
  kernel (`cuda_paged_kernels(one_kernel=False)`, benchmarked beside it): one program per
  (sequence, kv head, split of the keys). It loads the kv head's query heads once
  (grouped-query attention: the keys are read once for all of them), walks its split's keys
  `BLOCK_N` at a time through the slot table, reading each row where it lies in the pool,
  and keeps an online softmax in float32. Long contexts are cut into splits so that short
  batches still fill the GPU.
- **Merge** of split partial sums (`decode_merge`, `merge_splits`), which both kernels use,
  with the windows, products and row layouts they share (`_bounds`, `_products`,
  `values_at`). The first Triton prefill kernel (one program per query head, 11% of the
  GEMM rate on the H200) is gone: the step kernel's prefill replaced it.

With gpt-oss's sinks, each query head's sink logit is one more term of its softmax's sum
(e^(sink - max)), with no value. Scores and the softmax are float32, half-precision tiles
multiply on the tensor cores (float32 tiles in IEEE float32, not TF32), and the
probabilities are rounded to the values' type before the second product, as flash attention
does. Soft-capped scores (Gemma 2) and 4-bit KV rows stay on the gather-and-SDPA path.

CI runs the kernels under Triton's interpreter on CPU tensors (a launch picks the
interpreter when its tensors are on the CPU; `TRITON_INTERPRET=1` must be set before Triton
is imported, for Triton's own jit functions the kernels call) and compiles them for sm_90
with no GPU present: `python -m engine.kernels.triton_compile` prints each
kernel's registers, spills and shared memory (tests/engine/kernels/test_triton_attention.py).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.kernels.triton_launch import available, kernel, next_pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the gather-and-SDPA path runs instead
    triton = None

__all__ = ["available", "paged_decode"]

DECODE_BLOCK_N = 64
"""Keys per tile of the decode kernel."""
MAX_SPLITS = 64
"""At most this many splits of one sequence's keys in decode."""
SPLITS_PAD = MAX_SPLITS
"""The merge's tile of splits: any count fits in it, so one compiled merge serves every step
(a tile sized to each count would be one compile per power of two, met first mid-serving);
the splits past the count are masked loads, which move no bytes."""
PROGRAMS_PER_SM = 2
"""Decode splits keys until (sequences x kv heads x splits) reaches this many programs per
multiprocessor, so that a short batch of long sequences still fills the GPU."""
INTERPRETER_SMS = 2
"""The multiprocessor count assumed under the interpreter (small, so tests exercise splits)."""
# Warps and software-pipelining stages per kernel (`@kernel`): with two stages the decode
# kernel's key tiles stream through shared memory (cp.async), 80 registers a thread (one
# stage: 128) (compiled for sm_90: `python -m engine.kernels.triton_compile`).


if triton is not None:

    @triton.jit
    def _attend_tile(
        q,
        KV,
        slot,
        key_ok,
        seen,
        top,
        total,
        acc,
        stride_row,
        kvh,
        scale,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        V_AT: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """One tile of keys for the decode kernel: kv head `kvh`'s keys and values of the tile's
        slots read where they lie in the pool (the values V_AT past the keys; 0: the keys
        are the values, loaded once), the query rows' scores (`seen`: which rows see which
        keys), and the online softmax's running maximum, sum and output updated. A row that
        has seen no key yet keeps a maximum of -inf and sums nothing."""
        dims = tl.arange(0, HEAD_PAD)
        rows = KV + slot[:, None] * stride_row + kvh * HEAD_DIM + dims[None, :]
        if HEAD_PAD == HEAD_DIM:
            ok = key_ok[:, None]
        else:
            ok = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(rows, mask=ok, other=0.0)
        if V_AT == 0:
            v = k
        else:
            v = tl.load(rows + V_AT, mask=ok, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(seen, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)
        probs = tl.exp(scores - safe[:, None])
        shrink = tl.exp(top - safe)
        total = total * shrink + tl.sum(probs, 1)
        acc = acc * shrink[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        return new_top, total, acc

    @kernel(num_warps=4, num_stages=2)
    def decode_split(
        Q,
        KV,
        OUT,
        ACC,
        MAX,
        SUM,
        SLOTS,
        KV_LENS,
        SINKS,
        stride_qb,
        stride_qh,
        stride_row,
        stride_ob,
        stride_oh,
        kv_max,
        split_len,
        num_splits,
        scale,
        window,
        chunk,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        KV_DIM: tl.constexpr,
        V_AT: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ONE_SPLIT: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Program (b, kv head, split): the split's keys of sequence b against the kv head's
        query heads; the output (one split) or the split's unnormalized sums."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(KV_LENS + b)
        lo = split.to(tl.int64) * split_len
        hi = tl.minimum(lo + split_len, kv_len)
        lo = tl.maximum(lo, kv_len - window)
        lo = tl.maximum(lo, (kv_len - 1) - (kv_len - 1) % chunk)  # the last key's chunk
        heads = kvh * GROUP + tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_PAD)
        head_ok = tl.arange(0, GROUP_PAD) < GROUP
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        table = SLOTS + b.to(tl.int64) * kv_max
        for start in range(lo, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < hi
            slot = tl.load(table + keys, mask=key_ok, other=0)
            top, total, acc = _attend_tile(
                q, KV, slot, key_ok, key_ok[None, :], top, total, acc, stride_row, kvh, scale,
                HEAD_DIM, HEAD_PAD, V_AT, PRECISION, UPCAST,
            )  # fmt: skip
        if ONE_SPLIT:
            if HAS_SINKS:  # each head's sink: one more term of the sum, without a value
                total += tl.exp(tl.load(SINKS + heads, mask=head_ok, other=0.0) - top)
            out = acc / total[:, None]
            tl.store(
                OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                out.to(OUT.dtype.element_ty),
                mask=head_ok[:, None] & dim_ok[None, :],
            )
        else:
            part = (b.to(tl.int64) * (KV_DIM // HEAD_DIM * GROUP) + heads) * num_splits + split
            tl.store(
                ACC + part[:, None] * HEAD_PAD + dims[None, :],
                acc,
                mask=head_ok[:, None] & dim_ok[None, :],
            )
            tl.store(MAX + part, top, mask=head_ok)
            tl.store(SUM + part, total, mask=head_ok)

    @kernel(num_warps=4, num_stages=1, do_not_specialize=("num_splits",))
    def decode_merge(
        OUT,
        ACC,
        MAX,
        SUM,
        SINKS,
        stride_ob,
        stride_oh,
        num_heads,
        num_splits,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        """Program (b, head): the splits' partial sums merged (a split with no keys has sum 0
        and maximum -inf, and weighs nothing)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        split_ok = splits < num_splits
        dims = tl.arange(0, HEAD_PAD)
        part = (b.to(tl.int64) * num_heads + h) * num_splits + splits
        tops = tl.load(MAX + part, mask=split_ok, other=float("-inf"))
        sums = tl.load(SUM + part, mask=split_ok, other=0.0)
        top = tl.max(tops, 0)
        weights = tl.where(sums > 0, tl.exp(tops - top), 0.0)
        acc = tl.load(
            ACC + part[:, None] * HEAD_PAD + dims[None, :],
            mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :],  # padded dims are never written
            other=0.0,
        )
        total = tl.sum(sums * weights, 0)
        if HAS_SINKS:
            total += tl.exp(tl.load(SINKS + h) - top)
        out = tl.sum(acc * weights[:, None], 0) / total
        tl.store(
            OUT + b.to(tl.int64) * stride_ob + h * stride_oh + dims,
            out.to(OUT.dtype.element_ty),
            mask=dims < HEAD_DIM,
        )


NO_WINDOW = 1 << 30
"""The window (and chunk) the kernels get for none: every key is within it (branch-free
masks)."""


def _bounds(window: int) -> tuple[int, int]:
    """The kernels' (sliding window, chunk) for a layer's `window` (negative: chunked
    attention of -window, `engine.executor.attention.in_window`)."""
    return (window if window > 0 else NO_WINDOW), (-window if window < 0 else NO_WINDOW)


def _products(dtype: torch.dtype, on_gpu: bool) -> dict[str, Any]:
    """How tiles multiply: float32 ones in IEEE float32 (Triton's default for them is TF32).
    Under the interpreter bfloat16 tiles are upcast to float32 first: it stores bfloat16 as
    raw 16-bit integers and multiplies those (its loads, stores and conversions are right);
    the GPU multiplies them as they are."""
    upcast = dtype == torch.bfloat16 and not on_gpu
    return {"PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def decode_splits(
    batch: int, kv_heads: int, kv_max: int, sms: int, programs_per_sm: int = PROGRAMS_PER_SM
) -> tuple[int, int]:
    """(splits, keys a split): enough programs to give each multiprocessor `programs_per_sm`,
    each split a whole number of key tiles, at most MAX_SPLITS."""
    tiles = -(-max(1, kv_max) // DECODE_BLOCK_N)
    wanted = -(-(programs_per_sm * sms) // max(1, batch * kv_heads))
    split_tiles = max(1, tiles // min(wanted, MAX_SPLITS))
    while -(-tiles // split_tiles) > MAX_SPLITS:
        split_tiles += 1
    return -(-tiles // split_tiles), split_tiles * DECODE_BLOCK_N


def multiprocessors(q: torch.Tensor) -> int:
    """The multiprocessors q's GPU has; INTERPRETER_SMS for CPU tensors."""
    return _multiprocessors(q.device.index or 0) if q.is_cuda else INTERPRETER_SMS


def split_parts(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, ...]:
    """(accumulators (rows x heads x splits, HEAD_PAD), maxima, sums) in float32 for the
    splits' partial sums of an output (rows, heads, head_dim); with one split, `out` three
    times (not written)."""
    if num_splits == 1:
        return out, out, out
    parts = out.shape[0] * out.shape[1] * num_splits
    acc = torch.empty(parts, next_pow2(out.shape[2]), dtype=torch.float32, device=out.device)
    top = torch.empty(parts, dtype=torch.float32, device=out.device)
    return acc, top, torch.empty_like(top)


def merge_splits(
    out: torch.Tensor, parts: tuple[torch.Tensor, ...], sinks: torch.Tensor | None
) -> None:
    """`decode_merge` of the splits' partial sums (`split_parts`) into out (rows, heads,
    head_dim), with the sinks."""
    acc, top, total = parts
    rows, num_heads, head_dim = out.shape
    num_splits = top.shape[0] // max(1, rows * num_heads)
    decode_merge.launch(
        (rows, num_heads),
        out.is_cuda,
        out,
        acc,
        top,
        total,
        top if sinks is None else sinks,  # not read without sinks
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        HEAD_DIM=head_dim,
        HEAD_PAD=next_pow2(head_dim),
        SPLITS_PAD=SPLITS_PAD,
        HAS_SINKS=sinks is not None,
    )


def values_at(rows: torch.Tensor, kv_dim: int) -> int:
    """Where a pool row's values begin: after its keys in rows of 2 * kv_dim, at the keys
    themselves in rows of kv_dim (the values are the keys: `KVShape.values_are_keys`)."""
    if rows.shape[1] not in (kv_dim, 2 * kv_dim):
        raise ValueError(f"KV rows of {rows.shape[1]} values: expected {kv_dim} or {2 * kv_dim}")
    return 0 if rows.shape[1] == kv_dim else kv_dim


def paged_decode(
    q: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    kv_lens: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    window: int,
    split_len: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention (`PagedDecode`): q (B, heads, head_dim); rows (slots, 2 * kv_dim), a
    layer's pool as keys then values, or (slots, kv_dim), keys that are the values too
    (`values_at`); slots (B * kv_max,) int64, each sequence's keys' slots
    padded to kv_max; kv_lens (B,) int64. `split_len`: keys a split (tests); by default as
    many splits as fill the GPU."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    kv_max = slots.shape[0] // max(1, batch)
    on_gpu = q.is_cuda
    if split_len is None:
        num_splits, split_len = decode_splits(batch, num_kv_heads, kv_max, multiprocessors(q))
    else:
        num_splits = -(-max(1, kv_max) // split_len)
    out = torch.empty_like(q)
    parts = split_parts(out, num_splits)
    if batch == 0:
        return out
    decode_split.launch(
        (batch, num_kv_heads, num_splits),
        on_gpu,
        q,
        rows,
        out,
        *parts,
        slots,
        kv_lens,
        out if sinks is None else sinks,  # not read without sinks
        q.stride(0),
        q.stride(1),
        rows.stride(0),
        out.stride(0),
        out.stride(1),
        kv_max,
        split_len,
        num_splits,
        scale,
        *_bounds(window),
        HEAD_DIM=head_dim,
        HEAD_PAD=next_pow2(head_dim),
        KV_DIM=num_kv_heads * head_dim,
        V_AT=values_at(rows, num_kv_heads * head_dim),
        GROUP=group,
        GROUP_PAD=next_pow2(group),
        BLOCK_N=DECODE_BLOCK_N,
        ONE_SPLIT=num_splits == 1,
        HAS_SINKS=sinks is not None,
        **_products(q.dtype, on_gpu),
    )
    if num_splits > 1:
        merge_splits(out, parts, sinks)
    return out


COMPILE_CASES: dict[str, tuple[list[str], dict[str, Any]]] = {
    "decode_split": (
        ["*{t}", "*{t}", "*{t}", "*fp32", "*fp32", "*fp32", "*i64", "*i64", "*fp32"]
        + ["i32"] * 8
        + ["fp32", "i32", "i32"],
        dict(
            HEAD_DIM=128, HEAD_PAD=128, KV_DIM=1024, V_AT=1024, GROUP=4, GROUP_PAD=16,
            BLOCK_N=DECODE_BLOCK_N, ONE_SPLIT=False, HAS_SINKS=True, PRECISION="tf32",
            UPCAST=False,
        ),
    ),
    "decode_merge": (
        ["*{t}", "*fp32", "*fp32", "*fp32", "*fp32"] + ["i32"] * 4,
        dict(HEAD_DIM=128, HEAD_PAD=128, SPLITS_PAD=SPLITS_PAD, HAS_SINKS=True),
    ),
}  # fmt: skip
"""Each kernel's arguments (tensors typed by the compute type {t}) and constants for a
Llama-3-8B layer (head_dim 128, 32 query heads over 8 kv heads)."""
