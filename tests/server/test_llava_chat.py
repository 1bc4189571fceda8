"""Images in chat requests to a tiny LLaVA daemon (its CLIP tower, its image tokens causal as
text): a data URL part through the openai client and two Batch API lines give transformers'
greedy tokens for the prompt its own processor writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.core.engine_args import EngineArgs
from engine.runtime.core_client import CoreEngineClient
from policy import Policy
from server.openai.media import MediaLimits
from tests.engine.llava_model import TOKENS_PER_IMAGE, build_tiny_llava, hf_llava_generate
from tests.engine.vision_models import assert_same_answer, png_bytes
from tests.server.batch_files import read_lines, upload, wait_batch
from tests.server.live import ServerFactory
from tests.server.test_vision_chat import (
    MAX_TOKENS,
    TEXT,
    answer,
    chat_answer,
    data_url,
    image_message,
)

MODEL = "tiny-llava"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


def test_images_in_chat_and_batch_lines_give_transformers_tokens(
    llava_dir: Path, make_server: ServerFactory
) -> None:
    first, second = png_bytes(60, 90, seed=1), png_bytes(100, 70, seed=5)
    want = {}
    for key, image in (("a", first), ("b", second)):
        want_ids, *tokens = hf_llava_generate(llava_dir, [image], TEXT, MAX_TOKENS)
        want[key] = (tokens[0], tokens[1])
    assert want["a"][1] != want["b"][1]  # the two images give two answers
    args = EngineArgs(model=str(llava_dir), policy=Policy(), device="cpu")
    engine = CoreEngineClient(args, llava_dir, Policy(), model_name=MODEL, in_process=True)
    live = make_server(engine, media_limits=MediaLimits(max_images=2))
    api = live.openai()
    tokens, logprobs, prompt_tokens = chat_answer(api, MODEL, data_url(first))
    assert_same_answer(tokens, logprobs, want["a"])
    # the processor's prompt: its length, the image's 16 tokens included
    assert prompt_tokens == len(want_ids) and len(want_ids) > TOKENS_PER_IMAGE
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}
    body |= {"return_tokens_as_token_ids": True, "ignore_eos": True}
    lines = [
        json.dumps({"custom_id": key, "method": "POST", "url": "/v1/chat/completions",
                    "body": {**body, "messages": [image_message(data_url(image))]}})
        for key, image in (("a", first), ("b", second))
    ]  # fmt: skip
    batch = api.batches.create(
        input_file_id=upload(api, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(api, batch.id, timeout_s=120)
    assert done.status == "completed" and done.output_file_id is not None
    for line in read_lines(api, done.output_file_id):
        choice = line["response"]["body"]["choices"][0]
        assert_same_answer(*answer(choice["logprobs"]), want[line["custom_id"]])
