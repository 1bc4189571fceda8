"""`VisionConfig`: the shapes of a vision tower (Qwen2.5-VL's), read from its HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    """The tower's shapes (transformers' `Qwen2_5_VLVisionConfig`)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    """Pixels per attention window side; blocks not in `full_attention_blocks` attend within
    a window."""
    out_hidden_size: int
    """The language model's hidden size: the width of one image token."""
    full_attention_blocks: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        return cls(
            depth=hf.depth,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=hf.num_heads,
            in_channels=hf.in_channels,
            patch_size=hf.patch_size,
            temporal_patch_size=hf.temporal_patch_size,
            spatial_merge_size=hf.spatial_merge_size,
            window_size=hf.window_size,
            out_hidden_size=hf.out_hidden_size,
            full_attention_blocks=tuple(hf.fullatt_block_indexes),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
