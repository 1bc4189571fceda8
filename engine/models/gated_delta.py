"""The Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5): a causal short convolution over q, k
and v, then the gated delta rule over a (value heads, key dim, value dim) recurrent state,
chunked for a prompt and step by step for a decode; a sequence's state carries from one
chunk to the next.

The math follows transformers' torch paths (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_*`), op for op where it decides rounding,
so float32 tokens agree; the code is nanoflex's own, over ragged sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from policy.hybrid import GATED_DELTA_CHUNK as CHUNK


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (the FLA library's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def conv_step(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's causal depthwise convolution with SiLU over its new rows (Gated
    DeltaNet's and Mamba-2's). x (L, C) new rows, window (C, K-1) the previous K-1 inputs
    (zeros at the start), weight (C, 1, K), bias (C,) or None -> (out (L, C), the new window
    (C, K-1))."""
    kernel = weight.shape[-1]
    joined = torch.cat([window, x.t()], dim=-1).to(weight.dtype)  # (C, K-1+L)
    out = F.conv1d(joined[None], weight, bias, padding=0, groups=joined.shape[0])[0]
    new_window = joined[:, joined.shape[1] - (kernel - 1) :]
    return F.silu(out).to(x.dtype).t(), new_window


def conv_decode(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution for B decodes at once: x (B, C) one row each, windows (B, C, K-1) ->
    (out (B, C), new windows (B, C, K-1))."""
    joined = torch.cat([windows, x[:, :, None]], dim=-1).to(weight.dtype)  # (B, C, K)
    out = F.conv1d(joined, weight, bias, padding=0, groups=joined.shape[1])[:, :, -1]
    return F.silu(out).to(x.dtype), joined[:, :, 1:]


def _prepare(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (..., L, Hk, dk) -> float32 (..., Hv, L, dk), each k head serving Hv/Hk value
    heads, l2-normalized, q scaled by dk ** -0.5."""
    repeat = num_v_heads // k.shape[-2]
    if repeat > 1:
        q = q.repeat_interleave(repeat, dim=-2)
        k = k.repeat_interleave(repeat, dim=-2)
    q, k = (
        t.transpose(-3, -2).to(torch.float32, memory_format=torch.contiguous_format) for t in (q, k)
    )
    q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k


def delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's gated delta rule over L rows, CHUNK at a time (the UT transform within a
    chunk, the state carried between chunks). q, k (L, Hk, dk); v (L, Hv, dv); decay, beta
    (L, Hv) (the state is multiplied by exp(decay) per row); state (Hv, dk, dv) float32 ->
    (out (L, Hv, dv) float32, the new state)."""
    length, num_heads = v.shape[0], v.shape[1]
    q, k = _prepare(q, k, num_heads)  # (Hv, L, dk)
    v, beta, decay = (
        t.transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
        for t in (v, beta, decay)
    )
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, decay = F.pad(beta, (0, pad)), F.pad(decay, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    # (Hv, N, CHUNK, d): the rows cut into N chunks
    q, k, k_beta, v_beta = (
        t.reshape(num_heads, -1, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta)
    )
    decay = decay.reshape(num_heads, -1, CHUNK).cumsum(dim=-1)  # within each chunk
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower triangular after the mask
    attn = (q @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    decayed_keys = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    state = state.to(values)
    out = torch.zeros_like(values)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    for i in range(values.shape[1]):
        fresh = values[:, i] - decayed_keys[:, i] @ state
        out[:, i] = q[:, i] @ state + attn[:, i] @ fresh
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
    out = out.reshape(num_heads, -1, out.shape[-1])[:, :length]
    return out.transpose(0, 1), state


def delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row for each of B sequences (decodes): q, k (B, Hk, dk); v (B, Hv, dv); decay, beta
    (B, Hv); state (B, Hv, dk, dv) float32 -> (out (B, Hv, dv) float32, the new state)."""
    q, k = _prepare(q[:, None], k[:, None], v.shape[1])  # (B, Hv, 1, dk)
    q, k = q[:, :, 0], k[:, :, 0]
    v, beta, decay = (t.to(torch.float32) for t in (v, beta, decay))
    state = state.to(torch.float32) * decay.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(dim=-2)  # (B, Hv, dv)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """transformers' RMSNormGated: normalize x in float32, cast back, scale by weight, times
    SiLU(gate) in float32, cast back. x, gate (..., width)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * x32.to(x.dtype)
    return (out * F.silu(gate.to(torch.float32))).to(x.dtype)
