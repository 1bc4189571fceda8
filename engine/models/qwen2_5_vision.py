"""Qwen2.5-VL's vision tower: patch embedding, window-attention blocks with 2D rotary, and the
merger that turns each 2x2 patches into one image token of the language model's width; over one
image at a time, exactly as transformers' `Qwen2_5_VisionTransformerPretrainedModel` computes it.

Legend: N patches of one image, in the processor's order (row-major over merge_size x
merge_size blocks); C = channels * temporal_patch_size * patch_size**2 values per patch.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.llama import rms_norm
from engine.models.vision_config import VisionConfig

NORM_EPS = 1e-6
"""The tower's RMSNorms' epsilon (fixed in transformers' code, not in the config)."""


def vision_weight_name(hf_name: str) -> str | None:
    """A checkpoint tensor name -> the tower's local name ('blocks.0.attn.qkv.weight'), or None
    for a tensor of the language model."""
    for prefix in ("visual.", "model.visual."):
        if hf_name.startswith(prefix):
            return hf_name[len(prefix) :]
    return None


class VisionTower:
    """Stateless math of the tower over weights `w` (local names, `vision_weight_name`)."""

    def __init__(self, config: VisionConfig) -> None:
        self.config = config
        self._inv_freq = rotary_frequencies(config)

    def encode(self, w: Weights, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches (N, C) of `grid` (t, h, w) patches -> its image tokens
        (N / merge_size**2, out_hidden_size), in the prompt's order."""
        c = self.config
        unit = c.spatial_merge_size**2
        window_index, window_bounds = self._windows(grid)
        positions = patch_positions(grid, c.spatial_merge_size)  # (N, 2) row, column
        x = embed_patches(w, pixels, c)
        num = x.shape[0]

        def by_window(t: torch.Tensor) -> torch.Tensor:  # merged blocks regrouped by window
            return t.reshape(num // unit, unit, -1)[window_index].reshape(num, -1)

        x = by_window(x)
        cos, sin = (by_window(t[:, 0])[:, None] for t in rotary_tables(positions, self._inv_freq))
        frames = [0, *torch.arange(1, grid[0] + 1).mul(grid[1] * grid[2]).tolist()]
        for i in range(c.depth):
            bounds = frames if i in c.full_attention_blocks else window_bounds
            x = self._block(w, f"blocks.{i}.", x, cos, sin, bounds)
        merged = rms_norm(x, w["merger.ln_q.weight"], NORM_EPS).view(-1, c.hidden_size * unit)
        merged = linear(F.gelu(linear(merged, w, "merger.mlp.0")), w, "merger.mlp.2")
        return merged[torch.argsort(window_index)]

    def _block(
        self,
        w: Weights,
        prefix: str,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bounds: list[int],
    ) -> torch.Tensor:
        """One block: x + attention(norm1(x)) over the spans `bounds`, then + MLP(norm2(x))."""
        h = rms_norm(x, w[f"{prefix}norm1.weight"], NORM_EPS)
        x = x + attend(self.config, w, f"{prefix}attn.", h, cos, sin, bounds)
        h = rms_norm(x, w[f"{prefix}norm2.weight"], NORM_EPS)
        gated = F.silu(linear(h, w, f"{prefix}mlp.gate_proj")) * linear(
            h, w, f"{prefix}mlp.up_proj"
        )
        return x + linear(gated, w, f"{prefix}mlp.down_proj")

    def _windows(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, list[int]]:
        """(the merged blocks' order grouped by window, (num_merged,); the patch offsets where
        each window starts and the last ends)."""
        c = self.config
        t, h, w = grid
        m = c.spatial_merge_size
        side = c.window_size // m // c.patch_size  # merged blocks per window side
        rows, cols = h // m, w // m
        index = torch.arange(t * rows * cols).reshape(t, rows, cols)
        pad_h, pad_w = side - rows % side, side - cols % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        num_h, num_w = (rows + pad_h) // side, (cols + pad_w) // side
        padded = padded.reshape(t, num_h, side, num_w, side).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, num_h * num_w, side * side)
        sizes = (padded != -100).sum(-1).flatten()  # merged blocks per window
        order = padded.flatten()
        bounds = [0, *(sizes.cumsum(0) * m * m).tolist()]
        return order[order != -100], list(dict.fromkeys(bounds))


def embed_patches(w: Weights, pixels: torch.Tensor, config: VisionConfig) -> torch.Tensor:
    """(N, C) patches -> (N, hidden): the patch embedding is a Conv3d whose stride is its
    kernel, so one product per patch (with its bias, where the checkpoint has one)."""
    c = config
    kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
    x = pixels.to(w["patch_embed.proj.weight"].dtype).view(-1, c.in_channels, *kernel)
    x = F.conv3d(x, w["patch_embed.proj.weight"], w.get("patch_embed.proj.bias"), stride=kernel)
    return x.view(-1, c.hidden_size)


def patch_positions(grid: tuple[int, int, int], merge_size: int) -> torch.Tensor:
    """(N, 2) (row, column) of each patch of `grid`, in the processor's block order."""
    t, h, w = grid
    m = merge_size
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    blocks = (h // m, m, w // m, m)
    rows = rows.reshape(blocks).transpose(1, 2).flatten()
    cols = cols.reshape(blocks).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


def rotary_frequencies(config: VisionConfig) -> torch.Tensor:
    """(head_dim/4,) the 2D rotary's frequencies: a quarter of the head per axis."""
    quarter = config.head_dim // 2
    return 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))


def rotary_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 2) patch positions -> cos and sin (N, 1, head_dim): the row's angles, then the
    column's, twice over (rotate-half layout)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # (N, 2, hd/4)
    freqs = freqs.flatten(1)  # (N, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (N, hd)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


def attend(
    config: VisionConfig,
    w: Weights,
    prefix: str,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    bounds: list[int],
) -> torch.Tensor:
    """A block's attention over the normed (N, hidden) `h`: qkv, 2D rotary, full attention
    within each span [bounds[i], bounds[i+1]), the output projection -> (N, hidden)."""
    c = config
    qkv = linear(h, w, f"{prefix}qkv")
    q, k, v = qkv.view(-1, 3, c.num_heads, c.head_dim).unbind(1)  # each (N, heads, hd)
    q, k = (_rotate(t, cos, sin) for t in (q, k))
    out = torch.empty_like(q)
    for start, end in itertools.pairwise(bounds):
        if end > start:  # (1, heads, L, hd) per span, no mask: every patch sees its span
            qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
    return linear(out.reshape(h.shape[0], -1), w, f"{prefix}proj")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over whole heads in float32, cast back: x (N, heads, hd), cos and sin (N, 1, hd)."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
