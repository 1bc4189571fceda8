"""A held-out tiny Qwen3-VL checkpoint (a Qwen3 language model with interleaved M-RoPE, a
vision tower with learned positions and one DeepStack layer), saved whole with its processor
and chat template as tests/engine/vision_models.py saves Qwen2.5-VL's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.engine.vision_models import TEXT, TOKENS, build_tiny_vl

SPEC: dict[str, Any] = {
    "model_type": "qwen3_vl",
    **TOKENS,
    "text_config": {
        **TEXT,
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0],
    },
}
"""Text: head_dim 16, its 8 rotary frequencies' axes t h w t h w t t (sections 4+2+2,
interleaved); vision: head_dim 16, a 4x4 learned position table, block 0's output merged
and added after decoder layer 0 (DeepStack)."""

SCALED = {
    "visual.merger.linear_fc2": 100.0,
    "deepstack_merger_list.0.linear_fc2": 30.0,
    "self_attn.q_norm.weight": 3.0,
    "self_attn.k_norm.weight": 3.0,
}
"""The merger's and the DeepStack merger's outputs scaled up past the token embeddings' size,
and the per-head q and k norms (which undo any scale of the projections) so that attention
is peaked and hangs on the positions: at the random init's scale an image moves no greedy
token (tests/engine/vision_models.py's `SCALED` says how that was found)."""


PROCESSOR: dict[str, Any] = {
    "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 64 * 64,
    "max_pixels": 128 * 128,
}
"""Qwen3-VL's image processor: 16-pixel patches, 0.5 mean and deviation; a tiny budget."""


def build_tiny_qwen3_vl(path: Path, seed: int = 0) -> Path:
    """The checkpoint, its processor and its chat template saved at `path`."""
    return build_tiny_vl(path, seed, SPEC, SCALED, **PROCESSOR)


MOE_SPEC: dict[str, Any] = {
    **SPEC,
    "model_type": "qwen3_vl_moe",
    "text_config": {
        **SPEC["text_config"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "mlp_only_layers": [1],
    },
}
"""Qwen3-VL-MoE: layer 0 routes each token to 2 of 4 experts, layer 1 is dense."""


def build_tiny_qwen3_vl_moe(path: Path, seed: int = 0) -> Path:
    """The MoE checkpoint, its processor and chat template saved at `path`."""
    return build_tiny_vl(path, seed, MOE_SPEC, SCALED, **PROCESSOR)
