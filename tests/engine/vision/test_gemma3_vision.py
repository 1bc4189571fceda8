"""A held-out tiny Gemma 3 with its vision tower through the engine: an image in a chat gives
transformers' greedy tokens (its tokens attending to each other both ways, in one chunk or
after a chunk cut before it); the same image twice is encoded once; two different images never
share a cached prefix page."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.media import ImageInput, SeqMedia, VisionSpec
from engine.core.request_checks import RequestError, check_request
from engine.core.sequence import Request
from policy import Policy
from tests.engine.gemma3_vision_model import TOKENS_PER_IMAGE, build_tiny_gemma3, hf_gemma3_generate
from tests.engine.vision_models import assert_same_answer, chosen, image_prompt, png_bytes

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
TEXT = "what is this?"


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def reference(gemma3_dir: Path) -> tuple[bytes, list[int], list[int], list[float]]:
    """One image, and transformers' (prompt, greedy tokens, log-probabilities) for it."""
    image = png_bytes(60, 90, seed=1)
    return image, *hf_gemma3_generate(gemma3_dir, [image], TEXT, GREEDY.max_tokens)


def test_an_image_in_a_chat_gives_transformers_greedy_tokens(
    gemma3_dir: Path, reference: tuple[bytes, list[int], list[int], list[float]]
) -> None:
    image, want_ids, *want = reference
    pair = [image, png_bytes(130, 40, seed=2)]  # two images back to back: two spans
    want_pair_ids, *want_pair = hf_gemma3_generate(gemma3_dir, pair, TEXT, GREEDY.max_tokens)
    with LLM(str(gemma3_dir), policy=Policy(), device="cpu") as llm:
        spec = VisionSpec.from_model_dir(gemma3_dir)
        assert spec is not None and spec.bidirectional
        ids, media = image_prompt(llm, gemma3_dir, [image], TEXT)
        assert ids == want_ids  # the processor's prompt: newline runs merged alike
        assert media is not None and media.images[0].num_tokens == TOKENS_PER_IMAGE
        pair_ids, pair_media = image_prompt(llm, gemma3_dir, pair, TEXT)
        assert pair_ids == want_pair_ids  # the four newlines between the images one token
        outs = llm.generate([ids, pair_ids], GREEDY, media=[media, pair_media])
        for out, (tokens, logprobs) in zip(outs, (want, want_pair), strict=True):
            got = out.outputs[0]
            assert_same_answer(got.token_ids, chosen(got.logprobs), (tokens, logprobs))


def test_a_chunk_is_cut_before_an_image_and_reads_a_packed_past(
    gemma3_dir: Path, reference: tuple[bytes, list[int], list[int], list[float]]
) -> None:
    """Steps of 16 tokens: the image's 16 tokens from position 8 on would span two chunks;
    the first chunk stops at the image, the second runs it whole (its tokens see each other
    both ways), its past gathered into a packed copy (paged attention off: the padded mask)."""
    image, _, *want = reference
    options = dict(max_step_tokens=TOKENS_PER_IMAGE, paged_attention=False)
    with LLM(str(gemma3_dir), policy=Policy(), device="cpu", **options) as llm:  # type: ignore[arg-type]
        ids, media = image_prompt(llm, gemma3_dir, [image], TEXT)
        assert media is not None and 0 < media.images[0].start < TOKENS_PER_IMAGE
        got = llm.generate([ids], GREEDY, media=[media])[0].outputs[0]
        assert_same_answer(got.token_ids, chosen(got.logprobs), (want[0], want[1]))


def test_images_key_the_prefix_cache_and_are_encoded_once(gemma3_dir: Path) -> None:
    first, second = png_bytes(56, 56, seed=3), png_bytes(56, 56, seed=4)
    text = "describe the picture in a few words please, and then some more"
    with LLM(str(gemma3_dir), policy=Policy(), device="cpu", enable_prefix_caching=True) as llm:
        assert llm.executor.vision is not None
        ids, media = image_prompt(llm, gemma3_dir, [first], text)
        ids2, media2 = image_prompt(llm, gemma3_dir, [second], text)
        assert media is not None and media2 is not None
        assert ids == ids2 and len(ids) > 3 * 16  # pages past the image's tokens, if any hit
        out = llm.generate([ids], GREEDY, media=[media])[0]
        assert out.num_cached_tokens == 0 and llm.executor.vision.num_encoded == 1
        again = llm.generate([ids], GREEDY, media=[media])[0]
        assert again.num_cached_tokens > media.images[0].start  # the same image's pages hit
        assert again.outputs[0].token_ids == out.outputs[0].token_ids
        assert llm.executor.vision.num_encoded == 1  # the same image is encoded once
        other = llm.generate([ids2], GREEDY, media=[media2])[0]
        assert llm.executor.vision.num_encoded == 2
        # only the pages before the image may hit: none of them holds an image token
        assert other.num_cached_tokens <= media2.images[0].start
    _, *want = hf_gemma3_generate(gemma3_dir, [second], text, GREEDY.max_tokens)
    got = other.outputs[0]
    assert_same_answer(got.token_ids, chosen(got.logprobs), (want[0], want[1]))


def test_a_chunk_never_ends_inside_an_image() -> None:
    """`whole_images`: a chunk that would end inside an image stops at its start, or, where
    it starts there, waits (0); an image whose tokens attend causally may be cut anywhere."""
    image = ImageInput(b"", "0" * 32, (1, 4, 4), start=8, num_tokens=16)
    media = SeqMedia((image,), (), 0, bidirectional=True)
    assert [media.whole_images(0, n) for n in (8, 10, 23, 24, 30)] == [8, 8, 8, 24, 30]
    assert [media.whole_images(8, n) for n in (4, 16, 20)] == [0, 16, 20]
    assert media.whole_images(12, 12) == 12  # a cached prefix ending inside it: the rest whole
    causal = dataclasses.replace(media, bidirectional=False)
    assert causal.whole_images(0, 10) == 10
    request = Request("r", list(range(30)), media=media)
    check_request(request, 64, 64, set(), max_step_tokens=16)
    with pytest.raises(RequestError, match="raise max_step_tokens"):  # it would never run
        check_request(request, 64, 64, set(), max_step_tokens=12)


@pytest.mark.slow
@pytest.mark.parametrize("num_nano_batches", [1, 2])
def test_images_in_nano_batches_and_mixed_tiers(
    gemma3_dir: Path,
    reference: tuple[bytes, list[int], list[int], list[float]],
    tmp_path: Path,
    num_nano_batches: int,
) -> None:
    """Three image prompts in GPU batches of 2, their KV and activations over three tiers
    (decodes attending on the CPU), cut into nano-batches: each its image spans' mask."""
    image, _, *want = reference
    policy = Policy(
        gpu_batch_size=2,
        num_gpu_batches=2,
        kv_frac=(0.4, 0.3, 0.3),
        act_frac=(0.3, 0.3, 0.4),
        cpu_attention=True,
        num_nano_batches=num_nano_batches,
    )
    with LLM(str(gemma3_dir), policy=policy, device="cpu", offload_dir=tmp_path / "off") as llm:
        ids, media = image_prompt(llm, gemma3_dir, [image], TEXT)
        outs = llm.generate([ids] * 3, GREEDY, media=[media] * 3)
        for out in outs:
            got = out.outputs[0]
            assert_same_answer(got.token_ids, chosen(got.logprobs), (want[0], want[1]))
