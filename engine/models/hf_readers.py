"""Readers of a transformers config -> `ModelConfig` fields: OPT, the Llama family and the
mixtures of experts built on it (the hybrids' in hf_hybrid_readers.py). Each family's row in
policy/families.py names its reader and the fields it honours; engine/models/hf_config.py
refuses the others before the reader runs."""

from __future__ import annotations

import math
from typing import Any

from engine.models.hf_config import UnsupportedModelError, refuse_unhonoured, require
from policy.config_fields import COMMON, MOE, QWEN_MOE, WINDOWS
from policy.families import FAMILIES, rope_types


def qwen2_5_vl(hf: Any) -> dict[str, Any]:
    """Qwen2.5-VL: a Qwen2 language model (M-RoPE over the sections `mrope_section` of its
    rotary frequencies) with its vision tower (engine/models/qwen2_5_vision.py)."""
    require(hf.vision_config, "hidden_act", ("silu",))
    return dict(_vision_language(hf, COMMON | WINDOWS), qkv_bias=True)  # Qwen2's q, k, v biases


def qwen3_vl(hf: Any) -> dict[str, Any]:
    """Qwen3-VL: a Qwen3 language model (q and k norms; M-RoPE with the sections' frequencies
    interleaved) with its vision tower (engine/models/qwen3_vision.py) and DeepStack."""
    require(hf.vision_config, "hidden_act", ("gelu_pytorch_tanh",))
    return _vision_language(hf, COMMON | WINDOWS | {"attention_bias"})


def qwen3_vl_moe(hf: Any) -> dict[str, Any]:
    """Qwen3-VL-MoE: Qwen3-VL whose language model's MLPs are Qwen3-MoE's (a softmax router's
    top k, always renormalised; dense MLPs on the layers `mlp_only_layers` and
    `decoder_sparse_step` leave out)."""
    require(hf.vision_config, "hidden_act", ("gelu_pytorch_tanh",))
    fields = _vision_language(hf, COMMON | WINDOWS | MOE | QWEN_MOE | {"attention_bias"})
    experts = moe(hf.text_config)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "dense_layers"):
        fields[key] = experts[key]
    return dict(fields, norm_topk_prob=True)


def _vision_language(hf: Any, honoured: frozenset[str]) -> dict[str, Any]:
    """The fields of a Qwen-VL checkpoint: its text config's (each field off its default
    honoured or refused), its M-RoPE sections, its vision tower's shapes, its image token."""
    from engine.models.vision_config import VisionConfig

    text, vision = hf.text_config, hf.vision_config
    refuse_unhonoured(text, honoured)
    require(vision, "in_chans" if hasattr(vision, "in_chans") else "in_channels", (3,))
    fields = llama(text)
    scaling = dict(fields["rope_scaling"])
    section = tuple(int(s) for s in scaling.pop("mrope_section", ()))
    scaling.pop("mrope_interleaved", None)  # transformers interleaves Qwen3-VL's either way
    if 2 * sum(section) != fields["head_dim"]:
        raise UnsupportedModelError(
            f"{hf.model_type}: mrope_section {list(section)} does not cover head_dim "
            f"{fields['head_dim']} (its sections sum to half the head)"
        )
    tied = getattr(hf, "tie_word_embeddings", None)
    return dict(
        fields,
        model_type=hf.model_type,
        rope_scaling=scaling,
        mrope_section=section,
        vision=VisionConfig.from_hf(vision),
        image_token_id=int(hf.image_token_id),
        tie_word_embeddings=bool(text.tie_word_embeddings if tied is None else tied),
    )


