"""LLaVA (transformers' `LlavaForConditionalGeneration`): a CLIP vision tower
(engine/models/siglip.py with its class token), a two-layer MLP projector from the tower's
`vision_feature_layer` into the language model's width, and a Llama language model whose
image tokens attend causally like text. Exactly as transformers' `LlavaModel` computes it for
one image per placeholder."""

from __future__ import annotations

import torch

from engine.models.base import Weights, linear
from engine.models.gemma3_vision import vision_weight_name
from engine.models.llama import LlamaModel
from engine.models.siglip import ACTIVATIONS, ViTEncoder
from engine.models.vit_config import ViTConfig

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")
"""Where a LLaVA checkpoint keeps its language model (transformers 5's names, then the hub's
original ones, whose head is `language_model.lm_head`)."""


class LlavaModel(LlamaModel):
    """The Llama language model under LLaVA's names; the tower and the projector are the
    vision encoder's (`LlavaVisionTower`)."""

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        if vision_weight_name(hf_name) is not None:
            return None
        prefix = next((p for p in TEXT_PREFIXES if hf_name.startswith(p)), "")
        return super().map_name(hf_name.removeprefix(prefix))


class LlavaVisionTower:
    """One image's pixels -> its image tokens (tokens_per_image, out_hidden_size): the
    feature layer's states, the class token dropped unless `keep_class_token`, through
    'projector.linear_1', the activation, 'projector.linear_2' (`LlavaMultiModalProjector`)."""

    def __init__(self, config: ViTConfig) -> None:
        patches = config.patches_per_side**2 + config.keep_class_token
        if not config.class_token or config.tokens_per_image != patches:
            raise ValueError(
                f"a LLaVA tower needs CLIP's class token and {patches} image tokens per image, "
                f"not {config.tokens_per_image}"
            )
        self.config = config
        self.encoder = ViTEncoder(config)
        self._act = ACTIVATIONS[config.projector_act]

    def encode(self, w: Weights, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (channels, image_size, image_size) -> (tokens_per_image, out_hidden_size)."""
        x = self.encoder.encode(w, pixels)  # (N + 1, D), the class token first
        if not self.config.keep_class_token:
            x = x[1:]
        return linear(self._act(linear(x, w, "projector.linear_1")), w, "projector.linear_2")
