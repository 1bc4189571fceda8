"""A held-out tiny LLaVA (CLIP tower, MLP projector, Llama) through the engine: one image and
two images in a chat give transformers' greedy tokens and log-probabilities, the prompt
widened as LlavaProcessor widens it; the same image again is encoded once."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.core.media import VisionSpec
from policy import Policy
from tests.engine.llava_model import TOKENS_PER_IMAGE, build_tiny_llava, hf_llava_generate
from tests.engine.vision_models import assert_same_answer, chosen, image_prompt, png_bytes

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
TEXT = "what is this?"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


def test_images_in_a_chat_give_transformers_greedy_tokens(llava_dir: Path) -> None:
    image, other = png_bytes(60, 90, seed=1), png_bytes(130, 40, seed=2)
    want_ids, *want = hf_llava_generate(llava_dir, [image], TEXT, GREEDY.max_tokens)
    want_pair_ids, *want_pair = hf_llava_generate(llava_dir, [image, other], TEXT, 6)
    with LLM(str(llava_dir), policy=Policy(), device="cpu") as llm:
        assert llm.executor.vision is not None
        spec = VisionSpec.from_model_dir(llava_dir)
        assert spec is not None and not spec.bidirectional  # causal, as Llama's text
        ids, media = image_prompt(llm, llava_dir, [image], TEXT)
        assert ids == want_ids  # the processor's prompt: <image> widened to 16 tokens
        assert media is not None and media.images[0].num_tokens == TOKENS_PER_IMAGE
        pair_ids, pair_media = image_prompt(llm, llava_dir, [image, other], TEXT)
        assert pair_ids == want_pair_ids
        outs = llm.generate([ids, pair_ids], GREEDY, media=[media, pair_media])
        for out, (tokens, logprobs) in zip(outs, (want, want_pair), strict=True):
            got = out.outputs[0]
            assert_same_answer(got.token_ids, chosen(got.logprobs), (tokens, logprobs))
        assert llm.executor.vision.num_encoded == 2  # the image in both prompts: once
