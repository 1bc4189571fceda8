"""Idefics3 and SmolVLM (transformers' `Idefics3ForConditionalGeneration`,
`SmolVLMForConditionalGeneration`): a SigLIP-like tower run over each tile of an image
(engine/models/siglip.py, its positions bucketed as `Idefics3VisionEmbeddings` buckets them),
the connector's pixel shuffle (scale_factor**2 neighbouring patches into one token) and one
linear into the language model's width, and a Llama language model whose image tokens attend
causally like text. The tiles and their markers in the prompt: engine/core/idefics3_media.py.

Legend: N = patches_per_side**2 patches of one tile, D = the tower's hidden size, s = the
connector's scale_factor."""

from __future__ import annotations

from typing import Any

import torch

from engine.models.base import Weights, linear
from engine.models.hf_config import UnsupportedModelError, require
from engine.models.hf_readers import llama, llama_text_config
from engine.models.llama import LlamaModel
from engine.models.siglip import ViTEncoder
from engine.models.vit_config import ViTConfig

PREFIXES = {
    "model.vision_model.": "",
    "model.connector.modality_projection.": "projector.",
}
"""Checkpoint prefixes of the tower -> its local names ('encoder.layers.0.mlp.fc1.weight',
'projector.proj.weight')."""
TEXT_PREFIX = "model.text_model."
"""Where the checkpoint keeps its language model (its head is the top level's `lm_head`)."""


def vision_weight_name(hf_name: str) -> str | None:
    """A checkpoint tensor name -> the tower's local name, or None for the language model's."""
    for prefix, local in PREFIXES.items():
        if hf_name.startswith(prefix):
            return local + hf_name[len(prefix) :]
    return None


class Idefics3Model(LlamaModel):
    """The Llama language model under Idefics3's names; the tower and the connector are the
    vision encoder's (`Idefics3VisionTower`)."""

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        if vision_weight_name(hf_name) is not None:
            return None
        if hf_name.startswith(TEXT_PREFIX):
            hf_name = "model." + hf_name[len(TEXT_PREFIX) :]
        return super().map_name(hf_name)


def read_config(hf: Any) -> dict[str, Any]:
    """`ModelConfig` fields of an Idefics3 or SmolVLM config: its Llama text config's, the
    tower's shapes, the connector's scale; image tokens attend causally."""
    text, vision = llama_text_config(hf), hf.vision_config
    require(vision, "num_channels", (3,))
    scale = int(hf.scale_factor)
    side = vision.image_size // vision.patch_size
    if side % scale:
        raise UnsupportedModelError(
            f"{hf.model_type}: scale_factor {scale} does not divide the {side}x{side} patch grid"
        )
    tied = getattr(hf, "tie_word_embeddings", None)
    return dict(
        llama(text),
        model_type=hf.model_type,
        vision=ViTConfig.from_hf(
            vision,
            text.hidden_size,
            side * side // (scale * scale),
            projector="pixel_shuffle",
            scale_factor=scale,
        ),
        image_token_id=int(hf.image_token_id),
        tie_word_embeddings=bool(text.tie_word_embeddings if tied is None else tied),
    )


def bucketed_positions(side: int) -> torch.Tensor:
    """(N,) rows of the position table a whole tile's patches read, row-major, as
    `Idefics3VisionEmbeddings` buckets a full patch mask's fractional coordinates (the
    processor pads no tile: every tile it makes is whole)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    step = 1.0 / torch.tensor(side)  # float32, as transformers divides by the mask's count
    fractional = torch.clamp(torch.arange(side, dtype=torch.float32) * step, max=1.0 - 1e-6)
    buckets = torch.bucketize(fractional, boundaries, right=True)
    return (buckets[:, None] * side + buckets[None, :]).flatten()


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """(tiles, N, D) -> (tiles, N / s**2, D * s**2): each s x s block of the patch grid one
    token, its patches' states side by side row-major within the block (`Idefics3Connector`)."""
    tiles, n, d = x.shape
    side = int(n**0.5)
    blocks = x.view(tiles, side // scale, scale, side // scale, scale, d)
    return blocks.permute(0, 1, 3, 2, 4, 5).reshape(tiles, n // scale**2, d * scale**2)


class Idefics3VisionTower:
    """One image's tiles' pixels -> its image tokens (tiles * tokens_per_image,
    out_hidden_size), tile by tile in the processor's order (the tiles row by row, then the
    global image)."""

    def __init__(self, config: ViTConfig) -> None:
        side, scale = config.patches_per_side, config.scale_factor
        if side % scale or config.tokens_per_image != (side // scale) ** 2:
            raise ValueError(
                f"an Idefics3 tower of {side}x{side} patches and scale_factor {scale} does not "
                f"give {config.tokens_per_image} tokens per tile"
            )
        self.config = config
        self.encoder = ViTEncoder(config)
        self._positions = bucketed_positions(side)

    def encode(self, w: Weights, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (tiles, channels, image_size, image_size) -> (tiles * tokens_per_image,
        out_hidden_size)."""
        name = "embeddings.position_embedding.weight"
        table = w[name][self._positions.to(w[name].device)]  # (N, D)
        weights = {**w, name: table}
        states = torch.stack([self.encoder.encode(weights, tile) for tile in pixels])  # (t, N, D)
        shuffled = pixel_shuffle(states, self.config.scale_factor)  # (t, N / s**2, D * s**2)
        return linear(shuffled, w, "projector.proj").flatten(0, 1)