def gemma3(hf: Any) -> dict[str, Any]:
    """Gemma 3 with its vision tower: the Gemma 3 language model (`gemma`), a SigLIP encoder and
    the avg-pool projector (engine/models/gemma3_vision.py); an image's tokens attend to each
    other both ways."""
    from engine.models.vit_config import ViTConfig

    text, vision = hf.text_config, hf.vision_config
    refuse_unhonoured(text, FAMILIES["gemma3_text"].honoured or COMMON)
    # SigLIP's pooling head, where present, is not used: Gemma 3 reads its last hidden state
    require(vision, "num_channels", (3,))
    fields = gemma(text)
    tied = getattr(hf, "tie_word_embeddings", None)
    return dict(
        fields,
        model_type="gemma3",
        vision=ViTConfig.from_hf(vision, text.hidden_size, int(hf.mm_tokens_per_image)),
        image_token_id=int(hf.image_token_id),
        bidirectional_images=True,
        tie_word_embeddings=bool(text.tie_word_embeddings if tied is None else tied),
    )


def llama_text_config(hf: Any) -> Any:
    """A vision model's `text_config`, which must be a Llama one with only the fields the
    llama family honours (LLaVA's, Idefics3's and SmolVLM's)."""
    text = hf.text_config
    if text.model_type != "llama":
        raise UnsupportedModelError(
            f"{hf.model_type}: a {text.model_type} language model (text_config.model_type) is "
            "not supported; nanoflex runs it with a llama one"
        )
    refuse_unhonoured(text, FAMILIES["llama"].honoured or COMMON)
    return text


def llava(hf: Any) -> dict[str, Any]:
    """LLaVA: a Llama language model, a CLIP tower read at `vision_feature_layer` and a
    linear-GELU-linear projector (engine/models/llava.py); image tokens attend causally."""
    from engine.models.vit_config import ViTConfig

    text, vision = llama_text_config(hf), hf.vision_config
    require(vision, "model_type", ("clip_vision_model",))
    require(vision, "num_channels", (3,))
    require(hf, "vision_feature_select_strategy", ("default", "full"))
    require(hf, "projector_hidden_act", ("gelu",))
    layer = hf.vision_feature_layer
    if not isinstance(layer, int) or not -vision.num_hidden_layers <= layer <= -1:
        raise UnsupportedModelError(
            f"llava: vision_feature_layer {layer!r} is not supported (one negative layer "
            f"index from -1 to -{vision.num_hidden_layers})"
        )
    full = hf.vision_feature_select_strategy == "full"
    patches = (vision.image_size // vision.patch_size) ** 2
    tied = getattr(hf, "tie_word_embeddings", None)
    return dict(
        llama(text),
        model_type="llava",
        vision=ViTConfig.from_hf(
            vision,
            text.hidden_size,
            patches + full,
            class_token=True,
            feature_layer=layer,
            keep_class_token=full,
            projector="mlp",
            projector_act=hf.projector_hidden_act,
        ),
        image_token_id=int(hf.image_token_id),
        tie_word_embeddings=bool(text.tie_word_embeddings if tied is None else tied),
    )


def opt(hf: Any) -> dict[str, Any]:
    """OPT: learned positions, LayerNorm, a ReLU MLP, biases everywhere."""
    require(hf, "activation_function", ("relu",))
    require(hf, "layer_norm_elementwise_affine", (True,))
    return dict(
        shapes(hf),
        intermediate_size=hf.ffn_dim,
        num_kv_heads=hf.num_attention_heads,
        head_dim=hf.hidden_size // hf.num_attention_heads,
        norm_eps=1e-5,
        do_layer_norm_before=hf.do_layer_norm_before,
        word_embed_proj_dim=hf.word_embed_proj_dim or hf.hidden_size,
        activation="relu",
        enable_bias=getattr(hf, "enable_bias", True),
    )


def llama(hf: Any) -> dict[str, Any]:
    """The fields every Llama-family model has: shapes, norms, rotary, windows, biases."""
    require(hf, "hidden_act", ("silu",))
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


def moe(hf: Any) -> dict[str, Any]:
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
        llama(hf),
        num_experts=int(num_experts or 0),
        num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(width),
        norm_topk_prob=hf.model_type == "mixtral" or bool(getattr(hf, "norm_topk_prob", False)),
        shared_expert_intermediate_size=int(getattr(hf, "shared_expert_intermediate_size", 0)),
        dense_layers=tuple(dense),
    )


