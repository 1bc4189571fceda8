"""The newer families' shapes in the cost model: parameter counts equal transformers' models,
the built-in sizes the published ones, and a sliding window prices what a local layer reads."""

from __future__ import annotations

import dataclasses

import pytest

from policy import FLEXGEN_T4, Policy
from policy.catalog import BUILTIN_MODELS, resolve_model_spec
from policy.cost_model import estimate
from policy.plan import format_report
from policy.specs import ModelSpec, WorkloadSpec
from tests.engine.tiny_models import (
    DENSE_2025,
    GPT_OSS,
    GROUPED_MOE_FAMILIES,
    LLAMA4,
    NEW_FAMILIES,
    TINY_CONFIGS,
)


@pytest.mark.parametrize(
    "kind", [*NEW_FAMILIES, *DENSE_2025, *GROUPED_MOE_FAMILIES, GPT_OSS, LLAMA4, "mistral"]
)
def test_parameters_equal_transformers_model(kind: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.config import ModelConfig

    spec = dict(TINY_CONFIGS[kind])
    config = AutoConfig.for_model(spec.pop("model_type"), pad_token_id=0, **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ours = ModelSpec.from_hf_config(config.to_dict())
    assert ours.total_params == sum(p.numel() for p in model.parameters())  # tied: once
    windows = ModelConfig.from_hf(config).layer_windows  # as the engine reads them
    assert ours.num_local_layers == sum(1 for w in windows if w)
    assert ours.sliding_window == max(map(abs, windows), default=0)  # Llama 4's chunks: < 0


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("qwen3-0.6b", 0.596),
        ("qwen3-8b", 8.19),
        ("qwen3-32b", 32.76),
        ("gemma-2-9b", 9.24),
        ("gemma-2-27b", 27.2),
        ("gemma-3-1b", 1.0),
        ("gemma-3-12b", 11.77),
        ("gemma-3-27b", 27.0),
        ("phi-3-mini-4k", 3.82),
        ("phi-4-mini", 3.84),
        ("olmo-2-7b", 7.30),
        ("qwen3-235b-a22b", 235.0),
        ("deepseek-v3", 671.0),
        ("glm-4.5-air", 106.0),
        ("smollm3-3b", 3.08),
        ("gpt-oss-20b", 20.9),
        ("gpt-oss-120b", 116.8),
        ("llama-4-scout", 107.8),  # the text model (Meta's 109B counts the vision encoder)
        ("llama-4-maverick", 400.7),
    ],
)
def test_builtin_parameter_counts_match_published_sizes(name: str, billions: float) -> None:
    assert BUILTIN_MODELS[name].total_params / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize(
    ("hub_id", "name", "local_layers", "window"),
    [
        ("Qwen/Qwen3-8B", "qwen3-8b", 0, 0),
        ("google/gemma-2-9b-it", "gemma-2-9b", 21, 4096),
        ("google/gemma-3-27b-it", "gemma-3-27b-it", 52, 1024),
        ("microsoft/Phi-3-mini-4k-instruct", "phi-3-mini-4k", 32, 2047),
        ("microsoft/Phi-4-mini-instruct", "phi-4-mini", 0, 0),
        ("allenai/OLMo-2-1124-7B-Instruct", "olmo-2-7b", 0, 0),
        ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", "llama-4-maverick", 36, 8192),
        ("meta-llama/Llama-4-Scout-17B-16E", "llama-4-scout", 36, 8192),
    ],
)
def test_hub_ids_name_builtin_shapes(hub_id, name, local_layers, window) -> None:
    spec = resolve_model_spec(hub_id)
    assert (spec.name, spec.num_local_layers, spec.sliding_window) == (name, local_layers, window)


@pytest.mark.parametrize(
    ("hub_id", "name", "kv_row"),
    [
        ("deepseek-ai/DeepSeek-R1-0528", "deepseek-v3", 576),  # MLA: the latent row, once
        ("moonshotai/Kimi-K2-Instruct", "kimi-k2", 576),
        ("zai-org/GLM-4.6", "glm-4.5", 2 * 8 * 128),
        ("HuggingFaceTB/SmolLM3-3B", "smollm3-3b", 2 * 4 * 128),
    ],
)
def test_hub_ids_name_the_largest_moe_shapes(hub_id, name, kv_row) -> None:
    """The catalogue's grouped-routing giants (and SmolLM3): their KV row per token and layer
    as the engine stores it, and a plan's estimate on a fixed policy runs."""
    spec = resolve_model_spec(hub_id)
    assert spec.name == name and spec.kv_bytes_per_token_per_layer == kv_row * 2
    policy = Policy(
        weights_frac=(0.0, 1.0, 0.0), experts_frac=(0.0, 0.5, 0.5), kv_frac=(0.0, 1.0, 0.0)
    )
    found = estimate(policy, spec, WorkloadSpec(prompt_len=512, gen_len=32), FLEXGEN_T4)
    assert found.generation_throughput > 0


def test_gemma3_with_vision_reads_its_language_model() -> None:
    text = {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 262208,
        "sliding_window": 1024,
    }
    config = {"model_type": "gemma3", "torch_dtype": "bfloat16", "text_config": text}
    spec = ModelSpec.from_hf_config(config, name="gemma-3-12b-it")
    assert spec.total_params == BUILTIN_MODELS["gemma-3-12b"].total_params
    assert spec.model_type == "gemma3_text" and spec.num_local_layers == 40


