"""Tiny random checkpoints written by transformers, and transformers' own greedy output for them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import pytest

MAX_TOKENS = 8
"""Greedy tokens generated per prompt in the correctness tests."""
_MOE_SHAPE: dict[str, object] = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
"""What the tiny mixture-of-experts checkpoints share: GQA, an untied head, weights large
enough that the layers, not the embedding, decide the tokens."""
_HYBRID_SHAPE: dict[str, object] = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    initializer_range=0.1,
)
"""What the tiny hybrid checkpoints share (tests/engine/executor/test_hybrids.py)."""
_GRANITE_SHAPE: dict[str, object] = dict(
    model_type="granitemoehybrid",
    vocab_size=211,
    hidden_size=64,
    intermediate_size=40,
    shared_intermediate_size=56,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.3,
    logits_scaling=2.0,
    initializer_range=0.1,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
_NEMOTRON_H_SHAPE: dict[str, object] = dict(
    model_type="nemotron_h",
    vocab_size=211,
    hidden_size=64,
    intermediate_size=80,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=8,
    conv_kernel=4,
    chunk_size=16,
    initializer_range=0.1,
)
"""What the tiny Nemotron-H checkpoints share."""
_NEMOTRON_H_MOE: dict[str, object] = dict(
    _NEMOTRON_H_SHAPE,
    num_hidden_layers=6,
    layers_block_type=[
        "linear_attention",
        "moe",
        "full_attention",
        "mlp",
        "linear_attention",
        "moe",
    ],
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=40,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)
"""What the tiny Nemotron-H MoE checkpoints share."""
_FALCON_H1_SHAPE: dict[str, object] = dict(
    model_type="falcon_h1",
    vocab_size=211,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_bias=True,
    projectors_bias=True,
    mamba_d_ssm=96,
    mamba_n_heads=6,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    embedding_multiplier=1.5,
    lm_head_multiplier=0.5,
    key_multiplier=0.7,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.8,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.6,
    ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7],
    mlp_multipliers=[1.4, 0.6],
    initializer_range=0.1,
)
"""What the tiny Falcon-H1 checkpoints share."""
TINY_CONFIGS: dict[str, dict[str, object]] = {
    # OPT: pre-norm, ReLU, learned positions, tied embeddings, head_dim 12
    "opt": dict(
        model_type="opt",
        vocab_size=251,
        hidden_size=48,
        num_hidden_layers=3,
        ffn_dim=80,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=48,
    ),
    # Llama with GQA (6 heads over 2 KV heads), untied embeddings, odd sizes
    "llama": dict(
        model_type="llama",
        vocab_size=307,
        hidden_size=72,
        intermediate_size=100,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    # Llama 3.1-style rope scaling, tied embeddings
    "llama3": dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Qwen2: q/k/v biases
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=280,
        hidden_size=64,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    # Mistral with a sliding window shorter than the test sequences
    "mistral": dict(
        model_type="mistral",
        vocab_size=260,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=24,
        tie_word_embeddings=False,
    ),
    # Mistral with an explicit head_dim (24, not hidden / heads: Mistral Nemo's kind)
    "mistral-head-dim": dict(
        model_type="mistral",
        vocab_size=250,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        sliding_window=16,
        tie_word_embeddings=False,
    ),
    # Qwen 3: q/k norms per head, head_dim 32 (not hidden / heads), the last two of three
    # layers with a sliding window, untied head
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=12,
        max_window_layers=1,
        tie_word_embeddings=False,
        initializer_range=0.2,
    ),
    # Qwen 3 as the small checkpoints ship: tied head, no window
    "qwen3-tied": dict(
        model_type="qwen3",
        vocab_size=290,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.2,
    ),
    # Gemma 2: local and global layers alternating, score soft-capping (biting: q and k are
    # scaled up, SCALED_WEIGHTS), query_pre_attn_scalar != head_dim, final soft-capping
    "gemma2": dict(
        model_type="gemma2",
        vocab_size=310,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        query_pre_attn_scalar=24,
        sliding_window=10,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
    ),
    # Gemma 3 (text): q/k norms, local layers (their own rotary base) around one global
    # layer (linear rope scaling), query_pre_attn_scalar != head_dim, final soft-capping
    "gemma3": dict(
        model_type="gemma3_text",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        query_pre_attn_scalar=32,
        sliding_window=10,
        layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
        final_logit_softcapping=5.0,
    ),
    # Gemma 3 4B and up ship with a vision tower: its language model runs (tiny SigLIP beside)
    "gemma3-vision": dict(
        model_type="gemma3",
        text_config=dict(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            query_pre_attn_scalar=32,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        boi_token_index=290,
        eoi_token_index=291,
        image_token_index=292,
    ),
    # Phi-4-mini's shape: fused qkv and gate_up, GQA, partial rotary (12 of 16 dims), LongRoPE
    # short factors, tied head, a window on every layer
    "phi3": dict(
        model_type="phi3",
        vocab_size=330,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        original_max_position_embeddings=256,
        partial_rotary_factor=0.75,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0, 1.5, 2.0, 3.0, 4.0, 6.0],
            long_factor=[2.0, 3.0, 5.0, 8.0, 12.0, 16.0],
            initializer_range=0.2,
        ),
        sliding_window=20,
        tie_word_embeddings=True,
    ),
    # LongRoPE switching to its long factors at position 32: prompts stay at or under it
    # (PROMPT_LENS), generation crosses it (see STEPWISE); untied head, no window
    "phi3-long": dict(
        model_type="phi3",
        vocab_size=270,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        original_max_position_embeddings=32,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0] * 8,
            long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
        ),
        tie_word_embeddings=False,
    ),
    # OLMo 2: norms after attention and MLP, q/k norms over all heads
    "olmo2": dict(
        model_type="olmo2",
        vocab_size=340,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,
    ),
    # SmolLM3: NoPE on layers 1 and 3 (no_rope_layers 0), a window on those two only (its
    # config class puts windows on NoPE layers), tied head
    "smollm3": dict(
        model_type="smollm3",
        vocab_size=310,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        no_rope_layers=[1, 0, 1, 0],
        use_sliding_window=True,
        sliding_window=12,
        tie_word_embeddings=True,
        initializer_range=0.2,
    ),
    # OLMo 3: OLMo 2's layer, windows on three layers of four (its default layer_types), YaRN
    # on the full-attention layer, the sliding ones with a base of their own
    "olmo3": dict(
        model_type="olmo3",
        vocab_size=330,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=10,
        rope_parameters=dict(
            full_attention=dict(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=5e5
            ),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
        tie_word_embeddings=False,
        initializer_range=0.2,
    ),
    # Mixtral: 8 experts, top-2 (always renormalised)
    "mixtral": dict(
        _MOE_SHAPE, model_type="mixtral", vocab_size=256, intermediate_size=48, num_local_experts=8
    ),
    # Qwen2-MoE: qkv bias, top-2 of 8 unnormalised, a shared expert behind its sigmoid gate,
    # layer 1 dense (mlp_only_layers)
    "qwen2_moe": dict(
        _MOE_SHAPE,
        model_type="qwen2_moe",
        vocab_size=270,
        intermediate_size=80,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # Qwen3-MoE: per-head q/k norms, head_dim 32, 16 small experts, top-4 renormalised, every
    # second layer sparse (decoder_sparse_step 2: layers 1 and 3)
    "qwen3_moe": dict(
        _MOE_SHAPE,
        model_type="qwen3_moe",
        vocab_size=290,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    ),
    # OLMoE: q/k norms over the whole projections, top-2 of 8 unnormalised
    "olmoe": dict(
        _MOE_SHAPE, model_type="olmoe", vocab_size=300, intermediate_size=40, num_experts=8
    ),
    # GLM-4.5: 16 experts in 4 groups, top-4 from the best 2 groups, sigmoid scores with a
    # correction bias (random here: build_from_spec), renormalised and scaled by 2.5, one
    # shared expert, layer 0 dense; q/k/v biases, per-head q/k norms, head_dim 24 (not
    # hidden / heads) of which half rotates
    "glm4_moe": dict(
        _MOE_SHAPE,
        model_type="glm4_moe",
        vocab_size=280,
        intermediate_size=96,
        moe_intermediate_size=24,
        head_dim=24,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
    ),
    # DeepSeek-V3: MLA (q through a rank-24 latent, kv through a rank-32 one, 8 rotary dims
    # interleaved, YaRN with mscale), 16 experts in 4 groups, top-4 from the best 2, one
    # shared expert, layer 0 dense
    "deepseek_v3": dict(
        _MOE_SHAPE,
        model_type="deepseek_v3",
        vocab_size=290,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
    # gpt-oss: sinks per head, sliding and full layers alternating (window 10), YaRN without
    # truncation, top-2 of 8 experts with biases and the clamped SwiGLU (limit low enough to
    # clamp), q/k/v/o biases
    "gpt_oss": dict(
        _MOE_SHAPE,
        model_type="gpt_oss",
        vocab_size=300,
        intermediate_size=32,
        head_dim=16,
        num_local_experts=8,
        num_hidden_layers=4,
        sliding_window=10,
        swiglu_limit=1.5,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=64,
        ),
    ),
    # Llama 4 (Maverick's pattern): chunked attention (chunks of 8) on the rotary layers with
    # interleaved pairs and L2 q/k norms, a NoPE layer of four with full attention and its
    # temperature tuned early (floor_scale 4), MoE on every other layer (top-1 of 4 by
    # sigmoid, scaling the expert's input, and a shared expert), dense layers of another width
    "llama4_text": dict(
        _MOE_SHAPE,
        model_type="llama4_text",
        vocab_size=300,
        num_hidden_layers=4,
        intermediate_size=32,
        intermediate_size_mlp=48,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=8,
        floor_scale=4,
        attn_scale=0.5,
    ),
    # Qwen3-Next: Gated DeltaNet layers (value heads twice the key heads, grouped projections)
    # beside a gated attention layer with partial rotary; a MoE MLP with a gated shared expert
    # on every layer but one dense (mlp_only_layers)
    "qwen3_next": dict(
        _HYBRID_SHAPE,
        model_type="qwen3_next",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    ),
    # Qwen3.5 dense: the same layers, projections stored apart, its multimodal rotary over
    # text positions
    "qwen3_5": dict(
        _HYBRID_SHAPE,
        model_type="qwen3_5_text",
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    # Qwen3.5 MoE
    "qwen3_5_moe": dict(
        _HYBRID_SHAPE,
        model_type="qwen3_5_moe_text",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    ),
    # Granite 4 hybrid: Mamba-2 layers (2 B/C groups, a chunk of 16 so prompts span several)
    # beside a NoPE attention layer, Granite's multipliers, routed experts beside the shared MLP
    "granite4": dict(_GRANITE_SHAPE, num_local_experts=4, num_experts_per_tok=2),
    # Granite 4 hybrid dense, with rotary
    "granite4-dense": dict(_GRANITE_SHAPE, num_local_experts=0, position_embedding_type="rope"),
    # Nemotron-H: Mamba-2, MLP-only (squared ReLU) and attention layers, one mixer each
    "nemotron_h": dict(
        _NEMOTRON_H_SHAPE,
        num_hidden_layers=5,
        layers_block_type=[
            "linear_attention",
            "mlp",
            "full_attention",
            "mlp",
            "linear_attention",
        ],
    ),
    # Nemotron 3 (Nano's pattern): MoE layers of squared-ReLU experts (top-2 of 8 by grouped
    # sigmoid routing, 2 groups, renormalised and scaled) beside a shared MLP
    "nemotron_h-moe": dict(_NEMOTRON_H_MOE),
    # Nemotron 3 Super's latent MoE: the experts over a 32-wide latent
    "nemotron_h-latent": dict(_NEMOTRON_H_MOE, moe_latent_size=32),
    # Falcon-H1: attention (head_dim apart from hidden / heads, biases) and Mamba-2 (an inner
    # width of its own, the gated norm with the gate after it) in every layer, every muP
    # multiplier away from 1
    "falcon_h1": dict(_FALCON_H1_SHAPE, mamba_rms_norm=True, mamba_norm_before_gate=True),
    # Falcon-H1 as the 0.5B ships: the mixer's output gated alone, without a norm
    "falcon_h1-plain": dict(_FALCON_H1_SHAPE, mamba_rms_norm=False),
}
for _text in ("qwen3_5", "qwen3_5_moe"):  # Qwen3.5 as published: beside a tiny vision tower
    TINY_CONFIGS[f"{_text}-vision"] = dict(
        model_type=_text,
        text_config=TINY_CONFIGS[_text],
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=4,
            num_position_embeddings=16,
            out_hidden_size=TINY_CONFIGS[_text]["hidden_size"],
        ),
    )
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
"""The tiny mixture-of-experts checkpoints (tests/engine/executor/test_moe.py)."""
NEW_FAMILIES = ("qwen3", "qwen3-tied", "gemma2", "gemma3", "phi3", "olmo2")
"""The tiny checkpoints of the families issue 27 added (phi3-long has tests of its own)."""
DENSE_2025 = ("smollm3", "olmo3")
"""The dense families of issue 37 (tests/engine/executor/test_smollm3_olmo3.py)."""
GROUPED_MOE_FAMILIES = ("glm4_moe", "deepseek_v3")
"""The tiny checkpoints of the grouped-routing MoE families (tests/engine/executor/
test_grouped_moe.py)."""
HYBRIDS = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5-vision",
    "qwen3_5_moe-vision",
    "granite4",
    "granite4-dense",
    "nemotron_h",
    "nemotron_h-moe",
    "nemotron_h-latent",
    "falcon_h1",
    "falcon_h1-plain",
)
"""The tiny hybrid checkpoints (tests/engine/executor/test_hybrids.py)."""
GPT_OSS = "gpt_oss"
"""The tiny gpt-oss checkpoint (tests/engine/executor/test_moe_giants.py, test_gpt_oss.py)."""
LLAMA4 = "llama4_text"
"""The tiny Llama 4 checkpoint (tests/engine/executor/test_moe_giants.py, test_llama4.py)."""
SCALED_WEIGHTS: dict[str, dict[str, float]] = {
    "gemma2": {"q_proj": 12.0, "k_proj": 12.0},
    "phi3": {"_proj": 10.0},
}
"""kind -> {name part: factor}: weights scaled up after init: Gemma 2's q and k, so that
attention scores are large enough for soft-capping to change them; Phi-3's projections, so
that the layers outweigh the tied embedding (a tied head with transformers' init otherwise
echoes the last token, whatever attention does; the others get `initializer_range`)."""
PROMPT_LENS: dict[str, tuple[int, int]] = {"phi3-long": (2, 32)}
"""kind -> (shortest, longest) reference prompt, where not (2, 40): LongRoPE's prompts stay at
or under original_max_position_embeddings, where transformers' choice of factors per forward
call and ours per position agree (engine/models/rotary.py)."""
STEPWISE = frozenset({"phi3-long"})
"""Kinds whose reference is transformers' model stepped token by token over its cache
(`hf_greedy_stepwise`), not generate(): Phi-3's generate() throws the cache away and
recomputes the whole sequence with the long factors once it grows past
original_max_position_embeddings, where each position keeps the factors it was computed with,
in transformers' own forward with a cache as in nanoflex."""


