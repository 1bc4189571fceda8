"""A held-out tiny Qwen2.5-VL through the engine: an image in a chat gives transformers' greedy
tokens; the same image twice is encoded once; two different images never share a cached
prefix page."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.executor import vision_encoder
from policy import Policy
from tests.engine.vision_models import (
    assert_same_answer,
    build_tiny_vl,
    chosen,
    hf_vl_generate,
    image_prompt,
    png_bytes,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl(tmp_path_factory.mktemp("tiny-qwen2_5_vl"))


def test_an_image_in_a_chat_gives_transformers_greedy_tokens(vl_dir: Path) -> None:
    assert_image_chats_match(vl_dir)


def assert_image_chats_match(vl_dir: Path) -> None:
    """One image, then two (the text after both), in a chat to the checkpoint at `vl_dir`:
    the engine's prompt and greedy answer are transformers'."""
    pictures = [png_bytes(60, 90, seed=1), png_bytes(130, 40, seed=2)]
    with LLM(str(vl_dir), policy=Policy(), device="cpu") as llm:
        for images in (pictures[:1], pictures):  # one image; two, the text after both
            ids, media = image_prompt(llm, vl_dir, images, "what is this?")
            want_ids, *want = hf_vl_generate(vl_dir, images, "what is this?", GREEDY.max_tokens)
            assert ids == want_ids  # the processor's prompt: its pads widened alike
            got = llm.generate([ids], GREEDY, media=[media])[0].outputs[0]
            assert_same_answer(got.token_ids, chosen(got.logprobs), (want[0], want[1]))


def test_images_key_the_prefix_cache_and_are_encoded_once(
    vl_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # two images of one size: the same prompt tokens, so only the digests tell them apart
    first, second = png_bytes(112, 112, seed=3), png_bytes(112, 112, seed=4)
    text = "describe the picture in a few words please"
    with LLM(str(vl_dir), policy=Policy(), device="cpu", enable_prefix_caching=True) as llm:
        assert llm.executor.vision is not None
        ids, media = image_prompt(llm, vl_dir, [first], text)
        ids2, media2 = image_prompt(llm, vl_dir, [second], text)
        assert ids == ids2 and len(ids) > 3 * 16  # pages past the image's tokens, if any hit
        out = llm.generate([ids], GREEDY, media=[media])[0]
        assert out.num_cached_tokens == 0 and llm.executor.vision.num_encoded == 1
        again = llm.generate([ids], GREEDY, media=[media])[0]
        assert again.num_cached_tokens > 0  # the same image: its pages are hits
        assert again.outputs[0].token_ids == out.outputs[0].token_ids
        assert llm.executor.vision.num_encoded == 1  # and its features the cached ones
        monkeypatch.setattr(vision_encoder, "CACHED_IMAGES", 1)  # the next image evicts it
        other = llm.generate([ids2], GREEDY, media=[media2])[0]
        assert llm.executor.vision.num_encoded == 2
        assert media2 is not None
        # only the pages before the image may hit: none of them holds an image token
        assert other.num_cached_tokens <= media2.images[0].start
        # the first image's features are gone, its pages are not: it is not encoded again
        assert media is not None
        third = llm.generate([ids], GREEDY, media=[media])[0]
        image = media.images[0]
        assert third.num_cached_tokens >= image.start + image.num_tokens
        assert llm.executor.vision.num_encoded == 2
        assert third.outputs[0].token_ids == out.outputs[0].token_ids
        # two choices: the second forks the first's prompt KV, and decodes at its M-RoPE
        # positions (p + delta past the prompt), not at p
        two = llm.generate([ids], dataclasses.replace(GREEDY, n=2), media=[media])[0]
        assert [c.token_ids for c in two.outputs] == [out.outputs[0].token_ids] * 2
        assert llm.executor.vision.num_encoded == 2  # the fork runs none of the prompt
    _, *want = hf_vl_generate(vl_dir, [second], text, GREEDY.max_tokens)
    got = other.outputs[0]
    assert_same_answer(got.token_ids, chosen(got.logprobs), (want[0], want[1]))


def test_prefill_chunks_that_cut_through_an_image(vl_dir: Path) -> None:
    """Steps of 16 tokens: the image's 16 tokens from position 45 on span two chunks, each
    taking the slice of the features its rows cover."""
    image = png_bytes(112, 112, seed=3)
    _, *want = hf_vl_generate(vl_dir, [image], "what is this?", GREEDY.max_tokens)
    with LLM(str(vl_dir), policy=Policy(), device="cpu", max_step_tokens=16) as llm:
        ids, media = image_prompt(llm, vl_dir, [image], "what is this?")
        assert media is not None and media.images[0].start % 16 != 0
        got = llm.generate([ids], GREEDY, media=[media])[0].outputs[0]
        assert_same_answer(got.token_ids, chosen(got.logprobs), (want[0], want[1]))
