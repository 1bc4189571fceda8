"""`ViTConfig`: the shapes of a plain ViT image encoder (SigLIP's, CLIP's), read from its HF
vision config, and the connector that turns its patches into a language model's image tokens
(Gemma 3's avg-pool projector, LLaVA's two-layer MLP, Idefics3's pixel shuffle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ViTConfig:
    """A ViT encoder over one square image (transformers' `SiglipVisionConfig`, or CLIP's with
    its class token): a patch embedding, learned positions, pre-norm blocks, a final
    LayerNorm; and the model's connector to its language model (Gemma 3's avg-pool projector,
    LLaVA's MLP)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    in_channels: int
    patch_size: int
    image_size: int
    """Pixels per side of the (resized) image: (image_size / patch_size)**2 patches."""
    act: str
    """The MLP's activation: 'gelu_pytorch_tanh' (SigLIP) or 'quick_gelu' (CLIP)."""
    norm_eps: float
    out_hidden_size: int
    """The language model's hidden size: the width of one image token."""
    tokens_per_image: int
    """Image tokens per image after the connector (Gemma 3's mm_tokens_per_image; LLaVA's
    patches, and its class token where `keep_class_token`)."""
    class_token: bool = False
    """CLIP: a learned class embedding before the patches (position 0), and a LayerNorm
    (`pre_layrnorm`) over the embeddings before the first block."""
    feature_layer: int = 0
    """LLaVA: the hidden state its projector reads, indexed as transformers' `hidden_states`
    (0 the embeddings, i after block i, negative from the end: -2 skips the last block),
    without the final LayerNorm; 0 here: the last block's, after the final LayerNorm."""
    keep_class_token: bool = False
    """LLaVA's vision_feature_select_strategy 'full' (the class token is an image token too);
    'default' drops it."""
    projector: str = "avg_pool"
    """The connector: 'avg_pool' (Gemma 3's `Gemma3MultiModalProjector`), 'mlp' (LLaVA's
    linear, `projector_act`, linear) or 'pixel_shuffle' (Idefics3's `Idefics3Connector`, over
    each tile of an image)."""
    projector_act: str = ""
    """The activation between the MLP projector's two linears ('gelu')."""
    scale_factor: int = 1
    """Idefics3: the pixel shuffle's side, scale_factor**2 patches into one image token."""

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size or self.hidden_size % self.num_heads:
            raise ValueError(
                f"a ViT of image_size {self.image_size}, patch_size {self.patch_size}, "
                f"hidden {self.hidden_size} and {self.num_heads} heads does not tile"
            )

    @classmethod
    def from_hf(
        cls, hf: Any, out_hidden_size: int, tokens_per_image: int, **connector: Any
    ) -> ViTConfig:
        """The shapes of transformers' vision config `hf`; `connector`: the fields past
        `tokens_per_image` (CLIP's class token, LLaVA's feature layer and projector)."""
        return cls(
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=hf.num_attention_heads,
            num_layers=hf.num_hidden_layers,
            in_channels=hf.num_channels,
            patch_size=hf.patch_size,
            image_size=hf.image_size,
            act=hf.hidden_act,
            norm_eps=float(hf.layer_norm_eps),
            out_hidden_size=out_hidden_size,
            tokens_per_image=tokens_per_image,
            **connector,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_layers_run(self) -> int:
        """The blocks the encoder runs: all, or up to `feature_layer`'s hidden state."""
        if self.feature_layer < 0:
            return self.num_layers + 1 + self.feature_layer
        return self.feature_layer or self.num_layers