def built_once(
    build: Callable[[str, Path], Path], factory: pytest.TempPathFactory, prefix: str
) -> Callable[[str], Path]:
    """kind -> the checkpoint `build` writes for it, built on first use into a directory of
    `factory`'s (the fixtures of tiny checkpoints)."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build(kind, factory.mktemp(f"{prefix}-{kind}"))
        return built[kind]

    return get


def build_tiny(kind: str, path: Path, seed: int = 0) -> Path:
    spec = TINY_CONFIGS[kind]
    spec = dict(spec, **older_transformers_fields(str(spec["model_type"])))
    return build_from_spec(spec, path, seed, SCALED_WEIGHTS.get(kind, {}))


def older_transformers_fields(model_type: str) -> dict[str, object]:
    """Config values under which the installed transformers computes `model_type` as nanoflex
    does, where it is an older one that computes the tiny configs' values otherwise: before
    5.2x, Granite 4's gated RMSNorm normalized all its channels at once (Granite's kernels,
    mamba_ssm's, nanoflex and transformers 5.24: each of `mamba_n_groups` groups), and
    gpt-oss's SwiGLU took alpha 1.702 and limit 7.0 as constants whatever the config said. The
    GPU machine's transformers 5.17 is one (its reference differed from the first token on);
    the released checkpoints have one group and limit 7.0, where all versions agree. Empty
    with a transformers that has both."""
    import inspect

    if model_type == "granitemoehybrid":
        from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite

        init = inspect.signature(granite.GraniteMoeHybridRMSNormGated.__init__)
        return {} if "group_size" in init.parameters else {"mamba_n_groups": 1}
    if model_type == "gpt_oss":
        from transformers import GptOssConfig

        return {} if hasattr(GptOssConfig, "swiglu_limit") else {"swiglu_limit": 7.0}
    return {}


def build_from_spec(
    spec: dict[str, object],
    path: Path,
    seed: int = 0,
    scaled: dict[str, float] | None = None,
    **ids: int | None,
) -> Path:
    """A random checkpoint of transformers' config `spec` (with its model_type) saved at
    `path`; `scaled`: {name part: factor} for weights to scale up after init; `ids`: bos, eos
    and pad token ids (default 1, 2, 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    spec = dict(spec)
    model_type = str(spec.pop("model_type"))
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **ids}
    config = AutoConfig.for_model(model_type, **ids, **spec)
    torch.manual_seed(seed)
    # a checkpoint with a vision tower is written whole, as the hub ships it (for Qwen3.5,
    # AutoModelForCausalLM would build the language model alone)
    auto = AutoModelForImageTextToText if "vision_config" in spec else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initializes biases and norms to constants; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("sinks"):  # gpt-oss's sink logits, about as large as scores
                p.copy_(torch.randn_like(p))
            for part, factor in (scaled or {}).items():
                if part in name:
                    p.mul_(factor)
        for name, b in model.named_buffers():  # DeepSeek's and GLM's routing correction
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    return path


