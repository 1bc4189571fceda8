"""GGUF files of DeepSeek-V3 (either form of kv_b), gpt-oss (float and MXFP4 experts), GLM-4.5
(with its MTP block), Llama 4 (Maverick's rope, and Scout's as rope_freqs), SmolLM3 and OLMo 3,
written as llama.cpp's converter writes them: converted back to the checkpoint they came from,
bit for bit and config for config, and greedy tokens equal transformers' on it with weights,
experts and KV split over the tiers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.loading.checkpoint import CheckpointReader
from engine.loading.gguf_convert import MANIFEST, gguf_model_dir
from engine.models.config import ModelConfig, read_hf_config
from engine.models.hf_config import UnsupportedModelError
from policy import Policy
from tests.engine.loading.gguf_files import write_raw_gguf
from tests.engine.loading.gguf_giants import GIANT_CONFIGS, build_giant, write_giant_gguf
from tests.engine.loading.test_gguf_families import json_load
from tests.engine.loading.test_mxfp4 import write_mxfp4
from tests.engine.tiny_models import MAX_TOKENS, built_once, hf_greedy, random_prompts

KINDS = ("deepseek_v3", "gpt_oss", "glm4_moe", "llama4_text", "llama4_scout", "smollm3", "olmo3")
POLICY = Policy(
    weights_frac=(0.0, 0.5, 0.5),
    experts_frac=(0.0, 0.5, 0.5),
    kv_frac=(0.4, 0.3, 0.3),
    cpu_attention=True,
)
"""Weights, experts and KV on every tier, decode attention of CPU-homed KV on the CPU."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return built_once(build_giant, tmp_path_factory, "giant")


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.state_dict()


def _assert_same_model(converted: Path, original: Path, *, skip: tuple[str, ...] = ()) -> None:
    """Every tensor of the conversion equals the original checkpoint's (as transformers holds
    it), none is missing, and both configs make the same nanoflex ModelConfig."""
    ours = load_file(converted / "model.safetensors")
    theirs = _state(original)
    tied = read_hf_config(original).tie_word_embeddings
    assert set(ours) == {n for n in theirs if not (tied and n == "lm_head.weight")}
    for name, tensor in ours.items():
        if not name.endswith(skip):
            assert torch.equal(tensor, theirs[name]), name
    expected = ModelConfig.from_hf(read_hf_config(original))
    assert ModelConfig.from_hf(read_hf_config(converted)) == expected


def _generate(gguf: Path, prompts: list[list[int]], tmp_path: Path) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(gguf), policy=POLICY, device="cpu", offload_dir=tmp_path / "off") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _prompts(kind: str) -> list[list[int]]:
    return random_prompts(2, int(GIANT_CONFIGS[kind]["vocab_size"]), 6, 20, seed=5)


@pytest.mark.parametrize("kind", KINDS)
def test_file_converts_back_to_its_checkpoint(checkpoint, cache, tmp_path, kind):
    hf_dir = checkpoint(kind)
    model_dir = gguf_model_dir(write_giant_gguf(hf_dir, tmp_path / f"{kind}.gguf"))
    _assert_same_model(model_dir, hf_dir)
    if kind == "glm4_moe":  # the MTP block transformers' model does not hold is left out
        skipped = json_load(model_dir / MANIFEST)["skipped_tensors"]
        assert skipped and all(name.startswith("blk.3.") for name in skipped)


@pytest.mark.parametrize("kind", KINDS)
def test_file_generates_transformers_tokens(checkpoint, cache, tmp_path, kind):
    hf_dir = checkpoint(kind)
    gguf = write_giant_gguf(hf_dir, tmp_path / f"{kind}.gguf")
    prompts = _prompts(kind)
    expected = [hf_greedy(hf_dir, p, MAX_TOKENS) for p in prompts]
    assert _generate(gguf, prompts, tmp_path) == expected


def test_deepseek_file_with_kv_b_whole(checkpoint, cache, tmp_path):
    """Files converted before llama.cpp split kv_b (April 2025) keep attn_kv_b: read as it is."""
    hf_dir = checkpoint("deepseek_v3")
    gguf = write_giant_gguf(hf_dir, tmp_path / "deepseek-whole.gguf", kv_b="whole")
    _assert_same_model(gguf_model_dir(gguf), hf_dir)


