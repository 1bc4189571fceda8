"""A transformers config -> `ModelConfig` fields, per family; what the layer code does not honour
is refused by name.

Every field transformers' config class defines is accounted for: a family reads the fields it
implements (`_FAMILIES`), a few never change the numbers (`HARMLESS`: ids, dtypes, dropout,
bookkeeping), and any other field whose value differs from the class's default is one the
layer code would silently ignore, so loading stops with its name. A new transformers field or
a bidirectional Gemma fails this way instead of giving wrong tokens. Keys the class does not
define are ignored, as transformers' model ignores them (leftovers of remote code, such as
Phi-4-mini's `full_attn_mod`), except the ones that change the weights (`REFUSED`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from engine.models.multipliers import Multipliers
from engine.models.quant_config import Fp8ConfigError, fp8_block_size, is_mxfp4
from policy.errors import UserError

SUPPORTED_MODEL_TYPES = (
    "opt",
    "llama",
    "mistral",
    "qwen2",
    "qwen2_5_vl",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "phi3",
    "olmo2",
    "olmo3",
    "smollm3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "glm4_moe",
    "deepseek_v3",
    "gpt_oss",
    "llama4_text",
    "llama4",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "granitemoehybrid",
    "nemotron_h",
    "falcon_h1",
)
REFUSED_MODEL_TYPES = {
    "deepseek_v2": "DeepSeek-V2's softmax group-limited routing (nanoflex routes as V3 does)",
}
"""Mixture-of-experts types refused by name, with what nanoflex does not implement of each."""


log = logging.getLogger("nanoflex.engine")


class UnsupportedModelError(UserError):
    """The checkpoint's architecture, or a setting in its config, is not one nanoflex
    implements."""


HARMLESS = frozenset(
    {
        "architectures",
        "auto_map",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "name_or_path",
        "_model_name_or_path",
        "use_cache",
        "initializer_range",
        "init_std",
        "initializer_factor",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "id2label",
        "label2id",
        "tokenizer_class",
        "prefix",
        "cache_implementation",
        "pretraining_tp",  # Llama 2's sharded MLP: the same products, summed in pieces
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_remove_final_layer_norm",  # OPT conversion bookkeeping
        "unk_token_id",
    }
)
"""Config fields that never change the numbers (besides dropout, which inference skips)."""
REFUSED = frozenset({"quantization_config"})
"""Keys outside the config class that change what the weights mean."""

_COMMON = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "partial_rotary_factor",
        "hidden_act",
    }
)
"""Fields every Llama-family reader honours (the rotary ones through `_rope`)."""

_WINDOWS = frozenset({"sliding_window", "layer_types", "use_sliding_window", "max_window_layers"})
"""Fields that say which layers have which sliding window (read through `layer_types`)."""

_MOE = frozenset(
    {
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "norm_topk_prob",
        "moe_intermediate_size",
        # training only: the router's auxiliary loss and its jitter noise
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
    }
)
"""Fields every mixture-of-experts reader honours (`_moe`)."""
_QWEN_MOE = frozenset({"decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"})
"""Qwen2/3-MoE: which layers are dense, the shared expert (`_moe`)."""

_GEMMA = frozenset(
    {
        "hidden_activation",
        "query_pre_attn_scalar",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "use_bidirectional_attention",
        "attention_bias",
        "sliding_window_pattern",
        "rope_local_base_freq",
    }
)

ROPE_TYPES = {
    "llama": ("default", "linear", "llama3"),
    "mistral": ("default", "linear", "llama3"),
    "qwen2": ("default", "linear", "llama3"),
    "qwen2_5_vl_text": ("default",),
    "qwen3": ("default", "linear", "llama3"),
    "olmo2": ("default", "linear", "llama3"),
    "olmo3": ("default", "linear", "llama3", "yarn"),
    "smollm3": ("default", "linear", "llama3", "yarn"),
    "gemma2": ("default", "linear"),
    "gemma3_text": ("default", "linear"),
    "phi3": ("default", "longrope"),
    "mixtral": ("default", "linear", "llama3"),
    "qwen2_moe": ("default", "linear", "llama3"),
    "qwen3_moe": ("default", "linear", "llama3"),
    "olmoe": ("default", "linear", "llama3"),
    "glm4_moe": ("default", "linear", "llama3", "yarn"),
    "deepseek_v3": ("default", "linear", "yarn"),
    "gpt_oss": ("default", "yarn"),
    "llama4_text": ("default", "linear", "llama3"),
    "qwen3_next": ("default", "linear", "yarn"),
    "qwen3_5_text": ("default",),
    "qwen3_5_moe_text": ("default",),
    "granitemoehybrid": ("default", "linear", "llama3"),
    "falcon_h1": ("default", "linear", "llama3"),
}
"""Rotary scaling types each family implements (engine/models/rotary.py)."""


def model_config_fields(hf: Any) -> dict[str, Any]:
    """`ModelConfig` keyword arguments for the transformers config `hf`."""
    model_type = getattr(hf, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported: nanoflex does not implement "
            f"{REFUSED_MODEL_TYPES[model_type]}; its mixture-of-experts families are "
            "mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, deepseek_v3 and gpt_oss"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; nanoflex runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
        )
    if model_type == "qwen2_5_vl":
        return _qwen2_5_vl(hf)
    if model_type in TEXT_CONFIGS:  # one checkpoint with a vision tower: its language model
        text = _text_config(hf)
        honoured, read = _FAMILIES[text.model_type]
        refuse_unhonoured(text, honoured)
        fields = read(text)
        # the whole checkpoint's head is tied (or not) as the wrapper says, as transformers'
        # ...ForConditionalGeneration that saved it tied it
        tied = getattr(hf, "tie_word_embeddings", None)
        if tied is not None:
            fields["tie_word_embeddings"] = bool(tied)
        log.info(
            "%s: the vision tower is not loaded; nanoflex runs its %s language model on text",
            model_type,
            text.model_type,
        )
        return fields
    honoured, read = _FAMILIES[model_type]
    refuse_unhonoured(hf, honoured)
    return read(hf)


TEXT_CONFIGS = {
    "gemma3": "gemma3_text",
    "llama4": "llama4_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
"""Model types of checkpoints with a vision tower (Gemma 3 4B and up, Llama 4, Qwen3.5 as
published) -> their language model's type."""


