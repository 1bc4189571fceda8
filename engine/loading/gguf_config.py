"""A GGUF file's metadata -> a transformers config, for the families whose metadata transformers'
GGUF reader leaves out or cannot read: Qwen 3's head size, Gemma 2's soft-caps and score
scale, Gemma 3's window pattern, local rotary base and rope scaling, Phi-3's partial rotary,
window and LongRoPE factors, OLMo 2 and 3, SmolLM3, OLMoE and Mixtral at all; Qwen2/3-MoE's
expert width; the models that need offloading most in gguf_config_giants.py.

Keys are the ones llama.cpp's converter writes (`<arch>.attention.head_count`, ...). Where
llama.cpp's runtime assumes a value no key states (src/llama-model.cpp: Gemma's window pattern
and query scale by model size, Gemma 3's local rotary base), the same value is assumed here,
so the converted model computes what llama.cpp computes from the same file. A rotary scaling
the file asks for and nanoflex does not implement is refused by name.
"""

from __future__ import annotations

from typing import Any

from engine.loading.gguf_config_giants import GIANTS
from engine.loading.gguf_metadata import NO_ROPE_LAYER_STEP, Metadata, read_rope
from engine.loading.gguf_tensors import GgufTensors
from engine.models.hf_config import UnsupportedModelError
from policy.families import gguf_model_types

READ_BY_TRANSFORMERS = frozenset({"llama", "qwen2"})
"""GGUF architectures whose config transformers' GGUF reader reads (but a `llama` file with
experts is Mixtral, read here: `is_read_here`)."""
MODEL_TYPES = {
    arch: model_type
    for arch, model_type in gguf_model_types().items()
    if arch not in READ_BY_TRANSFORMERS
}
"""GGUF architectures read here -> transformers model type, from the family table (an `olmo2`
file with a window is OLMo 3)."""
OLMO3_FULL_LAYER_STEP = 4
"""OLMo 3 without a window pattern in the file: every fourth layer global (llama.cpp's
converter's default, transformers' too)."""
NORMED_TOP_K = {"qwen2moe": False, "qwen3moe": True, "olmoe": False, "llama": True}
"""Whether llama.cpp renormalises each architecture's top-k router weights where the file has
no `expert_weights_norm` key (its src/models/*.cpp)."""
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""llama.cpp scales the 27B models' queries by (hidden / heads) ** -0.5, the others' by
head_dim ** -0.5; it knows them by their number of layers."""


def is_read_here(tensors: GgufTensors) -> bool:
    """The file's config is read by `gguf_config`, not by transformers' GGUF reader."""
    return tensors.architecture in MODEL_TYPES or _is_mixtral(tensors)


def _is_mixtral(tensors: GgufTensors) -> bool:
    """llama.cpp writes Mixtral as a `llama` file with stacked experts."""
    return tensors.architecture == "llama" and "blk.0.ffn_gate_exps.weight" in (
        tensors.tensor_names()
    )


def gguf_config(tensors: GgufTensors) -> Any:
    """The transformers config of the GGUF file behind `tensors` (`is_read_here`)."""
    from transformers import AutoConfig

    meta = Metadata(tensors)
    names = tensors.tensor_names()
    fields = _common(meta, tensors, names)
    if _is_mixtral(tensors):
        fields.update(_mixtral(meta, tensors, fields))
        return AutoConfig.for_model("mixtral", **fields)
    family = {**_FAMILY, **GIANTS}[meta.arch]
    fields.update(family(meta, tensors, fields))
    model_type = fields.pop("model_type", MODEL_TYPES[meta.arch])
    return AutoConfig.for_model(model_type, **fields)


def _common(meta: Metadata, tensors: GgufTensors, names: set[str]) -> dict[str, Any]:
    hidden, heads = int(meta["embedding_length"]), int(meta["attention.head_count"])
    return dict(
        vocab_size=tensors.raw_shape("token_embd.weight")[0],
        hidden_size=hidden,
        intermediate_size=int(meta["feed_forward_length"]),
        num_hidden_layers=int(meta["block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("attention.head_count_kv", heads)),
        head_dim=int(meta.get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta["attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta["context_length"]),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def _qwen3(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    bias = "blk.0.attn_q.bias" in tensors.tensor_names()
    return dict(rope_parameters=read_rope(meta), attention_bias=bias)


def _olmo2(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """OLMo 2, or OLMo 3 where the file has a window: local layers from the pattern (three in
    four where it gives none, llama.cpp's converter's default), rotary without scaling on them
    at their own base (the file's, else the global one)."""
    window = int(meta.get("attention.sliding_window", 0))
    if not window:
        return dict(rope_parameters=read_rope(meta))
    num_layers = fields["num_hidden_layers"]
    pattern = meta.get("attention.sliding_window_pattern")
    local = (
        [bool(p) for p in pattern]
        if isinstance(pattern, list)
        else [(i + 1) % OLMO3_FULL_LAYER_STEP != 0 for i in range(num_layers)]
    )
    local_theta = meta.get("rope.freq_base_swa", meta.get("rope.freq_base", 1e4))
    return dict(
        model_type="olmo3",
        sliding_window=window,
        layer_types=["sliding_attention" if is_local else "full_attention" for is_local in local],
        rope_parameters={
            "full_attention": read_rope(meta),
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local_theta)},
        },
    )


