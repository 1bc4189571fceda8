"""GGUF files of Qwen 3, Gemma 2, Gemma 3, Phi-3 and OLMo 2, in every quantization people download,
converted and run: tensors bit for bit what transformers reads from the same file (OLMo 2, which
transformers cannot read from GGUF: what the gguf package dequantizes), the config llama.cpp's
metadata describes, transformers' greedy tokens, the file's tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.core.tokenizer import Tokenizer, TokenizerError
from engine.loading.gguf_convert import MANIFEST, gguf_model_dir
from engine.models.config import ModelConfig, read_hf_config
from policy import Policy
from tests.engine.loading.gguf_families import (
    GGUF_ARCH,
    QUANT_TYPES,
    build_gguf_checkpoint,
    write_family_gguf,
)
from tests.engine.tiny_models import built_once, random_prompts

FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "olmo2")
TRANSFORMERS_CANNOT_READ = frozenset({"olmo2"})
"""Architectures transformers' GGUF loader refuses ("not supported yet")."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return built_once(build_gguf_checkpoint, tmp_path_factory, "gguf")


def reference_model(kind: str, gguf: Path, hf_dir: Path) -> Any:
    """transformers' model of the original checkpoint's config with the weights transformers
    reads from the GGUF file (its own dequantization and tensor fixes); for an architecture it
    cannot read, the gguf package's dequantized tensors under transformers' names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    if kind not in TRANSFORMERS_CANNOT_READ:
        return AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, config=config, dtype=torch.float32
        )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(_dequantized(gguf, config), strict=False)
    model.tie_weights()
    return model.eval()


def _dequantized(gguf: Path, config: Any) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized by the gguf package, under transformers' name."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, dequantize, get_tensor_name_map

    arch = GGUF_ARCH[config.model_type]
    table = get_tensor_name_map(
        next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers
    )
    by_gguf = {}
    for name in _parameter_names(config):
        module, _, suffix = name.rpartition(".")
        by_gguf[f"{table.get_name(module)}.{suffix}"] = name
    out = {}
    for tensor in GGUFReader(str(gguf)).tensors:
        shape = tuple(reversed(tensor.shape.tolist()))
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        out[by_gguf[tensor.name]] = torch.from_numpy(values.copy())
    return out


def _parameter_names(config: Any) -> list[str]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return [n for n, _ in AutoModelForCausalLM.from_config(config).named_parameters()]


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_quantization_converts_to_what_transformers_reads(
    checkpoint, cache, tmp_path, kind, qtype
):
    hf_dir = checkpoint(kind)
    gguf = write_family_gguf(hf_dir, tmp_path / f"{kind}-{qtype}.gguf", qtype)
    model_dir = gguf_model_dir(gguf)
    ours = load_file(model_dir / "model.safetensors")
    theirs = reference_model(kind, gguf, hf_dir).state_dict()
    assert set(ours) == {n for n in theirs if n != "lm_head.weight" or n in ours}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    original = ModelConfig.from_hf(read_hf_config(hf_dir))
    assert ModelConfig.from_hf(read_hf_config(model_dir)) == original
    types = json_load(model_dir / MANIFEST)["tensor_types"]
    assert set(types) == {"F32", qtype}


def json_load(path: Path) -> Any:
    import json

    return json.loads(path.read_text())


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' model, greedy, over its cache step by step (as tests/engine/tiny_models.py
    `hf_greedy_stepwise`)."""
    from transformers import DynamicCache

    out: list[int] = []
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ids, positions = torch.tensor([prompt]), torch.arange(len(prompt))[None]
        for _ in range(n):
            logits = model(ids, position_ids=positions, cache=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            ids, positions = torch.tensor([[out[-1]]]), positions[:, -1:] + 1
    return out


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_mixed_file_generates_transformers_tokens(checkpoint, cache, tmp_path, kind):
    """A Q4_K_M-like mix (Q4_K, Q5_K, Q6_K, Q8_0, F32) under a placement that splits weights
    and KV over the tiers: the tokens of transformers' model reading the same file."""
    hf_dir = checkpoint(kind)
    gguf = write_family_gguf(hf_dir, tmp_path / f"{kind}.gguf", mixed=True)
    types = set(json_load(gguf_model_dir(gguf) / MANIFEST)["tensor_types"])
    assert types == {"F32", "Q4_K", "Q5_K", "Q6_K", "Q8_0"}
    prompts = random_prompts(3, 260, 12, 28, seed=5)
    model = reference_model(kind, gguf, hf_dir)
    expected = [_greedy(model, p, 8) for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    policy = Policy(weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.5, 0.5, 0.0), cpu_attention=True)
    with LLM(str(gguf), policy=policy, device="cpu", offload_dir=tmp_path / "off") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_files_tokenizer_and_chat_template(checkpoint, cache, tmp_path, kind):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    gguf = write_family_gguf(checkpoint(kind), tmp_path / f"{kind}.gguf")
    tokenizer = Tokenizer(gguf_model_dir(gguf))
    reader = PreTrainedTokenizerFast if kind in TRANSFORMERS_CANNOT_READ else AutoTokenizer
    theirs = reader.from_pretrained(str(tmp_path), gguf_file=gguf.name)
    text = "the winter in Athens, then the rest"
    assert tokenizer.encode(text) == theirs.encode(text)
    chats = [
        [{"role": "user", "content": "Where is the train?"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": "Say it again "},
        ],
    ]
    for chat in chats:
        want = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert tokenizer.render_chat(chat) == want
    system = [{"role": "system", "content": "Be brief."}, *chats[0]]
    if kind.startswith("gemma"):  # its template refuses a system message, as Gemma's does
        with pytest.raises(TokenizerError, match="System role not supported"):
            tokenizer.render_chat(system)
    else:
        assert tokenizer.render_chat(system).startswith("<|im_start|>system\nBe brief.")


def test_config_fields_llama_cpp_leaves_to_its_runtime(tmp_path):
    """What a file need not state, assumed as llama.cpp assumes it: Gemma 2's window 4096 and
    caps 50 / 30, query scale by head size except for the 27B models; Gemma 3's local layers
    five in six, local rotary base 10000, none without a window."""
    from engine.loading.gguf_config import gguf_config
    from engine.loading.gguf_tensors import open_gguf
    from tests.engine.loading.gguf_files import write_raw_gguf

    def config(arch: str, layers: int, **keys: Any) -> Any:
        import numpy as np

        path = write_raw_gguf(
            tmp_path / f"{arch}-{layers}.gguf",
            arch,
            {"token_embd.weight": (np.zeros((10, 96), np.float32), None)},
            metadata=dict(
                block_count=layers,
                context_length=64,
                embedding_length=96,
                feed_forward_length=128,
                **{"attention.head_count": 4, "attention.key_length": 32},
                **{"attention.layer_norm_rms_epsilon": 1e-6},
                **keys,
            ),
        )
        return gguf_config(open_gguf(path))

    gemma2 = config("gemma2", 26)
    assert (gemma2.sliding_window, gemma2.attn_logit_softcapping) == (4096, 50.0)
    assert (gemma2.final_logit_softcapping, gemma2.query_pre_attn_scalar) == (30.0, 32)
    assert config("gemma2", 46).query_pre_attn_scalar == 96 // 4
    gemma3 = ModelConfig.from_hf(config("gemma3", 12, **{"attention.sliding_window": 512}))
    assert gemma3.layer_windows == (512,) * 5 + (0,) + (512,) * 5 + (0,)
    assert gemma3.local_rope_theta == 10000.0 and gemma3.attn_scale == 32**-0.5
    assert ModelConfig.from_hf(config("gemma3", 6)).layer_windows == ()
    assert config("gemma3", 62).query_pre_attn_scalar == 96 // 4