def grouped_routing(hf: Any) -> dict[str, Any]:
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
        grouped_routing(hf),
        moe_intermediate_size=width,
        shared_expert_intermediate_size=width * int(hf.n_shared_experts or 0),
        dense_layers=tuple(range(first_dense)),
    )


def glm4_moe(hf: Any) -> dict[str, Any]:
    """GLM-4.5/4.6: Llama attention with q/k/v biases (o_proj none), partial rotary, optional
    per-head q/k norms; the grouped MoE."""
    return dict(llama(hf), o_bias=False, **_grouped_moe(hf))


def deepseek_v3(hf: Any) -> dict[str, Any]:
    """DeepSeek-V3 / R1: multi-head latent attention (engine/models/deepseek.py: the KV row is
    one head of kv_lora_rank + qk_rope_head_dim, queries absorbed into the latent), scores
    scaled by qk_head_dim ** -0.5 times YaRN's mscale(factor, mscale_all_dim) squared; the
    grouped MoE."""
    require(hf, "hidden_act", ("silu",))
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
        shapes(hf),
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


def gpt_oss(hf: Any) -> dict[str, Any]:
    """gpt-oss: Llama's shapes, biases and windows (`layer_types`), YaRN; top-k of
    `num_local_experts` experts as wide as `intermediate_size`, the clamped SwiGLU's alpha and
    limit. Its MXFP4 experts (`*_blocks`, `*_scales`) are dequantized at load
    (engine/loading/mxfp4.py)."""
    return dict(
        llama(hf),
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


def llama4_text(hf: Any) -> dict[str, Any]:
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
        llama(hf),
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


def gemma(hf: Any) -> dict[str, Any]:
    """Gemma 2 and 3: GeGLU, query_pre_attn_scalar, soft-capping, per-layer windows (and
    Gemma 3's local rotary base)."""
    require(hf, "hidden_activation", ("gelu_pytorch_tanh",))
    require(hf, "use_bidirectional_attention", (None, False))
    if hf.model_type == "gemma3_text":  # transformers' Gemma 3 never applies it
        require(hf, "attn_logit_softcapping", (None,))
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


def olmo3(hf: Any) -> dict[str, Any]:
    """OLMo 3: OLMo 2's layer with sliding windows on three layers of four and a rotary per
    layer type (YaRN on the full-attention layers of the long-context checkpoints)."""
    require(hf, "hidden_act", ("silu",))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return dict(
        _llama_shapes(hf, head_dim),
        **_typed_rope(hf, head_dim),
        qkv_bias=bool(hf.attention_bias),
        o_bias=bool(hf.attention_bias),
        layer_windows=_layer_windows(hf),
    )


def smollm3(hf: Any) -> dict[str, Any]:
    """SmolLM3: the Llama layer, with no rotary on the layers `no_rope_layers` marks 0 (every
    fourth by default: NoPE)."""
    flags = list(hf.no_rope_layers)[: hf.num_hidden_layers]
    if len(flags) < hf.num_hidden_layers:
        raise UnsupportedModelError(
            f"smollm3: no_rope_layers has {len(flags)} entries for {hf.num_hidden_layers} layers"
        )
    return dict(llama(hf), nope_layers=tuple(i for i, rope in enumerate(flags) if not rope))


def shapes(hf: Any) -> dict[str, Any]:
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
        shapes(hf),
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
    if rope_type not in rope_types(hf.model_type):
        raise UnsupportedModelError(
            f"{hf.model_type}: rope scaling type {rope_type!r} is not supported (nanoflex "
            f"implements {', '.join(rope_types(hf.model_type))} for this family)"
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