def _text_config(hf: Any) -> Any:
    """The language model's config of a checkpoint with a vision tower: nanoflex runs its text
    (the image tokens are ordinary vocabulary it never sees in a text prompt)."""
    text = getattr(hf, "text_config", None)
    if text is None or getattr(text, "model_type", None) != TEXT_CONFIGS[hf.model_type]:
        raise UnsupportedModelError(
            f"a {hf.model_type} config without a {TEXT_CONFIGS[hf.model_type]} text_config is "
            "not supported"
        )
    return text


def _qwen2_5_vl(hf: Any) -> dict[str, Any]:
    """Qwen2.5-VL: a Qwen2 language model (M-RoPE over the sections `mrope_section` of its
    rotary frequencies) with its vision tower (engine/models/qwen2_5_vision.py)."""
    from engine.models.vision_config import VisionConfig

    text, vision = hf.text_config, hf.vision_config
    refuse_unhonoured(text, _COMMON | _WINDOWS)
    _require(vision, "hidden_act", ("silu",))
    _require(vision, "in_chans" if hasattr(vision, "in_chans") else "in_channels", (3,))
    fields = _llama(text)
    scaling = dict(fields["rope_scaling"])
    section = tuple(int(s) for s in scaling.pop("mrope_section", ()))
    if 2 * sum(section) != fields["head_dim"]:
        raise UnsupportedModelError(
            f"qwen2_5_vl: mrope_section {list(section)} does not cover head_dim "
            f"{fields['head_dim']} (its sections sum to half the head)"
        )
    tied = getattr(hf, "tie_word_embeddings", None)
    return dict(
        fields,
        model_type="qwen2_5_vl",
        rope_scaling=scaling,
        qkv_bias=True,  # Qwen2's q, k and v projections have biases
        mrope_section=section,
        vision=VisionConfig.from_hf(vision),
        image_token_id=int(hf.image_token_id),
        tie_word_embeddings=bool(text.tie_word_embeddings if tied is None else tied),
    )


def refuse_unhonoured(hf: Any, honoured: frozenset[str]) -> None:
    """Raise `UnsupportedModelError` naming the first field of `hf` that is neither honoured,
    harmless, nor at its default value."""
    defaults = _defaults(type(hf))
    for key, value in hf.to_dict().items():
        if key in honoured or key in HARMLESS or "dropout" in key or key.endswith("pdrop"):
            continue
        if key == "quantization_config" and _is_fp8(hf.model_type, value):
            continue  # dequantized at load (engine/loading/fp8.py)
        if key == "quantization_config" and hf.model_type == "gpt_oss" and is_mxfp4(value):
            continue  # its experts dequantized at load (engine/loading/mxfp4.py)
        if key == "layerdrop" or (key in defaults and defaults[key] == value):
            continue
        if defaults and key not in defaults and key not in REFUSED:
            continue  # transformers' model never reads it either
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise UnsupportedModelError(
            f"{hf.model_type} config field {key}={shown} is not supported: nanoflex does not "
            "implement it, and running without it would give other tokens than the model's"
        )


def _is_fp8(model_type: str, quantization: Any) -> bool:
    """The checkpoint is block-scaled FP8 that nanoflex dequantizes at load; False for no
    quantization or another method (refused as any unhonoured field); an FP8 variant it
    does not read is refused here by name."""
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        return False
    try:
        fp8_block_size(quantization)
    except Fp8ConfigError as e:
        raise UnsupportedModelError(f"{model_type}: {e} is not supported") from e
    return True


_DEFAULTS: dict[type, dict[str, Any]] = {}


def _defaults(config_class: type) -> dict[str, Any]:
    """The fields of a default instance of `config_class` (made once per class)."""
    if config_class not in _DEFAULTS:
        try:
            _DEFAULTS[config_class] = dict(config_class().to_dict())
        except (TypeError, ValueError):  # a class with required fields: every field counts
            _DEFAULTS[config_class] = {}
    return _DEFAULTS[config_class]


