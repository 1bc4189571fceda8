"""Tests for the built-in demo model: determinism, config, and loading with transformers."""

from __future__ import annotations

import json
import os
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from engine.loading import demo

EXPECTED_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "README.md",
}

ASCII_SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog 1234567890 times.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew lines\r\n and   runs of spaces",
    string.printable,
    "zxqj wvvk unseen-words_like_THIS {json: [1, 2.5e-3]}",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The demo model built through `demo_model_dir()` into a private cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOFLEX_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield demo.demo_model_dir()


def test_layout(model_dir: Path) -> None:
    assert model_dir.name == "demo-v2"
    assert {p.name for p in model_dir.iterdir()} == EXPECTED_FILES
    # no temporary build directories are left beside it
    assert [p.name for p in model_dir.parent.iterdir()] == ["demo-v2"]
    readme = (model_dir / "README.md").read_text()
    assert "random weights" in readme and "not meaningful" in readme


def test_build_is_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    demo.build_demo_model(tmp_path / "again")
    for name in EXPECTED_FILES:
        assert (tmp_path / "again" / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_special_token_ids_agree_between_config_and_tokenizer(model_dir: Path) -> None:
    """The ids the scheduler stops on (config, generation_config) are the tokenizer's."""
    config = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"]
    for name, token in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>")):
        assert config[f"{name}_token_id"] == tok.token_to_id(token), name
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.token_to_id("</s>"), tok.token_to_id("<|end|>")]


def test_weights(model_dir: Path) -> None:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert len(names) == 2 + 1 + 6 * 9
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")  # (out, in)
        k = f.get_tensor("model.layers.5.self_attn.k_proj.weight")
        down = f.get_tensor("model.layers.3.mlp.down_proj.weight")
        embed = f.get_tensor("model.embed_tokens.weight")
        head = f.get_tensor("lm_head.weight")
        norm = f.get_tensor("model.layers.2.post_attention_layernorm.weight")
    assert q.shape == (512, 512) and k.shape == (128, 512) and down.shape == (512, 1408)
    assert embed.shape == head.shape == (2048, 512)
    assert embed.dtype == torch.float32
    assert not torch.equal(embed, head)  # untied, drawn separately
    assert torch.equal(norm, torch.ones(512))
    assert abs(embed.std().item() - 0.02) < 5e-4 and abs(embed.mean().item()) < 5e-4


def test_tokenizers_library_round_trip(model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in [*ASCII_SAMPLES, *demo.CORPUS.split("\n\n")[:5]]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    # chat markers are single special tokens
    ids = tok.encode("<|user|>\nhi<|end|>").ids
    assert ids[0] == tok.token_to_id("<|user|>") and ids[-1] == tok.token_to_id("<|end|>")


def test_auto_tokenizer_and_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    for text in ASCII_SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|system|>\nBe brief.<|end|>\n<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n"
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids[1]) == "<|system|>"


def test_transformers_computes_what_the_engine_computes(model_dir: Path) -> None:
    """transformers' own LlamaForCausalLM reads the files and its full forward gives the
    engine's logits at every position: the demo model is a real Llama checkpoint."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from engine.core.engine_args import EngineArgs
    from engine.executor.executor import Executor
    from policy import Policy

    model: Any = LlamaForCausalLM.from_pretrained(model_dir)
    tok: Any = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok.encode("Once upon a time, in a quiet village by the sea")
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0]
    executor = Executor(EngineArgs(model=str(model_dir), device="cpu"), Policy())
    try:
        got = executor.score([prompt], prefill_len=4)[0]  # a prefill, then decodes over the KV
    finally:
        executor.close()
    assert got.shape == expected.shape == (len(prompt), 2048)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_demo_model_dir_reuses_existing(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOFLEX_CACHE", str(model_dir.parent))

    def fail(out_dir: Path) -> None:
        raise AssertionError("rebuilt an existing demo model")

    monkeypatch.setattr(demo, "build_demo_model", fail)
    assert demo.demo_model_dir() == model_dir


def test_demo_model_dir_lost_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process renames its build into place first: ours is discarded, theirs used."""
    monkeypatch.setenv("NANOFLEX_CACHE", str(tmp_path))
    final = tmp_path / demo.DEMO_NAME

    def racing_build(out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")  # our (fake) build
        final.mkdir()
        (final / "config.json").write_text('{"winner": true}')  # the other process's

    monkeypatch.setattr(demo, "build_demo_model", racing_build)
    assert demo.demo_model_dir() == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert os.listdir(tmp_path) == [demo.DEMO_NAME]
