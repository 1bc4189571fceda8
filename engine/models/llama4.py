"""Llama 4 (text; Scout and Maverick): the Llama layer with

- rotary pairs interleaved (transformers rotates (x[2i], x[2i+1]) as one complex number):
  `fuse` reorders each head's rows of q_proj and k_proj at load to the even then the odd
  dimensions, so the half-split rotary every other family uses computes the same rotation (q
  and k reordered alike: their products, the L2 norm and the values are unchanged);
- chunked local attention on the rotary layers (`ModelConfig.layer_windows` holds
  -attention_chunk_size there: a query sees the keys of its own chunk only), full attention on
  the NoPE layers;
- q and k L2-normed per head (no weight) after the rotary on the rotary layers (use_qk_norm);
- attention temperature tuning on the NoPE layers: queries at position p scaled by
  log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, a table made once per step;
- MoE layers (`moe_layers`) whose router takes the top-k logits through a sigmoid and scales
  each row's input to its expert by it (`MoeModel.SCALES_INPUTS`), plus a shared expert every
  row runs, ungated; dense layers of `intermediate_size_mlp`.

Checkpoints keep the experts stacked, applied as x @ W: `feed_forward.experts.gate_up_proj`
(experts, hidden, 2 * width, gate columns then up) and `down_proj` (experts, width, hidden);
a checkpoint with the vision tower (model type llama4) keeps the language model under
`language_model.` (the hub's names) or `model.language_model.` (transformers 5's).
"""

from __future__ import annotations

import torch

from engine.models.base import Positions, Weights, linear
from engine.models.gemma import TEXT_PREFIXES
from engine.models.moe import MoeModel

VISION_PREFIXES = (
    "vision_model.",
    "multi_modal_projector.",
    "model.vision_model.",
    "model.multi_modal_projector.",
)
RENAMED = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp."))
"""Llama 4's module names -> the MoE families' (`engine.models.moe`)."""


def deinterleave_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A q or k projection's (heads * head_dim, ...) weight or bias with each head's rows
    reordered from the rotary pairs interleaved to the even rows then the odd ones."""
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()


class Llama4Model(MoeModel):
    SCALES_INPUTS = True

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        """The text model's names (also under a vision checkpoint's language-model prefix) as
        the MoE families name them; the vision tower and its projector are not read."""
        if hf_name.startswith(VISION_PREFIXES):
            return None
        name = hf_name.removeprefix(next((p for p in TEXT_PREFIXES if hf_name.startswith(p)), ""))
        if name.startswith("layers."):
            name = f"model.{name}"
        for old, new in RENAMED:
            name = name.replace(old, new)
        return super().map_name(name)

    def fuse(self, values: Weights) -> Weights:
        """q and k rows deinterleaved per head; stacked experts transposed to (experts, out,
        in) as the MoE families hold them, then split and fused (`MoeModel.fuse`)."""
        c = self.config
        out = dict(values)
        for name, heads in (("q", c.num_heads), ("k", c.num_kv_heads)):
            for param in ("weight", "bias"):
                if f"{name}.{param}" in out:
                    out[f"{name}.{param}"] = deinterleave_rows(out[f"{name}.{param}"], heads)
        for stacked in ("experts.gate_up_proj", "experts.down_proj"):
            if stacked in out:
                out[stacked] = out[stacked].transpose(1, 2).contiguous()
        return super().fuse(out)

    def positions(self, ids: torch.Tensor, dtype: torch.dtype) -> Positions:
        """Llama's rotary tables, and with temperature tuning each row's query scale (T, 1, 1)
        float32 for the NoPE layers."""
        positions = super().positions(ids, dtype)
        c = self.config
        if not c.attn_floor_scale:
            return positions
        steps = torch.floor((ids.float() + 1.0) / c.attn_floor_scale)
        scale = torch.log1p(steps) * c.attn_temperature_scale + 1.0
        return Positions(ids, (*positions.tables, scale[:, None, None]))

    def after_rotary(self, j: int, qkv: torch.Tensor, positions: Positions) -> torch.Tensor:
        """A rotary layer's q and k L2-normed per head (in float32, then cast back); a NoPE
        layer's queries scaled by the temperature table, in place."""
        c = self.config
        qk = slice(0, c.num_heads + c.num_kv_heads)
        if j - 1 not in c.nope_layers:
            if c.qk_l2_norm:
                x = qkv[:, qk].float()
                qkv[:, qk] = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps)).to(
                    qkv.dtype
                )
        elif c.attn_floor_scale:
            queries = slice(0, c.num_heads)
            qkv[:, queries] = (qkv[:, queries] * positions.tables[2]).to(qkv.dtype)
        return qkv

    def route(self, w: Weights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k router logits through a sigmoid (in float32, cast back), largest first."""
        top, ids = torch.topk(linear(x, w, "router"), self.config.num_experts_per_tok, dim=-1)
        return torch.sigmoid(top.float()).to(top.dtype), ids
