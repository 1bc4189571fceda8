"""Reading a transformers config into `ModelConfig`: each family's fields, and refusal by name of
what the layer code does not honour."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pytest
from transformers import AutoConfig

from engine.core.model_files import context_length
from engine.models import build_model
from engine.models.config import ModelConfig
from engine.models.hf_config import UnsupportedModelError, refuse_unhonoured
from engine.models.vit_config import ViTConfig
from tests.engine.tiny_models import TINY_CONFIGS


def hf_config(kind: str, **changes: Any) -> Any:
    spec = {**TINY_CONFIGS[kind], **changes}
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def test_each_family_reads_its_own_fields() -> None:
    qwen3 = ModelConfig.from_hf(hf_config("qwen3"))
    assert (qwen3.head_dim, qwen3.layer_windows, qwen3.windows) == (32, (0, 12, 12), (0, 12))
    assert qwen3.shared_window == 0 and not qwen3.qkv_bias
    gemma2 = ModelConfig.from_hf(hf_config("gemma2"))
    assert gemma2.layer_windows == (10, 0, 10, 0) and gemma2.attn_scale == 24**-0.5
    assert (gemma2.attn_softcap, gemma2.logit_softcap) == (3.0, 5.0)
    assert gemma2.activation == "gelu_pytorch_tanh" and gemma2.tie_word_embeddings
    gemma3 = ModelConfig.from_hf(hf_config("gemma3"))
    assert gemma3.layer_windows == (10, 10, 0, 10) and gemma3.attn_softcap == 0.0
    assert gemma3.rope_theta == 1e6 and gemma3.local_rope_theta == 1e4
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    phi3 = ModelConfig.from_hf(hf_config("phi3"))
    assert (phi3.rotary_dim, phi3.layer_windows, phi3.shared_window) == (12, (20,) * 3, 20)
    assert phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["original_max_position_embeddings"] == 256
    olmo2 = ModelConfig.from_hf(hf_config("olmo2"))
    assert olmo2.layer_windows == () and olmo2.windows == (0,)


@pytest.mark.parametrize(
    ("kind", "changes", "named"),
    [
        ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        ("gemma2", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
        ("gemma3", dict(attn_logit_softcapping=20.0), "attn_logit_softcapping=20.0"),
        ("qwen3", dict(rope_parameters=dict(rope_type="yarn", factor=4.0)), "'yarn'"),
        ("olmo2", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("qwen3", dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
        ("gemma3", dict(layer_types=["chunked_attention"] * 4), "'chunked_attention'"),
        ("olmoe", dict(clip_qkv=8.0), "olmoe config field clip_qkv=8.0"),
        ("mixtral", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("granite4", dict(time_step_limit=(0.0, 2.0)), "time_step_limit=\\[0.0, 2.0\\]"),
        ("nemotron_h", dict(mlp_hidden_act="silu"), "mlp_hidden_act='silu'"),
        ("nemotron_h-moe", dict(n_group=3), "8 experts in n_group=3 groups"),
        ("falcon_h1", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("falcon_h1", dict(time_step_limit=(0.0, 2.0)), "time_step_limit=\\[0.0, 2.0\\]"),
        ("falcon_h1", dict(ssm_multipliers=[1.0, 1.0]), "ssm_multipliers needs 5 values"),
        ("qwen3_next", dict(attention_bias=True), "attention_bias=True"),
    ],
)
def test_what_is_not_honoured_is_refused_by_name(kind, changes, named) -> None:
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_hf(hf_config(kind, **changes))


def test_hybrids_read_their_layers_and_state_shapes() -> None:
    """Which decoder layers keep a state, which attend over KV pages, and one sequence's state
    bytes (a convolution window and a float32 recurrent state per state layer)."""
    qwen = ModelConfig.from_hf(hf_config("qwen3_next"))
    assert qwen.state_layers == (0, 1, 3) and qwen.kv_layers == (2,) and qwen.attn_output_gate
    assert qwen.conv_dim == 2 * 16 + 48 and qwen.recurrent_shape == (4, 8, 12)
    assert qwen.state_bytes(4) == 3 * (80 * 3 * 4 + 4 * 8 * 12 * 4)
    assert qwen.is_moe_layer(0) and not qwen.is_moe_layer(1)
    granite = ModelConfig.from_hf(hf_config("granite4"))
    assert granite.is_mamba and granite.state_layers == (0, 2, 3) and granite.kv_layers == (1,)
    assert granite.recurrent_shape == (8, 16, 8) and granite.conv_dim == 128 + 2 * 2 * 8
    assert granite.nope_layers == (0, 1, 2, 3) and granite.attn_scale == 0.3
    nemotron = ModelConfig.from_hf(hf_config("nemotron_h"))
    assert nemotron.mlp_layers == (1, 3) and nemotron.kv_layers == (2,)
    model = build_model(nemotron)
    assert [model.layer_kind(j) for j in range(7)] == [
        "embed", "state", "dense", "decoder", "dense", "state", "head"
    ]  # fmt: skip
    assert model.kv_layer(3) == 0


def test_nemotron_h_moe_layers_route_and_the_rest_do_not() -> None:
    """Nemotron 3's 'moe' layers are MLP-only ('dense') layers that route; its attention, Mamba-2
    and MLP layers do not (so no attention layer is taken for a MoE one)."""
    c = ModelConfig.from_hf(hf_config("nemotron_h-latent"))
    assert c.mlp_layers == (1, 3, 5) and c.kv_layers == (2,) and c.state_layers == (0, 4)
    assert [i for i in range(6) if c.is_moe_layer(i)] == [1, 5]
    assert (c.num_experts, c.num_experts_per_tok, c.num_expert_groups) == (8, 2, 2)
    assert c.routed_scaling_factor == 2.5 and c.norm_topk_prob and c.moe_latent_size == 32
    assert c.shared_expert_intermediate_size == 40
    model = build_model(c)
    assert [model.layer_kind(j) for j in range(1, 7)] == [
        "state", "dense", "decoder", "dense", "state", "dense"
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_published_configs_read_their_text_model(kind, caplog) -> None:
    """A published Qwen3.5 config wraps its text model's beside a vision tower: the text
    model is read (one log line says the tower is not), its head tied as the wrapper says."""
    with caplog.at_level(logging.INFO, logger="nanoflex.engine"):
        wrapped = ModelConfig.from_hf(hf_config(f"{kind}-vision"))
    assert wrapped == ModelConfig.from_hf(hf_config(kind))
    assert [r.getMessage() for r in caplog.records] == [
        f"{kind}: the vision tower is not loaded; nanoflex runs its {kind}_text language "
        "model on text"
    ]
    assert ModelConfig.from_hf(
        hf_config(f"{kind}-vision", tie_word_embeddings=True)
    ).tie_word_embeddings
    with pytest.raises(UnsupportedModelError, match="attention_bias=True"):
        text = {**TINY_CONFIGS[kind], "attention_bias": True}
        ModelConfig.from_hf(hf_config(f"{kind}-vision", text_config=text))


def test_falcon_h1_layers_attend_and_keep_a_state_each() -> None:
    """Every Falcon-H1 layer has KV pages and a state slot; its Mamba-2 is d_ssm wide, its
    gated norm as the config says, its multipliers read."""
    c = ModelConfig.from_hf(hf_config("falcon_h1"))
    assert c.parallel_hybrid and c.state_layers == c.kv_layers == (0, 1, 2)
    assert (c.mamba_inner, c.conv_dim, c.head_dim) == (96, 96 + 2 * 2 * 8, 24)
    assert c.mamba_gate == "norm_gate_f32" and c.qkv_bias and c.o_bias
    assert c.multipliers.ssm_zxbcdt == (0.9, 1.1, 0.8, 1.2, 0.7) and c.multipliers.key == 0.7
    assert (c.multipliers.mlp_gate, c.multipliers.mlp_down, c.embedding_multiplier) == (
        1.4,
        0.6,
        1.5,
    )
    assert ModelConfig.from_hf(hf_config("falcon_h1-plain")).mamba_gate == "gate"
    gate_first = hf_config("falcon_h1", mamba_norm_before_gate=False)
    assert ModelConfig.from_hf(gate_first).mamba_gate == "gate_norm_f32"
    model = build_model(c)
    kinds = [model.layer_kind(j) for j in range(1, 4)]
    assert kinds == ["decoder"] * 3 and all(model.has_state(j) for j in range(1, 4))
    assert [model.kv_layer(j) for j in range(1, 4)] == [0, 1, 2]


def test_any_field_off_its_default_that_no_family_reads_is_refused() -> None:
    config = hf_config("llama", mlp_bias=True)
    every_field = frozenset(config.to_dict())
    refuse_unhonoured(config, every_field)
    with pytest.raises(UnsupportedModelError, match=r"llama config field mlp_bias=True"):
        refuse_unhonoured(config, every_field - {"mlp_bias"})
    unknown = hf_config("qwen3", full_attn_mod=1)  # remote code's leftovers: transformers ignores
    ModelConfig.from_hf(unknown)


@pytest.mark.parametrize("model_type", ["gemma3n_text", "dbrx"])
def test_other_types_are_refused_by_name(model_type: str) -> None:
    with pytest.raises(UnsupportedModelError, match=f"model type '{model_type}' is not supported"):
        ModelConfig.from_hf(AutoConfig.for_model(model_type))


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("deepseek_v2", "group-limited routing"),
    ],
)
def test_unimplemented_mixtures_of_experts_are_refused_in_one_line(model_type, why) -> None:
    one_line = rf"^model type '{model_type}' is not supported: [^\n]*{why}[^\n]*gpt_oss$"
    with pytest.raises(UnsupportedModelError, match=one_line):
        ModelConfig.from_hf(AutoConfig.for_model(model_type))


def test_mixture_of_experts_families_read_their_fields() -> None:
    mixtral = ModelConfig.from_hf(hf_config("mixtral"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.moe_intermediate_size == 48 and mixtral.norm_topk_prob
    assert mixtral.dense_layers == () and mixtral.shared_expert_intermediate_size == 0
    qwen2 = ModelConfig.from_hf(hf_config("qwen2_moe"))
    assert (qwen2.moe_intermediate_size, qwen2.shared_expert_intermediate_size) == (32, 48)
    assert qwen2.dense_layers == (1,) and qwen2.qkv_bias and not qwen2.norm_topk_prob
    assert [qwen2.is_moe_layer(i) for i in range(3)] == [True, False, True]
    qwen3 = ModelConfig.from_hf(hf_config("qwen3_moe"))
    assert qwen3.dense_layers == (0, 2) and qwen3.norm_topk_prob and qwen3.head_dim == 32
    both = ModelConfig.from_hf(hf_config("qwen3_moe", mlp_only_layers=[1]))
    assert both.dense_layers == (0, 1, 2)
    olmoe = ModelConfig.from_hf(hf_config("olmoe"))
    assert (olmoe.num_experts, olmoe.moe_intermediate_size, olmoe.norm_topk_prob) == (8, 40, False)


def test_issue_37_families_read_their_fields() -> None:
    """SmolLM3's NoPE layers (and windows on them), OLMo 3's windows and rotary per layer
    type (YaRN on the global layers), GLM-4.5's grouped routing, DeepSeek-V3's latent
    attention (one KV head of the latent and the rotary key) and its scale."""
    smollm3 = ModelConfig.from_hf(hf_config("smollm3"))
    assert smollm3.nope_layers == (1, 3) and smollm3.layer_windows == (0, 12, 0, 12)
    assert ModelConfig.from_hf(hf_config("smollm3", use_sliding_window=False)).windows == (0,)
    olmo3 = ModelConfig.from_hf(hf_config("olmo3"))
    assert olmo3.layer_windows == (10, 10, 10, 0) and olmo3.local_rope_theta == 1e4
    assert olmo3.rope_theta == 5e5 and olmo3.rope_scaling["rope_type"] == "yarn"
    glm = ModelConfig.from_hf(hf_config("glm4_moe"))
    assert (glm.num_experts, glm.num_expert_groups, glm.num_groups_per_tok) == (16, 4, 2)
    assert glm.routed_scaling_factor == 2.5 and glm.dense_layers == (0,)
    assert glm.shared_expert_intermediate_size == 24 and glm.rotary_dim == 12
    assert glm.qkv_bias and not glm.o_bias
    with pytest.raises(UnsupportedModelError, match="n_group=3"):
        ModelConfig.from_hf(hf_config("glm4_moe", n_group=3))
    deepseek = ModelConfig.from_hf(hf_config("deepseek_v3"))
    assert (deepseek.num_kv_heads, deepseek.head_dim, deepseek.rotary_dim) == (1, 40, 8)
    assert (deepseek.kv_lora_rank, deepseek.qk_nope_head_dim, deepseek.v_head_dim) == (32, 16, 12)
    mscale = 0.1 * math.log(4.0) + 1.0  # YaRN's, with mscale_all_dim 1, squared into the scale
    assert deepseek.attn_scale == pytest.approx(24**-0.5 * mscale**2, rel=1e-12)
    assert deepseek.rope_interleave and deepseek.dense_layers == (0,)
    gpt_oss = ModelConfig.from_hf(hf_config("gpt_oss"))
    assert gpt_oss.layer_windows == (10, 0, 10, 0) and gpt_oss.o_bias and gpt_oss.qkv_bias
    assert (gpt_oss.num_experts, gpt_oss.moe_intermediate_size) == (8, 32)
    assert (gpt_oss.swiglu_alpha, gpt_oss.swiglu_limit) == (1.702, 1.5)
    assert gpt_oss.rope_scaling["rope_type"] == "yarn" and not gpt_oss.rope_scaling["truncate"]


def test_gpt_oss_config_without_swiglu_fields() -> None:
    """A gpt-oss config as the released checkpoints and transformers before 5.2x hold it (no
    `swiglu_alpha`; 5.17 has no `swiglu_limit` field either): the constants transformers used
    then, not an AttributeError (the GPU machine's transformers 5.17 raised it)."""
    from transformers import PretrainedConfig

    fields = hf_config("gpt_oss").to_dict()
    config = PretrainedConfig(**{k: v for k, v in fields.items() if not k.startswith("swiglu")})
    config.model_type = "gpt_oss"
    assert not hasattr(config, "swiglu_alpha")
    gpt_oss = ModelConfig.from_hf(config)
    assert (gpt_oss.swiglu_alpha, gpt_oss.swiglu_limit) == (1.702, 7.0)
    assert gpt_oss.layer_windows == (10, 0, 10, 0)


def test_mixture_of_experts_tensor_names() -> None:
    """Per-expert names (transformers' save_pretrained, Mixtral's w1/w3/w2) and stacked ones
    (transformers 5 in memory) map to the layer's local names; dense layers keep the MLP's."""
    mixtral = build_model(ModelConfig.from_hf(hf_config("mixtral")))
    qwen2 = build_model(ModelConfig.from_hf(hf_config("qwen2_moe")))
    for model, name, want in [
        (mixtral, "model.layers.0.block_sparse_moe.gate.weight", (1, "router.weight")),
        (
            mixtral,
            "model.layers.2.block_sparse_moe.experts.7.w1.weight",
            (3, "experts.7.gate.weight"),
        ),
        (
            mixtral,
            "model.layers.0.block_sparse_moe.experts.0.w3.weight",
            (1, "experts.0.up.weight"),
        ),
        (
            mixtral,
            "model.layers.0.block_sparse_moe.experts.0.w2.weight",
            (1, "experts.0.down.weight"),
        ),
        (mixtral, "model.layers.1.mlp.experts.gate_up_proj", (2, "experts.gate_up_proj")),
        (mixtral, "model.layers.1.mlp.experts.down_proj", (2, "experts.down_proj")),
        (qwen2, "model.layers.0.mlp.experts.3.gate_proj.weight", (1, "experts.3.gate.weight")),
        (qwen2, "model.layers.0.mlp.shared_expert.up_proj.weight", (1, "shared.up.weight")),
        (qwen2, "model.layers.0.mlp.shared_expert_gate.weight", (1, "shared_gate.weight")),
        (qwen2, "model.layers.1.mlp.gate_proj.weight", (2, "gate.weight")),
        (qwen2, "model.layers.0.mlp.experts.3.unknown.weight", None),
    ]:
        assert model.map_name(name) == want, name


def test_a_gemma3_vision_checkpoint_reads_its_language_model_and_tower() -> None:
    """Its language model's fields are its text_config's, its tower's its vision_config's;
    its language model's tensors are found under either naming (the hub's original,
    transformers 5's), the vision tower's are left to the vision encoder."""
    config = ModelConfig.from_hf(hf_config("gemma3-vision"))
    assert config.model_type == "gemma3" and config.layer_windows == (10, 0, 10)
    assert isinstance(config.vision, ViTConfig) and config.bidirectional_images
    assert (config.vision.patches_per_side, config.vision.out_hidden_size) == (2, 64)
    model = build_model(config)
    head = model.num_layers - 1
    for name, want in [
        ("model.language_model.layers.1.self_attn.q_norm.weight", (2, "q_norm.weight")),
        ("language_model.model.layers.0.mlp.up_proj.weight", (1, "up.weight")),
        ("language_model.model.embed_tokens.weight", (0, "tok.weight")),
        ("model.language_model.norm.weight", (head, "norm.weight")),
        ("language_model.lm_head.weight", (head, "lm_head.weight")),
        ("lm_head.weight", (head, "lm_head.weight")),
        ("model.vision_tower.vision_model.embeddings.patch_embedding.weight", None),
        ("multi_modal_projector.mm_input_projection_weight", None),
    ]:
        assert model.map_name(name) == want, name


def test_a_gemma3_vision_checkpoints_context_is_its_language_models(tmp_path) -> None:
    """config.json of Gemma 3 4B and up keeps max_position_embeddings in its text_config only."""
    text = {"model_type": "gemma3_text", "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    assert context_length(tmp_path) == 131072