def vocab_size(kind: str) -> int:
    """The vocabulary of TINY_CONFIGS[kind] (its text_config's, with a vision tower)."""
    spec = TINY_CONFIGS[kind]
    text = spec.get("text_config")
    config: dict[str, Any] = text if isinstance(text, dict) else spec
    return int(config["vocab_size"])


def hf_reference(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of `model_dir`, the reference: with its eager attention where the
    config soft-caps attention scores. transformers 5.17 gives Gemma 2 SDPA by default, which
    drops the cap (5.24 refuses SDPA for it): the first H200 run's reference diverged from
    5.24's, and from nanoflex's, at the first token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    text = getattr(config, "text_config", None) or config
    eager = (
        {"attn_implementation": "eager"} if getattr(text, "attn_logit_softcapping", None) else {}
    )
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **eager)


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own generate(), greedy, EOS ignored: the reference tokens."""
    model = hf_reference(model_dir)
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def hf_greedy_stepwise(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own model, greedy: the prompt in one forward pass, then one token at a
    time over its cache at explicit positions."""
    from transformers import DynamicCache

    model = hf_reference(model_dir)
    out: list[int] = []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([prompt])
        positions = torch.arange(len(prompt))[None]
        for _ in range(max_new_tokens):
            logits = model(ids, position_ids=positions, cache=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            positions = positions[:, -1:] + 1
            ids = torch.tensor([[out[-1]]])
    return out


def random_prompts(num: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
