"""Attention over ragged sequences: each has its own past length and number of new tokens.

The batch's token rows are scattered into padded (B, L) tensors by precomputed
indices (`RaggedLayout`, built once per step and shared by every layer), so a
layer does one scatter per tensor and one SDPA call, with no loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass(slots=True)
class RaggedLayout:
    """Where each row goes in the padded attention tensors of B sequences (T new rows in
    sequence order, P past rows packed in sequence order)."""

    num_seqs: int
    q_max: int
    kv_max: int
    q_dest: torch.Tensor
    """(T,) new row -> b * q_max + t."""
    new_dest: torch.Tensor
    """(T,) new k/v row -> b * kv_max + past_len_b + t."""
    past_dest: torch.Tensor
    """(P,) past k/v row -> b * kv_max + position."""
    mask: torch.Tensor
    """(B, 1, q_max, kv_max) bool: causal (and sliding-window) visibility."""

    @property
    def num_past(self) -> int:
        return int(self.past_dest.shape[0])

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        past_lens: list[int],
        device: torch.device,
        sliding_window: int | None = None,
    ) -> RaggedLayout:
        num_seqs, q_max = len(q_lens), max(q_lens)
        kv_max = max(p + q for p, q in zip(past_lens, q_lens, strict=True))
        q_len_t = torch.tensor(q_lens, device=device)
        past_t = torch.tensor(past_lens, device=device)
        seqs = torch.arange(num_seqs, device=device)

        def offsets(lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
            """(sequence of each row, index of each row within its sequence)."""
            seq = torch.repeat_interleave(seqs, lens, output_size=total)
            starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
            return seq, torch.arange(total, device=device) - starts

        seq_new, t_new = offsets(q_len_t, sum(q_lens))
        seq_past, pos_past = offsets(past_t, sum(past_lens))
        # Absolute position of query t of sequence b is past_len_b + t.
        q_pos = past_t[:, None] + torch.arange(q_max, device=device)[None, :]  # (B, q_max)
        k_pos = torch.arange(kv_max, device=device)[None, None, :]  # (1, 1, kv_max)
        mask = k_pos <= q_pos[:, :, None]  # causal; also hides padded keys
        if sliding_window is not None:
            mask &= k_pos > q_pos[:, :, None] - sliding_window
        q_valid = torch.arange(q_max, device=device)[None, :] < q_len_t[:, None]
        mask[:, :, 0] |= ~q_valid  # padded query rows attend somewhere: no all -inf row
        return cls(
            num_seqs=num_seqs,
            q_max=q_max,
            kv_max=kv_max,
            q_dest=seq_new * q_max + t_new,
            new_dest=seq_new * kv_max + past_t[seq_new] + t_new,
            past_dest=seq_past * kv_max + pos_past,
            mask=mask[:, None],
        )


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_k: torch.Tensor | None,
    past_v: torch.Tensor | None,
    layout: RaggedLayout,
) -> torch.Tensor:
    """Causal attention of the new rows over each sequence's past and new keys.

    q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim) for the new tokens;
    past_k, past_v: (P, num_kv_heads, head_dim) packed in sequence order (None if P = 0).
    Returns (T, num_heads, head_dim).
    """
    b, q_max, kv_max = layout.num_seqs, layout.q_max, layout.kv_max
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]

    def padded_kv(new: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
        out = new.new_zeros(b * kv_max, num_kv_heads, head_dim)
        out[layout.new_dest] = new
        if past is not None and layout.num_past:
            out[layout.past_dest] = past
        return out.view(b, kv_max, num_kv_heads, head_dim).transpose(1, 2)  # (B, kvh, L, hd)

    qp = q.new_zeros(b * q_max, num_heads, head_dim)
    qp[layout.q_dest] = q
    qp = qp.view(b, q_max, num_heads, head_dim).transpose(1, 2)  # (B, nh, Qm, hd)
    out = scaled_dot_product_attention(
        qp,
        padded_kv(k, past_k),
        padded_kv(v, past_v),
        attn_mask=layout.mask,
        enable_gqa=num_heads != num_kv_heads,
    )  # (B, nh, Qm, hd)
    return out.transpose(1, 2).reshape(b * q_max, num_heads, head_dim)[layout.q_dest]


def split_kv(
    rows: torch.Tensor | None, kv_shape: tuple[int, int]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(N, 2 * kv_dim) packed KV rows -> k and v, each (N, num_kv_heads, head_dim)."""
    if rows is None:
        return None, None
    n, kv_dim = rows.shape[0], kv_shape[0] * kv_shape[1]
    return rows[:, :kv_dim].reshape(n, *kv_shape), rows[:, kv_dim:].reshape(n, *kv_shape)


def cpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past: torch.Tensor | None,
    layout: RaggedLayout,
    kv_shape: tuple[int, int],
) -> torch.Tensor:
    """Decode attention on the CPU over host-homed past KV (FlexGen Sec. 4.2): (T, heads,
    head_dim) float32 on the CPU. Computes in float32 (CPU half matmuls are slow and less
    exact); q, k, v may live anywhere and are copied as needed."""
    return ragged_attention(
        q.to("cpu", torch.float32),
        k.to("cpu", torch.float32),
        v.to("cpu", torch.float32),
        *split_kv(past, kv_shape),
        layout,
    )
