"""Dummy weights (`dummy:` models): names and shapes of a real checkpoint, generated values."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.model_files import ModelLoadError, resolve_model_dir
from engine.loading.checkpoint import CheckpointReader, open_reader
from engine.loading.dummy import INIT_SCALE, MARKER, DummyReader, dummy_model_dir
from engine.loading.generated import local_model_dir
from policy import Policy
from policy.catalog import builtin_spec
from tests.engine.tiny_models import TINY_CONFIGS, hf_greedy


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path / "cache"))


def tiny_config_dir(kind: str, path):
    from transformers import AutoConfig

    spec = dict(TINY_CONFIGS[kind])
    config = AutoConfig.for_model(spec.pop("model_type"), bos_token_id=1, eos_token_id=2, **spec)
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["opt", "llama"])
def test_names_and_shapes_are_a_saved_checkpoints(kind, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dir = tiny_config_dir(kind, tmp_path / "config")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    model.save_pretrained(tmp_path / "real")
    real = CheckpointReader(tmp_path / "real")
    dummy = open_reader(local_model_dir(f"dummy:{config_dir}"))
    assert isinstance(dummy, DummyReader)
    assert sorted(dummy.names) == sorted(real.names)
    for name in real.names:
        assert dummy.get(name).shape == real.get(name).shape, name


def test_values_are_deterministic_small_and_norms_are_identity(tmp_path):
    model_dir = dummy_model_dir(str(tiny_config_dir("opt", tmp_path / "config")))
    first, again = DummyReader.from_model_dir(model_dir), DummyReader.from_model_dir(model_dir)
    wide = DummyReader.from_model_dir(model_dir, dtype=torch.float32)
    for name in first.names:
        value = first.get(name)
        assert torch.equal(value, again.get(name))
        assert torch.equal(value.float(), wide.get(name)), "float32 values are the float16 ones"
        if "layer_norm" in name:
            expected = 1.0 if name.endswith("weight") else 0.0
            assert bool((value == expected).all()), name
        else:
            assert value.abs().max() <= INIT_SCALE and value.float().std() > INIT_SCALE / 4
    q0 = first.get("model.decoder.layers.0.self_attn.q_proj.weight")
    q1 = first.get("model.decoder.layers.1.self_attn.q_proj.weight")
    assert not torch.equal(q0, q1) and not torch.equal(q0[0], q0[1])


@pytest.mark.parametrize(
    "name",
    [
        "facebook/opt-30b",
        "opt-6.7b",
        "llama-3-8b",
        "mistral-7b",
        "qwen3-8b",
        "google/gemma-2-9b-it",
        "gemma-3-27b",
        "phi-4-mini",
        "olmo-2-7b",
    ],
)
def test_builtin_shapes_have_the_specs_parameter_count(name):
    spec = builtin_spec(name)
    assert spec is not None
    model_dir = local_model_dir(f"dummy:{name}")
    assert (model_dir / MARKER).is_file() and not list(model_dir.glob("*.safetensors"))
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == (
        spec.num_layers
    )
    reader = open_reader(model_dir)
    assert sum(reader.numel(n) for n in reader.names) == spec.total_params
    assert local_model_dir(f"dummy:{name}") == model_dir  # built once


def test_unknown_dummy_name_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="built-in model name"):
        local_model_dir("dummy:facebook/opt-7b")


@pytest.mark.parametrize("kind", ["opt", "llama", "deepseek_v3"])  # DeepSeek: a saved buffer
def test_dummy_model_generates_like_a_checkpoint_of_the_same_values(kind, tmp_path):
    from safetensors.torch import save_file

    config_dir = tiny_config_dir(kind, tmp_path / "config")
    model_dir = local_model_dir(f"dummy:{config_dir}")
    reader = DummyReader.from_model_dir(model_dir, dtype=torch.float32)
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    (real_dir / "config.json").write_text((config_dir / "config.json").read_text())
    save_file({n: reader.get(n).contiguous() for n in reader.names}, real_dir / "model.safetensors")
    prompt = [5, 9, 13, 40, 2, 77, 31]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    policy = Policy(weights_frac=(0.0, 0.5, 0.5))  # cpu and disk tiers too
    outputs = []
    for model in (f"dummy:{config_dir}", str(real_dir)):
        with LLM(model, policy=policy, device="cpu", offload_dir=tmp_path / "off") as llm:
            assert llm.tokenizer is None  # prompts are token ids
            outputs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1] == hf_greedy(real_dir, prompt, 6)


def test_torch_free_resolution_builds_in_a_child(tmp_path):
    """The daemon's resolution builds in `python -m engine.loading`; the engine's in-process."""
    model_dir = resolve_model_dir("dummy:opt-125m")
    assert (model_dir / MARKER).is_file()
    assert local_model_dir("dummy:opt-125m") == model_dir
    with pytest.raises(ModelLoadError, match="built-in model name"):
        resolve_model_dir("dummy:facebook/opt-7b")  # the child's error, in one line


def test_moe_shapes_carry_their_experts() -> None:
    """`dummy:` MoE shapes: the config says how many experts, how many a token picks and their
    width (the engine reads them back into the same shape), and the small one generates."""
    from transformers import AutoConfig

    from engine.loading.dummy import hf_config_dict
    from engine.models.config import ModelConfig

    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "tiny-mixtral"):
        spec = builtin_spec(name)
        assert spec is not None
        fields = hf_config_dict(name)
        config = ModelConfig.from_hf(AutoConfig.for_model(**fields))
        assert (config.num_experts, config.num_experts_per_tok) == (
            spec.num_experts,
            spec.num_experts_per_tok,
        )
        assert config.moe_intermediate_size == spec.moe_intermediate_size
        assert not config.dense_layers
    # a fixed policy: `auto` would run its close plans for real (a minute here), tested apart
    with LLM("dummy:tiny-mixtral", policy=Policy(), device="cpu") as llm:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids) == 4
