"""A held-out tiny Qwen3-VL through the engine: an image in a chat gives transformers' greedy
tokens (its interleaved M-RoPE, learned vision positions and DeepStack each move the tokens'
log-probabilities past the tolerance when left out), whole or in prefill chunks that cut
through an image; so does a tiny Qwen3-VL-MoE (its DeepStack features added after a layer
whose experts run grouped over the block); a published checkpoint's config reads as its
shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.models.config_cache import read_model_config
from engine.models.qwen3_vl import Qwen3VLModel, Qwen3VLMoeModel
from policy import Policy
from tests.engine.qwen3_vl_models import build_tiny_qwen3_vl, build_tiny_qwen3_vl_moe
from tests.engine.vision.test_qwen2_5_vl import GREEDY, assert_image_chats_match, chosen
from tests.engine.vision_models import assert_same_answer, hf_vl_generate, image_prompt, png_bytes


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3_vl"))


def test_an_image_in_a_chat_gives_transformers_greedy_tokens(vl_dir: Path) -> None:
    assert_image_chats_match(vl_dir)


@pytest.mark.slow
def test_prefill_chunks_that_cut_through_an_image(vl_dir: Path) -> None:
    """Steps of 16 tokens: the image's tokens span two chunks, each taking the slice of the
    features (the embedding's and DeepStack's columns) its rows cover."""
    image = png_bytes(128, 128, seed=3)
    _, *want = hf_vl_generate(vl_dir, [image], "what is this?", GREEDY.max_tokens)
    with LLM(str(vl_dir), policy=Policy(), device="cpu", max_step_tokens=16) as llm:
        ids, media = image_prompt(llm, vl_dir, [image], "what is this?")
        assert media is not None and media.images[0].start % 16 != 0
        assert media.images[0].num_tokens == 16
        got = llm.generate([ids], GREEDY, media=[media])[0].outputs[0]
        assert_same_answer(got.token_ids, chosen(got.logprobs), (want[0], want[1]))


PUBLISHED_2B = {
    "model_type": "qwen3_vl",
    "image_token_id": 151655,
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_vl_text",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
    "vision_config": {  # its model_type as released, which transformers renames
        "model_type": "qwen3_vl",
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
    },
}
"""The fields of Qwen/Qwen3-VL-2B-Instruct's config.json that shape it (the rest default)."""


def test_a_published_config_reads_as_its_shapes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_2B))
    config = read_model_config(tmp_path)
    assert (config.model_type, config.head_dim, config.mrope_section) == (
        "qwen3_vl",
        128,
        (24, 20, 20),
    )
    assert config.tie_word_embeddings and not config.qkv_bias
    assert config.vision is not None and config.vision.deepstack_blocks == (5, 11, 17)
    assert config.vision.feature_width == 4 * 2048  # the embedding's and three DeepStack's
    axes = Qwen3VLModel.rotary_axes(config.mrope_section).tolist()
    assert axes[:6] == [0, 1, 2, 0, 1, 2] and axes[60:] == [0, 0, 0, 0]
    assert [axes.count(a) for a in (0, 1, 2)] == [24, 20, 20]


def test_qwen3_vl_moe_gives_transformers_greedy_tokens(tmp_path: Path) -> None:
    """Layer 0 routes to experts and takes DeepStack features: the grouped-MoE way adds
    them too (left out, the first token's log-probability is 4e-3 off)."""
    moe_dir = build_tiny_qwen3_vl_moe(tmp_path / "tiny-qwen3_vl_moe")
    image = png_bytes(60, 90, seed=1)
    _, *want = hf_vl_generate(moe_dir, [image], "what is this?", GREEDY.max_tokens)
    with LLM(str(moe_dir), policy=Policy(), device="cpu") as llm:
        ids, media = image_prompt(llm, moe_dir, [image], "what is this?")
        got = llm.generate([ids], GREEDY, media=[media])[0].outputs[0]
        assert_same_answer(got.token_ids, chosen(got.logprobs), (want[0], want[1]))
        # the published checkpoints' experts stacked transposed read as transformers' own
        model = llm.executor.model
        assert isinstance(model, Qwen3VLMoeModel)
        gate_up = torch.randn(4, 2 * 48, 64)
        down = torch.randn(4, 64, 48)
        own = model.fuse({"experts.gate_up_proj": gate_up, "experts.down_proj": down})
        published = {"experts.gate_up_proj": gate_up.mT, "experts.down_proj": down.mT}
        assert all(torch.equal(own[k], v) for k, v in model.fuse(published).items())
