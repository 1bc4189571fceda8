"""Decoder-based embedders (Qwen3-Embedding style: a Qwen3 or Llama-family decoder whose
last token's final hidden state is the vector): the decoder's last hidden states for a
right-padded batch, without a KV cache.

One dense forward in the checkpoint's dtype with the decoder's own pieces (`ModelConfig`,
`Rope`, `rms_norm` of engine/models/llama.py): per layer RMSNorm, q/k/v, Qwen3's per-head
q/k RMSNorm, rotary, causal grouped-query attention, o, RMSNorm, SwiGLU; then the final
norm. Causal attention means a right-padded row's real tokens never see its padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.config import ModelConfig
from engine.models.llama import rms_norm
from engine.models.rotary import Rope


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderEncoder:
    """A decoder's weights (checkpoint names without the leading `model.`) and its forward
    to the last hidden states."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.config = config
        self.weights = {name.removeprefix("model."): w for name, w in weights.items()}
        self.rope = Rope.of(config)

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.weights[f"{name}.weight"], self.weights.get(f"{name}.bias"))

    def hidden(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) right-padded token ids -> (B, T, H) final hidden states (after the final
        norm)."""
        c = self.config
        length = token_ids.shape[1]
        x = F.embedding(token_ids, self.weights["embed_tokens.weight"])
        cos, sin = self.rope.tables(torch.arange(length, device=x.device), x.dtype)
        cos, sin = cos.transpose(0, 1)[None], sin.transpose(0, 1)[None]  # (1, 1, T, d)
        for j in range(c.num_layers):
            x = self._layer(x, cos, sin, f"layers.{j}")
        return rms_norm(x, self.weights["norm.weight"], c.norm_eps)

    def _layer(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, name: str
    ) -> torch.Tensor:
        c, w = self.config, self.weights
        batch, length, _ = x.shape
        h = rms_norm(x, w[f"{name}.input_layernorm.weight"], c.norm_eps)

        def heads(t: torch.Tensor, count: int) -> torch.Tensor:  # (B, T, n*hs) -> (B, n, T, hs)
            return t.view(batch, length, count, c.head_dim).transpose(1, 2)

        q = heads(self._linear(h, f"{name}.self_attn.q_proj"), c.num_heads)
        k = heads(self._linear(h, f"{name}.self_attn.k_proj"), c.num_kv_heads)
        v = heads(self._linear(h, f"{name}.self_attn.v_proj"), c.num_kv_heads)
        if f"{name}.self_attn.q_norm.weight" in w:  # Qwen3
            q = rms_norm(q, w[f"{name}.self_attn.q_norm.weight"], c.norm_eps)
            k = rms_norm(k, w[f"{name}.self_attn.k_norm.weight"], c.norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attended = attended.transpose(1, 2).reshape(batch, length, -1)
        x = x + self._linear(attended, f"{name}.self_attn.o_proj")
        h = rms_norm(x, w[f"{name}.post_attention_layernorm.weight"], c.norm_eps)
        gate = F.silu(self._linear(h, f"{name}.mlp.gate_proj"))
        return x + self._linear(
            gate * self._linear(h, f"{name}.mlp.up_proj"), f"{name}.mlp.down_proj"
        )
