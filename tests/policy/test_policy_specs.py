"""ModelSpec sizes, HF config parsing, name resolution; WorkloadSpec validation."""

import json
from pathlib import Path

import pytest

from base.errors import UserError
from policy.catalog import BUILTIN_MODELS, resolve_model_spec
from policy.specs import ModelSpec, WorkloadSpec


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("opt-125m", 0.125),
        ("opt-30b", 30.0),
        ("opt-175b", 174.6),
        ("llama-2-7b", 6.74),
        ("llama-3-8b", 8.03),
        ("mistral-7b", 7.24),
        ("qwen2-7b", 7.62),
        ("llama-2-70b", 68.98),
    ],
)
def test_builtin_parameter_counts_match_published_sizes(name: str, billions: float) -> None:
    assert BUILTIN_MODELS[name].total_params / 1e9 == pytest.approx(billions, rel=0.01)


def test_opt_layer_bytes_match_flexgen_formula() -> None:
    spec = BUILTIN_MODELS["opt-30b"]  # FlexGen: 8*h1^2 + 4*h1*h2 bytes in fp16
    h1, h2 = spec.hidden_size, spec.intermediate_size
    assert spec.layer_weight_bytes == pytest.approx(8 * h1**2 + 4 * h1 * h2, rel=1e-3)


def test_kv_bytes_are_gqa_aware() -> None:
    llama2, llama3 = BUILTIN_MODELS["llama-2-7b"], BUILTIN_MODELS["llama-3-8b"]
    assert llama2.kv_bytes_per_token_per_layer == 2 * 4096 * 2
    assert llama3.kv_bytes_per_token_per_layer == 2 * 8 * 128 * 2  # 8 KV heads
    assert llama3.kv_bytes_per_token == 32 * llama3.kv_bytes_per_token_per_layer


def test_demo_model_is_the_default() -> None:
    demo = resolve_model_spec(None)
    assert demo.name == "nanoflex-demo"
    assert (demo.vocab_size, demo.hidden_size, demo.intermediate_size) == (2048, 512, 1408)
    assert (demo.num_layers, demo.num_heads, demo.num_kv_heads, demo.head_dim) == (6, 8, 2, 64)
    assert demo.dtype_bytes == 4 and not demo.tie_word_embeddings


@pytest.mark.parametrize(
    ("hub_id", "name"),
    [
        ("facebook/opt-30b", "opt-30b"),
        ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
        ("meta-llama/Llama-2-70b-hf", "llama-2-70b"),
        ("mistralai/Mistral-7B-v0.1", "mistral-7b"),
        ("Qwen/Qwen2-72B-Instruct", "qwen2-72b"),
        ("OPT-13B", "opt-13b"),
    ],
)
def test_hub_ids_resolve_to_builtin_entries(hub_id: str, name: str) -> None:
    assert resolve_model_spec(hub_id).name == name


def test_from_hf_config_opt() -> None:
    config = {
        "model_type": "opt",
        "hidden_size": 1024,
        "ffn_dim": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "vocab_size": 50272,
        "word_embed_proj_dim": 512,
        "max_position_embeddings": 2048,
        "torch_dtype": "float16",
    }
    spec = ModelSpec.from_hf_config(config, name="opt-350m")
    assert spec.total_params == BUILTIN_MODELS["opt-350m"].total_params
    assert spec.num_kv_heads == spec.num_heads == 16


def test_from_hf_config_llama_family_with_gqa_and_head_dim() -> None:
    config = {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
    }
    spec = ModelSpec.from_hf_config(config)
    assert spec.arch == "llama" and spec.kv_dim == 1024 and spec.dtype_bytes == 2
    assert spec.total_params == BUILTIN_MODELS["mistral-7b"].total_params


def test_local_directory_config(tmp_path: Path) -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model_spec(str(tmp_path))
    assert spec.num_kv_heads == 4 and spec.head_dim == 16 and spec.dtype_bytes == 4


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "gpt2"},
        {"model_type": "llama", "hidden_size": 64},
        {"model_type": "llama", "torch_dtype": "int3"},
    ],
)
def test_bad_configs_are_user_errors(config: dict[str, object]) -> None:
    with pytest.raises(UserError):
        ModelSpec.from_hf_config(config)


def test_unknown_model_without_hub_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(*args: object, **kwargs: object) -> str:
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(UserError, match="unknown model"):
        resolve_model_spec("someone/not-a-model")
    with pytest.raises(UserError, match=r"no config\.json"):
        resolve_model_spec("./does-not-exist")


def test_workload_validation() -> None:
    assert WorkloadSpec(prompt_len=100.5, gen_len=20).total_len == 120.5
    with pytest.raises(UserError):
        WorkloadSpec(prompt_len=0, gen_len=8)
    with pytest.raises(UserError):
        WorkloadSpec(prompt_len=8, gen_len=0)