def _require(hf: Any, key: str, allowed: tuple[Any, ...]) -> Any:
    """hf.key, refused by name unless one of `allowed`."""
    value = getattr(hf, key, None)
    if value not in allowed:
        raise UnsupportedModelError(
            f"{hf.model_type} config field {key}={value!r} is not supported (nanoflex "
            f"implements {', '.join(map(repr, allowed))})"
        )
    return value


# -- readers -------------------------------------------------------------------------------


def _opt(hf: Any) -> dict[str, Any]:
    _require(hf, "activation_function", ("relu",))
    _require(hf, "layer_norm_elementwise_affine", (True,))
    return dict(
        _shapes(hf),
        intermediate_size=hf.ffn_dim,
        num_kv_heads=hf.num_attention_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads,
        norm_eps=1e-5,
        do_layer_norm_before=hf.do_layer_norm_before,
        word_embed_proj_dim=hf.word_embed_proj_dim or hf.hidden_size,
        activation="relu",
        enable_bias=getattr(hf, "enable_bias", True),
    )


def _llama(hf: Any) -> dict[str, Any]:
    """The fields every Llama-family model has: shapes, norms, rotary, windows, biases."""
    _require(hf, "hidden_act", ("silu",))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    theta, scaling, rotary_dim = _rope(hf, _rope_parameters(hf), head_dim)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return dict(
        _llama_shapes(hf, head_dim),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        qkv_bias=attention_bias or hf.model_type == "qwen2" or bool(getattr(hf, "qkv_bias", 0)),
        o_bias=attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        layer_windows=_layer_windows(hf),
    )


def _moe(hf: Any) -> dict[str, Any]:
    """A Llama-family layer whose MLP routes each token to its top-k experts: Mixtral (experts
    as wide as `intermediate_size`, top-k always renormalised), OLMoE (the same width), Qwen2/3-
    MoE (`moe_intermediate_size`, dense MLPs on the layers `mlp_only_layers` and
    `decoder_sparse_step` leave out, Qwen2-MoE's shared expert)."""
    num_experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    only_mlp = set(getattr(hf, "mlp_only_layers", None) or ())
    dense = [i for i in range(hf.num_hidden_layers) if i in only_mlp or (i + 1) % step]
    width = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    return dict(
        _llama(hf),
        num_experts=int(num_experts or 0),
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(width),
        norm_topk_prob=hf.model_type == "mixtral" or bool(getattr(hf, "norm_topk_prob", False)),
        shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0)),
        dense_layers=tuple(dense),
    )


_GROUPED_MOE = frozenset(
    {
        "n_routed_experts",
        "n_shared_experts",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "num_nextn_predict_layers",  # multi-token prediction layers: not read, as transformers
        "num_mtp_layers",
    }
)
"""DeepSeek-V3 and GLM-4.5: grouped sigmoid routing, shared experts, dense first layers."""


def _grouped_routing(hf: Any) -> dict[str, Any]:
    """Grouped sigmoid routing (DeepSeek-V3, GLM-4.5, Nemotron-H's MoE layers):
    `n_routed_experts` in `n_group` groups, a token's top k from the best `topk_group` groups,
    renormalised if `norm_topk_prob`, times `routed_scaling_factor`."""
    num_experts = int(hf.n_routed_experts)
    groups = int(hf.n_group or 1)
    if num_experts % groups or num_experts // groups < 2:
        raise UnsupportedModelError(
            f"{hf.model_type}: {num_experts} experts in n_group={groups} groups is not supported "
            "(each group needs at least 2 experts, as its score is its best two)"
        )
    if not 1 <= int(hf.topk_group or 1) <= groups:
        raise UnsupportedModelError(
            f"{hf.model_type}: topk_group={hf.topk_group} must be between 1 and n_group={groups}"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(hf.num_experts_per_tok),
        norm_topk_prob=bool(hf.norm_topk_prob),
        num_expert_groups=groups,
        num_groups_per_tok=int(hf.topk_group or 1),
        routed_scaling_factor=float(hf.routed_scaling_factor),
    )


def _grouped_moe(hf: Any) -> dict[str, Any]:
    """DeepSeek-V3's and GLM-4.5's MoE fields: `n_routed_experts` of `moe_intermediate_size`,
    `n_shared_experts` as one SwiGLU that many times as wide, the first
    `first_k_dense_replace` layers dense, grouped sigmoid routing. The multi-token prediction
    layer the checkpoints carry beyond `num_hidden_layers` is not read (transformers skips it)."""
    width = int(hf.moe_intermediate_size)
    first_dense = min(int(hf.first_k_dense_replace or 0), hf.num_hidden_layers)
    return dict(
        _grouped_routing(hf),
        moe_intermediate_size=width,
        shared_expert_intermediate_size=width * int(hf.n_shared_experts or 0),
        dense_layers=tuple(range(first_dense)),
    )


def _glm4_moe(hf: Any) -> dict[str, Any]:
    """GLM-4.5/4.6: Llama attention with q/k/v biases (o_proj none), partial rotary, optional
    per-head q/k norms; the grouped MoE."""
    return dict(_llama(hf), o_bias=False, **_grouped_moe(hf))


