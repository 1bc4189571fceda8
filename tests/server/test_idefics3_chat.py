"""Images in chat requests to tiny SmolVLM and Idefics3 daemons (each image cut into tiles and
a global image, its markers written as the processor writes them): two images as data URLs in
one chat through the openai client, and an image in a Batch API line, give transformers'
greedy tokens for the prompt its own processor writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.engine_args import EngineArgs
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy
from server.openai.media import MediaLimits
from tests.engine.idefics3_model import build_tiny_idefics3, hf_idefics3_generate
from tests.engine.vision_models import assert_same_answer, png_bytes
from tests.server.live import ServerFactory
from tests.server.test_vision_chat import MAX_TOKENS, TEXT, answer, batch_answers, data_url

MODEL = "tiny-smolvlm"


@pytest.fixture(
    scope="module", params=["smolvlm", pytest.param("idefics3", marks=pytest.mark.slow)]
)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kind = str(request.param)
    return build_tiny_idefics3(tmp_path_factory.mktemp(f"tiny-{kind}"), kind, tiles=3)


def test_images_in_chat_and_batch_lines_give_transformers_tokens(
    model_dir: Path, make_server: ServerFactory
) -> None:
    first, second = png_bytes(60, 90, seed=1), png_bytes(130, 40, seed=2)
    want_ids, *want_pair = hf_idefics3_generate(model_dir, [first, second], TEXT, MAX_TOKENS)
    _, *want = hf_idefics3_generate(model_dir, [first], TEXT, MAX_TOKENS)
    args = EngineArgs(model=str(model_dir), policy=Policy(), device="cpu")
    engine = StepLoopClient(args, model_dir, Policy(), model_name=MODEL, in_process=True)
    api = make_server(engine, media_limits=MediaLimits(max_images=2)).openai()
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in (first, second)]
    reply = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": TEXT}]}],  # type: ignore[list-item]
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    assert reply.choices[0].logprobs is not None and reply.usage is not None
    assert_same_answer(
        *answer(reply.choices[0].logprobs.model_dump()), (want_pair[0], want_pair[1])
    )
    assert reply.usage.prompt_tokens == len(want_ids)  # the processor's prompt, tiles and all
    (got,) = batch_answers(api, MODEL, {"a": data_url(first)}).values()
    assert_same_answer(*got, (want[0], want[1]))