def _smollm3(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Every fourth layer without rotary and no window (llama.cpp's runtime; no key says)."""
    num_layers = fields["num_hidden_layers"]
    return dict(
        rope_parameters=read_rope(meta),
        no_rope_layers=[int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(num_layers)],
        use_sliding_window=False,
        sliding_window=None,
        attention_bias="blk.0.attn_q.bias" in tensors.tensor_names(),
    )


def _experts(meta: Metadata) -> dict[str, Any]:
    """The router's fields: experts, top-k, whether the top-k weights are renormalised."""
    norm = meta.get("expert_weights_norm", NORMED_TOP_K[meta.arch])
    return dict(
        num_experts=int(meta["expert_count"]),
        num_experts_per_tok=int(meta["expert_used_count"]),
        norm_topk_prob=bool(norm),
    )


def _mixtral(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Experts as wide as feed_forward_length, top-k always renormalised (transformers'
    Mixtral; a file saying otherwise is refused)."""
    experts = _experts(meta)
    if not experts["norm_topk_prob"]:
        raise UnsupportedModelError(
            f"{meta.path.name}: a llama-architecture MoE without renormalised top-k weights "
            "is not Mixtral, and nanoflex does not convert it"
        )
    return dict(
        rope_parameters=read_rope(meta),
        num_local_experts=experts["num_experts"],
        num_experts_per_tok=experts["num_experts_per_tok"],
        sliding_window=int(meta.get("attention.sliding_window", 0)) or None,
    )


def _qwen_moe(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/3-MoE: every layer sparse (llama.cpp has no dense ones), the experts' width from
    expert_feed_forward_length; Qwen2-MoE's shared expert and qkv bias, Qwen3-MoE's head size
    (in `_common`) and optional attention bias."""
    out = dict(
        _experts(meta),
        rope_parameters=read_rope(meta),
        moe_intermediate_size=int(meta["expert_feed_forward_length"]),
    )
    bias = "blk.0.attn_q.bias" in tensors.tensor_names()
    if meta.arch == "qwen2moe":
        shared = int(meta.get("expert_shared_feed_forward_length", 0))
        out.update(shared_expert_intermediate_size=shared, qkv_bias=bias)
    else:
        out.update(attention_bias=bias)
    return out


def _olmoe(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """OLMoE: experts as wide as feed_forward_length."""
    return dict(_experts(meta), rope_parameters=read_rope(meta))


def _query_pre_attn_scalar(meta: Metadata, fields: dict[str, Any]) -> int:
    if fields["num_hidden_layers"] == GEMMA_27B_LAYERS[meta.arch]:
        return int(fields["hidden_size"] // fields["num_attention_heads"])
    return int(fields["head_dim"])


def _gemma2(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Every other layer local (transformers' default pattern and llama.cpp's), window 4096 and
    caps 50 / 30 where the file does not say (llama.cpp's defaults)."""
    return dict(
        rope_parameters=read_rope(meta),
        query_pre_attn_scalar=_query_pre_attn_scalar(meta, fields),
        sliding_window=int(meta.get("attention.sliding_window", 4096)),
        attn_logit_softcapping=float(meta.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(meta.get("final_logit_softcapping", 30.0)),
    )


def _gemma3(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Local layers only where the file has a window (llama.cpp), every sixth layer global
    unless the file gives a pattern, local rotary base 10000 unless given."""
    window = int(meta.get("attention.sliding_window", 0))
    num_layers = fields["num_hidden_layers"]
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if not window:
        local = [False] * num_layers
    elif isinstance(pattern, list):  # per layer: True where it is local
        local = [bool(p) for p in pattern]
    else:
        local = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    softcap = meta.get("final_logit_softcapping")
    return dict(
        rope_parameters={
            "full_attention": read_rope(meta),
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0)),
            },
        },
        query_pre_attn_scalar=_query_pre_attn_scalar(meta, fields),
        sliding_window=window or None,
        layer_types=["sliding_attention" if is_local else "full_attention" for is_local in local],
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


def _phi3(meta: Metadata, tensors: GgufTensors, fields: dict[str, Any]) -> dict[str, Any]:
    """Partial rotary from the rotated dimensions; LongRoPE from the factor tensors llama.cpp
    writes for it; a window of 0 means none (Phi-4)."""
    rope = read_rope(meta)
    rotated = int(meta.get("rope.dimension_count", fields["head_dim"]))
    rope["partial_rotary_factor"] = rotated / fields["head_dim"]
    original = int(
        meta.get("rope.scaling.original_context_length", fields["max_position_embeddings"])
    )
    if "rope_factors_long.weight" in tensors.tensor_names():
        rope.update(
            rope_type="longrope",
            long_factor=tensors.raw("rope_factors_long.weight").tolist(),
            short_factor=tensors.raw("rope_factors_short.weight").tolist(),
            original_max_position_embeddings=original,
        )
        if meta.get("rope.scaling.attn_factor") is not None:
            rope["attention_factor"] = float(meta["rope.scaling.attn_factor"])
    return dict(
        rope_parameters=rope,
        original_max_position_embeddings=original,
        sliding_window=int(meta.get("attention.sliding_window", 0)) or None,
    )


_FAMILY = {
    "qwen3": _qwen3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "olmo2": _olmo2,
    "qwen2moe": _qwen_moe,
    "qwen3moe": _qwen_moe,
    "olmoe": _olmoe,
    "smollm3": _smollm3,
}
