"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM3): RMSNorm, RoPE with scaling, SwiGLU,
GQA, layers without rotary (SmolLM3's NoPE layers).

`LlamaModel` is also the base of the newer families, which override one step each: the q/k
norms (`norm_qk`: Qwen 3, Gemma 3, OLMo 2), the norms around attention and MLP
(`attention_output`: Gemma, OLMo 2), the checkpoint's names (`LOCAL_NAMES`: Phi-3's fused
projections), the embedding and head (Gemma).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

import torch

from engine.kernels import DenseOps
from engine.models.base import Model, Positions, Weights, linear
from engine.models.config import ModelConfig
from engine.models.rotary import Rope

LAYER_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
"""A decoder layer's tensor name: groups (layer index, module.param)."""
PROJECTION_NAMES = {
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}
"""Checkpoint module -> the layer's local name, for the projections every family has."""
QK_NORM_NAMES = {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
LOCAL_NAMES = {**PROJECTION_NAMES, "input_layernorm": "ln1", "post_attention_layernorm": "ln2"}
"""Llama's names: ln1 before attention, ln2 before the MLP."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in float32, cast back, then scale (transformers' LlamaRMSNorm order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_f32(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """Normalize and scale by (offset + weight) in float32, then cast back: Gemma's RMSNorm
    (offset 1, weights stored as w - 1) and OLMo 2's (offset 0). In float32 it equals
    `rms_norm` with weight offset + w; in half types it rounds once, where Llama's rounds
    twice."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight.float() + offset if offset else weight.float()
    return (x32 * scale).to(x.dtype)


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


def partial_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int
) -> torch.Tensor:
    """As `DenseOps.rotary`, where cos and sin (T, 1, d) cover only the first d < head_dim
    dimensions of each head (Phi's partial rotary); the rest pass through."""
    dim = cos.shape[-1]
    out = x.contiguous().clone()
    head = x[:, :rotated, :dim]
    out[:, :rotated, :dim] = head * cos + _rotate_half(head) * sin
    return out


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def swiglu(ops: DenseOps, w: Weights, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) over x (T, hidden), the projections named `<prefix>gate_up`
    (fused, `Model.fuse`) and `<prefix>down`: the layer's own ('') or an expert's."""
    return linear(ops.silu_mul(linear(x, w, f"{prefix}gate_up")), w, f"{prefix}down")


TORCH_OPS = DenseOps(rms_norm, _add_rms_norm, _rotary, _silu_mul)
"""The ops around the GEMMs in torch, where no native ones are set (`Model.dense_ops`)."""


class LlamaModel(Model):
    LOCAL_NAMES: ClassVar[dict[str, str]] = LOCAL_NAMES

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._ropes = [Rope.of(config)]
        """The rotary variants: the global layers' first, then (Gemma 3) the local layers'."""
        if config.local_rope_theta:
            self._ropes.append(Rope.of(config, local=True))

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        name = hf_name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return 0, "tok.weight"
        if name == "norm.weight":
            return self.num_layers - 1, "norm.weight"
        if hf_name in ("lm_head.weight", "score.weight"):  # score: a reranker's classifier
            return self.num_layers - 1, hf_name
        return self.map_decoder_name(name, LAYER_NAME, self.LOCAL_NAMES)

    @property
    def ops(self) -> DenseOps:
        return self.dense_ops or TORCH_OPS

    def embed(self, w: Weights, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(token_ids, w["tok.weight"])

    def positions(self, ids: torch.Tensor, dtype: torch.dtype) -> Positions:
        """Rotary cos and sin of every variant, each (T, 1, rotary_dim) in `dtype`, once per
        step."""
        return Positions(ids, tuple(t for rope in self._ropes for t in rope.tables(ids, dtype)))

    def rotary_tables(self, j: int, positions: Positions) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer j's (cos, sin): its own variant's (Gemma 3's local layers), else the
        global one's."""
        local = len(self._ropes) > 1 and self.config.window(j - 1) > 0
        cos, sin = positions.tables[2 * local : 2 * local + 2]
        return cos, sin

    def input_norm(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        """The norm before attention."""
        return self.ops.rms_norm(h.contiguous(), w["ln1.weight"], self.config.norm_eps)

    def norm_qk(self, w: Weights, qkv: torch.Tensor) -> torch.Tensor:
        """Norms of q and k before rotary, on (T, heads + 2 kv_heads, head_dim); none here."""
        return qkv

    def attention_inputs(
        self, j: int, w: Weights, h: torch.Tensor, positions: Positions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        qkv = linear(self.input_norm(w, h), w, "qkv")  # (T, (heads + 2 kv_heads) * head_dim)
        qkv = self.norm_qk(w, qkv.view(qkv.shape[0], -1, c.head_dim))
        if j - 1 not in c.nope_layers:  # NoPE: k and v lie side by side in qkv's rows already
            cos, sin = self.rotary_tables(j, positions)
            # q and k rotate in one pass, v copied beside them: k and v come out adjacent in
            # each row, as a KV row lays them out (`join_kv` takes them as a view)
            rotate = self.ops.rotary if cos.shape[-1] == c.head_dim else partial_rotary
            qkv = rotate(qkv, cos, sin, c.num_heads + c.num_kv_heads)
        qkv = self.after_rotary(j, qkv, positions)
        q, k, v = qkv.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
        return q, k, v

    def after_rotary(self, j: int, qkv: torch.Tensor, positions: Positions) -> torch.Tensor:
        """What decoder layer j does to q and k after the rotary (or after none, on a NoPE
        layer), on (T, heads + 2 kv_heads, head_dim); nothing here (Llama 4: norms, the
        temperature)."""
        return qkv

    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h, x = self.before_mlp(w, h, o)
        return h + self.mlp(w, x)

    def before_mlp(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output projected and added to the residual stream: (the stream,
        its normed rows for the MLP)."""
        attended = linear(o.reshape(o.shape[0], -1), w, "o")
        eps = self.config.norm_eps
        return self.ops.add_rms_norm(h.contiguous(), attended, w["ln2.weight"], eps)

    def mlp(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP over normed states x (T, hidden) -> (T, hidden); mixture-of-experts
        models route it (`engine.models.moe`)."""
        return swiglu(self.ops, w, x)

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        """(S, hidden) -> (S, vocab) float32 logits; a pooling model's head (`Model.pooling`):
        the normed rows (S, hidden), or its classifier's (S, 1) logits."""
        x = self.ops.rms_norm(h.contiguous(), w["norm.weight"], self.config.norm_eps)
        if self.pooling is not None:
            return (linear(x, w, "score") if "score.weight" in w else x).float()
        return linear(x, w, "lm_head").float()


Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(x (N, width), weight (width,), eps) -> normalized x."""


def norm_rows(
    qkv: torch.Tensor, heads: slice, weight: torch.Tensor, eps: float, norm: Norm
) -> None:
    """Normalize the heads `heads` of qkv (T, n, head_dim) in place, over the width of
    `weight`: each head alone (head_dim: Qwen 3, Gemma 3) or all of them together
    (heads * head_dim: OLMo 2)."""
    part = qkv[:, heads]
    normed = norm(part.reshape(-1, weight.shape[0]).contiguous(), weight, eps)
    qkv[:, heads] = normed.view(part.shape)
