"""Falcon-H1: every decoder layer runs attention and a Mamba-2 mixer side by side over the
same RMSNormed input, sums their outputs into the residual stream, then a SwiGLU MLP; muP
multipliers throughout (`ModelConfig.multipliers`): on the embeddings, the attention's input,
keys and output, the mixer's input, each part of its in_proj output (z, x, B, C, dt: the mup
vector) and its output, the MLP's gate and output, and the logits.

Each layer is a 'decoder' layer (KV pages) that is also a state layer (`Model.has_state`):
the block pipeline runs the mixer over the batch (`state_layer`, its output alone), then the
attention, then `parallel_output`. The mixer is Granite's Mamba-2 (engine/models/mamba2.py)
with Falcon's differences: its inner width is `mamba_d_ssm`; its gated RMSNorm scales in
float32 before the cast back and gates before or (`mamba_norm_before_gate`) after the norm,
or the gate applies alone without a norm (`mamba_rms_norm` off: `ModelConfig.mamba_gate`);
in_proj's output is scaled by the mup vector. Weights as Granite's (`m_in`, `conv`, `ssm.*`,
`ssm_norm`, `ssm_out`) beside Llama's attention and MLP.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.config import ModelConfig
from engine.models.granite_hybrid import MAMBA_NAMES
from engine.models.llama import PROJECTION_NAMES, LlamaModel
from engine.models.mamba2 import mamba_mix

LOCAL_NAMES = {
    **PROJECTION_NAMES,
    **MAMBA_NAMES,
    "input_layernorm": "ln1",
    "pre_ff_layernorm": "ln2",
    "feed_forward.gate_proj": "gate",
    "feed_forward.up_proj": "up",
    "feed_forward.down_proj": "down",
}


def mup_vector(config: ModelConfig) -> torch.Tensor:
    """(I + conv_dim + H,) float32: each part of in_proj's output (z and x of the inner
    width I, B and C of groups * state, dt of the heads) times its multiplier."""
    c = config
    group_state = c.mamba_groups * c.mamba_state_dim
    widths = [c.mamba_inner, c.mamba_inner, group_state, group_state, c.mamba_num_heads]
    scales = c.multipliers.ssm_zxbcdt
    return torch.cat([torch.full((n,), m) for n, m in zip(widths, scales, strict=True)])


class FalconH1Model(LlamaModel):
    LOCAL_NAMES: ClassVar[dict[str, str]] = LOCAL_NAMES
    can_capture = False
    """Every layer reads and writes per-sequence states the graphs do not capture."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._mup = mup_vector(config)
        self._mup_cast: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        """The mup vector on each (device, dtype) it has been used in."""

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        if hf_name == "model.final_layernorm.weight":
            return self.num_layers - 1, "norm.weight"
        return super().map_name(hf_name)

    def embed(self, w: Weights, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, w["tok.weight"]) * self.config.embedding_multiplier

    def _scaled_norm(self, w: Weights, h: torch.Tensor, multiplier: float) -> torch.Tensor:
        x = self.ops.rms_norm(h.contiguous(), w["ln1.weight"], self.config.norm_eps)
        return x * multiplier if multiplier != 1.0 else x

    def input_norm(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        """The normed input times the attention's input multiplier."""
        return self._scaled_norm(w, h, self.config.multipliers.attention_in)

    def norm_qk(self, w: Weights, qkv: torch.Tensor) -> torch.Tensor:
        """The keys times the key multiplier, before the rotary, in place."""
        c = self.config
        if c.multipliers.key != 1.0:
            qkv[:, c.num_heads : c.num_heads + c.num_kv_heads] *= c.multipliers.key
        return qkv

    def state_layer(
        self,
        j: int,
        w: Weights,
        h: torch.Tensor,
        states: dict[str, torch.Tensor],
        spans: list[tuple[int, int]],
    ) -> torch.Tensor:
        """The Mamba-2 mixer's output alone (times ssm_out_multiplier): `parallel_output` adds
        it beside the attention's."""
        m = self.config.multipliers
        x = self._scaled_norm(w, h, m.ssm_in)
        key = (x.device, x.dtype)
        if key not in self._mup_cast:
            self._mup_cast[key] = self._mup.to(x.device, x.dtype)
        return mamba_mix(self.config, w, x, states, spans, self._mup_cast[key]) * m.ssm_out

    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a Falcon-H1 layer's attention always has its mixer beside it")

    def parallel_output(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor, mixed: torch.Tensor
    ) -> torch.Tensor:
        m, c = self.config.multipliers, self.config
        attended = linear(o.reshape(o.shape[0], -1), w, "o") * m.attention_out
        h = h + (mixed + attended)
        return h + self.mlp(w, self.ops.rms_norm(h.contiguous(), w["ln2.weight"], c.norm_eps))

    def mlp(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        """up(x) * SiLU(gate(x) * mlp_gate), down-projected, times mlp_down."""
        m = self.config.multipliers
        gate, up = linear(x, w, "gate_up").chunk(2, dim=-1)
        return linear(up * F.silu(gate * m.mlp_gate), w, "down") * m.mlp_down

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        x = self.ops.rms_norm(h.contiguous(), w["norm.weight"], self.config.norm_eps)
        return (linear(x, w, "lm_head") * self.config.multipliers.lm_head).float()
