"""Gemma 3's vision tower: the SigLIP encoder (engine/models/siglip.py), then its multi-modal
projector: the patch grid average-pooled to mm_tokens_per_image tokens, Gemma's RMSNorm, one
matmul into the language model's width; exactly as transformers' `Gemma3MultiModalProjector`
computes it. Image tokens attend to each other both ways in the language model
(`ModelConfig.bidirectional_images`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.base import Weights
from engine.models.gemma import gemma_norm
from engine.models.siglip import ViTEncoder
from engine.models.vit_config import ViTConfig

PREFIXES = {
    "model.vision_tower.vision_model.": "",
    "vision_tower.vision_model.": "",
    "model.vision_tower.": "",
    "vision_tower.": "",
    "model.multi_modal_projector.": "projector.",
    "multi_modal_projector.": "projector.",
}
"""Checkpoint prefixes -> local ones, longest first: the hub's files keep SigLIP's own
`vision_model.` level, transformers 5 saves the tower without it."""


def vision_weight_name(hf_name: str) -> str | None:
    """A checkpoint tensor name -> the tower's local name ('encoder.layers.0.mlp.fc1.weight',
    'projector.mm_input_projection_weight'), or None for a tensor of the language model."""
    for prefix, local in PREFIXES.items():
        if hf_name.startswith(prefix):
            return local + hf_name[len(prefix) :]
    return None


class Gemma3VisionTower:
    """One image's pixels -> its image tokens (tokens_per_image, out_hidden_size)."""

    def __init__(self, config: ViTConfig) -> None:
        side = config.tokens_per_image**0.5
        if side != int(side) or config.patches_per_side % int(side):
            raise ValueError(
                f"mm_tokens_per_image {config.tokens_per_image} is not a square that divides "
                f"the {config.patches_per_side}x{config.patches_per_side} patch grid"
            )
        self.config = config
        self.encoder = ViTEncoder(config)
        self._kernel = config.patches_per_side // int(side)

    def encode(self, w: Weights, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (channels, image_size, image_size) -> (tokens_per_image, out_hidden_size)."""
        c = self.config
        x = self.encoder.encode(w, pixels)  # (N, D)
        grid = x.transpose(0, 1).reshape(1, c.hidden_size, c.patches_per_side, -1)
        pooled = F.avg_pool2d(grid, self._kernel, self._kernel).flatten(2)[0].transpose(0, 1)
        normed = gemma_norm(pooled, w["projector.mm_soft_emb_norm.weight"], c.norm_eps)
        return torch.matmul(normed, w["projector.mm_input_projection_weight"]).to(x.dtype)
