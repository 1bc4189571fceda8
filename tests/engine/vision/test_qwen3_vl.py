"""A held-out tiny Qwen3-VL through the engine: an image in a chat gives transformers' greedy
tokens (its interleaved M-RoPE, learned vision positions and DeepStack each move the tokens'
log-probabilities past the tolerance when left out), whole or in prefill chunks that cut
through an image."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from policy import Policy
from tests.engine.qwen3_vl_models import build_tiny_qwen3_vl
from tests.engine.vision.test_qwen2_5_vl import (
    GREEDY,
    assert_image_chats_match,
    chosen,
    image_prompt,
)
from tests.engine.vision_models import assert_same_answer, hf_vl_generate, png_bytes


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
