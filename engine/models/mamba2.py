"""The Mamba-2 token mixer (Granite 4 hybrid, Nemotron-H, Falcon-H1): a causal short
convolution over x, B and C, then the selective state space scan over a (heads, head dim,
state dim) state, chunked (SSD) for a prompt and step by step for a decode; a sequence's state
carries between chunks.

The math follows transformers' torch paths (`mamba2_chunk_scan`,
`mamba2_selective_state_update`), op for op where it decides rounding, so float32 tokens
agree; the code is nanoflex's own, over ragged sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.config import ModelConfig
from engine.models.gated_delta import conv_decode, conv_step


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): out[..., i, j] = x[..., j+1] + ... + x[..., i] for j <= i (0 on
    the diagonal), -inf above it; by masked cumulative sums, as transformers computes it."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    upto = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~upto, -torch.inf)


def _chunks(x: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """(1, L, ...) padded with zero rows to a multiple of `chunk` -> (1, L / chunk, chunk, ...)."""
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])


def scan_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's scan over L rows. x (L, H, P); dt (L, H) after softplus and clamp;
    a (H,) = -exp(A_log); b, c (L, G, N); d (H,); state (H, P, N) float32 -> (out (L, H, P)
    float32, the new state)."""
    length, heads = x.shape[0], x.shape[1]
    x = x[None].float()
    b = b[None].float().repeat_interleave(heads // b.shape[1], dim=2)
    c = c[None].float().repeat_interleave(heads // c.shape[1], dim=2)
    dt = dt[None]
    pad = (chunk - length % chunk) % chunk
    skip = d[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    a = a.to(x.dtype) * dt.float()
    x, a, b, c = (_chunks(t, pad, chunk) for t in (x, a, b, c))
    a = a.permute(0, 3, 1, 2)  # (1, H, chunks, chunk)
    a_cumsum = torch.cumsum(a, dim=-1)
    # within each chunk: an attention-like product of C and B under the decay mask
    decay = torch.exp(segment_sum(a))
    scores = torch.einsum("bclhn,bcshn->bclsh", c, b) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    # each chunk's own contribution to the state, then the states across chunks
    b_decay = b * torch.exp(a_cumsum[:, :, :, -1:] - a_cumsum).permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", b_decay, x)
    states = torch.cat([state[None, None].to(states), states], dim=1)
    across = torch.exp(segment_sum(F.pad(a_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", across, states)
    states, final = states[:, :-1], states[:, -1]
    # each chunk's start state read out by C
    y_off = torch.einsum("bclhn,bchpn->bclhp", c, states)
    y_off = y_off * torch.exp(a_cumsum).permute(0, 2, 3, 1)[..., None]
    out = (y_diag + y_off).reshape(1, -1, heads, x.shape[-1]) + skip
    return out[0, :length], final[0]


def scan_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row for each of B sequences (decodes): x (B, H, P); dt (B, H) after softplus;
    a (H,); b, c (B, G, N); d (H,); state (B, H, P, N) float32 -> (out (B, H, P) in x's
    dtype, the new state)."""
    batch, heads, head_dim = x.shape
    groups, size = b.shape[1], b.shape[2]
    dt = dt[..., None].expand(-1, -1, head_dim)[..., None]  # (B, H, P, 1)
    decay = torch.exp(dt.float() * a[:, None, None].expand(-1, head_dim, size).float())
    per = heads // groups
    b = (
        b.reshape(batch, groups, 1, size)
        .expand(batch, groups, per, size)
        .reshape(batch, heads, 1, size)
    )
    state = state * decay + (dt * b * x[..., None])
    c = (
        c.reshape(batch, groups, 1, size)
        .expand(batch, groups, per, size)
        .reshape(batch, heads, size)
    )
    out = torch.bmm(state.to(c.dtype).view(-1, head_dim, size), c.reshape(-1, size, 1))
    out = out.view(batch, heads, head_dim)
    out = out + x * d[:, None].expand(-1, head_dim)
    return out.to(x.dtype), state


def grouped_gated_norm(
    y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, groups: int, eps: float
) -> torch.Tensor:
    """Mamba-2's gated RMSNorm (gate first): y * SiLU(gate) in float32, normalized over each of
    `groups` groups of channels, cast back, scaled by weight. y, gate (T, I)."""
    h = y.to(torch.float32) * F.silu(gate.to(torch.float32))
    h = h.view(h.shape[0], groups, -1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(y.shape).to(y.dtype)


def gated_norm_f32(
    y: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    groups: int,
    eps: float,
    gate_first: bool,
) -> torch.Tensor:
    """Falcon-H1's gated RMSNorm, all in float32 until the cast back: y times SiLU(gate)
    (`gate_first`), normalized over each of `groups` groups of channels, scaled by weight,
    then times SiLU(gate) (not `gate_first`). y, gate (T, I)."""
    silu = F.silu(gate.to(torch.float32))
    h = y.to(torch.float32)
    h = (h * silu if gate_first else h).view(y.shape[0], groups, -1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = (weight.view(groups, -1) * h).view(y.shape)
    return (h if gate_first else h * silu).to(y.dtype)


def mamba_output(c: ModelConfig, w: Weights, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The scan's output y (T, I) float32 gated by SiLU(gate) and normed as the family does
    (`ModelConfig.mamba_gate`)."""
    if c.mamba_gate == "gate":
        return y * F.silu(gate.to(torch.float32))
    weight, groups = w["ssm_norm.weight"], c.mamba_groups
    if c.mamba_gate == "gate_norm":
        return grouped_gated_norm(y, gate, weight, groups, c.norm_eps)
    return gated_norm_f32(y, gate, weight, groups, c.norm_eps, c.mamba_gate == "gate_norm_f32")


def mamba_mix(
    c: ModelConfig,
    w: Weights,
    x: torch.Tensor,
    states: dict[str, torch.Tensor],
    spans: list[tuple[int, int]],
    in_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Mamba-2 mixer over normed rows x (T, hidden) whose sequences own the rows `spans`
    and the states `states` (updated in place) -> its output (T, hidden), before the
    residual add. The weights: m_in, conv, ssm.A_log / D / dt_bias, ssm_norm, ssm_out
    (engine/models/granite_hybrid.py). `in_scale`: (conv_dim + I + H,) multipliers of
    in_proj's output (Falcon-H1's mup vector), or None."""
    heads, head_dim = c.mamba_num_heads, c.mamba_head_dim
    groups, size = c.mamba_groups, c.mamba_state_dim
    proj = linear(x, w, "m_in")
    if in_scale is not None:
        proj = proj * in_scale
    gate, mixed, dt = proj.split([c.mamba_inner, c.conv_dim, heads], dim=-1)
    dt = F.softplus(dt + w["ssm.dt_bias"].to(dt.dtype))  # (T, H); >= 0: the clamp is a no-op
    a = -torch.exp(w["ssm.A_log"].float())
    d = w["ssm.D"]
    conv, recurrent = states["conv"], states["recurrent"]
    weight, bias = w["conv.weight"], w.get("conv.bias")
    y = x.new_zeros(x.shape[0], c.mamba_inner, dtype=torch.float32)  # padding rows: 0
    split = [c.mamba_inner, groups * size, groups * size]
    decodes = [i for i, (_, n) in enumerate(spans) if n == 1]
    if decodes:  # one row each: the convolution and the scan for all at once
        index = torch.tensor(decodes, device=x.device)
        rows = torch.tensor([spans[i][0] for i in decodes], device=x.device)
        out, conv[index] = conv_decode(mixed[rows], conv[index], weight, bias)
        xs, b, cc = out.split(split, dim=-1)
        scanned, recurrent[index] = scan_step(
            xs.view(-1, heads, head_dim),
            dt[rows],
            a,
            b.view(-1, groups, size),
            cc.view(-1, groups, size),
            d,
            recurrent[index],
        )
        y[rows] = scanned.reshape(len(decodes), -1).float()
    for i, (first, n) in enumerate(spans):
        if n == 1:
            continue
        rows_i = slice(first, first + n)
        out, conv[i] = conv_step(mixed[rows_i], conv[i], weight, bias)
        xs, b, cc = out.split(split, dim=-1)
        scanned, recurrent[i] = scan_chunked(
            xs.view(n, heads, head_dim),
            dt[rows_i],
            a,
            b.view(n, groups, size),
            cc.view(n, groups, size),
            d,
            recurrent[i],
            c.mamba_chunk,
        )
        y[rows_i] = scanned.reshape(n, -1)
    return linear(mamba_output(c, w, y, gate).to(x.dtype), w, "ssm_out")