_MLA = frozenset(
    {
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "qk_head_dim",
        "v_head_dim",
        "rope_interleave",
        "attention_bias",
    }
)


def _deepseek_v3(hf: Any) -> dict[str, Any]:
    """DeepSeek-V3 / R1: multi-head latent attention (engine/models/deepseek.py: the KV row is
    one head of kv_lora_rank + qk_rope_head_dim, queries absorbed into the latent), scores
    scaled by qk_head_dim ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared; the
    grouped MoE."""
    _require(hf, "hidden_act", ("silu",))
    if hf.num_key_value_heads != hf.num_attention_heads:
        raise UnsupportedModelError(
            f"deepseek_v3: num_key_value_heads={hf.num_key_value_heads} other than "
            f"num_attention_heads={hf.num_attention_heads} is not supported"
        )
    rope_dim = int(hf.qk_rope_head_dim)
    theta, scaling, rotary_dim = _rope(hf, _rope_parameters(hf), rope_dim)
    scale = (hf.qk_nope_head_dim + rope_dim) ** -0.5
    if scaling["rope_type"] != "default" and scaling.get("mscale_all_dim"):
        factor = float(scaling["factor"])
        mscale = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
        scale = scale * (mscale if factor > 1 else 1.0) ** 2
    attention_bias = bool(hf.attention_bias)
    return dict(
        _shapes(hf),
        intermediate_size=hf.intermediate_size,
        num_kv_heads=1,
        head_dim=int(hf.kv_lora_rank) + rope_dim,
        norm_eps=hf.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        attn_scale=scale,
        kv_lora_rank=int(hf.kv_lora_rank),
        qk_nope_head_dim=int(hf.qk_nope_head_dim),
        v_head_dim=int(hf.v_head_dim),
        rope_interleave=bool(hf.rope_interleave),
        **_grouped_moe(hf),
    )


def _gpt_oss(hf: Any) -> dict[str, Any]:
    """gpt-oss: Llama's shapes, biases and windows (`layer_types`), YaRN; top-k of
    `num_local_experts` experts as wide as `intermediate_size`, the clamped SwiGLU's alpha and
    limit. Its MXFP4 experts (`*_blocks`, `*_scales`) are dequantized at load
    (engine/loading/mxfp4.py)."""
    return dict(
        _llama(hf),
        num_experts=int(hf.num_local_experts),
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.intermediate_size),
        swiglu_alpha=float(getattr(hf, "swiglu_alpha", GPT_OSS_SWIGLU[0])),
        swiglu_limit=float(getattr(hf, "swiglu_limit", GPT_OSS_SWIGLU[1])),
    )


GPT_OSS_SWIGLU = (1.702, 7.0)
"""gpt-oss's SwiGLU alpha and limit where a config does not say: the released checkpoints'
config.json has the limit and no alpha, and transformers before its config gained both fields
(5.17 has neither) took these two as constants."""


_LLAMA4 = frozenset(
    {
        "attention_bias",
        "intermediate_size_mlp",
        "moe_layers",
        "interleave_moe_layer_step",
        "use_qk_norm",
        "no_rope_layers",
        "no_rope_layer_interval",
        "attention_chunk_size",
        "layer_types",
        "attn_temperature_tuning",
        "floor_scale",
        "attn_scale",
    }
)


def _llama4_text(hf: Any) -> dict[str, Any]:
    """Llama 4 (text): rotary layers with chunked local attention (`attention_chunk_size`) and,
    where `use_qk_norm` says, an L2 norm of q and k after the rotary; NoPE layers (0 in
    `no_rope_layers`) with full attention and, with `attn_temperature_tuning`, queries scaled
    by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1; MoE layers (`moe_layers`)
    of `num_local_experts` experts as wide as `intermediate_size` with a sigmoid top-k router
    that scales the experts' inputs, and a shared expert as wide; dense layers of
    `intermediate_size_mlp`."""
    flags = list(hf.no_rope_layers)[: hf.num_hidden_layers]
    if len(flags) < hf.num_hidden_layers:
        raise UnsupportedModelError(
            f"llama4: no_rope_layers has {len(flags)} entries for {hf.num_hidden_layers} layers"
        )
    moe = set(hf.moe_layers)
    return dict(
        _llama(hf),
        intermediate_size=int(hf.intermediate_size_mlp),
        nope_layers=tuple(i for i, rope in enumerate(flags) if not rope),
        qk_l2_norm=bool(hf.use_qk_norm),
        attn_floor_scale=float(hf.floor_scale) if hf.attn_temperature_tuning else 0.0,
        attn_temperature_scale=float(hf.attn_scale),
        num_experts=int(hf.num_local_experts),
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.intermediate_size),
        shared_expert_intermediate_size=int(hf.intermediate_size),
        dense_layers=tuple(i for i in range(hf.num_hidden_layers) if i not in moe),
    )


