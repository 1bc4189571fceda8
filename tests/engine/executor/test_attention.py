"""Ragged attention: decodes and prefill chunks padded apart, each row equal to attention of
its own sequence computed alone."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from engine.executor.attention import RaggedLayout, paged_attention, ragged_attention

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
    assert layout.q_max == 64 and layout.num_past == 300
    decodes = next(grp for grp in layout.groups if grp.q_max == 1)
    assert decodes.mask is None  # one length, every key visible


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(
    "q_lens,past_lens",
    [
        ([1, 7, 1, 3, 1], [9, 0, 4, 6, 12]),
        ([1, 1, 1], [5, 5, 5]),
        ([1, 1, 1], [2, 9, 4]),
        ([6, 2], [0, 3]),
    ],
)
def test_paged_attention_reads_the_pool_in_place(
    q_lens: list[int], past_lens: list[int], window: int | None
) -> None:
    """Keys scattered over a pool's slots, read in place, give what the packed path gives."""
    g = torch.Generator().manual_seed(1)
    total, past_total = sum(q_lens), sum(past_lens)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=g) for _ in "kv")
    past_k, past_v = (torch.randn(past_total, KV_HEADS, DIM, generator=g) for _ in "kv")
    num_slots = 4 * (total + past_total)
    pool = torch.full((num_slots, 2 * KV_HEADS * DIM), float("nan"))  # unread slots poison
    order = torch.randperm(num_slots, generator=g).tolist()
    seq_slots, row, past_row = [], 0, 0
    for t, p in zip(q_lens, past_lens, strict=True):
        slots = [order.pop() for _ in range(p + t)]
        keys = torch.cat([past_k[past_row : past_row + p], k[row : row + t]])
        values = torch.cat([past_v[past_row : past_row + p], v[row : row + t]])
        pool[slots] = torch.cat([keys.flatten(1), values.flatten(1)], dim=1)
        seq_slots.append(slots)
        row, past_row = row + t, past_row + p
    cpu = torch.device("cpu")
    packed = RaggedLayout.build(q_lens, past_lens, cpu, window)
    paged = RaggedLayout.build(q_lens, past_lens, cpu, window, seq_slots)
    assert paged.in_place and not packed.in_place
    want = ragged_attention(q, k, v, past_k, past_v, packed)
    got = paged_attention(q, pool, lambda rows: rows, paged, (KV_HEADS, DIM))
    torch.testing.assert_close(got, want)
