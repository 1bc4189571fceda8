"""Qwen3-VL's vision tower: Qwen2.5-VL's patch embedding and 2D rotary (engine/models/
qwen2_5_vision.py) plus a learned position table resampled to each image's grid, LayerNorm
blocks with a GELU MLP attending over the whole image (no windows), the merger, and DeepStack:
chosen blocks' outputs merged by their own mergers, to be added to the first decoder layers'
outputs at the image tokens. Over one image at a time, as transformers'
`Qwen3VLVisionModel` computes it.

Legend: N patches of one image, in the processor's order (row-major over merge_size x
merge_size blocks); C = channels * temporal_patch_size * patch_size**2 values per patch;
D = out_hidden_size, the language model's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.qwen2_5_vision import (
    attend,
    embed_patches,
    patch_positions,
    rotary_frequencies,
    rotary_tables,
)
from engine.models.vision_config import VisionConfig

NORM_EPS = 1e-6
"""The tower's LayerNorms' epsilon (fixed in transformers' code, not in the config)."""


class Qwen3VisionTower:
    """Stateless math of the tower over weights `w` (local names, `vision_weight_name`)."""

    def __init__(self, config: VisionConfig) -> None:
        self.config = config
        self._inv_freq = rotary_frequencies(config)

    def encode(self, w: Weights, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches (N, C) of `grid` (t, h, w) patches -> its image tokens'
        features (N / merge_size**2, D * (1 + len(deepstack_blocks))): the embedding's D
        columns, then each DeepStack layer's D, in the prompt's order."""
        c = self.config
        positions = patch_positions(grid, c.spatial_merge_size)  # (N, 2) row, column
        x = embed_patches(w, pixels, c)
        x = x + self._learned_positions(w, positions, grid).to(x.dtype)
        cos, sin = rotary_tables(positions, self._inv_freq.to(x.device))
        cos, sin = cos.to(x.device), sin.to(x.device)
        frames = [0, *torch.arange(1, grid[0] + 1).mul(grid[1] * grid[2]).tolist()]
        deep: list[torch.Tensor] = []
        for i in range(c.depth):
            x = self._block(w, f"blocks.{i}.", x, cos, sin, frames)
            if i in c.deepstack_blocks:
                index = c.deepstack_blocks.index(i)
                deep.append(self._merge(w, f"deepstack_merger_list.{index}.", x, True))
        return torch.cat([self._merge(w, "merger.", x, False), *deep], dim=-1)

    def _learned_positions(
        self, w: Weights, positions: torch.Tensor, grid: tuple[int, int, int]
    ) -> torch.Tensor:
        """(N, hidden) the square position table resampled to the (h, w) grid, bilinear with
        the corners aligned (transformers' four taps per patch and their weights, float32)."""
        table = w["pos_embed.weight"]  # (side * side, hidden)
        side = int(self.config.num_position_embeddings**0.5)
        rows, cols = (positions[:, axis].to(table.device) for axis in (0, 1))
        row_taps, row_weights = _taps(rows, grid[1], side)
        col_taps, col_weights = _taps(cols, grid[2], side)
        index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
        return (F.embedding(index, table) * weights[:, :, None]).sum(1)

    def _block(
        self,
        w: Weights,
        prefix: str,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bounds: list[int],
    ) -> torch.Tensor:
        """One block: x + attention(norm1(x)) over each frame, then + MLP(norm2(x))."""
        h = _layer_norm(x, w, f"{prefix}norm1")
        x = x + attend(self.config, w, f"{prefix}attn.", h, cos, sin, bounds)
        h = _layer_norm(x, w, f"{prefix}norm2")
        h = F.gelu(linear(h, w, f"{prefix}mlp.linear_fc1"), approximate="tanh")
        return x + linear(h, w, f"{prefix}mlp.linear_fc2")

    def _merge(self, w: Weights, prefix: str, x: torch.Tensor, norm_merged: bool) -> torch.Tensor:
        """(N, hidden) -> (N / merge_size**2, D): each merge_size**2 patches' states side by
        side, normed (per patch, or over the merged row for a DeepStack merger), then an MLP."""
        width = self.config.hidden_size * self.config.spatial_merge_size**2
        if norm_merged:
            merged = _layer_norm(x.reshape(-1, width), w, f"{prefix}norm")
        else:
            merged = _layer_norm(x, w, f"{prefix}norm").reshape(-1, width)
        return linear(F.gelu(linear(merged, w, f"{prefix}linear_fc1")), w, f"{prefix}linear_fc2")


def _layer_norm(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    weight = w[f"{name}.weight"]
    return F.layer_norm(x, weight.shape, weight, w[f"{name}.bias"], NORM_EPS)


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) patch coordinates on an axis of `size` patches -> their two taps into the
    table's `side` and the weights of each (N, 2): source coordinate index * (side - 1) /
    (size - 1), as `F.interpolate(align_corners=True)` places it."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(source)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