def _gemma(hf: Any) -> dict[str, Any]:
    """Gemma 2 and 3: GeGLU, query_pre_attn_scalar, soft-capping, per-layer windows (and
    Gemma 3's local rotary base)."""
    _require(hf, "hidden_activation", ("gelu_pytorch_tanh",))
    _require(hf, "use_bidirectional_attention", (None, False))
    if hf.model_type == "gemma3_text":  # transformers' Gemma 3 never applies it
        _require(hf, "attn_logit_softcapping", (None,))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return dict(
        _llama_shapes(hf, head_dim),
        **_typed_rope(hf, head_dim),
        qkv_bias=bool(getattr(hf, "attention_bias", False)),
        o_bias=bool(getattr(hf, "attention_bias", False)),
        layer_windows=_layer_windows(hf),
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
        logit_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        activation="gelu_pytorch_tanh",
    )


def _typed_rope(hf: Any, head_dim: int) -> dict[str, Any]:
    """The rotary fields where each layer type may have its own parameters (Gemma 3, OLMo 3:
    `rope_parameters` keyed by 'full_attention' and 'sliding_attention'): the global layers'
    base and scaling, and the local layers' base (their scaling must be the default one)."""
    rope = _rope_parameters(hf)
    local_theta = 0.0
    if "full_attention" in rope:
        local = dict(rope.get("sliding_attention") or {})
        local_theta, local_scaling, _ = _rope(hf, local, head_dim)
        if local_scaling["rope_type"] != "default":
            raise UnsupportedModelError(
                f"{hf.model_type}: rotary scaling {local_scaling['rope_type']!r} on the "
                "sliding-window layers is not supported"
            )
        rope = dict(rope["full_attention"] or {})
    theta, scaling, _ = _rope(hf, rope, head_dim)
    return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)


def _olmo3(hf: Any) -> dict[str, Any]:
    """OLMo 3: OLMo 2's layer with sliding windows on three layers of four and a rotary per
    layer type (YaRN on the full-attention layers of the long-context checkpoints)."""
    _require(hf, "hidden_act", ("silu",))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return dict(
        _llama_shapes(hf, head_dim),
        **_typed_rope(hf, head_dim),
        qkv_bias=bool(hf.attention_bias),
        o_bias=bool(hf.attention_bias),
        layer_windows=_layer_windows(hf),
    )


def _smollm3(hf: Any) -> dict[str, Any]:
    """SmolLM3: the Llama layer, with no rotary on the layers `no_rope_layers` marks 0 (every
    fourth by default: NoPE)."""
    flags = list(hf.no_rope_layers)[: hf.num_hidden_layers]
    if len(flags) < hf.num_hidden_layers:
        raise UnsupportedModelError(
            f"smollm3: no_rope_layers has {len(flags)} entries for {hf.num_hidden_layers} layers"
        )
    return dict(_llama(hf), nope_layers=tuple(i for i, rope in enumerate(flags) if not rope))


_GATED_DELTA_NET = frozenset(
    {
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "attention_bias",
    }
)
"""Qwen3-Next and Qwen3.5: the Gated DeltaNet layers' shapes."""


def _gated_delta_net(hf: Any) -> dict[str, Any]:
    """Qwen3-Next and Qwen3.5 (dense and MoE): `layer_types` marks each layer
    'linear_attention' (Gated DeltaNet, engine/models/qwen3_next.py) or 'full_attention'
    (attention with per-head q/k norms, partial rotary and a sigmoid output gate); the MLP is
    Qwen2-MoE's (routed experts, a gated shared expert) or dense."""
    _require(hf, "attention_bias", (False,))
    types = list(getattr(hf, "layer_types", None) or [])
    if len(types) != hf.num_hidden_layers:
        raise UnsupportedModelError(
            f"{hf.model_type}: layer_types has {len(types)} entries for "
            f"{hf.num_hidden_layers} layers"
        )
    if int(hf.linear_num_value_heads) % int(hf.linear_num_key_heads):
        raise UnsupportedModelError(
            f"{hf.model_type}: linear_num_value_heads={hf.linear_num_value_heads} is not a "
            f"multiple of linear_num_key_heads={hf.linear_num_key_heads}"
        )
    fields = _moe(hf) if getattr(hf, "num_experts", 0) else _llama(hf)
    if hf.model_type == "qwen3_5_moe_text":  # its router always renormalises the top k
        fields["norm_topk_prob"] = True
    return dict(
        fields,
        layer_windows=(),
        state_layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        linear_num_key_heads=int(hf.linear_num_key_heads),
        linear_num_value_heads=int(hf.linear_num_value_heads),
        linear_key_head_dim=int(hf.linear_key_head_dim),
        linear_value_head_dim=int(hf.linear_value_head_dim),
        linear_conv_kernel=int(hf.linear_conv_kernel_dim),
        attn_output_gate=True,
    )


def _require_no_time_step_limit(hf: Any) -> None:
    """Mamba-2's time step clamp: only the default (0, inf), a no-op after the softplus (the
    decode step of transformers never clamps, so another limit would make prompt and decode
    disagree there too)."""
    limit = tuple(getattr(hf, "time_step_limit", None) or (0.0, float("inf")))
    if limit != (0.0, float("inf")):
        raise UnsupportedModelError(
            f"{hf.model_type} config field time_step_limit={list(limit)} is not supported "
            "(nanoflex implements the default [0.0, inf])"
        )


