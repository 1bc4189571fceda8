"""Llama 4 (text) beyond what every newer MoE family is tested for (test_moe_giants.py:
placements, the portable path, logits, prefix cache, each feature): the published checkpoint
with its vision tower read as its text model, and chunked layers without a chunk size
refused."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.models.config import ModelConfig, read_hf_config
from engine.models.hf_config import UnsupportedModelError
from policy import Policy
from tests.engine.executor.test_correctness import run
from tests.engine.executor.test_family_features import _with_config
from tests.engine.tiny_models import LLAMA4


def test_vision_checkpoint_reads_as_its_text_model(tiny_model, references, tmp_path):
    """The hub's layout of Llama 4 (model type llama4, the text config inside, tensors under
    `language_model.`, a vision tower beside) gives the text model's tokens."""
    from safetensors.torch import load_file, save_file

    prompts, expected = references(LLAMA4)
    source = tiny_model(LLAMA4)
    dest = tmp_path / "vision"
    dest.mkdir()
    text = json.loads((source / "config.json").read_text())
    config = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}
    (dest / "config.json").write_text(json.dumps({**config, "text_config": text}))
    text_state = load_file(str(source / "model.safetensors"))
    state = {f"language_model.{name}": tensor for name, tensor in text_state.items()}
    tower = text_state["model.norm.weight"][None].clone()  # a vision tensor: not read
    state["vision_model.patch_embedding.linear.weight"] = tower
    save_file(state, str(dest / "model.safetensors"))
    shutil.copy(source / "generation_config.json", dest)
    assert ModelConfig.from_hf(read_hf_config(dest)).model_type == "llama4_text"
    assert run(dest, prompts, Policy(), tmp_path) == expected


def test_chunked_layers_need_a_chunk_size(tiny_model, tmp_path):
    changed = _with_config(tiny_model(LLAMA4), tmp_path / "changed", "attention_chunk_size", None)
    config = json.loads((changed / "config.json").read_text())
    assert "chunked_attention" in config["layer_types"]
    with pytest.raises(UnsupportedModelError, match=r"'chunked_attention' .* attention_chunk_size"):
        ModelConfig.from_hf(read_hf_config(changed))
