"""Mixture-of-experts shapes: parameter counts equal transformers' models (every expert), active
parameters count the routed top-k only, the built-in shapes match the published sizes."""

from __future__ import annotations

import pytest

from policy.catalog import BUILTIN_MODELS, resolve_model_spec
from policy.errors import ModelSpecError
from policy.specs import ModelSpec

SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
TINY_MOE: dict[str, dict[str, object]] = {
    "mixtral": dict(model_type="mixtral", intermediate_size=48, num_local_experts=6),
    "olmoe": dict(model_type="olmoe", intermediate_size=40, num_experts=8),
    # a dense layer between sparse ones, and the shared expert with its gate
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        intermediate_size=96,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=56,
        num_experts=8,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=10,
        decoder_sparse_step=2,
        head_dim=24,
    ),
}


def _meta_model(kind: str):  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**SHAPE, **TINY_MOE[kind]}
    config = AutoConfig.for_model(spec.pop("model_type"), num_experts_per_tok=2, **spec)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", sorted(TINY_MOE))
def test_parameters_equal_transformers_model(kind: str) -> None:
    """Every routed expert, the routers, the shared expert and its gate, dense layers between
    sparse ones: all counted, as transformers builds the model."""
    config, model = _meta_model(kind)
    ours = ModelSpec.from_hf_config(config.to_dict())
    assert ours.total_params == sum(p.numel() for p in model.parameters())
    sparse = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(ours.moe_layer_ids) == sparse
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert ours.total_expert_params == experts


@pytest.mark.parametrize("kind", sorted(TINY_MOE))
def test_active_parameters_count_only_the_routed_top_k(kind: str) -> None:
    config, model = _meta_model(kind)
    ours = ModelSpec.from_hf_config(config.to_dict())
    routed = ours.num_moe_layers * (ours.num_experts - 2) * ours.expert_params  # not picked
    assert ours.active_params == sum(p.numel() for p in model.parameters()) - routed


@pytest.mark.parametrize(
    ("hub_id", "total", "active", "layers"),
    [
        ("mistralai/Mixtral-8x7B-v0.1", 46.7, 12.9, 32),  # Mixtral of Experts, Sec. 2
        ("Qwen/Qwen3-30B-A3B", 30.5, 3.3, 48),  # the model card: 30.5B, 3.3B activated
    ],
)
def test_builtin_moe_shapes_match_published_sizes(
    hub_id: str, total: float, active: float, layers: int
) -> None:
    spec = resolve_model_spec(hub_id)
    assert spec.total_params / 1e9 == pytest.approx(total, abs=0.05)
    assert spec.active_params / 1e9 == pytest.approx(active, rel=0.02)
    assert spec.num_moe_layers == spec.num_layers == layers


def test_weight_bytes_count_every_expert() -> None:
    """Mixtral-8x7B: 8 experts of 3 x 4096 x 14336 bf16 in each of 32 layers."""
    mixtral = BUILTIN_MODELS["mixtral-8x7b"]
    assert mixtral.expert_weight_bytes == 3 * 4096 * 14336 * 2
    assert mixtral.total_expert_params == 32 * 8 * 3 * 4096 * 14336
    dense_part = mixtral.total_params - mixtral.total_expert_params
    assert mixtral.total_weight_bytes == 2 * (dense_part + mixtral.total_expert_params)
    assert mixtral.layer_weight_bytes * 32 == 2 * mixtral.layers_params
    qwen = BUILTIN_MODELS["qwen3-30b-a3b"]
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 768)
    assert qwen.expert_weight_bytes == 3 * 2048 * 768 * 2


def test_dense_models_have_no_experts() -> None:
    llama = BUILTIN_MODELS["llama-3-8b"]
    assert not llama.is_moe and llama.total_expert_params == 0
    assert llama.active_params == llama.total_params
    assert llama.active_layer_params == llama.layer_params


def test_bad_moe_fields_are_refused() -> None:
    base = BUILTIN_MODELS["tiny-mixtral"]
    config = dict(model_type="mixtral", hidden_size=64, intermediate_size=32, vocab_size=99)
    config |= dict(num_hidden_layers=2, num_attention_heads=4, num_local_experts=4)
    with pytest.raises(ModelSpecError, match="num_experts_per_tok must be in"):
        ModelSpec.from_hf_config({**config, "num_experts_per_tok": 5})
    with pytest.raises(ModelSpecError, match="lacks 'num_experts_per_tok'"):
        ModelSpec.from_hf_config(config)
    assert base.num_experts == 8 and base.dtype_bytes == 4