_GRANITE_HYBRID = frozenset(
    {
        "layer_types",
        "attention_bias",
        "embedding_multiplier",
        "residual_multiplier",
        "attention_multiplier",
        "logits_scaling",
        "num_local_experts",
        "num_experts_per_tok",
        "shared_intermediate_size",
        "position_embedding_type",
        "mamba_n_heads",
        "mamba_n_groups",
        "mamba_d_state",
        "mamba_d_head",
        "mamba_d_conv",
        "mamba_expand",
        "mamba_chunk_size",
        "mamba_conv_bias",
        "mamba_proj_bias",
        "time_step_limit",
        "output_router_logits",
        "router_aux_loss_coef",
    }
)


def _mamba(hf: Any, inner: int, inner_named: str) -> dict[str, Any]:
    """The Mamba-2 fields of a config that names them `mamba_*` (Granite 4, Falcon-H1), the
    mixer `inner` wide (as `inner_named` says) over mamba_n_heads heads of mamba_d_head."""
    _require_no_time_step_limit(hf)
    if inner != hf.mamba_n_heads * hf.mamba_d_head:
        raise UnsupportedModelError(
            f"{hf.model_type}: {inner_named} = {inner} is not mamba_n_heads * mamba_d_head = "
            f"{hf.mamba_n_heads * hf.mamba_d_head}"
        )
    return dict(
        linear_conv_kernel=int(hf.mamba_d_conv),
        mamba_num_heads=int(hf.mamba_n_heads),
        mamba_head_dim=int(hf.mamba_d_head),
        mamba_state_dim=int(hf.mamba_d_state),
        mamba_groups=int(hf.mamba_n_groups),
        mamba_inner=inner,
        mamba_chunk=int(hf.mamba_chunk_size),
    )


def _granite_hybrid(hf: Any) -> dict[str, Any]:
    """Granite 4 hybrid: Mamba-2 layers ('linear_attention' in `layer_types`) beside
    attention layers (no rotary unless `position_embedding_type` is 'rope'; scores scaled by
    `attention_multiplier`), Granite's embedding, residual and logit scalings, a shared
    SwiGLU on every layer and, with `num_local_experts`, routed experts (top-k logits
    softmaxed among themselves) beside it."""
    _require(hf, "position_embedding_type", (None, "rope"))
    types = list(hf.layer_types)
    experts = int(hf.num_local_experts or 0)
    fields = dict(
        _llama(hf),
        **_mamba(hf, int(hf.mamba_expand * hf.hidden_size), "mamba_expand * hidden_size"),
        intermediate_size=int(hf.shared_intermediate_size),
        layer_windows=(),
        attn_scale=float(hf.attention_multiplier),
        state_layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        embedding_multiplier=float(hf.embedding_multiplier),
        residual_multiplier=float(hf.residual_multiplier),
        logits_scaling=float(hf.logits_scaling),
    )
    if hf.position_embedding_type is None:  # NoPE: no layer rotates q and k
        fields["nope_layers"] = tuple(range(hf.num_hidden_layers))
    if experts:
        fields.update(
            num_experts=experts,
            num_experts_per_tok=int(hf.num_experts_per_tok),
            moe_intermediate_size=int(hf.intermediate_size),
            shared_expert_intermediate_size=int(hf.shared_intermediate_size),
        )
    return fields


_NEMOTRON_H = _COMMON | frozenset(  # its config class has no rotary or rms_norm_eps fields
    {
        "layers_block_type",
        "layer_norm_epsilon",
        "mlp_hidden_act",
        "mamba_hidden_act",
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "n_groups",
        "conv_kernel",
        "expand",
        "chunk_size",
        "use_conv_bias",
        "mamba_proj_bias",
        "use_bias",
        "mlp_bias",
        "attention_bias",
        "time_step_limit",
        "residual_in_fp32",
        "mamba_ssm_cache_dtype",
        "use_mamba_kernels",
        "num_logits_to_keep",
        # the training-time initialisation of the time step and the residual rescaling
        "time_step_min",
        "time_step_max",
        "time_step_floor",
        "rescale_prenorm_residual",
        # the multi-token prediction layers (not read, as transformers skips them)
        "mtp_layers_block_type",
        "num_nextn_predict_layers",
        # the MoE layers' ('moe' in layers_block_type); n_shared_experts and the overlap
        # change nothing: transformers runs one shared MLP of its own width
        "n_routed_experts",
        "n_shared_experts",
        "moe_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "moe_latent_size",
        "moe_shared_expert_overlap",
        "num_experts_per_tok",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "output_router_logits",
    }
)