def test_llama4_with_vision_reads_its_language_model() -> None:
    """Maverick's config.json as published (its text_config's shape fields): the catalogue's
    shape, MoE on every other layer, chunks on the rotary layers (a NoPE layer of four)."""
    text = {
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 202048,
        "num_local_experts": 128,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 8192,
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
        "tie_word_embeddings": False,
    }
    config = {"model_type": "llama4", "torch_dtype": "bfloat16", "text_config": text}
    spec = ModelSpec.from_hf_config(config, name="Llama-4-Maverick-17B-128E-Instruct")
    assert spec.total_params == BUILTIN_MODELS["llama-4-maverick"].total_params
    assert spec.moe_layer_ids == tuple(range(1, 48, 2))
    assert (spec.num_local_layers, spec.sliding_window) == (36, 8192)


def test_a_window_prices_what_local_layers_read() -> None:
    """Gemma 3 27B at 8K tokens: 52 of 62 layers read 1024 keys, so decode reads and attends
    over far less KV than the same shape without windows; its memory is the same (every
    token's KV is kept)."""
    gemma = BUILTIN_MODELS["gemma-3-27b"]
    full = dataclasses.replace(gemma, sliding_window=0, num_local_layers=0)
    assert gemma.attended_len(8192) == pytest.approx((10 * 8192 + 52 * 1024) / 62)
    assert gemma.attended_len(512) == full.attended_len(512) == 512
    local_pairs = 1024 * 1024 / 2 + (8192 - 1024) * 1024  # the window's triangle, then rows of it
    assert gemma.attention_pairs(8192) == pytest.approx((10 * 8192**2 / 2 + 52 * local_pairs) / 62)
    assert gemma.attention_pairs(1000) == full.attention_pairs(1000) == 500_000
    workload = WorkloadSpec(prompt_len=8192, gen_len=64)
    policy = Policy(weights_frac=(0.0, 1.0, 0.0), kv_frac=(0.0, 1.0, 0.0))
    windowed = estimate(policy, gemma, workload, FLEXGEN_T4)
    plain = estimate(policy, full, workload, FLEXGEN_T4)
    assert windowed.decode_time < plain.decode_time and windowed.prefill_time < plain.prefill_time
    assert windowed.peak_bytes["cpu"] == pytest.approx(plain.peak_bytes["cpu"], rel=0.01)


def test_plan_report_names_the_window() -> None:
    from policy.search import search

    gemma = BUILTIN_MODELS["gemma-2-9b"]
    workload = WorkloadSpec(prompt_len=512, gen_len=32)
    report = format_report(gemma, workload, search(gemma, workload, FLEXGEN_T4), {})
    assert "21 of 42 layers attend over their last 4096 tokens only" in report


def test_mla_latent_is_priced_once_per_token() -> None:
    """DeepSeek-V3's latent is stored once (its value is its key): the cost model's KV bytes
    per token, and the KV a block homes on disk, are half those of the same shape priced as
    key and value."""
    spec = resolve_model_spec("deepseek-ai/DeepSeek-R1-0528")
    as_key_and_value = dataclasses.replace(spec, values_are_keys=False)
    assert (
        spec.values_are_keys and 2 * spec.kv_bytes_per_token == as_key_and_value.kv_bytes_per_token
    )
    policy = Policy(
        weights_frac=(0.0, 1.0, 0.0), experts_frac=(0.0, 1.0, 0.0), kv_frac=(0.0, 0.0, 1.0)
    )
    work = WorkloadSpec(prompt_len=512, gen_len=32)
    once, twice = (estimate(policy, s, work, FLEXGEN_T4) for s in (spec, as_key_and_value))
    home = policy.block_size * (512 + 32) * spec.kv_bytes_per_token
    assert once.peak_bytes["disk"] == pytest.approx(home)
    assert twice.peak_bytes["disk"] == pytest.approx(2 * home)


def test_qwen2_5_vl_prices_its_language_model() -> None:
    """Qwen2.5-VL-7B's config.json shape fields: a Qwen2 7B language model (its vision tower
    is priced beside it: tests/policy/test_vision_specs.py)."""
    text = {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    }
    config = {"model_type": "qwen2_5_vl", "torch_dtype": "bfloat16", "text_config": text}
    spec = ModelSpec.from_hf_config(config, name="Qwen2.5-VL-7B-Instruct")
    assert spec.model_type == "qwen2" and spec.qkv_bias and spec.num_layers == 28
    assert 7.0e9 < spec.total_params < 7.7e9  # Qwen2-7B's 7.6B


def test_a_kimi_k2_checkpoint_is_priced_as_the_deepseek_v3_it_runs_as(tmp_path) -> None:
    """The planner reads a model type the family table aliases as the engine does: a Kimi K2
    directory (DeepSeek-V3's architecture under its own name) is priced as DeepSeek-V3."""
    import json

    deepseek = {**TINY_CONFIGS["deepseek_v3"], "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps({**deepseek, "model_type": "kimi_k2"}))
    kimi = resolve_model_spec(str(tmp_path))
    assert kimi == ModelSpec.from_hf_config(deepseek, name=str(tmp_path))
