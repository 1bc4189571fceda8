"""OLMo 2: no norm before attention or the MLP; an RMSNorm after each (before the residual add),
and RMSNorms over the whole q and k projections (all heads together) before rotary. Its
RMSNorm scales in float32, as Gemma's does, without the 1 + w. OLMo 3 is the same layer with
sliding windows on three layers of four and a rotary per layer type, both from the config
(`Model.attention_spec`, `LlamaModel.rotary_tables`)."""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.models.base import Weights, linear
from engine.models.llama import (
    PROJECTION_NAMES,
    QK_NORM_NAMES,
    LlamaModel,
    norm_rows,
    rms_norm_f32,
)

LOCAL_NAMES = {
    **PROJECTION_NAMES,
    **QK_NORM_NAMES,
    "post_attention_layernorm": "ln_post_attn",
    "post_feedforward_layernorm": "ln_post_mlp",
}


class Olmo2Model(LlamaModel):
    LOCAL_NAMES: ClassVar[dict[str, str]] = LOCAL_NAMES

    def _norm(self, x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
        return rms_norm_f32(x, w[f"{name}.weight"], self.config.norm_eps)

    def input_norm(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return h

    def norm_qk(self, w: Weights, qkv: torch.Tensor) -> torch.Tensor:
        """q_norm over all query heads at once (heads * head_dim wide), k_norm over all key
        heads, in place on (T, heads + 2 kv_heads, head_dim)."""
        c = self.config
        norm_rows(qkv, slice(0, c.num_heads), w["q_norm.weight"], c.norm_eps, rms_norm_f32)
        keys = slice(c.num_heads, c.num_heads + c.num_kv_heads)
        norm_rows(qkv, keys, w["k_norm.weight"], c.norm_eps, rms_norm_f32)
        return qkv

    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h = h + self._norm(linear(o.reshape(o.shape[0], -1), w, "o"), w, "ln_post_attn")
        return h + self._norm(self.mlp(w, h), w, "ln_post_mlp")

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(self._norm(h, w, "norm"), w, "lm_head").float()