def _nemotron_h(hf: Any) -> dict[str, Any]:
    """Nemotron-H: each layer one mixer after an RMSNorm (weights multiplied in float32), added
    to the residual stream: Mamba-2 ('linear_attention'), attention without rotary
    ('full_attention'), an MLP of squared ReLU ('mlp') or routed experts of squared ReLU
    beside a shared one ('moe', Nemotron 3: grouped sigmoid routing, the experts optionally
    over a latent of `moe_latent_size`)."""
    types = list(hf.layers_block_type)
    _require(hf, "mlp_hidden_act", ("relu2",))
    _require(hf, "mamba_hidden_act", ("silu",))
    _require(hf, "residual_in_fp32", (False,))
    _require_no_time_step_limit(hf)
    heads, head_dim = int(hf.mamba_num_heads), int(hf.mamba_head_dim)
    fields = dict(
        _shapes(hf),
        intermediate_size=int(hf.intermediate_size),
        num_kv_heads=int(hf.num_key_value_heads),
        head_dim=int(hf.head_dim or hf.hidden_size // hf.num_attention_heads),
        norm_eps=float(hf.layer_norm_epsilon),
        activation="relu2",  # attention has no biases, whatever attention_bias says
        mlp_bias=bool(hf.mlp_bias),
        nope_layers=tuple(range(hf.num_hidden_layers)),
        state_layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        mlp_layers=tuple(i for i, kind in enumerate(types) if kind in ("mlp", "moe")),
        linear_conv_kernel=int(hf.conv_kernel),
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state_dim=int(hf.ssm_state_size),
        mamba_groups=int(hf.n_groups),
        mamba_inner=heads * head_dim,
        mamba_chunk=int(hf.chunk_size),
    )
    if "moe" in types:
        fields.update(
            _grouped_routing(hf),
            moe_intermediate_size=int(hf.moe_intermediate_size),
            shared_expert_intermediate_size=int(hf.moe_shared_expert_intermediate_size),
            dense_layers=tuple(i for i, kind in enumerate(types) if kind != "moe"),
            moe_latent_size=int(hf.moe_latent_size or 0),
        )
    return fields


_FALCON_H1 = _COMMON | frozenset(
    {
        "attention_bias",
        "mlp_bias",
        "projectors_bias",
        "mamba_d_ssm",
        "mamba_n_heads",
        "mamba_d_head",
        "mamba_n_groups",
        "mamba_d_state",
        "mamba_d_conv",
        "mamba_expand",
        "mamba_chunk_size",
        "mamba_conv_bias",
        "mamba_proj_bias",
        "mamba_norm_before_gate",
        "mamba_rms_norm",
        "time_step_limit",
        "num_logits_to_keep",
        "embedding_multiplier",
        "lm_head_multiplier",
        "mlp_multipliers",
        "key_multiplier",
        "attention_in_multiplier",
        "attention_out_multiplier",
        "ssm_multipliers",
        "ssm_in_multiplier",
        "ssm_out_multiplier",
    }
)


def _falcon_h1(hf: Any) -> dict[str, Any]:
    """Falcon-H1: attention (rotary, optional biases) and a Mamba-2 mixer of inner width
    `mamba_d_ssm` (else mamba_expand * hidden) side by side in every layer, a SwiGLU MLP, and
    the muP multipliers (`Multipliers`)."""
    ssm = tuple(float(m) for m in hf.ssm_multipliers)
    mlp = tuple(float(m) for m in hf.mlp_multipliers)
    if len(ssm) != 5 or len(mlp) != 2:
        raise UnsupportedModelError(
            f"falcon_h1: ssm_multipliers needs 5 values (z, x, B, C, dt), has {len(ssm)}; "
            f"mlp_multipliers 2 (gate, down), has {len(mlp)}"
        )
    gate = "gate"
    if hf.mamba_rms_norm:
        gate = "norm_gate_f32" if hf.mamba_norm_before_gate else "gate_norm_f32"
    inner = int(hf.mamba_d_ssm or hf.mamba_expand * hf.hidden_size)
    return dict(
        _llama(hf),
        **_mamba(hf, inner, "mamba_d_ssm (else mamba_expand * hidden_size)"),
        state_layers=tuple(range(hf.num_hidden_layers)),
        parallel_hybrid=True,
        mamba_gate=gate,
        embedding_multiplier=float(hf.embedding_multiplier),
        multipliers=Multipliers(
            attention_in=float(hf.attention_in_multiplier),
            key=float(hf.key_multiplier),
            attention_out=float(hf.attention_out_multiplier),
            ssm_in=float(hf.ssm_in_multiplier),
            ssm_zxbcdt=ssm,
            ssm_out=float(hf.ssm_out_multiplier),
            mlp_gate=mlp[0],
            mlp_down=mlp[1],
            lm_head=float(hf.lm_head_multiplier),
        ),
    )


def _shapes(hf: Any) -> dict[str, Any]:
    """The fields every family has."""
    return dict(
        model_type=hf.model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        bos_token_id=hf.bos_token_id,
    )


def _llama_shapes(hf: Any, head_dim: int) -> dict[str, Any]:
    return dict(
        _shapes(hf),
        intermediate_size=hf.intermediate_size,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        norm_eps=hf.rms_norm_eps,
    )


def _rope_parameters(hf: Any) -> dict[str, Any]:
    """The config's rotary parameters (v5 `rope_parameters`, v4 `rope_scaling` + fields)."""
    return dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})