def test_gpt_oss_mxfp4_experts_are_the_safetensors_mxfp4_weights(checkpoint, cache, tmp_path):
    """gpt-oss's experts in GGUF's MXFP4 blocks, repacked from the same codes and exponents as
    a safetensors MXFP4 checkpoint: dequantized, they equal what nanoflex's safetensors MXFP4
    reader yields, bit for bit, and greedy tokens equal transformers' on that checkpoint."""
    hf_dir = checkpoint("gpt_oss")
    quantized = write_mxfp4(hf_dir, tmp_path / "mxfp4")
    gguf = write_giant_gguf(hf_dir, tmp_path / "gpt-oss-mxfp4.gguf", mxfp4_dir=quantized)
    model_dir = gguf_model_dir(gguf)
    assert json_load(model_dir / MANIFEST)["tensor_types"]["MXFP4"] == 3 * 4  # 3 a layer
    reader = CheckpointReader(quantized)
    ours = load_file(model_dir / "model.safetensors")
    experts = [n for n in ours if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 2 * 4
    for name in experts:
        assert torch.equal(ours[name], reader.get(name)), name
    _assert_same_model(model_dir, hf_dir, skip=("experts.gate_up_proj", "experts.down_proj"))
    prompts = _prompts("gpt_oss")
    expected = [hf_greedy(quantized, p, MAX_TOKENS) for p in prompts]
    assert _generate(gguf, prompts, tmp_path) == expected


def _config(tmp_path: Path, arch: str, **keys: Any) -> Any:
    """The transformers config gguf_config reads from a file of these metadata keys."""
    from engine.loading.gguf_config import gguf_config
    from engine.loading.gguf_tensors import open_gguf

    path = write_raw_gguf(
        tmp_path / f"{arch}.gguf",
        arch,
        {"token_embd.weight": (np.zeros((10, 64), np.float32), None)},
        metadata={
            "block_count": 4,
            "context_length": 64,
            "embedding_length": 64,
            "feed_forward_length": 96,
            "expert_feed_forward_length": 32,
            "expert_count": 8,
            "expert_used_count": 2,
            "attention.head_count": 4,
            "attention.layer_norm_rms_epsilon": 1e-6,
            **keys,
        },
    )
    return gguf_config(open_gguf(path))


def test_what_llama_cpp_assumes_where_the_file_is_silent(tmp_path):
    """Llama 4: chunks of 8192 on three layers in four, the fourth NoPE, q/k norms but for the
    128-expert model; gpt-oss: local layers from the first, SwiGLU limit 7; SmolLM3: every
    fourth layer NoPE; OLMo 3 (an `olmo2` file with a window): three local layers in four."""
    llama4 = _config(tmp_path, "llama4")
    assert (llama4.attention_chunk_size, llama4.no_rope_layers) == (8192, [1, 1, 1, 0])
    assert llama4.use_qk_norm and (llama4.floor_scale, llama4.attn_scale) == (8192, 0.1)
    assert not _config(tmp_path, "llama4", expert_count=128).use_qk_norm
    gpt_oss = _config(tmp_path, "gpt-oss", **{"attention.sliding_window": 128})
    assert gpt_oss.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert gpt_oss.swiglu_limit == 7.0
    assert _config(tmp_path, "smollm3").no_rope_layers == [1, 1, 1, 0]
    olmo3 = _config(tmp_path, "olmo2", **{"attention.sliding_window": 16})
    assert olmo3.model_type == "olmo3" and olmo3.layer_types[2:] == [
        "sliding_attention",
        "full_attention",
    ]
    assert _config(tmp_path, "olmo2").model_type == "olmo2"


def test_softmax_routed_deepseek2_file_is_refused(tmp_path):
    """DeepSeek-V2's softmax router is not DeepSeek-V3's: refused in one line, by name."""
    with pytest.raises(UnsupportedModelError, match=r"^[^\n]*routes its experts by softmax"):
        _config(tmp_path, "deepseek2", expert_gating_func=1)
