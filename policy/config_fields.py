"""The transformers config fields each family's reader honours (engine/models/hf_readers.py).

Plain names, no transformers: the family table (policy/families.py) holds each family's set,
and the engine refuses any other field set away from its default (engine/models/hf_config.py).
"""

from __future__ import annotations

COMMON = frozenset(
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
"""Fields every Llama-family reader honours (the rotary ones through hf_readers' `_rope`)."""

WINDOWS = frozenset({"sliding_window", "layer_types", "use_sliding_window", "max_window_layers"})
"""Fields that say which layers have which sliding window (read through `layer_types`)."""

MOE = frozenset(
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
"""Fields every mixture-of-experts reader honours (`moe`)."""
QWEN_MOE = frozenset({"decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"})
"""Qwen2/3-MoE: which layers are dense, the shared expert (`moe`)."""

GEMMA = frozenset(
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
"""Gemma 2 and 3: GeGLU, the score scale and soft-caps, the window pattern, the local rotary."""

GROUPED_MOE = frozenset(
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

MLA = frozenset(
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
"""DeepSeek-V3's multi-head latent attention."""

LLAMA4 = frozenset(
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
"""Llama 4 (text): dense and MoE layers, NoPE layers, chunked attention, q/k L2 norms,
the attention temperature."""

GATED_DELTA_NET = frozenset(
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

GRANITE_HYBRID = frozenset(
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
"""Granite 4 hybrid: Mamba-2 layers beside attention, Granite's scalings, a shared MLP and
experts."""

NEMOTRON_H = COMMON | frozenset(  # its config class has no rotary or rms_norm_eps fields
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
"""Nemotron-H: its mixer kinds per layer, Mamba-2, squared-ReLU MLPs and grouped experts."""

FALCON_H1 = COMMON | frozenset(
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
"""Falcon-H1: attention and Mamba-2 side by side in every layer, and the muP multipliers."""

OPT = frozenset(
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
)
"""OPT's fields (its reader reads no rotary and no windows)."""
