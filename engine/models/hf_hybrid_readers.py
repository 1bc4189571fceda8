"""Readers of a transformers config -> `ModelConfig` fields for the hybrids, whose state layers
sit beside (or inside) attention layers: Qwen3-Next and Qwen3.5 (Gated DeltaNet), Granite 4,
Nemotron-H and Falcon-H1 (Mamba-2). Named by their rows in policy/families.py."""

from __future__ import annotations

from typing import Any

from engine.models.hf_config import UnsupportedModelError, require
from engine.models.hf_readers import grouped_routing, llama, moe, shapes
from engine.models.multipliers import Multipliers


def gated_delta_net(hf: Any) -> dict[str, Any]:
    """Qwen3-Next and Qwen3.5 (dense and MoE): `layer_types` marks each layer
    'linear_attention' (Gated DeltaNet, engine/models/qwen3_next.py) or 'full_attention'
    (attention with per-head q/k norms, partial rotary and a sigmoid output gate); the MLP is
    Qwen2-MoE's (routed experts, a gated shared expert) or dense."""
    require(hf, "attention_bias", (False,))
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
    fields = moe(hf) if getattr(hf, "num_experts", 0) else llama(hf)
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


def granite_hybrid(hf: Any) -> dict[str, Any]:
    """Granite 4 hybrid: Mamba-2 layers ('linear_attention' in `layer_types`) beside
    attention layers (no rotary unless `position_embedding_type` is 'rope'; scores scaled by
    `attention_multiplier`), Granite's embedding, residual and logit scalings, a shared
    SwiGLU on every layer and, with `num_local_experts`, routed experts (top-k logits
    softmaxed among themselves) beside it."""
    require(hf, "position_embedding_type", (None, "rope"))
    types = list(hf.layer_types)
    experts = int(hf.num_local_experts or 0)
    fields = dict(
        llama(hf),
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


def nemotron_h(hf: Any) -> dict[str, Any]:
    """Nemotron-H: each layer one mixer after an RMSNorm (weights multiplied in float32), added
    to the residual stream: Mamba-2 ('linear_attention'), attention without rotary
    ('full_attention'), an MLP of squared ReLU ('mlp') or routed experts of squared ReLU
    beside a shared one ('moe', Nemotron 3: grouped sigmoid routing, the experts optionally
    over a latent of `moe_latent_size`)."""
    types = list(hf.layers_block_type)
    require(hf, "mlp_hidden_act", ("relu2",))
    require(hf, "mamba_hidden_act", ("silu",))
    require(hf, "residual_in_fp32", (False,))
    _require_no_time_step_limit(hf)
    heads, head_dim = int(hf.mamba_num_heads), int(hf.mamba_head_dim)
    fields = dict(
        shapes(hf),
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
            grouped_routing(hf),
            moe_intermediate_size=int(hf.moe_intermediate_size),
            shared_expert_intermediate_size=int(hf.moe_shared_expert_intermediate_size),
            dense_layers=tuple(i for i, kind in enumerate(types) if kind != "moe"),
            moe_latent_size=int(hf.moe_latent_size or 0),
        )
    return fields


def falcon_h1(hf: Any) -> dict[str, Any]:
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
        llama(hf),
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
