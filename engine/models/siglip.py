"""`ViTEncoder`: a plain ViT over one image (SigLIP's vision model, which Gemma 3, SmolVLM and
Idefics3 use; CLIP's, which LLaVA uses, with its class token, its pre-norm and quick_gelu),
exactly as transformers' `SiglipVisionTransformer` and `CLIPVisionTransformer` compute it
without their pooling heads.

Legend: N = (image_size / patch_size)**2 patches of one image, row-major (CLIP: N + 1, its
class token first); D = hidden_size. Weights use the checkpoint's names under the encoder's
prefix: 'embeddings.patch_embedding' (CLIP's without a bias), 'embeddings.position_embedding',
'embeddings.class_embedding' and 'pre_layrnorm' (CLIP),
'encoder.layers.{i}.(layer_norm1|self_attn.q_proj|...)', 'post_layernorm'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.vit_config import ViTConfig

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
"""The MLP activations a ViT config may name."""


class ViTEncoder:
    """Stateless math of the encoder over weights `w` (names as the module docstring says)."""

    def __init__(self, config: ViTConfig) -> None:
        if config.act not in ACTIVATIONS:
            raise ValueError(f"a ViT with hidden_act {config.act!r} is not supported")
        self.config = config
        self._act = ACTIVATIONS[config.act]

    def encode(self, w: Weights, pixels: torch.Tensor) -> torch.Tensor:
        """One image's pixels (channels, image_size, image_size), normalized as its processor
        normalizes them -> (N, D) patch states after the final LayerNorm (CLIP: N + 1; with a
        `feature_layer`, that layer's states without the final LayerNorm)."""
        c = self.config
        weight = w["embeddings.patch_embedding.weight"]  # (D, channels, patch, patch)
        x = F.conv2d(
            pixels[None].to(weight.dtype),
            weight,
            w.get("embeddings.patch_embedding.bias"),
            stride=c.patch_size,
        )  # (1, D, side, side)
        x = x.flatten(2)[0].transpose(0, 1)  # (N, D)
        if c.class_token:  # CLIP: (N + 1, D), then its pre-norm
            x = torch.cat((w["embeddings.class_embedding"][None].to(x.dtype), x))
        x = x + w["embeddings.position_embedding.weight"]
        if c.class_token:
            x = self._norm(x, w, "pre_layrnorm")
        for i in range(c.num_layers_run):
            x = self._block(w, f"encoder.layers.{i}.", x)
        return x if c.feature_layer else self._norm(x, w, "post_layernorm")

    def _block(self, w: Weights, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """x + attention(norm1(x)) over every patch, then + MLP(norm2(x))."""
        c = self.config
        h = self._norm(x, w, f"{prefix}layer_norm1")
        q, k, v = (
            linear(h, w, f"{prefix}self_attn.{name}_proj").view(-1, c.num_heads, c.head_dim)
            for name in ("q", "k", "v")
        )  # each (N, heads, hd)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        )
        x = x + linear(out.transpose(0, 1).reshape(x.shape), w, f"{prefix}self_attn.out_proj")
        h = self._norm(x, w, f"{prefix}layer_norm2")
        return x + linear(self._act(linear(h, w, f"{prefix}mlp.fc1")), w, f"{prefix}mlp.fc2")

    def _norm(self, x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
        return F.layer_norm(
            x, (x.shape[-1],), w[f"{name}.weight"], w[f"{name}.bias"], self.config.norm_eps
        )
