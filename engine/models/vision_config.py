"""`VisionConfig`: the shapes of a vision tower (Qwen2.5-VL's or Qwen3-VL's), read from its HF
config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    """The tower's shapes (transformers' `Qwen2_5_VLVisionConfig`, `Qwen3VLVisionConfig`)."""

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
    num_position_embeddings: int = 0
    """Qwen3-VL: rows of its learned square position table, resampled to each image's grid;
    0: no learned positions (Qwen2.5-VL)."""
    deepstack_blocks: tuple[int, ...] = ()
    """Qwen3-VL: the blocks whose outputs, merged, are added to the first decoder layers'
    outputs at the image tokens (DeepStack), block `deepstack_blocks[i]` to layer i."""

    @classmethod
    def from_hf(cls, hf: Any) -> VisionConfig:
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        shapes = dict(
            depth=hf.depth,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=hf.num_heads,
            in_channels=hf.in_channels,
            patch_size=hf.patch_size,
            temporal_patch_size=hf.temporal_patch_size,
            spatial_merge_size=hf.spatial_merge_size,
            out_hidden_size=hf.out_hidden_size,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if hasattr(hf, "deepstack_visual_indexes"):  # Qwen3-VL's: no windows, DeepStack
            return cls(
                **shapes,
                window_size=0,
                full_attention_blocks=tuple(range(hf.depth)),
                num_position_embeddings=hf.num_position_embeddings,
                deepstack_blocks=tuple(hf.deepstack_visual_indexes),
            )
        return cls(
            **shapes,
            window_size=hf.window_size,
            full_attention_blocks=tuple(hf.fullatt_block_indexes),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def feature_width(self) -> int:
        """Columns of one image token's features: the embedding's, then each DeepStack
        layer's (`out_hidden_size` each)."""
        return self.out_hidden_size * (1 + len(self.deepstack_blocks))
