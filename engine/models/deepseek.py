"""DeepSeek-V3 / R1: multi-head latent attention (MLA) over the grouped-routing MoE layer.

MLA projects each token to one compressed latent c (kv_lora_rank wide, RMS-normed) and one
rotary key k_r (qk_rope_head_dim wide) shared by all heads; each head's key is
[W_uk[h] c, k_r] and its value W_uv[h] c, with W_uk and W_uv the two parts of `kv_b_proj`.
transformers expands c into those per-head keys and values at every step. Here the attention
runs in the absorbed form, over the latent itself: each head's query q = [q_nope, q_rope]
becomes [W_uk[h]^T q_nope, q_rope], so that its score against a token is the same product
q_nope . (W_uk[h] c) + q_rope . k_r = (W_uk[h]^T q_nope) . c + q_rope . k_r, and each head's
output is W_uv[h] applied to the attention-weighted sum of latents. The attention is then
plain multi-query attention with one KV head of kv_lora_rank + qk_rope_head_dim (576 in
DeepSeek-V3) that every attention path already runs:

    key   (T, 1, r + rope)  [c, rotated k_r]
    value (T, 1, r + rope)  the same row (the output's last rope columns are not read)

The value is the key, so a KV page row holds it once (`ModelConfig.values_are_keys`, which
kv_lora_rank sets: every tier, kernel and the prefix cache read the value from the key):
576 elements per token and layer, as transformers 5's own cache keeps the latent, where
per-head keys and values would take 128 heads x (192 + 128) = 40960 (71x more); the model
returns the same tensor as k and v. Attention computes over 576-wide keys per
head instead of 192-wide ones: 3x the score products of the expanded form, without
expanding the past at every step. The sums run in another order than transformers' (the
latent products first), which moves float32 logits by about 1e-6.

Local names of a layer's attention: q_a, q_a_norm, q_b (or q without q_lora_rank), kv_a,
kv_a_norm, kv_b (kept in full precision: it is read as per-head matrices, not a GEMM's
weight), o.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.models.base import AttentionSpec, Positions, Weights, linear
from engine.models.llama import LOCAL_NAMES, rms_norm
from engine.models.moe import GroupedMoeModel

MLA_NAMES = {
    "self_attn.q_proj": "q",
    "self_attn.q_a_proj": "q_a",
    "self_attn.q_a_layernorm": "q_a_norm",
    "self_attn.q_b_proj": "q_b",
    "self_attn.kv_a_proj_with_mqa": "kv_a",
    "self_attn.kv_a_layernorm": "kv_a_norm",
    "self_attn.kv_b_proj": "kv_b",
}
LATENT_NORM_EPS = 1e-6
"""transformers builds the q and kv latents' RMSNorms with their default eps, not the
config's rms_norm_eps."""


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., d) with rotary pairs interleaved (0, 1), (2, 3), ... -> the even then the odd
    dimensions (rope_interleave: transformers rotates DeepSeek-V3's pairs this way and keeps
    the result in this order, for q and k alike)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepseekV3Model(GroupedMoeModel):
    LOCAL_NAMES: ClassVar[dict[str, str]] = {**LOCAL_NAMES, **MLA_NAMES}

    def attention_spec(self, j: int, w: Weights) -> AttentionSpec:
        return AttentionSpec(scale=self.config.attn_scale)

    def is_compressible(self, j: int, name: str, tensor: torch.Tensor) -> bool:
        return name != "kv_b.weight" and super().is_compressible(j, name, tensor)

    def _up_projections(self, w: Weights) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj (heads * (nope + v), r) as W_uk (heads, nope, r) and W_uv (heads, v, r)."""
        c = self.config
        kv_b = w["kv_b.weight"].view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        return kv_b[:, : c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim :]

    def attention_inputs(
        self, j: int, w: Weights, h: torch.Tensor, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        rope, rank = c.rotary_dim, c.kv_lora_rank
        x = self.input_norm(w, h)
        if "q_a.weight" in w:
            q_latent = rms_norm(linear(x, w, "q_a"), w["q_a_norm.weight"], LATENT_NORM_EPS)
            q = linear(q_latent, w, "q_b")
        else:
            q = linear(x, w, "q")
        q = q.view(q.shape[0], c.num_heads, c.qk_nope_head_dim + rope)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, rope], dim=-1)
        latent, k_rope = linear(x, w, "kv_a").split([rank, rope], dim=-1)
        latent = rms_norm(latent, w["kv_a_norm.weight"], LATENT_NORM_EPS)
        rotated = torch.cat([q_rope, k_rope[:, None]], dim=1)  # (T, heads + 1, rope)
        if c.rope_interleave:
            rotated = deinterleave(rotated)
        cos, sin = positions.tables[:2]
        rotated = self.ops.rotary(rotated.contiguous(), cos, sin, c.num_heads + 1)
        w_uk, _ = self._up_projections(w)
        q_absorbed = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # (T, heads, r)
        q = torch.cat([q_absorbed, rotated[:, : c.num_heads]], dim=-1)
        k = torch.cat([latent, rotated[:, c.num_heads]], dim=-1)[:, None]  # (T, 1, r + rope)
        return q, k, k

    def before_mlp(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o (T, heads, r + rope), each head's weighted sum of [latent, k_rope] rows: its
        latent part through that head's W_uv (T, heads, v), then Llama's o_proj and norm."""
        _, w_uv = self._up_projections(w)
        values = torch.einsum("thr,hvr->thv", o[..., : self.config.kv_lora_rank], w_uv)
        return super().before_mlp(w, h, values.contiguous())
