"""GGUF metadata -> transformers config for the models that need offloading most: DeepSeek-V3 and
Kimi K2 (`deepseek2`), gpt-oss (`gpt-oss`), GLM-4.5 (`glm4moe`) and Llama 4 (`llama4`).

Keys are those of llama.cpp's converter; where its runtime (src/llama-model.cpp) assumes what
no key states, the same is assumed here: gpt-oss's local layers every other one from the first
and its SwiGLU limit 7; Llama 4's chunked attention (8192 tokens) on three layers in four, the
fourth without rotary and with its query temperature (floor 8192, scale 0.1), and q/k L2 norms
unless it has 128 experts (Maverick); DeepSeek's YaRN magnitude as mscale_all_dim (the file's
`yarn_log_multiplier` / 0.1) for both of transformers' mscales.
"""

from __future__ import annotations

from typing import Any

from engine.loading.gguf_metadata import NO_ROPE_LAYER_STEP, Metadata, read_rope
from engine.loading.gguf_tensors import GgufTensors
from engine.models.hf_config import UnsupportedModelError

SIGMOID = 2
"""llama.cpp's expert_gating_func for sigmoid scores (1 is softmax, its default)."""
GPT_OSS_SWIGLU_LIMIT = 7.0
LLAMA4_CHUNK = 8192
"""Llama 4's attention chunk and temperature floor, and its temperature scale (llama.cpp)."""
LLAMA4_TEMPERATURE_SCALE = 0.1
MAVERICK_EXPERTS = 128
"""llama.cpp turns Llama 4's q/k norms off for the 128-expert model (Maverick has none)."""


def _grouped_experts(meta: Metadata) -> dict[str, Any]:
    """DeepSeek-V3's and GLM-4.5's router: sigmoid scores with a correction bias, groups of
    experts (none where the file does not say), a shared expert, leading dense layers."""
    gating = int(meta.get("expert_gating_func", 1))
    if gating != SIGMOID:
        raise UnsupportedModelError(
            f"{meta.path.name} routes its experts by softmax (expert_gating_func {gating}, as "
            "DeepSeek-V2 does); nanoflex converts the sigmoid-routed DeepSeek-V3, Kimi K2 and "
            "GLM-4.5 files"
        )
    return dict(
        moe_intermediate_size=int(meta["expert_feed_forward_length"]),
        n_routed_experts=int(meta["expert_count"]),
        num_experts_per_tok=int(meta["expert_used_count"]),
        n_shared_experts=int(meta.get("expert_shared_count", 0)),
        routed_scaling_factor=float(meta.get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(meta.get("expert_weights_norm", False)),
        n_group=int(meta.get("expert_group_count", 1)),
        topk_group=int(meta.get("expert_group_used_count", 1)),
        first_k_dense_replace=int(meta.get("leading_dense_block_count", 0)),
    )


def _deepseek2(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention: llama.cpp writes it as one KV head of kv_lora_rank +
    rope dims (key_length) and the per-head sizes as key_length_mla / value_length_mla; files
    from before those keys hold the per-head sizes in key_length / value_length."""
    experts = _grouped_experts(meta)  # refuses softmax routing first
    rope_dim = int(meta["rope.dimension_count"])
    if meta.get("attention.key_length_mla") is not None:
        key, value = int(meta["attention.key_length_mla"]), int(meta["attention.value_length_mla"])
    else:
        key, value = int(meta["attention.key_length"]), int(meta["attention.value_length"])
    q_rank = int(meta.get("attention.q_lora_rank", 0))
    rope = read_rope(meta)
    if rope["rope_type"] == "yarn":
        mscale = round(float(meta.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        rope.update(mscale=mscale, mscale_all_dim=mscale)
    return dict(
        experts,
        num_key_value_heads=fields["num_attention_heads"],
        head_dim=rope_dim,
        q_lora_rank=q_rank or None,
        kv_lora_rank=int(meta["attention.kv_lora_rank"]),
        qk_nope_head_dim=key - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=value,
        rope_parameters=rope,
    )


def _glm4moe(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """The file's last `nextn_predict_layers` blocks are the multi-token-prediction layer,
    which transformers' model does not hold (skipped); partial rotary from the rotated
    dimensions; q/k norms and q/k/v biases where the file has them."""
    names = tensors.tensor_names()
    nextn = int(meta.get("nextn_predict_layers", 0))
    rope = read_rope(meta)
    rope["partial_rotary_factor"] = int(meta["rope.dimension_count"]) / fields["head_dim"]
    return dict(
        _grouped_experts(meta),
        num_hidden_layers=fields["num_hidden_layers"] - nextn,
        num_nextn_predict_layers=nextn,
        use_qk_norm="blk.0.attn_q_norm.weight" in names,
        attention_bias="blk.0.attn_q.bias" in names,
        rope_parameters=rope,
    )


def _gpt_oss(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """YaRN without truncating its ramp (every gpt-oss checkpoint's `truncate: false`; no key
    carries it)."""
    rope = read_rope(meta)
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    num_layers = fields["num_hidden_layers"]
    return dict(
        intermediate_size=int(meta["expert_feed_forward_length"]),
        num_local_experts=int(meta["expert_count"]),
        num_experts_per_tok=int(meta["expert_used_count"]),
        sliding_window=int(meta["attention.sliding_window"]),
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ],
        swiglu_limit=GPT_OSS_SWIGLU_LIMIT,
        rope_parameters=rope,
    )


def _llama4(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Chunked attention unless the file's window is 0 (then no chunks, and only the last
    layer without rotary, as llama.cpp does)."""
    num_experts = int(meta["expert_count"])
    num_layers = fields["num_hidden_layers"]
    chunked = int(meta.get("attention.sliding_window", LLAMA4_CHUNK)) != 0
    step = NO_ROPE_LAYER_STEP if chunked else num_layers
    return dict(
        intermediate_size=int(meta["expert_feed_forward_length"]),
        intermediate_size_mlp=fields["intermediate_size"],
        num_local_experts=num_experts,
        num_experts_per_tok=int(meta["expert_used_count"]),
        interleave_moe_layer_step=int(meta.get("interleave_moe_layer_step", 1)),
        attention_chunk_size=LLAMA4_CHUNK if chunked else None,
        no_rope_layers=[int((i + 1) % step != 0) for i in range(num_layers)],
        use_qk_norm=num_experts != MAVERICK_EXPERTS,
        floor_scale=LLAMA4_CHUNK,
        attn_scale=LLAMA4_TEMPERATURE_SCALE,
        attn_temperature_tuning=True,
        rope_parameters=read_rope(meta),
    )


GIANTS = {"deepseek2": _deepseek2, "glm4moe": _glm4moe, "gpt-oss": _gpt_oss, "llama4": _llama4}