def _rope(hf: Any, rope: dict[str, Any], head_dim: int) -> tuple[float, dict[str, Any], int]:
    """(base, scaling with its 'rope_type', rotated dimensions per head) of one rotary
    parameter set; a scaling type the family does not implement is refused by name."""
    rope = dict(rope)
    theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("su", "yarn") and hf.model_type == "phi3":  # Phi-3's old names
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES[hf.model_type]:
        raise UnsupportedModelError(
            f"{hf.model_type}: rope scaling type {rope_type!r} is not supported (nanoflex "
            f"implements {', '.join(ROPE_TYPES[hf.model_type])} for this family)"
        )
    factor = rope.pop("partial_rotary_factor", None) or getattr(hf, "partial_rotary_factor", 1.0)
    if rope_type == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(
            hf, "original_max_position_embeddings", None
        )
        rope["original_max_position_embeddings"] = original or hf.max_position_embeddings
    return float(theta), {**rope, "rope_type": rope_type}, int(head_dim * float(factor))


def _layer_windows(hf: Any) -> tuple[int, ...]:
    """Each decoder layer's sliding window from `layer_types` (Qwen, Gemma; Llama 4's chunked
    layers as -attention_chunk_size), else the one `sliding_window` of every layer (Mistral,
    Phi-3); () where none has one."""
    window = int(getattr(hf, "sliding_window", None) or 0)
    chunk = int(getattr(hf, "attention_chunk_size", None) or 0)
    types = getattr(hf, "layer_types", None)
    if types is None:
        return (window,) * hf.num_hidden_layers if window else ()
    # Falcon-H1's layers are all 'hybrid': full attention beside a Mamba-2 mixer
    by_kind = {"full_attention": 0, "sliding_attention": window, "linear_attention": 0, "hybrid": 0}
    if chunk > 0:  # Llama 4's config names its chunk size; no other family has one
        by_kind["chunked_attention"] = -chunk
    for kind in types:
        if kind not in by_kind:
            raise UnsupportedModelError(
                f"{hf.model_type}: layer type {kind!r} is not supported"
                + (" without an attention_chunk_size" if kind == "chunked_attention" else "")
            )
    windows = tuple(by_kind[kind] for kind in types)
    return windows if any(windows) else ()


_FAMILIES: dict[str, tuple[frozenset[str], Callable[[Any], dict[str, Any]]]] = {
    "opt": (
        frozenset(
            {
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "ffn_dim",
                "num_attention_heads",
                "max_position_embeddings",
                "do_layer_norm_before",
                "word_embed_proj_dim",
                "activation_function",
                "enable_bias",
                "layer_norm_elementwise_affine",
                "tie_word_embeddings",
                "bos_token_id",
            }
        ),
        _opt,
    ),
    "llama": (_COMMON | {"attention_bias", "mlp_bias"}, _llama),
    "mistral": (_COMMON | _WINDOWS, _llama),
    "qwen2": (_COMMON | _WINDOWS, _llama),
    "qwen3": (_COMMON | _WINDOWS | {"attention_bias"}, _llama),
    "olmo2": (_COMMON | {"attention_bias"}, _llama),
    "olmo3": (_COMMON | _WINDOWS | {"attention_bias"}, _olmo3),
    "smollm3": (
        _COMMON
        | _WINDOWS
        | {"attention_bias", "mlp_bias", "no_rope_layers", "no_rope_layer_interval"},
        _smollm3,
    ),
    "phi3": (_COMMON | _WINDOWS | {"original_max_position_embeddings"}, _llama),
    "mixtral": (_COMMON | _WINDOWS | _MOE, _moe),
    "qwen2_moe": (_COMMON | _WINDOWS | _MOE | _QWEN_MOE | {"qkv_bias"}, _moe),
    "qwen3_moe": (_COMMON | _WINDOWS | _MOE | _QWEN_MOE | {"attention_bias"}, _moe),
    "olmoe": (_COMMON | _MOE | {"attention_bias"}, _moe),
    "glm4_moe": (
        _COMMON | _MOE | _GROUPED_MOE | {"attention_bias", "use_qk_norm"},
        _glm4_moe,
    ),
    "deepseek_v3": (_COMMON | _MOE | _GROUPED_MOE | _MLA, _deepseek_v3),
    "gpt_oss": (
        _COMMON | _WINDOWS | _MOE | {"attention_bias", "swiglu_alpha", "swiglu_limit"},
        _gpt_oss,
    ),
    "llama4_text": (_COMMON | _MOE | _LLAMA4, _llama4_text),
    "qwen3_next": (_COMMON | _WINDOWS | _MOE | _QWEN_MOE | _GATED_DELTA_NET, _gated_delta_net),
    "qwen3_5_text": (_COMMON | {"layer_types"} | _GATED_DELTA_NET, _gated_delta_net),
    "qwen3_5_moe_text": (
        _COMMON | {"layer_types"} | _MOE | {"shared_expert_intermediate_size"} | _GATED_DELTA_NET,
        _gated_delta_net,
    ),
    "granitemoehybrid": (_COMMON | _GRANITE_HYBRID, _granite_hybrid),
    "nemotron_h": (_NEMOTRON_H, _nemotron_h),
    "falcon_h1": (_FALCON_H1, _falcon_h1),
    "gemma2": (_COMMON | _WINDOWS | _GEMMA, _gemma),
    "gemma3_text": (_COMMON | _WINDOWS | _GEMMA, _gemma),
}
"""model_type -> (the config fields its reader honours, the reader)."""
