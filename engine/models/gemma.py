"""Gemma 2 and Gemma 3 (text): the Llama layer with Gemma's RMSNorm (scale 1 + w, in float32),
norms after attention and after the MLP as well as before, GeGLU (tanh GELU), embeddings
scaled by sqrt(hidden), and soft-capped final logits. Gemma 3 adds q/k norms per head and
local layers with their own rotary base; Gemma 2 soft-caps the attention scores. Scores are
scaled by query_pre_attn_scalar ** -0.5 and each layer keeps its own window, both through
`Model.attention_spec`."""

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
    "input_layernorm": "ln1",
    "post_attention_layernorm": "ln_post_attn",
    "pre_feedforward_layernorm": "ln2",
    "post_feedforward_layernorm": "ln_post_mlp",
}
"""Gemma's post_attention_layernorm follows attention (Llama's precedes the MLP: ln2)."""
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")
"""Where a Gemma 3 checkpoint with a vision tower keeps its language model (transformers 5's
names, then the hub's original ones, whose head is `language_model.lm_head`)."""
VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: scale by 1 + w in float32 (its checkpoints store w - 1)."""
    return rms_norm_f32(x, weight, eps, offset=1.0)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 I) gate then up -> GELU_tanh(gate) * up (T, I): GeGLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in transformers' order of operations; x itself where cap is 0."""
    return torch.tanh(x / cap) * cap if cap else x


class GemmaModel(LlamaModel):
    LOCAL_NAMES: ClassVar[dict[str, str]] = LOCAL_NAMES

    def map_name(self, hf_name: str) -> tuple[int, str] | None:
        """Llama's names, also under a vision checkpoint's language-model prefix; the vision
        tower and its projector are the vision encoder's (engine/models/gemma3_vision.py)."""
        if hf_name.startswith(VISION_PREFIXES):
            return None
        prefix = next((p for p in TEXT_PREFIXES if hf_name.startswith(p)), "")
        return super().map_name(hf_name.removeprefix(prefix))

    def _norm(self, x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
        return gemma_norm(x, w[f"{name}.weight"], self.config.norm_eps)

    def embed(self, w: Weights, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(hidden), that factor rounded to the weights' dtype first
        (as transformers' Gemma2TextScaledWordEmbedding rounds it)."""
        table = w["tok.weight"]
        # a Python number, not a host tensor copied to the device: that copy cannot be
        # captured in a CUDA graph (the first H200 run's Gemma failures)
        scale = torch.tensor(self.config.hidden_size**0.5).to(table.dtype).item()
        return torch.nn.functional.embedding(token_ids, table) * scale

    def input_norm(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return self._norm(h, w, "ln1")

    def norm_qk(self, w: Weights, qkv: torch.Tensor) -> torch.Tensor:
        """Gemma 3: Gemma's RMSNorm over each head of q and of k, in place; Gemma 2: none."""
        if "q_norm.weight" not in w:
            return qkv
        c = self.config
        norm_rows(qkv, slice(0, c.num_heads), w["q_norm.weight"], c.norm_eps, gemma_norm)
        keys = slice(c.num_heads, c.num_heads + c.num_kv_heads)
        norm_rows(qkv, keys, w["k_norm.weight"], c.norm_eps, gemma_norm)
        return qkv

    def attention_output(self, w: Weights, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        attended = linear(o.reshape(o.shape[0], -1), w, "o")
        h = h + self._norm(attended, w, "ln_post_attn")
        x = self._norm(h, w, "ln2")
        mlp = linear(gelu_mul(linear(x, w, "gate_up")), w, "down")
        return h + self._norm(mlp, w, "ln_post_mlp")

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        logits = linear(self._norm(h, w, "norm"), w, "lm_head").float()
        return softcap(logits, self.config.logit_softcap)
