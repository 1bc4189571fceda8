"""Qwen3-Next and Qwen3.5 (dense and MoE): three Gated DeltaNet layers to one gated attention
layer, RMSNorms that scale by 1 + w in float32, and Qwen2-MoE's MLP (routed experts and a
sigmoid-gated shared expert) or a dense one.

A Gated DeltaNet layer's weights, as the layer's math reads them:

    mix_in.weight   (conv_dim + value_dim + 2 Hv, hidden): q, k, v (all heads each), z (the
                    output gate), b (beta) and a (the decay's input) in one GEMM; Qwen3-Next's
                    checkpoints group them per key head (in_proj_qkvz, in_proj_ba), Qwen3.5's
                    store them apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a): `fuse`
                    makes both this layout
    conv.weight     (conv_dim, 1, K) the depthwise short convolution
    gdn.A_log, gdn.dt_bias  (Hv,) the decay: -exp(A_log) * softplus(a + dt_bias)
    gdn_norm.weight (dv,) the gated RMSNorm over each head's output
    gdn_out.weight  (hidden, value_dim)

An attention layer's q_proj computes each head's query and its output gate side by side;
`fuse` splits them into `q` (fused into qkv) and `attn_gate`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.models.base import Weights, linear
from engine.models.gated_delta import (
    conv_decode,
    conv_step,
    delta_chunked,
    delta_recurrent,
    gated_rms_norm,
)
from engine.models.gemma import gemma_norm
from engine.models.llama import LOCAL_NAMES, QK_NORM_NAMES, norm_rows
from engine.models.moe import MoeModel

GDN_NAMES = {
    "linear_attn.in_proj_qkvz": "in_qkvz",
    "linear_attn.in_proj_ba": "in_ba",
    "linear_attn.in_proj_qkv": "in_qkv",
    "linear_attn.in_proj_z": "in_z",
    "linear_attn.in_proj_b": "in_b",
    "linear_attn.in_proj_a": "in_a",
    "linear_attn.conv1d": "conv",
    "linear_attn": "gdn",
    "linear_attn.norm": "gdn_norm",
    "linear_attn.out_proj": "gdn_out",
}
TEXT_PREFIXES = ("model.language_model.",)
"""Where a Qwen3.5 checkpoint with a vision tower keeps its language model."""


class Qwen3NextModel(MoeModel):
    LOCAL_NAMES: ClassVar[dict[str, str]] = {**LOCAL_NAMES, **QK_NORM_NAMES, **GDN_NAMES}
    can_capture = False
    """State layers read and write per-sequence states the graphs do not capture."""

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        if hf_name.startswith(("model.visual.", "mtp.")):
            return None  # the vision tower; the multi-token prediction head
        prefix = next((p for p in TEXT_PREFIXES if hf_name.startswith(p)), "")
        name = hf_name.removeprefix(prefix)
        return super().map_name(f"model.{name}" if prefix else name)

    def fuse(self, values: Weights) -> Weights:
        out = dict(values)
        c = self.config
        if "q.weight" in out:  # (heads * 2 head_dim, hidden): each head's query, then gate
            both = out.pop("q.weight").view(c.num_heads, 2, c.head_dim, -1)
            out["q.weight"] = both[:, 0].reshape(c.num_heads * c.head_dim, -1).clone()
            out["attn_gate.weight"] = both[:, 1].reshape(c.num_heads * c.head_dim, -1).clone()
        if "in_qkvz.weight" in out:
            out.update(self._split_grouped(out.pop("in_qkvz.weight"), out.pop("in_ba.weight")))
        parts = [f"in_{p}.weight" for p in ("qkv", "z", "b", "a")]
        if all(p in out for p in parts):
            out["mix_in.weight"] = torch.cat([out.pop(p) for p in parts])
        return super().fuse(out)

    def _split_grouped(self, qkvz: torch.Tensor, ba: torch.Tensor) -> Weights:
        """Qwen3-Next's projections grouped per key head ([q, k, v, z] of each, then [b, a] of
        each) -> Qwen3.5's layout, every head of one kind together."""
        c = self.config
        heads, per = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
        dk, dv, hidden = c.linear_key_head_dim, c.linear_value_head_dim, qkvz.shape[-1]
        q, k, v, z = qkvz.view(heads, -1, hidden).split([dk, dk, per * dv, per * dv], dim=1)
        b, a = ba.view(heads, 2 * per, hidden).split([per, per], dim=1)
        qkv = torch.cat([t.reshape(-1, hidden) for t in (q, k, v)])
        return {
            "in_qkv.weight": qkv,
            "in_z.weight": z.reshape(-1, hidden).clone(),
            "in_b.weight": b.reshape(-1, hidden).clone(),
            "in_a.weight": a.reshape(-1, hidden).clone(),
        }

    # -- norms: 1 + w in float32 ------------------------------------------------------------

    def _norm(self, x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
        return gemma_norm(x.contiguous(), w[f"{name}.weight"], self.config.norm_eps)

    def input_norm(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return self._norm(h, w, "ln1")

    def norm_qk(self, w: Weights, qkv: torch.Tensor) -> torch.Tensor:
        c = self.config
        norm_rows(qkv, slice(0, c.num_heads), w["q_norm.weight"], c.norm_eps, gemma_norm)
        keys = slice(c.num_heads, c.num_heads + c.num_kv_heads)
        norm_rows(qkv, keys, w["k_norm.weight"], c.norm_eps, gemma_norm)
        return qkv

    def before_mlp(
        self, w: Weights, h: torch.Tensor, o: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output times the sigmoid of its gate (from the layer's normed input),
        projected, added to the residual stream; (the stream, its normed rows for the MLP)."""
        gate = linear(self.input_norm(w, h), w, "attn_gate")
        attended = linear(o.reshape(o.shape[0], -1) * torch.sigmoid(gate), w, "o")
        h = h + attended
        return h, self._norm(h, w, "ln2")

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(self._norm(h, w, "norm"), w, "lm_head").float()

    # -- Gated DeltaNet -----------------------------------------------------------------------

    def state_layer(
        self,
        j: int,
        w: Weights,
        h: torch.Tensor,
        states: dict[str, torch.Tensor],
        spans: list[tuple[int, int]],
    ) -> torch.Tensor:
        c = self.config
        heads_k, heads_v = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        proj = linear(self.input_norm(w, h), w, "mix_in")
        mixed, z, b, a = proj.split([c.conv_dim, c.linear_value_dim, heads_v, heads_v], dim=-1)
        beta = b.sigmoid()
        decay = -w["gdn.A_log"].float().exp() * F.softplus(a.float() + w["gdn.dt_bias"])
        core = h.new_zeros(h.shape[0], heads_v, dv)  # padding rows mix nothing
        conv, recurrent, weight = states["conv"], states["recurrent"], w["conv.weight"]
        decodes = [i for i, (_, n) in enumerate(spans) if n == 1]
        if decodes:  # one row each: the convolution and the recurrence for all at once
            index = torch.tensor(decodes, device=h.device)
            rows = torch.tensor([spans[i][0] for i in decodes], device=h.device)
            x, conv[index] = conv_decode(mixed[rows], conv[index], weight)
            q, k, v = x.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
            out, recurrent[index] = delta_recurrent(
                q.view(-1, heads_k, dk),
                k.view(-1, heads_k, dk),
                v.view(-1, heads_v, dv),
                decay[rows],
                beta[rows],
                recurrent[index],
            )
            core[rows] = out.to(core.dtype)
        for i, (first, n) in enumerate(spans):
            if n == 1:
                continue
            rows_i = slice(first, first + n)
            x, conv[i] = conv_step(mixed[rows_i], conv[i], weight)
            q, k, v = x.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
            out, recurrent[i] = delta_chunked(
                q.view(n, heads_k, dk),
                k.view(n, heads_k, dk),
                v.view(n, heads_v, dv),
                decay[rows_i],
                beta[rows_i],
                recurrent[i],
            )
            core[rows_i] = out.to(core.dtype)
        normed = gated_rms_norm(core, z.view(-1, heads_v, dv), w["gdn_norm.weight"], c.norm_eps)
        h = h + linear(normed.view(h.shape[0], -1), w, "gdn_out")
        return h + self.mlp(w, self._norm(h, w, "ln2"))
