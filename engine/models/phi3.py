"""Phi-3 and Phi-4-mini: the Llama layer, read from a checkpoint whose q, k, v and whose gate and
up projections are already fused (`qkv_proj`, `gate_up_proj`, in the order `Model.fuse` makes
them). Partial rotary and LongRoPE are the config's (engine/models/rotary.py); the sliding
window, when configured, holds for every layer."""

from __future__ import annotations

from typing import ClassVar

from engine.models.llama import LOCAL_NAMES, LlamaModel


class Phi3Model(LlamaModel):
    LOCAL_NAMES: ClassVar[dict[str, str]] = {
        **LOCAL_NAMES,
        "self_attn.qkv_proj": "qkv",
        "mlp.gate_up_proj": "gate_up",
    }
