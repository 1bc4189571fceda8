"""Ragged attention: decodes and prefill chunks padded apart, each row equal to attention of
its own sequence computed alone."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from engine.executor.attention import (
    RaggedLayout,
    join_kv,
    paged_attention,
    ragged_attention,
    split_kv,
)
from engine.kernels import PagedKernels, paged_kernels
from engine.models.base import AttentionSpec
from engine.models.config import KVShape

HEADS, KV_HEADS, DIM = 4, 2, 8


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int, window: int | None
) -> torch.Tensor:
    """One sequence alone: q (t, H, D) over keys k, v (past_len + t, KVH, D)."""
    t = q.shape[0]
    q_pos = torch.arange(past_len, past_len + t)[:, None]
    k_pos = torch.arange(past_len + t)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    rep = HEADS // KV_HEADS
    out = scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1),
        attn_mask=mask,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    "q_lens,past_lens",
    [
        ([1, 7, 1, 3, 1], [9, 0, 4, 6, 12]),  # mixed: decodes and prefill chunks
        ([1, 1, 1], [5, 5, 5]),  # decodes of one length: no mask at all
        ([1, 1, 1], [2, 9, 4]),  # decodes of several lengths
        ([6, 2], [0, 3]),  # prefill chunks only
        ([1, 1, 5, 3], [4, 9, 0, 2]),  # decodes, then chunks: each group one run of rows
    ],
)
def test_each_row_equals_its_sequence_alone(
    q_lens: list[int], past_lens: list[int], window: int | None
) -> None:
    g = torch.Generator().manual_seed(0)
    total, past_total = sum(q_lens), sum(past_lens)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=g) for _ in "kv")
    past_k, past_v = (torch.randn(past_total, KV_HEADS, DIM, generator=g) for _ in "kv")
    layout = RaggedLayout.build(q_lens, past_lens, torch.device("cpu"), window)
    got = ragged_attention(q, k, v, past_k, past_v, layout)
    row = past_row = 0
    for t, p in zip(q_lens, past_lens, strict=True):
        keys = torch.cat([past_k[past_row : past_row + p], k[row : row + t]])
        values = torch.cat([past_v[past_row : past_row + p], v[row : row + t]])
        want = reference(q[row : row + t], keys, values, p, window)
        torch.testing.assert_close(got[row : row + t], want)
        row, past_row = row + t, past_row + p


def test_decodes_are_padded_apart_from_prefill_chunks() -> None:
    """A mixed step does B x kv work for its decodes, not B x q_max x kv_max."""
    q_lens, past_lens = [1, 1, 1, 64], [100, 100, 100, 0]
    layout = RaggedLayout.build(q_lens, past_lens, torch.device("cpu"))
    shapes = sorted((grp.num_seqs, grp.q_max, grp.kv_max) for grp in layout.groups)
    assert shapes == [(1, 64, 64), (3, 1, 101)]
    assert [grp.new_span for grp in layout.groups] == [(0, 3), (3, 67)]  # slices, no gathers
    mixed = RaggedLayout.build([1, 64, 1], [100, 0, 100], torch.device("cpu"))
    assert [grp.new_span for grp in mixed.groups] == [None, (1, 65)]
    assert layout.q_max == 64 and layout.num_past == 300
    decodes = next(grp for grp in layout.groups if grp.q_max == 1)
    assert decodes.mask is None  # one length, every key visible


def scattered_pool(
    k: torch.Tensor,
    v: torch.Tensor,
    past_k: torch.Tensor,
    past_v: torch.Tensor,
    q_lens: list[int],
    past_lens: list[int],
    g: torch.Generator,
    values_are_keys: bool = False,
) -> tuple[torch.Tensor, list[list[int]]]:
    """A pool holding every sequence's past then new keys and values at random slots, the
    slots it does not use NaN (a read of one poisons the result); and each one's slots.
    `values_are_keys`: rows of the keys alone (v and past_v must be k and past_k)."""
    num_slots = 4 * (k.shape[0] + past_k.shape[0])
    sides = 1 if values_are_keys else 2
    pool = torch.full((num_slots, sides * k.shape[1] * k.shape[2]), float("nan"), dtype=k.dtype)
    order = torch.randperm(num_slots, generator=g).tolist()
    seq_slots, row, past_row = [], 0, 0
    for t, p in zip(q_lens, past_lens, strict=True):
        slots = [order.pop() for _ in range(p + t)]
        keys = torch.cat([past_k[past_row : past_row + p], k[row : row + t]])
        values = torch.cat([past_v[past_row : past_row + p], v[row : row + t]])
        rows = [keys.flatten(1)] if values_are_keys else [keys.flatten(1), values.flatten(1)]
        pool[slots] = torch.cat(rows, dim=1)
        seq_slots.append(slots)
        row, past_row = row + t, past_row + p
    return pool, seq_slots


@pytest.mark.parametrize("kernel", ["sdpa", "native"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    "q_lens,past_lens",
    [
        ([1, 7, 1, 3, 1], [9, 0, 4, 6, 12]),
        ([1, 1, 1], [5, 5, 5]),
        ([1, 1, 1], [2, 9, 4]),
        ([6, 2], [0, 3]),
        ([6, 8, 3], [2, 3, 3]),  # a past shorter than the chunk, and as long
        ([1, 1, 5, 3], [4, 9, 0, 2]),  # decodes, then chunks: each group one run of rows
    ],
)
def test_paged_attention_reads_the_pool_in_place(
    q_lens: list[int], past_lens: list[int], window: int | None, kernel: str
) -> None:
    """Keys scattered over a pool's slots, read in place (gathered for SDPA, or by the native
    CPU kernels), give what the packed path gives."""
    g = torch.Generator().manual_seed(1)
    total, past_total = sum(q_lens), sum(past_lens)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=g) for _ in "kv")
    past_k, past_v = (torch.randn(past_total, KV_HEADS, DIM, generator=g) for _ in "kv")
    pool, seq_slots = scattered_pool(k, v, past_k, past_v, q_lens, past_lens, g)
    cpu = torch.device("cpu")
    packed = RaggedLayout.build(q_lens, past_lens, cpu, window)
    paged = RaggedLayout.build(q_lens, past_lens, cpu, window, seq_slots)
    assert paged.in_place and not packed.in_place
    want = ragged_attention(q, k, v, past_k, past_v, packed)
    kernels = native_kernels() if kernel == "native" else None
    got = paged_attention(q, pool, lambda rows: rows, paged, KVShape(KV_HEADS, DIM), kernels)
    torch.testing.assert_close(got, want)


def native_kernels() -> PagedKernels:
    """The native kernels, which the test set-up (a C++ compiler and ninja) must build."""
    kernels = paged_kernels()
    assert kernels is not None, "the native CPU kernels did not build: see the log"
    return kernels


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]
)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("window", [None, 40])
def test_native_decode_kernel_equals_sdpa_over_the_padded_copy(
    dtype: torch.dtype, tol: float, heads: int, kv_heads: int, dim: int, window: int | None
) -> None:
    """The kernel on realistic decode shapes (SmolLM2's grouped heads, a head_dim of 128 with
    4 query heads a kv head, and plain multi-head in the portable loops), lengths 1..300 (one
    to 19 blocks of 16, partial blocks at the end), with and without a sliding window,
    against SDPA in float32 over the same values: within `tol` (float32 to rounding; the half
    types round their output once)."""
    past_lens = [0, 299, 17, 64, 150, 3, 255, 100]
    kernel_equals_sdpa([1] * len(past_lens), past_lens, (heads, kv_heads, dim), window, dtype, tol)


def kernel_equals_sdpa(
    q_lens: list[int],
    past_lens: list[int],
    shape: tuple[int, int, int],
    window: int | None,
    dtype: torch.dtype,
    tol: float,
    sinks: torch.Tensor | None = None,
    kernels: PagedKernels | None = None,
    values_are_keys: bool = False,
    native: bool = True,
) -> list[bool]:
    """The native kernels (or `kernels`; not `native`: none, the gather-and-SDPA path) over a
    NaN-poisoned scattered pool give SDPA's float32 result over the same values (with
    `sinks`: the eager product transformers computes), within `tol`; returns which of the
    layout's groups are prefill chunks. `values_are_keys`: the pool's rows are the keys
    alone, read as the values too."""
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(2)
    total, past_total = sum(q_lens), sum(past_lens)
    q = torch.randn(total, heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(total, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
    past_k, past_v = (torch.randn(past_total, kv_heads, dim, generator=g).to(dtype) for _ in "kv")
    if values_are_keys:
        v, past_v = k, past_k
    pool, seq_slots = scattered_pool(k, v, past_k, past_v, q_lens, past_lens, g, values_are_keys)
    cpu = torch.device("cpu")
    paged = RaggedLayout.build(q_lens, past_lens, cpu, window, seq_slots)
    spec = AttentionSpec(sinks=sinks)
    if native:
        kernels = kernels or native_kernels()
    kv_shape = KVShape(kv_heads, dim, values_are_keys)
    got = paged_attention(q, pool, lambda rows: rows, paged, kv_shape, kernels, spec)
    assert got.dtype == dtype
    packed = RaggedLayout.build(q_lens, past_lens, cpu, window)
    f32 = [x.float() for x in (q, k, v, past_k, past_v)]
    want = ragged_attention(*f32, packed, spec)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    return [grp.starts is not None for grp in paged.groups]


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]
)
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 1, 256), (6, 6, 64), (4, 4, 32)]
)
@pytest.mark.parametrize("window", [None, 40])
def test_native_prefill_kernel_equals_sdpa_over_the_padded_copy(
    dtype: torch.dtype, tol: float, heads: int, kv_heads: int, dim: int, window: int | None
) -> None:
    """The prefill kernel on realistic chunk shapes (SmolLM2's grouped heads, head_dims of 128
    and 256, multi-head with 48 query rows an item, and a head_dim of 32 in the portable
    loops): chunks with no past, a past shorter and longer than themselves, a chunk of one
    row among longer ones, lengths that end inside a tile of 32 keys and a run of 48 query
    rows, with and without a sliding window, read from a pool whose other slots are NaN,
    against SDPA in float32 over the same values."""
    q_lens, past_lens = [70, 5, 33, 1, 100, 17], [0, 30, 200, 7, 64, 3]
    groups = kernel_equals_sdpa(q_lens, past_lens, (heads, kv_heads, dim), window, dtype, tol)
    assert groups == [False, True]  # the one-row chunk is a decode, in a group of its own


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("window", [None, -48], ids=["full", "chunks"])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_native_kernels_take_sinks_and_chunks(
    dtype: torch.dtype,
    tol: float,
    heads: int,
    kv_heads: int,
    dim: int,
    window: int | None,
    prefill: bool,
) -> None:
    """gpt-oss's sink logits (one per query head, some far above the scores, some below) and
    Llama 4's chunks (48 positions: keys before a query's chunk unseen) in both kernels, the
    AVX-512 paths and the portable loops, against the eager product transformers computes."""
    sinks = torch.linspace(-3.0, 6.0, heads)
    past_lens = [0, 299, 17, 64, 150, 3] if not prefill else [0, 30, 200, 7, 64, 3]
    q_lens = [1] * 6 if not prefill else [70, 5, 33, 1, 100, 17]
    kernel_equals_sdpa(q_lens, past_lens, (heads, kv_heads, dim), window, dtype, tol, sinks)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 1, 64), (8, 1, 40), (4, 2, 128)])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "sdpa"])
def test_values_that_are_keys_are_read_from_the_keys(
    dtype: torch.dtype,
    tol: float,
    heads: int,
    kv_heads: int,
    dim: int,
    prefill: bool,
    native: bool,
) -> None:
    """A pool of rows holding the keys alone (multi-head latent attention's latent, stored
    once: `KVShape.values_are_keys`), read by both native kernels (the AVX-512 paths at head
    dims 64 and 128, the portable loops at 40, MLA's one kv head under many query heads) and
    by the gather-and-SDPA path, gives SDPA's float32 result with the values equal to the
    keys; a read of the values anywhere past a row's keys would read the next row or a NaN."""
    past_lens = [0, 299, 17, 64, 150, 3] if not prefill else [0, 30, 200, 7, 64, 3]
    q_lens = [1] * 6 if not prefill else [70, 5, 33, 1, 100, 17]
    shape = (heads, kv_heads, dim)
    kernel_equals_sdpa(q_lens, past_lens, shape, None, dtype, tol, None, None, True, native)


def test_values_that_are_keys_join_and_split_as_one_view() -> None:
    """Where the values are the keys, a KV row is the keys alone: joined without a copy, and
    split into k and v that are the same view of the rows."""
    k = torch.randn(5, 1, 12)
    joined = join_kv(k, k, values_are_keys=True)
    assert joined.shape == (5, 12) and joined.data_ptr() == k.data_ptr()
    key, value = split_kv(joined, KVShape(1, 12, values_are_keys=True))
    assert key is value and key is not None and torch.equal(key, k)
    assert KVShape(1, 12, values_are_keys=True).row_dim == 12 and KVShape(1, 12).row_dim == 24


def test_prefill_kernel_refuses_offsets_that_do_not_fit() -> None:
    kernels = native_kernels()
    q, pool = torch.randn(4, 2, 8), torch.randn(10, 2 * 1 * 8)
    slots = torch.arange(4)
    with pytest.raises(RuntimeError, match="q_len <= kv_len"):
        kernels.prefill(q, pool, slots[:3], torch.tensor([0, 4]), torch.tensor([0, 3]), 1, 1.0, 0)
    with pytest.raises(RuntimeError, match="ends at q's rows"):
        kernels.prefill(q, pool, slots, torch.tensor([0, 3]), torch.tensor([0, 4]), 1, 1.0, 0)


def test_join_kv_is_a_view_where_values_follow_keys() -> None:
    """KV rows out of the model's rotary (keys, then values, in each row of one tensor) are
    taken as they lie; keys and values apart are copied side by side. Same rows either way."""
    qkv = torch.randn(5, 4 + 2 * KV_HEADS, DIM)
    k, v = qkv[:, 4 : 4 + KV_HEADS], qkv[:, 4 + KV_HEADS :]
    want = torch.cat([k.reshape(5, -1), v.reshape(5, -1)], dim=1)
    joined = join_kv(k, v)
    assert torch.equal(joined, want) and joined.data_ptr() == k.data_ptr()
    apart = join_kv(k.clone(), v.clone())
    assert torch.equal(apart, want) and apart.data_ptr() != k.data_ptr()
    swapped = join_kv(v, k)  # v before k in the row: not a KV row, so a copy
    assert torch.equal(swapped, torch.cat([v.reshape(5, -1), k.reshape(5, -1)], dim=1))
