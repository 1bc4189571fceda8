"""Attention over ragged sequences: each has its own past length and number of new tokens."""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention
from torch.nn.utils.rnn import pad_sequence


def ragged_attention(
    q: list[torch.Tensor],
    k: list[torch.Tensor],
    v: list[torch.Tensor],
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for B sequences at once, padded to one kernel call.

    q[i]: (q_len_i, num_heads, head_dim), the new tokens of sequence i.
    k[i], v[i]: (ctx_len_i + q_len_i, num_kv_heads, head_dim), its past then its new tokens.
    Returns (sum q_len_i, num_heads, head_dim) in sequence order.
    """
    device = q[0].device
    q_lens = torch.tensor([x.shape[0] for x in q], device=device)
    kv_lens = torch.tensor([x.shape[0] for x in k], device=device)
    qp = pad_sequence(q, batch_first=True).transpose(1, 2)  # (B, nh, Qm, hd)
    kp = pad_sequence(k, batch_first=True).transpose(1, 2)  # (B, kvh, Lm, hd)
    vp = pad_sequence(v, batch_first=True).transpose(1, 2)
    q_max, kv_max = qp.shape[2], kp.shape[2]
    # Absolute position of query t of sequence i is ctx_len_i + t = kv_len_i - q_len_i + t.
    q_pos = (kv_lens - q_lens)[:, None] + torch.arange(q_max, device=device)[None, :]  # (B, Qm)
    k_pos = torch.arange(kv_max, device=device)[None, None, :]  # (1, 1, Lm)
    mask = k_pos <= q_pos[:, :, None]  # causal; also excludes padded keys
    if sliding_window is not None:
        mask &= k_pos > q_pos[:, :, None] - sliding_window
    q_valid = torch.arange(q_max, device=device)[None, :] < q_lens[:, None]  # (B, Qm)
    mask[:, :, 0] |= ~q_valid  # padded query rows attend somewhere so no row is all -inf
    out = scaled_dot_product_attention(
        qp, kp, vp, attn_mask=mask[:, None], enable_gqa=qp.shape[1] != kp.shape[1]
    )  # (B, nh, Qm, hd)
    return out.transpose(1, 2)[q_valid]  # (T, nh, hd)
