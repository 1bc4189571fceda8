"""Granite 4 hybrid (`granitemoehybrid`): Mamba-2 layers beside attention layers (no rotary
unless the config asks for it, scores scaled by `attention_multiplier`), Granite's scalings
(embeddings, each sub-layer's output before its residual add, the logits), a shared SwiGLU on
every layer and, in the MoE checkpoints, routed experts beside it (the top-k router logits
softmaxed among themselves).

A Mamba-2 layer's weights, as the layer's math reads them:

    m_in.weight     (I + conv_dim + H, hidden): the gate z, then x, B and C (the
                    convolution's channels), then dt
    conv.weight, conv.bias  (conv_dim, 1, K), (conv_dim,)
    ssm.A_log, ssm.D, ssm.dt_bias   (H,)
    ssm_norm.weight (I,) the gated RMSNorm over groups of I / G channels
    ssm_out.weight  (hidden, I)
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.llama import LAYER_NAME, PROJECTION_NAMES
from engine.models.mamba2 import mamba_mix
from engine.models.moe import ExpertSource, MoeModel

MAMBA_NAMES = {
    "mamba.in_proj": "m_in",
    "mamba.conv1d": "conv",
    "mamba": "ssm",
    "mamba.norm": "ssm_norm",
    "mamba.out_proj": "ssm_out",
}
"""A Mamba-2 mixer's modules named `mamba.*` (Granite 4, Falcon-H1) -> local names."""
LOCAL_NAMES = {
    **PROJECTION_NAMES,
    **MAMBA_NAMES,
    "input_layernorm": "ln1",
    "post_attention_layernorm": "ln2",
    "shared_mlp.input_linear": "gate_up",
    "shared_mlp.output_linear": "down",
    "block_sparse_moe.router.layer": "router",
    "block_sparse_moe.router": "router",
}


GRANITE_EXPERTS = {
    "block_sparse_moe.input_linear.weight": "experts.gate_up_proj",
    "block_sparse_moe.output_linear.weight": "experts.down_proj",
}


class GraniteHybridModel(MoeModel):
    LOCAL_NAMES: ClassVar[dict[str, str]] = LOCAL_NAMES
    can_capture = False
    """State layers read and write per-sequence states the graphs do not capture."""

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        """Granite's stacked experts (`block_sparse_moe.input_linear` (E, 2I, H), gate rows
        then up rows, and `output_linear` (E, H, I)) as transformers 5's stacked names."""
        match = LAYER_NAME.match(hf_name.removeprefix("model."))
        if match is not None and match.group(2) in GRANITE_EXPERTS:
            return int(match.group(1)) + 1, GRANITE_EXPERTS[match.group(2)]
        return super().map_name(hf_name)

    def fuse(self, values: Weights) -> Weights:
        """A MoE layer's shared SwiGLU is its shared expert (no gate)."""
        out = super().fuse(values)
        if "router.weight" in out:
            for name in ("gate_up.weight", "down.weight"):
                out[f"shared.{name}"] = out.pop(name)
        return out

    def embed(self, w: Weights, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        table = w["tok.weight"]
        return F.embedding(token_ids, table) * self.config.embedding_multiplier

    def route(self, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k router logits (float32), softmaxed among themselves."""
        logits = linear(x, w, "router").float()
        top, ids = logits.topk(self.config.num_experts_per_tok, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def _residual(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return h + delta * self.config.residual_multiplier

    def before_mlp(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self._residual(h, linear(o.reshape(o.shape[0], -1), w, "o"))
        return h, self.ops.rms_norm(h.contiguous(), w["ln2.weight"], self.config.norm_eps)

    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        h, x = self.before_mlp(w, h, o)
        return self._residual(h, self.mlp(w, x))

    def block_mlp(
        self, w: Weights, xs: list[torch.Tensor], source: ExpertSource
    ) -> list[torch.Tensor]:
        """The block's MLP outputs, scaled as the residual add wants them (the pipeline adds
        them to the stream as they are)."""
        m = self.config.residual_multiplier
        return [out * m for out in super().block_mlp(w, xs, source)]

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        x = self.ops.rms_norm(h.contiguous(), w["norm.weight"], self.config.norm_eps)
        return linear(x, w, "lm_head").float() / self.config.logits_scaling

    def state_layer(
        self,
        j: int,
        w: Weights,
        h: torch.Tensor,
        states: dict[str, torch.Tensor],
        spans: list[tuple[int, int]],
    ) -> torch.Tensor:
        c = self.config
        h = self._residual(h, mamba_mix(c, w, self.input_norm(w, h), states, spans))
        return self._residual(h, self.mlp(w, self.ops.rms_norm(h, w["ln2.weight"], c.norm_eps)))
