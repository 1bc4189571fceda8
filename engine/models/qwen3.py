"""Qwen 3: the Llama layer with an RMSNorm over each head of q and of k before rotary."""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.models.base import Weights
from engine.models.llama import LOCAL_NAMES, QK_NORM_NAMES, LlamaModel, norm_rows


class Qwen3Model(LlamaModel):
    LOCAL_NAMES: ClassVar[dict[str, str]] = {**LOCAL_NAMES, **QK_NORM_NAMES}

    def norm_qk(self, w: Weights, qkv: torch.Tensor) -> torch.Tensor:
        """q_norm over each query head, k_norm over each key head (transformers' Qwen3RMSNorm,
        as Llama's), in place on (T, heads + 2 kv_heads, head_dim)."""
        c, norm = self.config, self.ops.rms_norm
        norm_rows(qkv, slice(0, c.num_heads), w["q_norm.weight"], c.norm_eps, norm)
        keys = slice(c.num_heads, c.num_heads + c.num_kv_heads)
        norm_rows(qkv, keys, w["k_norm.weight"], c.norm_eps, norm)
        return qkv
