"""The Llama family (Llama 2/3, Mistral, Qwen2): RMSNorm, RoPE with scaling, SwiGLU, GQA."""

from __future__ import annotations

import re

import torch

from engine.kernels import DenseOps
from engine.models.base import Model, Positions, Weights, linear
from engine.models.config import ModelConfig

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_LOCAL = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
    "input_layernorm": "ln1",
    "post_attention_layernorm": "ln2",
}


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies with the config's scaling, in transformers' order
    of float operations so the angles agree to the last bit."""
    dim, theta = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_mid, blended, scaled)
    return inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in float32, cast back, then scale (transformers' LlamaRMSNorm order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    h = h + delta
    return h, rms_norm(h, weight, eps)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    head = x[:, :rotated]
    return torch.cat([head * cos + _rotate_half(head) * sin, x[:, rotated:]], dim=1)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


TORCH_OPS = DenseOps(rms_norm, _add_rms_norm, _rotary, _silu_mul)
"""The ops around the GEMMs in torch, where no native ones are set (`Model.dense_ops`)."""


class LlamaModel(Model):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._inv_freq = rope_inv_freq(config)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        name = hf_name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return 0, "tok.weight"
        if name == "norm.weight":
            return self.num_layers - 1, "norm.weight"
        if hf_name == "lm_head.weight":
            return self.num_layers - 1, "lm_head.weight"
        return self.map_decoder_name(name, _LAYER, _LOCAL)

    def embed(self, w: Weights, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(token_ids, w["tok.weight"])

    def positions(self, ids: torch.Tensor, dtype: torch.dtype) -> Positions:
        """Rotary cos and sin, each (T, 1, head_dim) in `dtype`, once per step."""
        inv_freq = self._inv_freq_by_device.get(ids.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_by_device[ids.device] = self._inv_freq.to(ids.device)
        freqs = ids.float()[:, None] * inv_freq[None, :]  # (T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, head_dim)
        return Positions(ids, (emb.cos().to(dtype), emb.sin().to(dtype)))

    def attention_inputs(
        self, w: Weights, h: torch.Tensor, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, ops = self.config, self.dense_ops or TORCH_OPS
        x = ops.rms_norm(h.contiguous(), w["ln1.weight"], c.norm_eps)
        qkv = linear(x, w, "qkv")  # (T, (heads + 2 * kv_heads) * head_dim)
        qkv = qkv.view(qkv.shape[0], -1, c.head_dim)
        cos, sin = positions.tables
        # q and k rotate in one pass, v copied beside them: k and v come out adjacent in
        # each row, as a KV row lays them out (`join_kv` takes them as a view)
        qkv = ops.rotary(qkv, cos, sin, c.num_heads + c.num_kv_heads)
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
        return q, k, v

    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        ops, eps = self.dense_ops or TORCH_OPS, self.config.norm_eps
        attended = linear(o.reshape(o.shape[0], -1), w, "o")
        h, x = ops.add_rms_norm(h.contiguous(), attended, w["ln2.weight"], eps)
        return h + linear(ops.silu_mul(linear(x, w, "gate_up")), w, "down")

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        ops = self.dense_ops or TORCH_OPS
        x = ops.rms_norm(h.contiguous(), w["norm.weight"], self.config.norm_eps)
        return linear(x, w, "lm_head").float()
